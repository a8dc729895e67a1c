//! Connection hygiene of a real `tine server start` over real sockets:
//!
//! - 300 connections that send nothing and 300 that send half an HTTP/2
//!   preface (`PRI * HTTP/2.0\r\n`) do not keep a well-behaved MCP client
//!   from initializing and calling a tool, nor `/healthz` from answering,
//!   and the server closes every one of them at its header read timeout
//!   (2 s here);
//! - with the default `max_connections` (256) taken by such connections,
//!   a client still gets through once the server has closed them;
//! - past `max_sessions` an `initialize` is refused with 503 and a message
//!   saying what to do, and after a `DELETE /mcp` a new session is made;
//! - a `--dev` server (no credentials) answers a browser's `Origin` of its
//!   own listen address (`localhost`, `127.0.0.1`, `[::1]` with its port)
//!   and refuses every other with 403: a foreign site, another loopback
//!   port, and a preview page's `<id>.localhost` (a guest's page must not
//!   drive the server); `/mcp` under a preview's host never reaches MCP.
//! - one address holds at most half the slots by default (more are closed
//!   at once), and keep-alive connections idle between requests are closed
//!   after a few seconds when more than 3/4 of the slots are taken, so
//!   unauthenticated `GET /healthz` connections do not keep a client out.
//!
//! No sandbox is made (the tool called is `sandbox_list`), no default
//! template is built and the warm pool is off, so no guest boots and KVM
//! is not needed; the server needs the guest images' paths (testkit finds
//! them).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::mcp::{call, connect, TineServer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;

const TOKEN: &str = "connections-test-token-0123456789abcdef012345";
/// The servers' `header_read_timeout_secs`.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How late a close may come after its deadline on a busy test host.
const SLACK: Duration = Duration::from_secs(3);
/// How long a well-behaved client's initialize, tool call and `/healthz`
/// may take with the bad connections open (they take milliseconds).
const USUAL: Duration = Duration::from_secs(5);
/// Connections of each bad kind.
const BAD: usize = 300;
/// A server without the default template's build and without the pool,
/// so that no guest boots.
const QUIET: &str = "[templates]\nbuild_default = false\n[pool]\nsize = 0\n";

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tine"))
}

/// Raises this process's open file limit (and so its servers', started
/// after) to `want`, or as near as the hard limit allows; panics when
/// that is below `need`.
fn raise_open_files(want: u64, need: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit(2) writes the struct passed, which lives on this stack frame.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0, "getrlimit");
    if limit.rlim_cur < want {
        limit.rlim_cur = want.min(limit.rlim_max);
        // SAFETY: setrlimit(2) reads the struct passed; it changes only this process's limit.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0, "getrlimit");
    }
    assert!(limit.rlim_cur >= need, "open file limit {} < {need}; raise it (ulimit -n)", limit.rlim_cur);
}

/// `host:port` of `server`.
fn addr(server: &TineServer) -> String {
    server.base.trim_start_matches("http://").to_string()
}

/// A connection that sent `first` (nothing if empty) and then nothing
/// more, and when it was opened.
async fn bad_connection(addr: &str, first: &[u8]) -> (TcpStream, Instant) {
    let opened = Instant::now();
    let mut s = TcpStream::connect(addr).await.expect("connect");
    if !first.is_empty() {
        s.write_all(first).await.expect("send");
    }
    (s, opened)
}

/// `BAD` connections that send nothing and `BAD` that send half an
/// HTTP/2 preface.
async fn bad_connections(addr: &str) -> Vec<(TcpStream, Instant, &'static str)> {
    let mut out = Vec::with_capacity(2 * BAD);
    for _ in 0..BAD {
        let (s, t) = bad_connection(addr, b"").await;
        out.push((s, t, "silent"));
        let (s, t) = bad_connection(addr, b"PRI * HTTP/2.0\r\n").await;
        out.push((s, t, "half preface"));
    }
    out
}

