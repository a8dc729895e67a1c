//! Secrets end to end: a real server (`--dev`), a real guest, a real MCP
//! client, and two servers of the test's on loopback: `api.test`, HTTPS
//! with a certificate of the test's own CA (which the server's broker
//! trusts through `[network] upstream_ca_certificates`, and the guest does
//! not), and `plain.test`, plain HTTP. Both names come from the sandbox's
//! DNS (`[network.hosts]`, the gateway's address), allowed by name under a
//! deny-by-default policy, the loopback permitted for them.
//!
//! The secret is set with `tine secret set` while the server runs. Then:
//! the guest's environment has only a placeholder; curl and Python's urllib
//! reach `api.test` with the real value in place of it (the server checks
//! it), an echo of the value comes back to curl as the placeholder (and is
//! logged `secret-echo-scrubbed`), and the trust variables that `requests` and Node.js read name the
//! broker's CA (with `TINE_TEST_FULL`, `requests` and Node's `fetch` reach
//! it too: their first starts are minutes of guest work on a nested host);
//! the placeholder sent in plain HTTP to `plain.test` arrives unchanged and
//! is logged; a branch child's swap works with its own copy of the binding;
//! after a detach in the parent the parent's requests carry the placeholder
//! while the child's still work. The egress checks hold on the same guest:
//! a ClientHello without SNI and a second keep-alive request naming another
//! host are refused and logged. The real value occurs nowhere in the data
//! directory (a template's and a hibernation's memory included), in any
//! tool result, in the server's log or in `/metrics`.
//!
//! Needs KVM and the guest images; skips loudly without them.

use std::convert::Infallible;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use testkit::mcp::{call, McpClient, TineServer};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// What the HTTPS server saw: each request's `Authorization`.
type Seen = Arc<Mutex<Vec<String>>>;

/// An HTTPS server for `api.test` on 127.0.0.1 with a certificate of a
/// CA of its own (written to `ca_path`): `/check` answers `auth-ok` when
/// `Authorization` is `Bearer <value>`, else `auth-bad`; `/echo` answers
/// with the `Authorization` it got, in a header and the body (as httpbin's
/// `/headers` does).
fn https_server(value: &str, ca_path: &Path) -> (u16, Seen) {
    let ca = testkit::tls::TestCa::new("secrets test CA");
    ca.write_pem(ca_path);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(ca.server_config("api.test")));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Default::default();
    let (expect, record) = (format!("Bearer {value}"), seen.clone());
    tokio::spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, expect, record) = (acceptor.clone(), expect.clone(), record.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let auth =
                        req.headers().get("authorization").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
                    let auth = auth.unwrap_or_default();
                    record.lock().unwrap().push(auth.clone());
                    let body = if auth == expect { "auth-ok".to_string() } else { "auth-bad".to_string() };
                    let resp = if req.uri().path() == "/echo" {
                        Response::builder()
                            .header("x-echo", auth.clone())
                            .body(Full::new(Bytes::from(format!("you sent: {auth}"))))
                            .unwrap()
                    } else {
                        Response::new(Full::new(Bytes::from(body)))
                    };
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (port, seen)
}

/// A plain HTTP server on 127.0.0.1 that keeps each request head it got
/// and answers `plain` (keep-alive).
fn plain_server() -> (u16, Seen) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let heads: Seen = Default::default();
    let record = heads.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let record = record.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while let Ok(n @ 1..) = c.read(&mut chunk) {
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        record.lock().unwrap().push(String::from_utf8_lossy(&head).into_owned());
                        let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nplain");
                    }
                }
            });
        }
    });
    (port, heads)
}

/// A tool call whose result (kept in `results`, to look for the value in
/// later) must succeed.
async fn tool(client: &McpClient, results: &mut Vec<String>, name: &str, args: Value) -> Value {
    let r = call(client, name, args.clone()).await.unwrap_or_else(|e| panic!("{name} {args}: {e}"));
    results.push(r.to_string());
    r
}

/// A Python cell's `result`, or its error.
async fn python(client: &McpClient, results: &mut Vec<String>, id: &str, code: &str) -> String {
    let r =
        tool(client, results, "sandbox_run_python", json!({"sandbox_id": id, "code": code, "timeout_secs": 120})).await;
    assert!(r["error"].is_null(), "{code}: {r}");
    r["result"].as_str().unwrap_or_default().to_string()
}

