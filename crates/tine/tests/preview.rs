//! Preview URLs end to end: a real `tine --dev` server, a real guest
//! serving HTTP from its Python interpreter, a real MCP client making the
//! URLs, and HTTP and WebSocket clients opening them as a browser would
//! (`<id>.localhost:<port>`, resolved to the loopback by the client as
//! browsers do, RFC 6761 §6.3).
//!
//! Headless Chromium (Debian's `chromium`) loads the app's page through its
//! URL; the page's script talks to the guest over a WebSocket through the
//! same URL; the screenshot is kept as `target/test-logs/
//! tine--preview-page.png`.
//!
//! One server and one sandbox (and its branch child) for every case.
//! Transfers are 16 MiB each way (`TINE_TEST_FULL`: 100 MiB; the guest's
//! network moves about 1.4 MB/s here, docs/hosts.md).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use testkit::mcp::{call, TineServer};

/// Bytes moved each way through a preview URL.
fn transfer_bytes() -> usize {
    if testkit::full_size() {
        100 << 20
    } else {
        16 << 20
    }
}

/// Most the server's own memory (outside guest RAM) may grow while it
/// streams a transfer (bytes): far less than the transfer.
const RSS_GROWTH_BOUND: u64 = 12 << 20;

/// The app: an HTTP/1.1 server on guest port 8000 in a thread of the
/// sandbox's interpreter (a new python3 process takes 15 s here):
/// `/headers` (what it was sent, as JSON), `/sse` (one event, then the
/// second once `/release` is asked for, chunked), `/ws` (a WebSocket echo
/// of text messages of up to 119 bytes until a close, RFC 6455), `/blob?n=N` (N bytes, byte i = i % 251),
/// `PUT /upload` (the SHA-256 of the body), `/count` (requests seen, not
/// counting itself), `/cookies` (cookies for the whole preview domain and
/// `Service-Worker-Allowed: /`), `/` (a page).
const APP: &str = include_str!("py/preview_app.py");
/// Debian's Chromium, or `None` (with a loud SKIPPED line) where it is
/// missing and not required (`TINE_REQUIRE_CHROMIUM`, which
/// scripts/test.sh sets, or `CI`).
fn chromium(test: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("TINE_CHROMIUM").map(Into::into).unwrap_or_else(|| "/usr/bin/chromium".into());
    if Path::new(&path).exists() {
        return Some(path);
    }
    let required = std::env::var_os("TINE_REQUIRE_CHROMIUM").is_some() || std::env::var_os("CI").is_some();
    assert!(!required, "{test}: no Chromium at {}; scripts/setup.sh installs Debian's", path.display());
    eprintln!("SKIPPED {test} (the browser part): no Chromium at {} (scripts/setup.sh installs it)", path.display());
    None
}

/// Where the test's screenshot is kept: beside the suite's logs
/// (`target/test-logs`, scripts/run-tests.py).
fn screenshot_path() -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| testkit::workspace_root().join("target"));
    let dir = target.join("test-logs");
    std::fs::create_dir_all(&dir).expect("make target/test-logs");
    dir.join("tine--preview-page.png")
}

/// A child process killed on drop.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One DevTools protocol call on `page`: the result of the reply with
/// the call's id (events in between are skipped).
async fn devtools<S>(page: &mut S, id: u64, method: &str, params: Value) -> Value
where
    S: futures_util::Sink<tokio_tungstenite::tungstenite::Message>
        + futures_util::Stream<
            Item = Result<tokio_tungstenite::tungstenite::Message, tokio_tungstenite::tungstenite::Error>,
        > + Unpin,
    <S as futures_util::Sink<tokio_tungstenite::tungstenite::Message>>::Error: std::fmt::Debug,
{
    let call = json!({"id": id, "method": method, "params": params}).to_string();
    page.send(tokio_tungstenite::tungstenite::Message::text(call)).await.expect("send to Chromium");
    loop {
        let msg = page.next().await.expect("Chromium's answer").expect("read from Chromium");
        let Ok(text) = msg.to_text() else { continue };
        let v: Value = serde_json::from_str(text).unwrap_or_default();
        if v["id"] == id {
            assert!(v.get("error").is_none(), "{method}: {v}");
            return v["result"].clone();
        }
    }
}