/// A well-behaved client's session: initialize, `sandbox_list`, and
/// `/healthz` with the token; each within `within`. Returns how long the
/// three took.
async fn well_behaved_client(server: &TineServer, within: Duration) -> Duration {
    let start = Instant::now();
    let client = tokio::time::timeout(within, connect(&server.url, Some(TOKEN)))
        .await
        .unwrap_or_else(|_| panic!("no MCP initialize within {within:?}"));
    let listed = tokio::time::timeout(within, call(client.peer(), "sandbox_list", json!({})))
        .await
        .unwrap_or_else(|_| panic!("no sandbox_list answer within {within:?}"))
        .expect("sandbox_list");
    assert!(listed["sandboxes"].is_array(), "{listed}");
    let health = tokio::time::timeout(
        within,
        reqwest::Client::new().get(format!("{}/healthz", server.base)).bearer_auth(TOKEN).send(),
    )
    .await
    .unwrap_or_else(|_| panic!("no /healthz answer within {within:?}"))
    .expect("GET /healthz");
    assert_eq!(health.status(), 200);
    assert_eq!(health.json::<Value>().await.unwrap()["status"], "ok");
    let took = start.elapsed();
    let _ = client.cancel().await;
    took
}

/// Waits until the server closes `s` (EOF or a reset), until `deadline`;
/// returns when it saw the close.
async fn closed_by(s: &mut TcpStream, deadline: Instant, what: &str) -> Instant {
    let mut buf = [0u8; 256];
    match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => Instant::now(),
        Ok(Ok(n)) => panic!("{what}: the server sent {n} bytes to a connection that asked nothing"),
        Err(_) => panic!("{what}: still open {:?} after its deadline", deadline.elapsed()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_and_half_preface_connections_neither_starve_clients_nor_stay_open() {
    raise_open_files(8192, 4 * BAD as u64 + 512);
    // The flood comes from one address: no cap per address here (this is
    // a test of the deadlines).
    let config =
        format!("header_read_timeout_secs = 2\nmax_connections = 1024\nmax_connections_per_address = 0\n{QUIET}");
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let mut bad = bad_connections(&addr(&server)).await;

    let took = well_behaved_client(&server, USUAL).await;
    eprintln!("initialize, sandbox_list and /healthz beside {} bad connections: {took:?}", bad.len());

    for (i, (s, opened, kind)) in bad.iter_mut().enumerate() {
        let seen = closed_by(s, *opened + HEADER_READ_TIMEOUT + SLACK, &format!("{kind} connection {i}")).await;
        if i == 0 {
            let after = seen - *opened;
            assert!(after + Duration::from_millis(100) >= HEADER_READ_TIMEOUT, "closed after {after:?} only");
            eprintln!("the first bad connection was closed after {after:?}");
        }
    }
    // The server still serves.
    well_behaved_client(&server, USUAL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_whose_connections_are_all_taken_by_idle_ones_recovers() {
    raise_open_files(8192, 4 * BAD as u64 + 512);
    // The default max_connections (256): the bad connections take every
    // slot, and the rest (and the client's) wait in the listen backlog
    // until the server closes them, 256 every 2 s. The flood comes from
    // one address: no cap per address here (this is a test of the slots).
    let config = format!("header_read_timeout_secs = 2\nmax_connections_per_address = 0\n{QUIET}");
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let start = Instant::now();
    let bad = bad_connections(&addr(&server)).await;
    let opened = start.elapsed();
    let waves = (bad.len() / 256 + 1) as u32;
    let within = HEADER_READ_TIMEOUT * waves + SLACK * 2;
    well_behaved_client(&server, within).await;
    let took = start.elapsed();
    eprintln!(
        "a client behind {} bad connections (opened in {opened:?}) on 256 slots got through {took:?} after the first",
        bad.len()
    );
    assert!(took <= within, "{took:?}");
    drop(bad);
}

/// `POST /mcp` `initialize`.
async fn initialize(http: &reqwest::Client, server: &TineServer) -> reqwest::Response {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}});
    http.post(&server.url)
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_string())
        .send()
        .await
        .expect("POST /mcp")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_initialize_past_max_sessions_is_refused_until_a_session_ends() {
    let config = format!("max_sessions = 5\nsession_timeout_secs = 600\n{QUIET}");
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let http = reqwest::Client::new();
    let mut sessions = Vec::new();
    for _ in 0..5 {
        let r = initialize(&http, &server).await;
        assert_eq!(r.status(), 200);
        sessions.push(r.headers()["mcp-session-id"].to_str().unwrap().to_string());
        r.text().await.unwrap();
    }
    let refused = initialize(&http, &server).await;
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().get("mcp-session-id").is_none());
    let body: Value = refused.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    for part in ["5 MCP sessions open", "max_sessions", "DELETE /mcp", "after 600 s without a request"] {
        assert!(message.contains(part), "{part:?} in {body}");
    }
    let deleted = http
        .delete(&server.url)
        .bearer_auth(TOKEN)
        .header("mcp-session-id", &sessions[0])
        .header("mcp-protocol-version", "2025-06-18")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    // A new session is accepted and works; it takes the place again.
    let client = tokio::time::timeout(USUAL, connect(&server.url, Some(TOKEN))).await.expect("initialize");
    let listed = call(client.peer(), "sandbox_list", json!({})).await.expect("sandbox_list");
    assert!(listed["sandboxes"].is_array(), "{listed}");
    assert_eq!(initialize(&http, &server).await.status(), 503);
}

