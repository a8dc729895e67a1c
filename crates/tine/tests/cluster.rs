//! Two Tine hosts behind a real nginx (Debian's package) with the
//! consistent-hash configuration of `deploy/nginx/tine.conf`: sessions
//! through nginx keep their sandbox and Python state whichever host nginx
//! hashes them to, a call naming the other host's sandbox is forwarded
//! (and one naming a host nobody knows is refused with its name), a
//! request of one host's session sent to the other is proxied to it,
//! `/metrics` holds the expected series after a create, an exec, a branch
//! and a kill, a tenant's call forwarded to the other host acts as that
//! tenant there (and another tenant's is refused as for an unknown id), a
//! preview URL of one host's sandbox opened through the other reaches it
//! (and through a third host that knows no peer by name, only
//! `[cluster] peer_dns`, WebSocket included),
//! and killing one host leaves the other's sessions working.
//!
//! Needs KVM, the guest images and `/usr/sbin/nginx` (scripts/setup.sh
//! installs it; `$TINE_NGINX` names another); skips loudly without them unless `TINE_REQUIRE_NGINX`
//! (scripts/test.sh sets it) or `CI` is set.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use testkit::mcp::{call, connect, free_port, McpClient, TineServer};

const TOKEN: &str = "cluster-test-token-0123456789abcdef0123456789";
const NGINX: &str = "/usr/sbin/nginx";
/// Sessions opened through nginx.
const SESSIONS: usize = 10;
/// The guest web app of the preview test (`/count`, `/ws`, ...).
const APP: &str = include_str!("py/preview_app.py");

/// nginx (`$TINE_NGINX`, else Debian's), or `None` (with a loud SKIPPED
/// line) where it is missing and not required.
fn nginx(test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("TINE_NGINX").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(NGINX));
    if path.exists() {
        return Some(path);
    }
    let required = std::env::var_os("TINE_REQUIRE_NGINX").is_some() || std::env::var_os("CI").is_some();
    assert!(!required, "{test}: {NGINX} is missing; scripts/setup.sh installs Debian's nginx");
    eprintln!("SKIPPED {test}: {NGINX} is missing (scripts/setup.sh installs it)");
    None
}