/// `urllib` GET of `url` with `Authorization: Bearer <placeholder>` (the
/// sandbox's `$API_KEY`, or `placeholder`), verifying TLS unless `verify`
/// is false; the body, or the error's text.
fn py_get(url: &str, placeholder: Option<&str>, verify: bool) -> String {
    let auth = match placeholder {
        Some(p) => format!("'Bearer {p}'"),
        None => "'Bearer ' + os.environ['API_KEY']".into(),
    };
    let ctx = if verify { "None" } else { "ssl._create_unverified_context()" };
    format!(
        "import os, ssl, urllib.request\n\
         try:\n\
         \x20   r = urllib.request.urlopen(urllib.request.Request('{url}', headers={{'Authorization': {auth}}}), timeout=60, context={ctx}).read().decode()\n\
         except Exception as e:\n\
         \x20   r = 'error: ' + repr(e)\n\
         r"
    )
}

/// Every file under `dir` that contains `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let Ok(mut f) = std::fs::File::open(&path) else { continue };
                let finder = memchr::memmem::Finder::new(needle);
                let mut buf = vec![0u8; 8 << 20];
                let mut carry: Vec<u8> = Vec::new();
                loop {
                    let n = match f.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    carry.extend_from_slice(&buf[..n]);
                    if finder.find(&carry).is_some() {
                        found.push(path.display().to_string());
                        break;
                    }
                    let keep = carry.len().saturating_sub(needle.len());
                    carry.drain(..keep);
                }
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_their_hosts_and_nothing_else() {
    if !testkit::kvm_available("secrets") {
        return;
    }
    let started = std::time::Instant::now();
    let phase = |what: &str| eprintln!("secrets test: {what} at {:.1} s", started.elapsed().as_secs_f64());
    let value = format!("sk-tine-test-{:016x}{:016x}", rand_u64(), rand_u64());
    let dir = tempfile::tempdir().unwrap();
    let ca_path = dir.path().join("test-ca.pem");
    let (api_port, seen) = https_server(&value, &ca_path);
    let (plain_port, heads) = plain_server();
    let config = format!(
        "[network]\npermit_ranges = [\"127.0.0.1/32\"]\nupstream_ca_certificates = [\"{}\"]\n\
         [network.hosts]\n\"api.test\" = \"10.0.2.2\"\n\"plain.test\" = \"10.0.2.2\"\n",
        ca_path.display()
    );
    let server = TineServer::start_with_default_template(binary(), None, &config);
    let client = server.client().await;
    let mut results = Vec::new();

    // The secret, set on the host while the server runs (value on stdin).
    let mut set = std::process::Command::new(binary())
        .args(["secret", "set", "api-key", "--hosts", "api.test", "--data-dir"])
        .arg(&server.data_dir)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    set.stdin.take().unwrap().write_all(format!("{value}\n").as_bytes()).unwrap();
    let out = set.wait_with_output().unwrap();
    assert!(out.status.success(), "tine secret set: {}", String::from_utf8_lossy(&out.stderr));
    let t = std::time::Instant::now();
    loop {
        let listed = tool(&client, &mut results, "secret_list", json!({})).await;
        if listed["secrets"].as_array().is_some_and(|s| s.iter().any(|s| s["name"] == "api-key")) {
            assert_eq!(listed["secrets"][0]["hosts"], json!(["api.test"]), "{listed}");
            break;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "the server never read the secret: {listed}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    phase("secret set");

    let sb = tool(
        &client,
        &mut results,
        "sandbox_create",
        json!({"secrets": {"API_KEY": "api-key"},
               "network": {"egress": "deny", "allow": ["api.test", "plain.test"]}}),
    )
    .await;
    let id = sb["sandbox_id"].as_str().unwrap().to_string();
    let placeholder = sb["secrets"][0]["placeholder"].as_str().unwrap().to_string();
    assert_eq!(sb["secrets"][0]["env"], "API_KEY", "{sb}");
    assert!(placeholder.starts_with("tine_placeholder_") && !placeholder.contains(&value), "{sb}");
    let in_guest = python(&client, &mut results, &id, "import os\nos.environ.get('API_KEY')").await;
    assert_eq!(in_guest, format!("'{placeholder}'"), "the guest holds the placeholder only");
    phase("sandbox with its secret");

    // curl, as the issue's example has it.
    let url = format!("https://api.test:{api_port}/check");
    let r = tool(
        &client,
        &mut results,
        "sandbox_exec",
        json!({"sandbox_id": id, "command": format!("curl -sS --max-time 90 -H \"Authorization: Bearer $API_KEY\" {url}"),
               "timeout_secs": 180}),
    )
    .await;
    assert_eq!((r["stdout"].as_str(), r["exit_code"].as_i64()), (Some("auth-ok"), Some(0)), "{r}");
    assert_eq!(seen.lock().unwrap().last().cloned(), Some(format!("Bearer {value}")), "the server got the real value");
    phase("curl");
    // An echo of the value (headers and body) reaches the guest as the
    // placeholder only.
    let r = tool(
        &client,
        &mut results,
        "sandbox_exec",
        json!({"sandbox_id": id, "command": format!("curl -sS -i --max-time 90 -H \"Authorization: Bearer $API_KEY\" https://api.test:{api_port}/echo"),
               "timeout_secs": 180}),
    )
    .await;
    let echoed = r["stdout"].as_str().unwrap_or_default();
    assert_eq!(seen.lock().unwrap().last().cloned(), Some(format!("Bearer {value}")), "the server got the value");
    assert!(
        echoed.contains(&format!("x-echo: Bearer {placeholder}"))
            && echoed.contains(&format!("you sent: Bearer {placeholder}")),
        "{r}"
    );
    assert!(!echoed.contains(&value), "the guest read the value: {r}");
    phase("echo scrubbed");
    // Python's urllib (OpenSSL's default paths: `SSL_CERT_FILE`).
    assert_eq!(python(&client, &mut results, &id, &py_get(&url, None, true)).await, "'auth-ok'", "urllib");
    phase("urllib");
    // requests and Node.js find the broker's CA through the variables the
    // agent sets: every bundle variable names the bundle (system store
    // plus the broker's CA), `NODE_EXTRA_CA_CERTS` the broker's CA alone.
    let broker_ca = std::fs::read_to_string(server.data_dir.join("broker-ca.pem")).expect("the broker's CA");
    let body: String = broker_ca.lines().filter(|l| !l.starts_with("-----")).collect();
    let code = format!(
        "import os\n\
         def body(p):\n    return ''.join(l for l in open(p).read().splitlines() if not l.startswith('-----'))\n\
         ([os.environ.get(v) for v in ('SSL_CERT_FILE', 'REQUESTS_CA_BUNDLE', 'CURL_CA_BUNDLE', 'PIP_CERT', 'GIT_SSL_CAINFO')], \
         os.environ.get('NODE_EXTRA_CA_CERTS'), '{body}' in body('{bundle}'), '{body}' in body('{extra}'))",
        bundle = tine_protocol::TRUST_BUNDLE,
        extra = tine_protocol::TRUST_EXTRA,
    );
    let b = tine_protocol::TRUST_BUNDLE;
    assert_eq!(
        python(&client, &mut results, &id, &code).await,
        format!("(['{b}', '{b}', '{b}', '{b}', '{b}'], '{}', True, True)", tine_protocol::TRUST_EXTRA),
        "the trust variables"
    );
    // The clients themselves (each one's first start is a minute or more of
    // guest work here: `requests` 43 s, Node.js 95 s) with TINE_TEST_FULL.
    if testkit::full_size() {
        // requests: pip's own copy (the image has no other).
        let code = format!(
            "from pip._vendor import requests\nimport os\n\
             requests.get('{url}', headers={{'Authorization': 'Bearer ' + os.environ['API_KEY']}}, timeout=60).text"
        );
        assert_eq!(python(&client, &mut results, &id, &code).await, "'auth-ok'", "requests");
        phase("requests");
        // Node's fetch.
        let js = format!(
            "const r = await fetch('{url}', {{headers: {{authorization: 'Bearer ' + process.env.API_KEY}}}}); await r.text()"
        );
        let r = tool(
            &client,
            &mut results,
            "sandbox_run_code",
            json!({"sandbox_id": id, "language": "javascript", "code": js, "timeout_secs": 300}),
        )
        .await;
        assert_eq!(r["result"], "'auth-ok'", "{r}");
        phase("node");
    }

    // The placeholder in plain HTTP to a host outside the secret's list:
    // unchanged, and logged.
    let plain = format!("http://plain.test:{plain_port}/leak");
    assert_eq!(python(&client, &mut results, &id, &py_get(&plain, None, true)).await, "'plain'");
    let head = heads.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(head.contains(&format!("Bearer {placeholder}")) && !head.contains(&value), "{head}");
    let log = tool(&client, &mut results, "sandbox_network_log", json!({"sandbox_id": id})).await;
    let records = log["records"].as_array().unwrap().clone();
    let leak = records.iter().find(|r| r["rule"] == "secret-leak-blocked").unwrap_or_else(|| panic!("{log}"));
    assert_eq!((leak["domain"].as_str(), &leak["secrets"]), (Some("plain.test"), &json!(["api-key"])), "{leak}");
    let echo = records.iter().find(|r| r["rule"] == "secret-echo-scrubbed").unwrap_or_else(|| panic!("{log}"));
    assert_eq!((echo["domain"].as_str(), &echo["secrets"]), (Some("api.test"), &json!(["api-key"])), "{echo}");
    let brokered = records.iter().filter(|r| r["domain"] == "api.test" && r["secrets"] == json!(["api-key"])).count();
    // curl and urllib, and with TINE_TEST_FULL requests and Node too.
    let clients = if testkit::full_size() { 4 } else { 2 };
    assert!(brokered >= clients, "the brokered connections name the secret swapped: {log}");

    // Egress on the same guest: a ClientHello without SNI to the allowed
    // name's address, and a second keep-alive request naming another
    // host, are refused and logged.
    let no_sni = format!(
        "import socket, ssl\n\
         c = ssl.create_default_context(); c.check_hostname = False; c.verify_mode = ssl.CERT_NONE\n\
         s = socket.create_connection(('api.test', {api_port}), timeout=30)\n\
         try:\n\
         \x20   c.wrap_socket(s, server_hostname=None); r = 'handshake done'\n\
         except Exception as e:\n\
         \x20   r = 'refused: ' + type(e).__name__\n\
         r"
    );
    let r = python(&client, &mut results, &id, &no_sni).await;
    assert!(r.starts_with("'refused"), "no SNI: {r}");
    let second_host = format!(
        "import socket\n\
         s = socket.create_connection(('plain.test', {plain_port}), timeout=30)\n\
         s.sendall(b'GET /one HTTP/1.1\\r\\nHost: plain.test\\r\\n\\r\\n')\n\
         first = s.recv(100)\n\
         s.sendall(b'GET /two HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n')\n\
         try:\n\
         \x20   rest = s.recv(100)\n\
         except Exception as e:\n\
         \x20   rest = repr(e).encode()\n\
         (first[:15], rest[:30])"
    );
    let r = python(&client, &mut results, &id, &second_host).await;
    assert!(r.starts_with("(b'HTTP/1.1 200 OK'"), "the first request passes: {r}");
    assert!(!heads.lock().unwrap().iter().any(|h| h.contains("evil.test")), "the second never reached the host");
    let log = tool(&client, &mut results, "sandbox_network_log", json!({"sandbox_id": id})).await;
    let rules: Vec<(String, String)> = log["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (r["rule"].as_str().unwrap_or_default().to_string(), r["domain"].as_str().unwrap_or_default().to_string())
        })
        .collect();
    assert!(rules.iter().any(|(rule, _)| rule == "sni:missing"), "{rules:?}");
    assert!(rules.iter().any(|(rule, domain)| rule == "egress:deny" && domain == "evil.test"), "{rules:?}");
    phase("plain HTTP and egress");

    // A branch child swaps with its copy of the binding; a detach in the
    // parent leaves the child's.
    let kids = tool(&client, &mut results, "sandbox_branch", json!({"sandbox_id": id, "n": 1})).await;
    let child = kids["children"][0]["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!(kids["children"][0]["secrets"][0]["placeholder"], placeholder.as_str(), "{kids}");
    assert_eq!(python(&client, &mut results, &child, &py_get(&url, None, true)).await, "'auth-ok'", "child");
    let updated = tool(&client, &mut results, "sandbox_update", json!({"sandbox_id": id, "secrets": {}})).await;
    assert!(updated.get("secrets").is_none(), "{updated}");
    let before = seen.lock().unwrap().len();
    // Not brokered now: straight to the host, whose CA the guest does not
    // trust (so unverified), with the placeholder as it is.
    let r = python(&client, &mut results, &id, &py_get(&url, Some(&placeholder), false)).await;
    assert_eq!(r, "'auth-bad'", "the parent's swap stopped");
    assert_eq!(seen.lock().unwrap()[before..].to_vec(), vec![format!("Bearer {placeholder}")]);
    assert_eq!(
        python(&client, &mut results, &child, &py_get(&url, None, true)).await,
        "'auth-ok'",
        "the child's goes on"
    );
    phase("branch and detach");

    // The value is nowhere the server writes: a template of the child, its
    // hibernation, the rest of the data directory; nor in any tool result,
    // the server's log or /metrics.
    tool(&client, &mut results, "sandbox_snapshot", json!({"sandbox_id": child, "name": "with-secret"})).await;
    tool(&client, &mut results, "sandbox_pause", json!({"sandbox_id": child, "to_disk": true})).await;
    let found = files_containing(&server.data_dir, value.as_bytes());
    assert!(found.is_empty(), "the real value is in {found:?}");
    assert!(
        !files_containing(&server.data_dir.join("templates/with-secret"), placeholder.as_bytes()).is_empty()
            || !files_containing(&server.data_dir.join("kept"), placeholder.as_bytes()).is_empty(),
        "the scan reads guest memory: the placeholder is in it"
    );
    for r in &results {
        assert!(!r.contains(&value), "a tool result holds the value: {r}");
    }
    assert!(!server.log().contains(&value), "the server's log holds the value");
    let metrics = reqwest::get(format!("{}/metrics", server.base)).await.unwrap().text().await.unwrap();
    assert!(!metrics.contains(&value) && metrics.contains("tine_"), "/metrics");
    phase("scanned");
    for s in [&child, &id] {
        let _ = call(&client, "sandbox_kill", json!({"sandbox_id": s})).await;
    }
}

/// 64 bits from the kernel's random source.
fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut b).unwrap();
    u64::from_ne_bytes(b)
}