/// 300 `initialize`s with one tenant's key: the tenant's quota of MCP
/// sessions (20 here) takes the first 20, the rest are refused with 429
/// naming the quota, and the operator's client and `/healthz` are served
/// as usual meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_hundred_sessions_of_one_key_stop_at_its_quota() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    let out = std::process::Command::new(binary())
        .args(["tenant", "add", "busy", "--max-sessions", "20", "--tenants-file"])
        .arg(&tenants)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
    // 300 connections at once from one address: no cap per address here.
    let config = format!("max_connections_per_address = 0\n[auth]\ntenants_file = \"{}\"\n{QUIET}", tenants.display());
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let http = reqwest::Client::new();
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
    .to_string();
    let attempts = (0..300).map(|_| {
        http.post(&server.url)
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.clone())
            .send()
    });
    let (mut made, mut refused) = (0, 0);
    for r in futures_util::future::join_all(attempts).await {
        let r = r.expect("POST /mcp");
        match r.status().as_u16() {
            200 => made += 1,
            429 => {
                let v: Value = r.json().await.unwrap();
                let m = v["message"].as_str().unwrap_or_default();
                assert!(m.contains("tenant busy is at its quota of MCP sessions") && m.contains("DELETE /mcp"), "{v}");
                refused += 1;
            }
            s => panic!("initialize answered {s}"),
        }
    }
    // Initializes in flight count: the quota holds exactly.
    assert_eq!((made, refused), (20, 280));
    let late = http
        .post(&server.url)
        .bearer_auth(&key)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 429, "at the quota");
    let t = Instant::now();
    let client = tokio::time::timeout(USUAL, connect(&server.url, Some(TOKEN))).await.expect("initialize");
    call(client.peer(), "sandbox_list", json!({})).await.expect("sandbox_list");
    let health = http.get(format!("{}/healthz", server.base)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(t.elapsed() <= USUAL, "the operator waited {:?}", t.elapsed());
}