/// Headless Chromium opens `url` (a preview URL with its token: the
/// cookie exchange and the redirect are the browser's own); the test
/// drives it over its DevTools protocol (the page's WebSocket endpoint)
/// and reads `#ws` until the page's script has shown something other than
/// "waiting" (60 s at most), then takes a screenshot to
/// [`screenshot_path`]. Returns `#app`'s and `#ws`'s text.
async fn browse(chromium: &Path, url: &str) -> (String, String) {
    let profile = tempfile::tempdir().unwrap();
    let _browser = Killed(
        std::process::Command::new(chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0"])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(["--window-size=800,300", url])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start chromium"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    // Chromium writes the port it chose to DevToolsActivePort.
    let port = loop {
        let text = std::fs::read_to_string(profile.path().join("DevToolsActivePort")).unwrap_or_default();
        if let Some(port) = text.lines().next().and_then(|l| l.parse::<u16>().ok()) {
            break port;
        }
        assert!(Instant::now() < deadline, "Chromium wrote no DevToolsActivePort");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let page_url = loop {
        let list: Value = match reqwest::get(format!("http://127.0.0.1:{port}/json/list")).await {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => Value::Null,
        };
        let page = list.as_array().and_then(|l| l.iter().find(|t| t["type"] == "page").cloned());
        if let Some(u) = page.as_ref().and_then(|p| p["webSocketDebuggerUrl"].as_str()) {
            break u.to_string();
        }
        assert!(Instant::now() < deadline, "Chromium lists no page: {list}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (mut page, _) = tokio_tungstenite::connect_async(page_url.as_str()).await.expect("connect to the page");
    let text_of = |id: &str| format!("(document.getElementById('{id}') || {{}}).textContent || ''");
    let mut n = 0;
    let mut eval = async |page: &mut _, expr: String| {
        n += 1;
        let r = devtools(page, n, "Runtime.evaluate", json!({"expression": expr, "returnByValue": true})).await;
        r["result"]["value"].as_str().unwrap_or_default().to_string()
    };
    let ws = loop {
        let ws = eval(&mut page, text_of("ws")).await;
        if !ws.is_empty() && ws != "waiting" {
            break ws;
        }
        assert!(Instant::now() < deadline, "the page still shows {ws:?} after 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let app = eval(&mut page, text_of("app")).await;
    n += 1;
    let shot = devtools(&mut page, n, "Page.captureScreenshot", json!({"format": "png"})).await;
    let png =
        base64::Engine::decode(&base64::engine::general_purpose::STANDARD, shot["data"].as_str().unwrap_or_default())
            .expect("a base64 PNG");
    let path = screenshot_path();
    std::fs::write(&path, png).expect("write the screenshot");
    eprintln!("preview test: screenshot at {}", path.display());
    (app, ws)
}

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// The pattern `/blob` sends: byte i is i % 251.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

fn hex_sha256(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// An HTTP client that sends `*.localhost` to the server and follows no
/// redirects (the test looks at each).
fn http_for(url: &str, server: SocketAddr) -> reqwest::Client {
    let host = reqwest::Url::parse(url).unwrap().host_str().unwrap().to_string();
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .resolve(&host, server)
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap()
}

/// `url` without its query.
fn origin_of(url: &str) -> String {
    let mut u = reqwest::Url::parse(url).unwrap();
    u.set_query(None);
    u.to_string().trim_end_matches('/').to_string()
}

async fn preview(client: &testkit::mcp::McpClient, args: Value) -> Value {
    call(client, "sandbox_preview_url", args.clone())
        .await
        .unwrap_or_else(|e| panic!("sandbox_preview_url {args}: {e}"))
}

/// The cookie a host-based URL's token is exchanged for: the first
/// request's `303` (to the same URL without the token) sets it.
async fn exchange(http: &reqwest::Client, url: &str) -> String {
    let r = http.get(url).send().await.expect("open the preview URL");
    assert_eq!(r.status(), 303, "the token is exchanged for a cookie");
    assert_eq!(r.headers()["location"], "/", "the token leaves the address bar");
    let set = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(set.contains("HttpOnly") && set.contains("SameSite=Lax") && !set.contains("Domain"), "{set}");
    set.split(';').next().unwrap().to_string()
}

async fn count(http: &reqwest::Client, origin: &str, cookie: &str) -> u64 {
    let r = http.get(format!("{origin}/count")).header("cookie", cookie).send().await.expect("GET /count");
    assert_eq!(r.status(), 200);
    r.text().await.unwrap().trim().parse().expect("a count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_browser_reaches_the_guest_through_its_preview_url() {
    if !testkit::kvm_available("preview") {
        return;
    }
    // Four requests in flight per guest port, a 20 s wait for a place:
    // the burst below queues and sheds load within seconds (a guest here
    // serves about 2 requests a second, docs/hosts.md).
    // The burst below is 200 connections from one address, as from a
    // proxy in front: no cap per address (by default half the slots).
    let config = "max_connections_per_address = 0\n[preview]\npath_urls = true\nmax_guest_connections = 4\n\
                  wake_timeout_secs = 20\n";
    let server = TineServer::start_with_default_template(binary(), None, config);
    let addr: SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let client = server.client().await;
    let started = Instant::now();
    let phase = |what: &str| eprintln!("preview test: {what} at {:.1} s", started.elapsed().as_secs_f64());

    let sb = call(&client, "sandbox_create", json!({})).await.expect("create");
    let id = sb["sandbox_id"].as_str().unwrap().to_string();
    let r = call(&client, "sandbox_run_python", json!({"sandbox_id": id, "code": APP})).await.expect("start the app");
    assert!(r.get("exception").is_none_or(Value::is_null), "{r}");
    phase("app started");

    // A URL with a token: without it, with a mangled one, or with another
    // preview's, the request is refused and the guest sees nothing.
    let p = preview(&client, json!({"sandbox_id": id, "port": 8000})).await;
    let url = p["url"].as_str().unwrap().to_string();
    let pid = p["preview_id"].as_str().unwrap().to_string();
    assert!(url.starts_with(&format!("http://{pid}.localhost:")) && url.contains("tine_preview_token="), "{p}");
    assert_eq!(
        (p["public"].as_bool(), p["port"].as_u64(), p["form"].as_str()),
        (Some(false), Some(8000), Some("host"))
    );
    let origin = origin_of(&url);
    let http = http_for(&url, addr);
    let cookie = exchange(&http, &url).await;
    let seen_before = count(&http, &origin, &cookie).await;
    let other = preview(&client, json!({"sandbox_id": id, "port": 8001})).await;
    let other_token = other["url"].as_str().unwrap().split("tine_preview_token=").nth(1).unwrap().to_string();
    for (what, req) in [
        ("no token", http.get(format!("{origin}/"))),
        ("a mangled token", http.get(format!("{origin}/?tine_preview_token=1.00"))),
        ("another preview's token", http.get(format!("{origin}/?tine_preview_token={other_token}"))),
        (
            "another preview's cookie",
            http.get(format!("{origin}/")).header("cookie", format!("__Host-tine_preview={other_token}")),
        ),
    ] {
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{what}");
        assert!(r.text().await.unwrap().contains("token"), "{what}: the page says why");
    }
    assert_eq!(count(&http, &origin, &cookie).await, seen_before, "refused requests never reach the guest");
    let unknown = format!("http://{}.localhost:{}/", "0000000000aa", addr.port());
    assert_eq!(http_for(&unknown, addr).get(&unknown).send().await.unwrap().status(), 404);

    // A browser: Chromium opens the URL with its token, keeps the cookie,
    // loads the page, whose script echoes a message over a WebSocket
    // through the same URL and shows it.
    if let Some(chromium) = chromium("tine::preview") {
        let (app, ws) = browse(&chromium, &url).await;
        assert_eq!(app, "hello from the sandbox");
        assert_eq!(ws, "echo: from the page", "the page's WebSocket echo is shown");
        phase("Chromium checked");
    }

    // With the cookie: the page, and what the guest saw (no token, no
    // cookie of ours, Host rewritten, X-Forwarded-*).
    let r = http.get(format!("{origin}/")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("hello from the sandbox"));
    let seen: Value = http
        .get(format!("{origin}/headers?a=1"))
        .header("cookie", format!("theirs=1; {cookie}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(seen["host"], "localhost:8000", "{seen}");
    assert_eq!(seen["cookie"], "theirs=1", "{seen}");
    assert_eq!(seen["target"], "/headers?a=1", "{seen}");
    assert_eq!(seen["x-forwarded-host"].as_str(), Some(origin.trim_start_matches("http://")), "{seen}");
    assert_eq!(
        (seen["x-forwarded-proto"].as_str(), seen["x-forwarded-for"].as_str()),
        (Some("http"), Some("127.0.0.1"))
    );
    phase("auth and headers checked");

    // One tenant's preview cannot reach the others' (issue 58, items 8 and
    // 9). Everything is looked at first and printed, then checked.
    let token = url.split("tine_preview_token=").nth(1).unwrap().to_string();
    let set_cookies = |r: &reqwest::Response| -> Vec<String> {
        r.headers().get_all("set-cookie").iter().map(|v| v.to_str().unwrap().to_string()).collect()
    };
    let sw_allowed =
        |r: &reqwest::Response| r.headers().get("service-worker-allowed").map(|v| v.to_str().unwrap().to_string());
    // Host form: the server's cookie is a __Host- one (a sibling preview
    // cannot plant or shadow it), the old name opens nothing, and a
    // guest's cookies stay on its own host (no Domain).
    let ours = set_cookies(&http.get(&url).send().await.unwrap());
    let old_name =
        http.get(format!("{origin}/")).header("cookie", format!("tine_preview={token}")).send().await.unwrap().status();
    let host_page = http.get(format!("{origin}/cookies")).header("cookie", &cookie).send().await.unwrap();
    let (host_cookies, host_sw) = (set_cookies(&host_page), sw_allowed(&host_page));
    // Path form (one origin for every path preview): no guest cookie, no
    // service worker scope past the preview, and the token reaches the
    // guest neither in the prefix nor in a Referer of a path URL.
    let pp = preview(&client, json!({"sandbox_id": id, "port": 8000, "form": "path"})).await;
    let pp_url = pp["url"].as_str().unwrap().to_string();
    let pp_id = pp["preview_id"].as_str().unwrap().to_string();
    let pp_token = pp_url.trim_end_matches('/').rsplit_once(&format!("{pp_id}.")).unwrap().1.to_string();
    let plain = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let path_page = plain.get(format!("{pp_url}cookies")).send().await.unwrap();
    let (path_cookies, path_sw) = (set_cookies(&path_page), sw_allowed(&path_page));
    let path_seen: Value = plain
        .get(format!("{pp_url}headers"))
        .header("referer", format!("{pp_url}page?x=1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    eprintln!(
        "preview test: our cookie {ours:?}; old name {old_name}; host form: guest cookies {host_cookies:?}, \
         Service-Worker-Allowed {host_sw:?}; path form: guest cookies {path_cookies:?}, Service-Worker-Allowed \
         {path_sw:?}, the guest saw {path_seen}"
    );
    assert_eq!(ours.len(), 1, "{ours:?}");
    assert!(ours[0].starts_with(&format!("__Host-tine_preview={token};")), "{ours:?}");
    let attrs: Vec<&str> = ours[0].split(';').map(str::trim).collect();
    assert!(attrs.contains(&"Secure") && attrs.contains(&"Path=/") && attrs.contains(&"HttpOnly"), "{ours:?}");
    assert!(!ours[0].to_ascii_lowercase().contains("domain"), "{ours:?}");
    assert_eq!(old_name, 401, "the old cookie name is not read");
    assert_eq!(
        host_cookies,
        vec!["guest_a=1; Path=/".to_string(), "guest_b=2; Path=/; HttpOnly; SameSite=Lax".to_string()],
        "a guest's cookies lose their Domain, nothing else"
    );
    assert_eq!(host_sw.as_deref(), Some("/"), "its own origin: the guest's to widen");
    assert_eq!(path_page.status(), 200);
    assert_eq!((path_cookies, path_sw), (vec![], None), "path form: no guest cookie, no wider service worker");
    assert_eq!(path_seen["x-forwarded-prefix"], format!("/preview/{pp_id}"), "{path_seen}");
    assert_eq!(path_seen["referer"], format!("{}/preview/{pp_id}/page?x=1", server.base), "{path_seen}");
    assert!(!path_seen.to_string().contains(&pp_token), "the guest never sees the token: {path_seen}");
    phase("cookies, service workers and tokens kept apart");

    // Server-Sent Events arrive as they are sent: curl prints the first
    // before the second is released.
    let authority = origin.trim_start_matches("http://").to_string();
    let host_only = authority.split(':').next().unwrap().to_string();
    let mut curl = std::process::Command::new("curl")
        .args(["-sN", "--resolve", &format!("{host_only}:{}:127.0.0.1", addr.port()), "-H"])
        .arg(format!("cookie: {cookie}"))
        .arg(format!("{origin}/sse"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run curl");
    let mut events = std::io::BufReader::new(curl.stdout.take().unwrap());
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut events, &mut line).expect("curl's first line");
        (line, events)
    });
    let (first, mut events) = first.await.unwrap();
    assert_eq!(first, "data: one\n", "the first event, before the second is sent");
    let released = http.get(format!("{origin}/release")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(released.status(), 200);
    let rest = tokio::task::spawn_blocking(move || {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut events, &mut rest).expect("the rest of the stream");
        rest
    })
    .await
    .unwrap();
    assert_eq!(rest, "\ndata: two\n\n");
    assert!(curl.wait().unwrap().success());
    phase("SSE checked");

    // A WebSocket echo through the URL, with the cookie.
    let ws_url = format!("ws://{}/ws", origin.trim_start_matches("http://"));
    let mut request = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(ws_url).unwrap();
    request.headers_mut().insert("cookie", cookie.parse().unwrap());
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(request, tcp).await.expect("WebSocket handshake");
    assert_eq!(resp.status(), 101);
    ws.send(tokio_tungstenite::tungstenite::Message::text("hi there")).await.unwrap();
    let echo = ws.next().await.expect("an echo").unwrap();
    assert_eq!(echo.to_text().unwrap(), "echo: hi there");
    drop(ws);
    phase("WebSocket checked");

    // A download and an upload larger than any buffer on the way, with
    // the server's own memory bounded.
    let n = transfer_bytes();
    let rss_before = server.own_rss_bytes();
    let t = Instant::now();
    let got = http.get(format!("{origin}/blob?n={n}")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(got.status(), 200);
    let mut body = got.bytes_stream();
    let (mut hasher, mut len, mut peak) = (Sha256::new(), 0usize, 0u64);
    while let Some(c) = body.next().await {
        let c = c.unwrap();
        hasher.update(&c);
        len += c.len();
        if len % (1 << 20) < c.len() {
            peak = peak.max(server.own_rss_bytes());
        }
    }
    let down = t.elapsed();
    assert_eq!(len, n);
    let want = pattern(n);
    assert_eq!(hasher.finalize().as_slice(), Sha256::digest(&want).as_slice(), "the download is whole");
    let t = Instant::now();
    let up = http.put(format!("{origin}/upload")).header("cookie", &cookie).body(want.clone()).send().await.unwrap();
    assert_eq!(up.status(), 200);
    assert_eq!(up.text().await.unwrap(), hex_sha256(&want), "the upload is whole");
    let up = t.elapsed();
    peak = peak.max(server.own_rss_bytes());
    assert!(
        peak.saturating_sub(rss_before) < RSS_GROWTH_BOUND,
        "the server's memory grew {} bytes while moving {n} each way",
        peak.saturating_sub(rss_before)
    );
    phase(&format!(
        "{} MiB down in {:.1} s, up in {:.1} s, server RSS {} -> peak {} KiB",
        n >> 20,
        down.as_secs_f64(),
        up.as_secs_f64(),
        rss_before >> 10,
        peak >> 10
    ));

    // Nothing listening: the 502 page names the port.
    let closed = preview(&client, json!({"sandbox_id": id, "port": 7999})).await;
    let closed_url = closed["url"].as_str().unwrap();
    let c = http_for(closed_url, addr);
    let ck = exchange(&c, closed_url).await;
    let r = c.get(format!("{}/", origin_of(closed_url))).header("cookie", ck).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let text = r.text().await.unwrap();
    assert!(text.contains("port 7999") && text.contains("0.0.0.0:7999"), "{text}");

    // Path-based: the token in the path, no cookie, the prefix stripped.
    let path = preview(&client, json!({"sandbox_id": id, "port": 8000, "form": "path"})).await;
    let path_url = path["url"].as_str().unwrap().to_string();
    assert!(path_url.starts_with(&format!("{}/preview/", server.base)), "{path}");
    let plain = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let seen: Value = plain.get(format!("{path_url}headers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(seen["target"], "/headers", "{seen}");
    assert!(seen["x-forwarded-prefix"].as_str().is_some_and(|p| p.starts_with("/preview/")), "{seen}");
    let r = plain.get(path_url.trim_end_matches('/')).send().await.unwrap();
    assert_eq!(r.status(), 308, "the prefix gets its slash");
    let bare = format!("{}/preview/{}/", server.base, path["preview_id"].as_str().unwrap());
    assert_eq!(plain.get(&bare).send().await.unwrap().status(), 401);

    // Public: no token; revoked: gone.
    let public = preview(&client, json!({"sandbox_id": id, "port": 8000, "public": true})).await;
    let public_url = public["url"].as_str().unwrap().to_string();
    assert!(!public_url.contains("token"), "{public}");
    let ph = http_for(&public_url, addr);
    assert_eq!(ph.get(&public_url).send().await.unwrap().status(), 200);
    let revoked =
        call(&client, "sandbox_preview_revoke", json!({"sandbox_id": id, "preview_id": public["preview_id"]}))
            .await
            .expect("revoke");
    assert_eq!(revoked["revoked"].as_array().map(Vec::len), Some(1), "{revoked}");
    assert_eq!(ph.get(&public_url).send().await.unwrap().status(), 404, "a revoked URL stops working");

    // A URL that expires stops working.
    let short = preview(&client, json!({"sandbox_id": id, "port": 8000, "public": true, "ttl_secs": 1})).await;
    let short_url = short["url"].as_str().unwrap().to_string();
    let sh = http_for(&short_url, addr);
    let t = Instant::now();
    while sh.get(&short_url).send().await.unwrap().status() != 404 {
        assert!(t.elapsed() < Duration::from_secs(30), "the 1 s URL still works after 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    phase("502, path form, public, revoke and expiry checked");

    // A branch child has its own URLs; the parent's never reach it.
    let child = call(&client, "sandbox_branch", json!({"sandbox_id": id, "n": 1})).await.expect("branch");
    let child_id = child["children"][0]["sandbox_id"].as_str().unwrap_or_else(|| panic!("{child}")).to_string();
    let cp = preview(&client, json!({"sandbox_id": child_id, "port": 8000})).await;
    let cp_url = cp["url"].as_str().unwrap().to_string();
    let ch = http_for(&cp_url, addr);
    let ccookie = exchange(&ch, &cp_url).await;
    let child_seen = count(&ch, &origin_of(&cp_url), &ccookie).await;
    let parent_seen = count(&http, &origin, &cookie).await;
    assert_eq!(http.get(format!("{origin}/")).header("cookie", &cookie).send().await.unwrap().status(), 200);
    assert_eq!(
        count(&ch, &origin_of(&cp_url), &ccookie).await,
        child_seen,
        "the parent's request stayed in the parent"
    );
    assert_eq!(count(&http, &origin, &cookie).await, parent_seen + 1);
    let cross = http.get(format!("{origin}/")).header("cookie", ccookie.clone()).send().await.unwrap();
    assert_eq!(cross.status(), 401, "the child's cookie does not open the parent");

    // 200 requests at once to one guest: each is answered, four at a time
    // on kept connections, or refused with 503 after waiting 20 s for a
    // place, and the server goes on answering calls about another sandbox
    // meanwhile.
    let burst: Vec<_> = (0..200)
        .map(|_| {
            let (http, url, cookie) = (http.clone(), format!("{origin}/"), cookie.clone());
            tokio::spawn(
                async move { http.get(url).header("cookie", cookie).send().await.map(|r| r.status().as_u16()) },
            )
        })
        .collect();
    let t = Instant::now();
    let other_call = call(&client, "sandbox_info", json!({"sandbox_id": child_id})).await.expect("info meanwhile");
    let answered_in = t.elapsed();
    let burst_started = t;
    assert_eq!(other_call["sandbox_id"], child_id.as_str());
    let mut statuses = std::collections::BTreeMap::new();
    for b in burst {
        *statuses.entry(b.await.unwrap().expect("every request is answered")).or_insert(0) += 1;
    }
    assert!(statuses.keys().all(|s| *s == 200 || *s == 503), "{statuses:?}");
    assert!(statuses.get(&200).copied().unwrap_or(0) > 0, "{statuses:?}");
    phase(&format!(
        "200 at once: {statuses:?} in {:.1} s; another sandbox's call answered in {answered_in:?}",
        burst_started.elapsed().as_secs_f64()
    ));

    // A hibernated sandbox wakes for a request and serves it.
    let h = call(&client, "sandbox_pause", json!({"sandbox_id": id, "to_disk": true})).await.expect("hibernate");
    assert_eq!(h["state"], "hibernated", "{h}");
    let r = http.get(format!("{origin}/")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(r.status(), 200, "the request woke the sandbox");
    assert!(r.text().await.unwrap().contains("hello from the sandbox"));
    let info = call(&client, "sandbox_info", json!({"sandbox_id": id})).await.expect("info");
    assert_eq!(info["state"], "running", "{info}");
    phase("wake on request checked");

    call(&client, "sandbox_kill", json!({"sandbox_id": child_id})).await.expect("kill child");
    call(&client, "sandbox_kill", json!({"sandbox_id": id})).await.expect("kill");
    assert_eq!(http.get(format!("{origin}/")).header("cookie", &cookie).send().await.unwrap().status(), 404);
}