/// A running nginx with `deploy/nginx/tine.conf` in front of `upstreams`;
/// stopped on drop.
struct Nginx {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// Starts `binary` on 127.0.0.1 with the deploy configuration, its
    /// listen line and server lines replaced; waits until it accepts.
    fn start(binary: &Path, upstreams: &[u16]) -> Nginx {
        let deploy = testkit::workspace_root().join("deploy/nginx/tine.conf");
        let conf = std::fs::read_to_string(&deploy).expect("read deploy/nginx/tine.conf");
        let port = free_port();
        let mut servers = upstreams.iter().map(|p| format!("server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;"));
        let mut out = Vec::new();
        for line in conf.lines() {
            let t = line.trim_start();
            if t.starts_with("server 10.0.0.") {
                out.push(format!("    {}", servers.next().expect("as many server lines as upstreams")));
            } else if t == "listen 80;" {
                out.push(format!("    listen 127.0.0.1:{port};"));
            } else {
                out.push(line.to_string());
            }
        }
        assert!(servers.next().is_none(), "deploy/nginx/tine.conf has a server line per upstream");
        let text = out.join("\n");
        assert!(text.contains("hash $http_mcp_session_id consistent;"), "the deploy configuration hashes sessions");
        assert!(text.contains(&format!("listen 127.0.0.1:{port};")), "the deploy configuration has `listen 80;`");
        let dir = tempfile::Builder::new().prefix("tine-nginx").tempdir_in("/tmp").expect("temp dir");
        let d = dir.path().display();
        std::fs::write(dir.path().join("tine.conf"), text).expect("write tine.conf");
        let main = format!(
            "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             \x20 fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             \x20 include {d}/tine.conf;\n}}\n"
        );
        std::fs::write(dir.path().join("nginx.conf"), main).expect("write nginx.conf");
        // The prefix, the start-up error log and the configuration: all in
        // the temporary directory, nothing of the system's nginx.
        let nginx = || {
            let mut c = Command::new(binary);
            c.arg("-p").arg(dir.path()).arg("-e").arg(dir.path().join("error.log"));
            c.arg("-c").arg(dir.path().join("nginx.conf"));
            c
        };
        let check = nginx().arg("-t").output().expect("run nginx -t");
        assert!(check.status.success(), "nginx -t: {}", String::from_utf8_lossy(&check.stderr));
        let child = nginx().stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("start nginx");
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "nginx does not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Nginx { child, port, dir }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGQUIT: graceful stop of the master and its worker.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGQUIT) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default();
        eprintln!("nginx error.log (last lines):\n{}", tail(&log, 20));
    }
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// The peer key of the test's hosts (`[cluster] peer_key_file`), a file
/// of mode 0600 in `dir`; another key than [`TOKEN`].
fn peer_key_file(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("peer-key");
    std::fs::write(&path, "cluster-test-peer-key-0123456789abcdef0123456789").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A listener on a loopback port that counts the connections it accepts
/// (and closes them at once): a peer URL that leaks shows up as a count.
struct Counting {
    port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Counting {
    fn start() -> Counting {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(conn);
            }
        });
        Counting { port, accepted }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Starts `tine server start` with `config` and the test token; `Err`
/// with its standard error when it exits before it listens, else the
/// running server (killed on drop) and its port.
fn try_start(bin: &Path, dir: &Path, config: &str) -> Result<(KillOnDrop, u16), String> {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    let (config_path, token) = (dir.join("tine.toml"), dir.join("token"));
    std::fs::write(&config_path, config).unwrap();
    std::fs::write(&token, TOKEN).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let port = free_port();
    let mut child = Command::new(bin)
        .args(["server", "start", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--config")
        .arg(&config_path)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--token-file")
        .arg(&token)
        .arg("--kernel")
        .arg(testkit::kernel())
        .arg("--rootfs")
        .arg(testkit::rootfs())
        .env_remove("TINE_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tine server");
    // Standard error drained (a running server logs), kept for the answer.
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    if !lines.by_ref().map_while(Result::ok).any(|l| l.starts_with("tine: listening on")) {
        let _ = child.wait();
        return Err(err.join().unwrap());
    }
    std::thread::spawn(move || for _ in lines.by_ref() {});
    Ok((KillOnDrop(child), port))
}

/// A child process killed and reaped on drop.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `peer_url` that puts the host part of a client's id where a URL's
/// host is, `http://{host}:PORT` (the issue's example), would send an id
/// whose host part is a number (`2130706433` is 127.0.0.1) to that IP
/// address with the peer key. Such a configuration is refused at start,
/// saying what to write instead; a cluster without its own peer key is
/// refused too; and a host whose peers are named reaches no address for
/// numeric host parts in a session id or a sandbox id: the listener the
/// peer URL would point at sees no connection, and the caller gets an
/// error. Host-only (no guest, no nginx).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numeric_hosts_in_ids_reach_no_address() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_tine"));
    let target = Counting::start();
    let dir = tempfile::tempdir().unwrap();
    let key = peer_key_file(dir.path());
    let base = "[templates]\nbuild_default = false\n[pool]\nsize = 0\n[cluster]\nhost_name = \"h1\"\n";
    // Numeric host parts: 127.0.0.1 as a decimal and as a hex number.
    let numeric = ["2130706433", "0x7f000001"];
    let random = "a1b2c3d4";

    // What a client of such a server sends, and what it must get.
    let probe = |port: u16| async move {
        let http = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{port}/mcp");
        let mut answers = Vec::new();
        for host in numeric {
            let resp = http
                .post(&url)
                .bearer_auth(TOKEN)
                .header("accept", "application/json, text/event-stream")
                .header("content-type", "application/json")
                .header("mcp-session-id", format!("{host}.0f7c2d"))
                .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#)
                .send()
                .await
                .unwrap();
            answers.push(format!("session {host}: {}", resp.status()));
            assert!(!resp.status().is_success(), "a session of host {host} was served: {}", resp.status());
        }
        let client = connect(&url, Some(TOKEN)).await;
        for host in numeric {
            let id = format!("sb-{host}-{random}");
            let e =
                call(client.peer(), "sandbox_exec", json!({"sandbox_id": id, "command": "true"})).await.unwrap_err();
            assert!(e.contains(&id), "the error names the id: {e}");
            answers.push(format!("sandbox {id}: {e}"));
        }
        answers
    };

    // 1. The issue's peer_url: refused, saying how to write it.
    let issue =
        format!("{base}peer_url = \"http://{{host}}:{}\"\npeer_key_file = \"{}\"\n", target.port, key.display());
    match try_start(&bin, dir.path(), &issue) {
        Err(err) => assert!(err.contains("peer_url") && err.contains("{host}.<DNS suffix>"), "{err}"),
        Ok((_server, port)) => {
            let answers = probe(port).await;
            panic!(
                "peer_url http://{{host}}:{} was accepted; numeric hosts reached {} connection(s) on 127.0.0.1 ({answers:?})",
                target.port,
                target.accepted()
            );
        }
    }

    // 2. A cluster without its own peer key: refused, saying how to make one.
    let no_key = format!("{base}peers = {{ h2 = \"http://127.0.0.1:{}\" }}\n", target.port);
    match try_start(&bin, dir.path(), &no_key) {
        Err(err) => assert!(err.contains("peer_key_file") && err.contains("tine server keygen"), "{err}"),
        Ok(_) => panic!("a cluster without a peer key started: it would send peers the operator's token"),
    }

    // 3. A good configuration: numeric hosts in ids reach nothing.
    let good = format!(
        "{base}peers = {{ h2 = \"http://127.0.0.1:{}\" }}\npeer_url = \"http://{{host}}.peers.invalid:{}\"\n\
         peer_key_file = \"{}\"\n",
        target.port,
        target.port,
        key.display()
    );
    let (_server, port) = try_start(&bin, dir.path(), &good).unwrap_or_else(|e| panic!("a good configuration: {e}"));
    let answers = probe(port).await;
    assert_eq!(target.accepted(), 0, "numeric hosts reached 127.0.0.1: {answers:?}");
}

/// The host a sandbox id names (`sb-<host>-<random>`).
fn host_of(id: &str) -> &str {
    let rest = id.strip_prefix("sb-").unwrap_or_else(|| panic!("{id} starts with sb-"));
    rest.rsplit_once('-').unwrap_or_else(|| panic!("{id} is sb-<host>-<random>")).0
}

/// `GET /metrics` of `base` with `token` (or none): status line and body.
fn scrape(base: &str, token: Option<&str>) -> (String, String) {
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    (head.lines().next().unwrap_or_default().to_string(), body.to_string())
}

/// The value of the sample `series` (name with labels, as exposed), or
/// `None` when it is not there. Chunked bodies are decoded loosely: sample
/// lines survive the chunk framing intact unless cut, so the value is read
/// from the first whole line that starts with `series `.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.parse().ok()))
}

fn python(out: &Value) -> String {
    out["stdout"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hosts_behind_nginx() {
    let test = "tine::cluster two_hosts_behind_nginx";
    if !testkit::kvm_available(test) {
        return;
    }
    let Some(nginx_bin) = nginx(test) else { return };
    // Cargo's build of this package's binary: `testkit::mcp::tine_binary`
    // runs `cargo build -p tine`, whose feature set differs from the
    // workspace build's, so it relinked `target/release/tine` mid-run
    // (minutes of compiling, and every server after it started a new
    // binary and rebuilt its default template).
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_tine"));
    let (p1, p2) = (free_port(), free_port());
    // One tenants file for both hosts, as a shared mount would give them.
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    let key = |name: &str| {
        let out = Command::new(&bin).args(["tenant", "add", name, "--tenants-file"]).arg(&tenants).output().unwrap();
        assert!(out.status.success(), "tine tenant add: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let (acme, beta) = (key("acme"), key("beta"));
    let peer_key = peer_key_file(dir.path());
    let config = |me: &str, other: &str, port: u16| {
        format!(
            "[cluster]\nhost_name = \"{me}\"\npeers = {{ {other} = \"http://127.0.0.1:{port}\" }}\n\
             peer_key_file = \"{}\"\n[auth]\n\
             tenants_file = \"{}\"\n[preview]\ndomain = \"preview.test\"\nscheme = \"http\"\n",
            peer_key.display(),
            tenants.display()
        )
    };
    let h1 = TineServer::start_with_default_template_on(&bin, Some(TOKEN), &config("h1", "h2", p2), p1);
    let mut h2 = TineServer::start_with_default_template_on(&bin, Some(TOKEN), &config("h2", "h1", p1), p2);
    let lb = Nginx::start(&nginx_bin, &[p1, p2]);

    // Ten sessions through nginx, each with its own sandbox and a value in
    // its Python state.
    let mut sessions: Vec<(McpClient, String)> = Vec::new();
    for i in 0..SESSIONS {
        let client = connect(&lb.url(), Some(TOKEN)).await;
        let id = call(&client, "sandbox_create", json!({})).await.unwrap()["sandbox_id"].as_str().unwrap().to_string();
        assert!(["h1", "h2"].contains(&host_of(&id)), "{id} names h1 or h2");
        let out = call(&client, "sandbox_run_python", json!({"code": format!("x = {i} * 7\nprint('set', x)")})).await;
        assert!(python(&out.unwrap()).contains(&format!("set {}", i * 7)));
        sessions.push((client, id));
    }
    let on = |h: &str| sessions.iter().filter(|(_, id)| host_of(id) == h).count();
    eprintln!("{test}: sessions on h1 {}, on h2 {}", on("h1"), on("h2"));
    assert!(on("h1") > 0 && on("h2") > 0, "new sessions spread over both hosts (round robin without a session id)");
    let ids: std::collections::BTreeSet<&String> = sessions.iter().map(|(_, id)| id).collect();
    assert_eq!(ids.len(), SESSIONS, "every session has its own sandbox");
    // Later calls of each session (without sandbox_id: the session's own)
    // find its state, whichever host nginx hashes its session id to.
    for (i, (client, id)) in sessions.iter().enumerate() {
        let out = call(client, "sandbox_run_python", json!({"code": "print('x is', x)"})).await.unwrap();
        assert!(python(&out).contains(&format!("x is {}", i * 7)), "session {i} ({id}): {out}");
        let info = call(client, "sandbox_info", json!({})).await.unwrap();
        assert_eq!(info["sandbox_id"], json!(id), "session {i} keeps its sandbox");
    }

    // A call naming the other host's sandbox is forwarded there.
    let (i1, (c1, _)) = sessions.iter().enumerate().find(|(_, (_, id))| host_of(id) == "h1").unwrap();
    let (i2, (_, s2)) = sessions.iter().enumerate().find(|(_, (_, id))| host_of(id) == "h2").unwrap();
    let out = call(c1, "sandbox_run_python", json!({"sandbox_id": s2, "code": "print('there', x)"})).await.unwrap();
    assert!(python(&out).contains(&format!("there {}", i2 * 7)), "forwarded to h2: {out}");
    // A host nobody knows is refused with its name.
    let e = call(c1, "sandbox_exec", json!({"sandbox_id": "sb-h3-1", "command": "true"})).await.unwrap_err();
    assert!(e.contains("host h3") && e.contains("no address for h3"), "{e}");

    // A request of h1's session sent straight to h2 is proxied to h1.
    let direct = connect(&h1.url, Some(TOKEN)).await;
    call(&direct, "sandbox_run_python", json!({"code": "y = 'direct'"})).await.unwrap();
    let own = call(&direct, "sandbox_info", json!({})).await.unwrap()["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!(host_of(&own), "h1");
    let proxied = raw_call_via(&h1, &h2, "sandbox_run_python", json!({"sandbox_id": own, "code": "print(y)"})).await;
    assert!(proxied.contains("direct"), "h2 passed h1's session to h1: {proxied}");
    // Both hops at once: h1's session sent to h2, naming h2's sandbox (h2
    // passes the request to h1, which forwards the call back to h2).
    let both =
        raw_call_via(&h1, &h2, "sandbox_run_python", json!({"sandbox_id": s2, "code": "print('both', x)"})).await;
    assert!(both.contains(&format!("both {}", i2 * 7)), "proxied, then forwarded: {both}");

    // A preview URL of h1's sandbox opened through h2 is passed to h1,
    // token, cookie exchange and all (the id's first characters name h1).
    call(&direct, "sandbox_run_python", json!({"code": APP})).await.unwrap();
    let pv = call(&direct, "sandbox_preview_url", json!({"port": 8000})).await.unwrap();
    let url = pv["url"].as_str().unwrap().to_string();
    let host = format!("{}.preview.test", pv["preview_id"].as_str().unwrap());
    assert!(url.starts_with(&format!("http://{host}/?tine_preview_token=")), "{pv}");
    let via_h2 = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .resolve(&host, format!("127.0.0.1:{p2}").parse().unwrap())
        .build()
        .unwrap();
    let first = via_h2.get(url.replace(&host, &format!("{host}:{p2}"))).send().await.unwrap();
    assert_eq!(first.status(), 303, "h1 exchanged the token through h2");
    let cookie = first.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    let page = via_h2.get(format!("http://{host}:{p2}/count")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let served: u64 = page.text().await.unwrap().parse().expect("h1's guest app answers its count");
    let bare = via_h2.get(format!("http://{host}:{p2}/count")).send().await.unwrap();
    assert_eq!(bare.status(), 401, "h1 checks the token, not h2");
    // h3 names no peer: it finds the preview's host among those its
    // peer_dns resolves to (localhost: h1's address), asking each its
    // name; the page and a WebSocket echo pass through it.
    let p3 = free_port();
    let h3_config = format!(
        "[cluster]\nhost_name = \"h3\"\npeer_dns = \"http://localhost:{p1}\"\npeer_key_file = \"{}\"\n\
         [templates]\nbuild_default = false\n[preview]\ndomain = \"preview.test\"\nscheme = \"http\"\n",
        peer_key.display()
    );
    let h3 = TineServer::start_on(&bin, Some(TOKEN), &h3_config, p3);
    let via_h3 = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .resolve(&host, format!("127.0.0.1:{p3}").parse().unwrap())
        .build()
        .unwrap();
    let page = via_h3.get(format!("http://{host}:{p3}/count")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(page.status(), 200, "h3 found h1 by peer_dns");
    let again: u64 = page.text().await.unwrap().parse().unwrap();
    assert_eq!(again, served, "the same guest app (/count counts other paths)");
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(format!("ws://{host}:{p3}/ws"))
            .unwrap();
    request.headers_mut().insert("cookie", cookie.parse().unwrap());
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", p3)).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(request, tcp).await.expect("WebSocket handshake through h3");
    assert_eq!(resp.status(), 101);
    ws.send(tokio_tungstenite::tungstenite::Message::text("via h3")).await.unwrap();
    let echo = ws.next().await.expect("an echo").unwrap();
    assert_eq!(echo.to_text().unwrap(), "echo: via h3", "a WebSocket through a peer host");
    drop(ws);
    drop(h3);

    // A tenant's call on h2 naming its sandbox on h1 is forwarded and acts
    // as that tenant there; another tenant's is refused by h1 as for an
    // unknown id.
    let acme_h1 = connect(&h1.url, Some(&acme)).await;
    let theirs = call(&acme_h1, "sandbox_create", json!({})).await.unwrap();
    let theirs = theirs["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!(host_of(&theirs), "h1");
    let acme_h2 = connect(&h2.url, Some(&acme)).await;
    let out = call(&acme_h2, "sandbox_exec", json!({"sandbox_id": theirs, "command": "echo acme"})).await.unwrap();
    assert_eq!(out["stdout"], "acme\n", "forwarded as acme: {out}");
    let listed = call(&acme_h2, "sandbox_list", json!({})).await.unwrap();
    assert_eq!(listed["total"], 0, "h2 holds none of acme's: {listed}");
    let beta_h2 = connect(&h2.url, Some(&beta)).await;
    let e = call(&beta_h2, "sandbox_exec", json!({"sandbox_id": theirs, "command": "true"})).await.unwrap_err();
    let ghost = format!("sb-h1-{}", u32::MAX);
    let unknown = call(&beta_h2, "sandbox_exec", json!({"sandbox_id": ghost, "command": "true"})).await.unwrap_err();
    assert_eq!(e.replace(&theirs, &ghost), unknown, "beta's forwarded call on acme's sandbox");
    // The operator's forwarded call reaches any tenant's.
    let op_h2 = connect(&h2.url, Some(TOKEN)).await;
    let op = call(&op_h2, "sandbox_info", json!({"sandbox_id": theirs})).await.unwrap();
    assert_eq!(op["tenant"], "acme", "{op}");
    for c in [acme_h1, acme_h2, beta_h2, op_h2] {
        let _ = c.cancel().await;
    }

    // /metrics after a create, an exec, a branch and a kill (on h1).
    call(&direct, "sandbox_exec", json!({"command": "true"})).await.unwrap();
    let kids = call(&direct, "sandbox_branch", json!({"n": 1})).await.unwrap();
    let kid = kids["children"][0]["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!(host_of(&kid), "h1", "children stay on their parent's host");
    call(&direct, "sandbox_kill", json!({"sandbox_id": kid})).await.unwrap();
    let (status, _) = scrape(&h1.base, None);
    assert!(status.contains("401"), "/metrics needs the token: {status}");
    let (status, body) = scrape(&h1.base, Some(TOKEN));
    assert!(status.contains("200"), "{status}");
    eprintln!("{test}: h1 /metrics ({} bytes)", body.len());
    for (series, at_least) in [
        (r#"tine_sandboxes{state="running"}"#, 1.0),
        (r#"tine_sandboxes_created_total{how="restore"}"#, 1.0),
        (r#"tine_sandboxes_created_total{how="branch"}"#, 1.0),
        (r#"tine_sandboxes_killed_total{reason="kill"}"#, 1.0),
        (r#"tine_tool_calls_total{tool="sandbox_create",tenant="admin",outcome="ok"}"#, 1.0),
        (r#"tine_tool_calls_total{tool="sandbox_exec",tenant="admin",outcome="ok"}"#, 1.0),
        (r#"tine_tool_calls_total{tool="sandbox_branch",tenant="admin",outcome="ok"}"#, 1.0),
        (r#"tine_tool_calls_total{tool="sandbox_kill",tenant="admin",outcome="ok"}"#, 1.0),
        (r#"tine_tool_call_duration_seconds_count{tool="sandbox_exec"}"#, 1.0),
        (r#"tine_tool_call_duration_seconds_count{tool="sandbox_branch"}"#, 1.0),
        (r#"tine_sandbox_start_seconds_count{how="branch"}"#, 1.0),
        ("tine_guest_memory_bytes", 1.0),
        ("tine_guest_memory_budget_bytes", 1.0),
        (r#"tine_disk_bytes{kind="template"}"#, 1.0),
        (r#"tine_disk_bytes{kind="sandbox"}"#, 0.0),
        (r#"tine_disk_bytes{kind="hibernation"}"#, 0.0),
        (r#"tine_disk_bytes{kind="image"}"#, 0.0),
        (r#"tine_disk_bytes{kind="volume"}"#, 0.0),
        ("tine_disk_reserved_bytes", 1.0),
        ("tine_disk_budget_bytes", 1.0),
        ("tine_pool_size", 0.0),
        ("tine_pool_ready", 0.0),
        ("tine_mcp_sessions", 1.0),
        (r#"tine_forwarded_calls_total{peer="h2",outcome="ok"}"#, 1.0),
    ] {
        let v = sample(&body, series).unwrap_or_else(|| panic!("{series} in h1's /metrics:\n{body}"));
        assert!(v >= at_least, "{series} = {v}, want at least {at_least}");
    }
    assert!(body.contains(r#"tine_tool_call_duration_seconds_bucket{le="#), "histogram buckets:\n{body}");
    assert!(body.contains(r#"tine_build_info{version=""#) && body.contains(r#"host="h1""#), "{body}");

    // One host dies: the other's sessions go on through nginx; calls for
    // the dead host's sandboxes say which host is gone.
    let pid = h2.pid();
    // SAFETY: kill(2) on the test's own child process.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let _ = h2.terminate(); // reaps it
    for (i, (client, id)) in sessions.iter().enumerate().filter(|(_, (_, id))| host_of(id) == "h1") {
        let out = call(client, "sandbox_run_python", json!({"code": "print('still', x)"})).await.unwrap();
        assert!(python(&out).contains(&format!("still {}", i * 7)), "session {i} ({id}) after h2 died: {out}");
    }
    let e = call(c1, "sandbox_info", json!({"sandbox_id": s2})).await.unwrap_err();
    assert!(e.contains("host h2"), "{e}");
    eprintln!("{test}: h1's sessions work after h2 died (session {i1} among them)");
    drop(sessions);
    drop(direct);
    drop(lb);
}

/// Sends one `tools/call` of `tool` with `args` in `owner`'s session (a
/// fresh one, initialized on `owner` directly) to `other`, as raw
/// Streamable HTTP; the response body (JSON or an SSE stream).
async fn raw_call_via(owner: &TineServer, other: &TineServer, tool: &str, args: Value) -> String {
    let http = reqwest::Client::new();
    let post = |url: &str, session: Option<&str>, body: Value| {
        let mut r = http
            .post(url)
            .bearer_auth(TOKEN)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .header("mcp-protocol-version", "2025-06-18")
            .body(body.to_string());
        if let Some(s) = session {
            r = r.header("mcp-session-id", s);
        }
        r.send()
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}});
    let resp = post(&owner.url, None, init).await.expect("initialize");
    assert!(resp.status().is_success(), "initialize: {}", resp.status());
    let session = resp.headers()["mcp-session-id"].to_str().unwrap().to_string();
    assert!(session.starts_with("h1."), "session ids name their host: {session}");
    let _ = resp.text().await;
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let resp = post(&other.url, Some(&session), note).await.expect("initialized, via the other host");
    assert!(resp.status().is_success(), "notifications/initialized via the other host: {}", resp.status());
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": tool, "arguments": args}});
    let resp = post(&other.url, Some(&session), call).await.expect("tools/call via the other host");
    assert!(resp.status().is_success(), "tools/call via the other host: {}", resp.status());
    resp.text().await.expect("body")
}