/// A tenant's quota of requests open at once on its sessions holds SSE
/// streams too: with `--max-streams 2`, two sessions' `GET` streams take
/// both places, a third session's `GET` gets 429 naming the quota, and
/// ending one session (its stream ends with it) gives the place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_open_streams_stop_at_its_quota() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    let out = std::process::Command::new(binary())
        .args(["tenant", "add", "streamer", "--max-streams", "2", "--tenants-file"])
        .arg(&tenants)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let config = format!("[auth]\ntenants_file = \"{}\"\n{QUIET}", tenants.display());
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let http = reqwest::Client::new();
    let mut sessions = Vec::new();
    for _ in 0..3 {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}});
        let r = http
            .post(&server.url)
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let id = r.headers()["mcp-session-id"].to_str().unwrap().to_string();
        r.text().await.unwrap();
        let done = http
            .post(&server.url)
            .bearer_auth(&key)
            .header("mcp-session-id", &id)
            .header("mcp-protocol-version", "2025-06-18")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string())
            .send()
            .await
            .unwrap();
        assert!(done.status().is_success(), "{}", done.status());
        sessions.push(id);
    }
    let stream = |id: &str| {
        http.get(&server.url)
            .bearer_auth(&key)
            .header("mcp-session-id", id)
            .header("mcp-protocol-version", "2025-06-18")
            .header("accept", "text/event-stream")
            .send()
    };
    let first = stream(&sessions[0]).await.unwrap();
    let second = stream(&sessions[1]).await.unwrap();
    assert_eq!((first.status().as_u16(), second.status().as_u16()), (200, 200));
    let refused = stream(&sessions[2]).await.unwrap();
    assert_eq!(refused.status(), 429);
    let v: Value = refused.json().await.unwrap();
    let m = v["message"].as_str().unwrap_or_default();
    assert!(m.contains("tenant streamer is at its quota of requests open at once") && m.contains("2 open"), "{v}");
    // Ending the first session ends its stream and frees its place.
    let deleted = http
        .delete(&server.url)
        .bearer_auth(&key)
        .header("mcp-session-id", &sessions[0])
        .header("mcp-protocol-version", "2025-06-18")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let ended = tokio::time::timeout(USUAL, first.bytes()).await.expect("the stream ends with its session");
    drop(ended);
    let deadline = Instant::now() + USUAL;
    loop {
        let r = stream(&sessions[2]).await.unwrap();
        if r.status() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no place freed: {}", r.status());
        tokio::task::yield_now().await;
    }
    drop(second);
}

/// `POST /mcp` `initialize` of a `--dev` server, with `origin` as `Origin`
/// (none when `None`) and `host` as `Host`.
async fn dev_initialize(server: &TineServer, host: &str, origin: Option<&str>) -> reqwest::Response {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}});
    let mut req = reqwest::Client::new()
        .post(&server.url)
        .header("host", host)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_string());
    if let Some(o) = origin {
        req = req.header("origin", o);
    }
    req.send().await.expect("POST /mcp")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dev_server_answers_its_own_loopback_origins_only() {
    let server = TineServer::start(binary(), None, QUIET);
    let port = addr(&server).rsplit_once(':').unwrap().1.to_string();
    let other_port = if port == "5555" { "5556" } else { "5555" };
    let own = format!("127.0.0.1:{port}");
    // The transport spec's DNS rebinding protection: a loopback server
    // accepts the origins it is reached by and refuses the others.
    let cases: Vec<(Option<String>, u16)> = vec![
        (None, 200),
        (Some(format!("http://localhost:{port}")), 200),
        (Some(format!("http://127.0.0.1:{port}")), 200),
        (Some(format!("http://[::1]:{port}")), 200),
        (Some("http://evil.example".into()), 403),
        (Some(format!("http://evil.example:{port}")), 403),
        (Some(format!("http://localhost:{other_port}")), 403),
        (Some(format!("http://127.0.0.1:{other_port}")), 403),
        (Some(format!("https://localhost:{port}")), 403),
        (Some(format!("http://0123456789ab.localhost:{port}")), 403),
        (Some(format!("http://localhost.evil.example:{port}")), 403),
        (Some("null".into()), 403),
    ];
    let mut seen = Vec::new();
    for (origin, _) in &cases {
        let r = dev_initialize(&server, &own, origin.as_deref()).await;
        seen.push((origin.clone(), r.status().as_u16()));
    }
    let want = cases;
    assert_eq!(seen, want, "(Origin, status) of a --dev server's initialize");
    // /mcp under a preview's host is the preview's (here none: 404), never
    // the MCP endpoint.
    let r = dev_initialize(&server, &format!("0123456789ab.localhost:{port}"), None).await;
    assert_eq!(r.status(), 404, "a preview host's /mcp");
    assert!(r.text().await.unwrap().contains("No such preview"));
}

/// A keep-alive connection from `from` (port 0) that has sent `GET
/// /healthz` without a token and read its answer, left open; `Err` when
/// the server closed it instead.
async fn healthz_kept_alive(server: &TineServer, from: std::net::IpAddr) -> Result<TcpStream, String> {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind((from, 0).into()).expect("bind the client's address");
    let addr: std::net::SocketAddr = addr(server).parse().unwrap();
    let mut s = socket.connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    s.write_all(request.as_bytes()).await.map_err(|e| format!("send: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&got).contains(r#"{"status":"ok"}"#) {
        match tokio::time::timeout(USUAL, s.read(&mut buf)).await {
            Ok(Ok(0)) => return Err(format!("closed after {} bytes", got.len())),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => return Err(format!("read: {e}")),
            Err(_) => panic!("no /healthz answer within {USUAL:?}"),
        }
    }
    Ok(s)
}

/// The slots the tests below give the server.
const SLOTS: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_address_holds_at_most_half_the_slots_by_default() {
    // No max_connections_per_address: the default, half of 16.
    let config = format!("max_connections = {SLOTS}\n{QUIET}");
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let loopback = std::net::IpAddr::from([127, 0, 0, 1]);
    let mut held = Vec::new();
    for i in 0..SLOTS / 2 {
        held.push(healthz_kept_alive(&server, loopback).await.unwrap_or_else(|e| panic!("connection {i}: {e}")));
    }
    let past = healthz_kept_alive(&server, loopback).await;
    assert!(
        past.is_err(),
        "connection {} from {loopback} was served past the default cap of {}",
        SLOTS / 2 + 1,
        SLOTS / 2
    );
    // Another address is served.
    let other = std::net::IpAddr::from([127, 0, 0, 2]);
    healthz_kept_alive(&server, other).await.unwrap_or_else(|e| panic!("a connection from {other}: {e}"));
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_keep_alive_connections_are_closed_when_slots_run_low() {
    // Every slot held by an unauthenticated keep-alive /healthz
    // connection (from one address: no cap per address here); without
    // pressure they would stay 60 s (idle) or 30 s (hyper's header read
    // timeout between requests).
    let config = format!(
        "max_connections = {SLOTS}\nmax_connections_per_address = 0\nheader_read_timeout_secs = 30\n\
         idle_timeout_secs = 60\n{QUIET}"
    );
    let server = TineServer::start(binary(), Some(TOKEN), &config);
    let start = Instant::now();
    let mut held = Vec::new();
    for i in 0..SLOTS {
        let s = healthz_kept_alive(&server, std::net::IpAddr::from([127, 0, 0, 1]))
            .await
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        held.push(s);
    }
    // The slots run low: the idle ones are closed within a few seconds
    // (3 s), and the client waiting in the listen backlog is served.
    let within = Duration::from_secs(3) + SLACK;
    let took = well_behaved_client(&server, within).await;
    eprintln!("a client behind {SLOTS} idle keep-alive connections got through {:?} after the first", start.elapsed());
    assert!(start.elapsed() <= within + USUAL, "{took:?}");
    // Idle ones were closed until the slots no longer ran low; the others
    // stay (60 s) now that they do not.
    let mut closed = 0;
    for s in &mut held {
        let mut buf = [0u8; 64];
        if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            closed += 1;
        }
    }
    eprintln!("{closed} of the {SLOTS} idle connections were closed");
    assert!(closed >= 1, "none of the {SLOTS} idle connections was closed");
}
