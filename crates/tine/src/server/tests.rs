//! Router tests: the HTTP layer in front of the MCP tools (bearer auth and
//! its 401 challenge, the `Host` and `Origin` checks, the body limit,
//! `--dev`, `/healthz`, `DELETE`) through `tower::ServiceExt::oneshot`,
//! and the accept loop (header read timeout, connection cap) on a loopback
//! socket; no VM, so they run on hosts without `/dev/kvm`. The manager is
//! made on two empty image files; nothing here boots a sandbox.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::Response;
use tine_sandbox::{Manager, ManagerConfig};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use super::{accept_loop, router, ServeOptions, MAX_REQUEST_BYTES};

const TOKEN: &str = "router-test-token-0123456789abcdef0123456789abcdef";

/// A router over a manager on empty images in `dir`; `token: None` is `--dev`.
fn app(dir: &tempfile::TempDir, token: Option<&str>) -> axum::Router {
    let opts = options(token, vec![]);
    router(manager(dir), &opts, files(), &CancellationToken::new()).unwrap()
}

/// Options as `tine server start` makes them by default.
fn options(token: Option<&str>, allowed_origins: Vec<String>) -> ServeOptions {
    ServeOptions {
        listen: "127.0.0.1:5555".parse().unwrap(),
        auth: std::sync::Arc::new(
            crate::auth::Auth::new(crate::auth::AuthConfig {
                admin_token: token.map(str::to_string),
                peer_key: None,
                tenants_file: "/nonexistent/tenants.toml".into(),
                default_quota: Default::default(),
                oauth: None,
            })
            .unwrap(),
        ),
        allowed_hosts: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
        allowed_origins,
        max_connections: super::DEFAULT_MAX_CONNECTIONS,
        max_connections_per_address: 0,
        header_read_timeout: super::DEFAULT_HEADER_READ_TIMEOUT,
        idle_timeout: super::DEFAULT_IDLE_TIMEOUT,
        http2_keep_alive_interval: Some(super::DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL),
        http2_keep_alive_timeout: super::DEFAULT_HTTP2_KEEP_ALIVE_TIMEOUT,
        http2_max_concurrent_streams: super::DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS,
        session_timeout: Duration::from_secs(60),
        max_sessions: super::DEFAULT_MAX_SESSIONS,
        build_default_template: false,
        public_url: None,
        ports: Default::default(),
        secrets: None,
        toolset: crate::mcp::toolsets::Toolset::full(),
        previews: std::sync::Arc::new(
            crate::preview::Previews::open(
                &tempfile::tempdir().unwrap().keep(),
                Default::default(),
                crate::preview::UrlForms { host: Some(("http".into(), "localhost".into(), Some(5555))), path: true },
                "t1",
            )
            .unwrap(),
        ),
        cluster: std::sync::Arc::new(
            crate::cluster::Cluster::new(
                &crate::cluster::ClusterConfig { host_name: Some("t1".into()), ..Default::default() },
                token.map(str::to_string),
            )
            .unwrap(),
        ),
    }
}

/// A file-URL signer for the routers of these tests.
fn files() -> crate::files_url::FileUrls {
    crate::files_url::FileUrls::new(None, "127.0.0.1:5555".parse().unwrap()).unwrap()
}

/// A manager on empty images in `dir`.
fn manager(dir: &tempfile::TempDir) -> std::sync::Arc<Manager> {
    let (kernel, rootfs) = (dir.path().join("vmlinux"), dir.path().join("rootfs.ext4"));
    std::fs::write(&kernel, b"").unwrap();
    std::fs::write(&rootfs, b"").unwrap();
    Manager::new(ManagerConfig {
        kernel,
        rootfs,
        run_dir: dir.path().join("sandboxes"),
        kept_dir: dir.path().join("kept"),
        templates_dir: dir.path().join("templates"),
        memory_backing: vmm::MemoryBacking::Private,
        profile: vmm::HostProfile::BareMetal,
        limits: tine_sandbox::Limits::default(),
        network: None,
        pool_size: 0,
        huge_pages: false,
        host_name: None,
        images: Default::default(),
        images_dir: dir.path().join("images"),
        secrets: None,
        prefetch: false,
    })
    .expect("a manager on empty images")
}

/// `POST /mcp` with `body`, `Host: host` and, if given, `Authorization`.
fn post(host: &str, authorization: Option<&str>, body: impl Into<Body>) -> Request<Body> {
    let mut req = Request::post("/mcp")
        .header(header::HOST, host)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, "application/json, text/event-stream");
    if let Some(a) = authorization {
        req = req.header(header::AUTHORIZATION, a);
    }
    req.body(body.into()).unwrap()
}

/// An MCP `initialize` request body.
fn initialize() -> String {
    serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "router-test", "version": "0"}}})
    .to_string()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn send(app: &axum::Router, req: Request<Body>) -> Response {
    app.clone().oneshot(req).await.expect("the router is infallible")
}

fn challenge(r: &Response) -> &str {
    r.headers().get(header::WWW_AUTHENTICATE).expect("WWW-Authenticate").to_str().unwrap()
}

#[tokio::test]
async fn a_missing_or_wrong_token_gets_401_with_a_bearer_challenge() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));

    let r = send(&app, post("localhost", None, initialize())).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(challenge(&r), r#"Bearer realm="tine""#);
    let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"], "unauthorized", "{body}");

    for wrong in [bearer("wrong-token"), bearer(&TOKEN[1..]), format!("Basic {TOKEN}"), TOKEN.to_string()] {
        let r = send(&app, post("localhost", Some(&wrong), initialize())).await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "{wrong}");
        assert!(challenge(&r).starts_with("Bearer"), "{wrong}: {}", challenge(&r));
    }
    let r = send(&app, post("localhost", Some(&bearer("wrong-token")), initialize())).await;
    assert_eq!(challenge(&r), r#"Bearer realm="tine", error="invalid_token""#);
}

#[tokio::test]
async fn the_right_token_passes() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    for authorization in [bearer(TOKEN), format!("bearer {TOKEN}")] {
        let r = send(&app, post("localhost", Some(&authorization), initialize())).await;
        assert_eq!(r.status(), StatusCode::OK, "{authorization}");
        assert!(r.headers().get("mcp-session-id").is_some(), "an MCP session began");
    }
}

#[tokio::test]
async fn dev_mode_serves_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, None);
    let r = send(&app, post("localhost", None, initialize())).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers().get(header::WWW_AUTHENTICATE).is_none());
}

#[tokio::test]
async fn a_host_outside_the_allowed_list_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for token in [Some(TOKEN), None] {
        let app = app(&dir, token);
        let auth = token.map(bearer);
        // DNS rebinding: the right token (or none needed), a foreign Host.
        for host in ["evil.example", "evil.example:5555", "localhost.evil.example"] {
            let r = send(&app, post(host, auth.as_deref(), initialize())).await;
            assert_eq!(r.status(), StatusCode::FORBIDDEN, "{host}");
        }
        for host in ["localhost", "localhost:5555", "127.0.0.1:5555", "[::1]:5555"] {
            let r = send(&app, post(host, auth.as_deref(), initialize())).await;
            assert_eq!(r.status(), StatusCode::OK, "{host}");
        }
    }
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_with_413() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let big = vec![b' '; MAX_REQUEST_BYTES + 1];
    let r = send(&app, post("localhost", Some(&bearer(TOKEN)), big.clone())).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // Authentication comes first: a stranger's big body is not read.
    let r = send(&app, post("localhost", None, big)).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    // Up to the limit is fine: an initialize padded to exactly the limit.
    let mut padded = initialize().into_bytes();
    padded.resize(MAX_REQUEST_BYTES, b' ');
    let r = send(&app, post("localhost", Some(&bearer(TOKEN)), padded)).await;
    assert_eq!(r.status(), StatusCode::OK);
}

/// `GET /healthz` with `authorization`, as JSON.
async fn healthz(app: &axum::Router, authorization: Option<&str>) -> serde_json::Value {
    let mut req = Request::get("/healthz").header(header::HOST, "localhost");
    if let Some(a) = authorization {
        req = req.header(header::AUTHORIZATION, a);
    }
    let r = send(app, req.body(Body::empty()).unwrap()).await;
    assert_eq!(r.status(), StatusCode::OK);
    let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test]
async fn healthz_is_open_and_says_more_only_with_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let with_token = app(&dir, Some(TOKEN));
    assert_eq!(healthz(&with_token, None).await, serde_json::json!({"status": "ok"}));
    assert_eq!(healthz(&with_token, Some(&bearer("wrong-token"))).await, serde_json::json!({"status": "ok"}));
    let full = serde_json::json!({
        "status": "ok", "host": "t1", "sandboxes": 0, "pool": {"size": 0, "ready": 0, "filling": false}
    });
    assert_eq!(healthz(&with_token, Some(&bearer(TOKEN))).await, full);
    // --dev has no token: the details are for anyone on loopback.
    let dev = app(&dir, None);
    assert_eq!(healthz(&dev, None).await, full);
}

/// `post` with an `Origin` header.
fn post_from(origin: &str, authorization: Option<&str>) -> Request<Body> {
    let mut req = post("localhost:5555", authorization, initialize());
    req.headers_mut().insert(header::ORIGIN, origin.parse().unwrap());
    req
}

#[tokio::test]
async fn a_foreign_origin_is_refused_with_403() {
    let dir = tempfile::tempdir().unwrap();
    for token in [Some(TOKEN), None] {
        let app = app(&dir, token);
        let auth = token.map(bearer);
        // MCP transport spec, Streamable HTTP "Security Warning": servers
        // MUST validate Origin. By default no browser origin is allowed.
        for origin in ["https://evil.example", "http://localhost:5555", "null", "http://127.0.0.1:8080"] {
            let r = send(&app, post_from(origin, auth.as_deref())).await;
            assert_eq!(r.status(), StatusCode::FORBIDDEN, "{origin}");
        }
        // Clients that send no Origin (every non-browser one) pass.
        let r = send(&app, post("localhost:5555", auth.as_deref(), initialize())).await;
        assert_eq!(r.status(), StatusCode::OK);
    }
    // Configured origins pass; others are still refused.
    let opts = options(None, vec!["https://app.example:443".into(), "http://localhost:*".into()]);
    let app = router(manager(&dir), &opts, files(), &CancellationToken::new()).unwrap();
    for origin in ["https://app.example", "http://localhost:3000"] {
        assert_eq!(send(&app, post_from(origin, None)).await.status(), StatusCode::OK, "{origin}");
    }
    for origin in ["https://app.example:8443", "http://app.example", "https://evil.example"] {
        assert_eq!(send(&app, post_from(origin, None)).await.status(), StatusCode::FORBIDDEN, "{origin}");
    }
}

#[tokio::test]
async fn a_dev_servers_own_loopback_origins_pass_and_no_other() {
    let listen: std::net::SocketAddr = "127.0.0.1:5555".parse().unwrap();
    let own = super::loopback_origins(listen);
    assert_eq!(own, ["http://localhost:5555", "http://127.0.0.1:5555", "http://[::1]:5555"]);
    assert_eq!(super::loopback_origins("[::1]:7".parse().unwrap()).len(), 3);
    assert_eq!(super::loopback_origins("127.0.0.2:80".parse().unwrap())[3], "http://127.0.0.2:80");
    // `tine server start --dev` passes these as its allowed origins.
    let dir = tempfile::tempdir().unwrap();
    let app = router(manager(&dir), &options(None, own), files(), &CancellationToken::new()).unwrap();
    for origin in ["http://localhost:5555", "http://127.0.0.1:5555", "http://[::1]:5555"] {
        assert_eq!(send(&app, post_from(origin, None)).await.status(), StatusCode::OK, "{origin}");
    }
    for origin in ["http://0123456789ab.localhost:5555", "http://localhost:5556", "https://localhost:5555", "null"] {
        assert_eq!(send(&app, post_from(origin, None)).await.status(), StatusCode::FORBIDDEN, "{origin}");
    }
}

#[tokio::test]
async fn delete_ends_a_session_with_200() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let r = send(&app, post("localhost", Some(&bearer(TOKEN)), initialize())).await;
    assert_eq!(r.status(), StatusCode::OK);
    let session = r.headers().get("mcp-session-id").unwrap().clone();
    let delete = || {
        Request::delete("/mcp")
            .header(header::HOST, "localhost")
            .header(header::AUTHORIZATION, bearer(TOKEN))
            .header("mcp-session-id", session.clone())
            .body(Body::empty())
            .unwrap()
    };
    // The Python SDK takes 200 or 204 as a clean close (202 is logged as
    // "Session termination failed: 202"); the TypeScript SDK any 2xx.
    assert_eq!(send(&app, delete()).await.status(), StatusCode::OK);
    // The session is gone: a request in it is refused.
    let mut req = post("localhost", Some(&bearer(TOKEN)), r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#);
    req.headers_mut().insert("mcp-session-id", session.clone());
    req.headers_mut().insert("mcp-protocol-version", "2025-06-18".parse().unwrap());
    assert_eq!(send(&app, req).await.status(), StatusCode::NOT_FOUND);
}

/// Runs the accept loop on a loopback port with `max_connections` and
/// `header_read_timeout`; returns the address and the loop's task.
async fn serve(
    dir: &tempfile::TempDir,
    max_connections: usize,
    header_read_timeout: Duration,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    serve_with(dir, |opts| {
        opts.max_connections = max_connections;
        opts.header_read_timeout = header_read_timeout;
    })
    .await
}

/// Runs the accept loop on a loopback port with the default options as
/// `change` leaves them; returns the address and the loop's task.
async fn serve_with(
    dir: &tempfile::TempDir,
    change: impl FnOnce(&mut ServeOptions),
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let mut opts = options(None, vec![]);
    change(&mut opts);
    let app = router(manager(dir), &opts, files(), &CancellationToken::new()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        accept_loop(listener, app, &opts, std::future::pending()).await;
    });
    (addr, task)
}

const GET_HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

/// Reads `stream` to its end.
async fn read_all(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt as _;
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.unwrap_or_default();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_client_that_sends_no_headers_is_disconnected() {
    use tokio::io::AsyncWriteExt as _;
    let dir = tempfile::tempdir().unwrap();
    let (addr, task) = serve(&dir, 4, Duration::from_secs(1)).await;
    // Half a request line, then nothing (slowloris).
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: loc").await.unwrap();
    // The server closes it (well before this test's own limit).
    let answer = tokio::time::timeout(Duration::from_secs(60), read_all(&mut slow)).await;
    let answer = answer.expect("the server closed the connection at its header read timeout");
    assert!(!answer.contains("200 OK"), "{answer}");
    // Others are served meanwhile and after.
    let mut ok = tokio::net::TcpStream::connect(addr).await.unwrap();
    ok.write_all(GET_HEALTHZ).await.unwrap();
    assert!(read_all(&mut ok).await.starts_with("HTTP/1.1 200"));
    task.abort();
}

#[tokio::test]
async fn connections_over_the_cap_wait_for_a_free_slot() {
    use tokio::io::AsyncWriteExt as _;
    let dir = tempfile::tempdir().unwrap();
    let (addr, task) = serve(&dir, 1, Duration::from_secs(600)).await;
    // One idle connection takes the only slot.
    let idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut waiting = tokio::net::TcpStream::connect(addr).await.unwrap();
    waiting.write_all(GET_HEALTHZ).await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(500), read_all(&mut waiting)).await;
    assert!(early.is_err(), "a connection over the cap is not served: {early:?}");
    // The slot frees when the idle connection closes; the waiting one is
    // served then.
    drop(idle);
    let answer = tokio::time::timeout(Duration::from_secs(60), read_all(&mut waiting)).await.expect("served");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    task.abort();
}

#[tokio::test]
async fn connections_over_the_per_address_cap_are_closed_when_accepted() {
    use tokio::io::AsyncWriteExt as _;
    let dir = tempfile::tempdir().unwrap();
    let (addr, task) = serve_with(&dir, |opts| {
        opts.max_connections_per_address = 2;
        opts.header_read_timeout = Duration::from_secs(600);
    })
    .await;
    // Two idle connections from 127.0.0.1 are held; a third is closed
    // unanswered, well before any timeout.
    let first = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _second = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = third.write_all(GET_HEALTHZ).await;
    let answer = tokio::time::timeout(Duration::from_secs(30), read_all(&mut third)).await.expect("closed at once");
    assert!(answer.is_empty(), "{answer}");
    // When one closes, a new connection from the address is served.
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut next = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = next.write_all(GET_HEALTHZ).await;
        let answer = tokio::time::timeout(Duration::from_secs(30), read_all(&mut next)).await.unwrap();
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no place for a new connection after one closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
}

/// The JSON-RPC message with `"id": id` in a response body (plain JSON, or
/// the `data:` lines of an SSE stream).
async fn rpc_answer(r: Response, id: u64) -> serde_json::Value {
    let body = tokio::time::timeout(Duration::from_secs(10), axum::body::to_bytes(r.into_body(), 1 << 20))
        .await
        .expect("the answer's stream ends")
        .unwrap();
    let text = String::from_utf8_lossy(&body);
    let mut found = None;
    for chunk in std::iter::once(text.as_ref()).chain(text.lines().filter_map(|l| l.strip_prefix("data:"))) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(chunk.trim()) {
            if v["id"] == id {
                found = Some(v);
            }
        }
    }
    found.unwrap_or_else(|| panic!("no answer with id {id} in {text}"))
}

/// A request in session `session`.
fn in_session(session: &axum::http::HeaderValue, body: serde_json::Value) -> Request<Body> {
    let mut req = post("localhost", Some(&bearer(TOKEN)), body.to_string());
    req.headers_mut().insert("mcp-session-id", session.clone());
    req.headers_mut().insert("mcp-protocol-version", "2025-06-18".parse().unwrap());
    req
}

/// An initialized MCP session: its id and the `initialize` answer.
async fn initialized_session(app: &axum::Router) -> (axum::http::HeaderValue, serde_json::Value) {
    let r = send(app, post("localhost", Some(&bearer(TOKEN)), initialize())).await;
    assert_eq!(r.status(), StatusCode::OK);
    let session = r.headers().get("mcp-session-id").expect("a session").clone();
    let init = rpc_answer(r, 1).await;
    let note = serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    assert_eq!(send(app, in_session(&session, note)).await.status(), StatusCode::ACCEPTED);
    (session, init)
}

/// The MCP conformance suite's `logging-set-level` scenario, without a
/// sandbox: the server declares logging, and `logging/setLevel` answers
/// an empty result for every level.
#[tokio::test]
async fn initialize_declares_logging_and_set_level_answers_empty() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let (session, init) = initialized_session(&app).await;
    let caps = &init["result"]["capabilities"];
    assert!(caps["logging"].is_object(), "{init}");
    assert!(caps["tools"].is_object(), "{init}");
    for (id, level) in [(2u64, "info"), (3, "debug"), (4, "emergency")] {
        let req = serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "logging/setLevel",
                                     "params": {"level": level}});
        let r = send(&app, in_session(&session, req)).await;
        assert_eq!(r.status(), StatusCode::OK);
        let answer = rpc_answer(r, id).await;
        assert_eq!(answer["result"], serde_json::json!({}), "{answer}");
    }
    let req = serde_json::json!({"jsonrpc": "2.0", "id": 9, "method": "logging/setLevel",
                                 "params": {"level": "loud"}});
    let answer = rpc_answer(send(&app, in_session(&session, req)).await, 9).await;
    assert!(answer["error"].is_object(), "an unknown level is refused: {answer}");
}

/// Process tools refuse bad input before any sandbox is involved, with a
/// message that says what to do.
#[tokio::test]
async fn process_tools_refuse_bad_input_with_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let (session, _) = initialized_session(&app).await;
    let cases = [
        ("sandbox_process_output", serde_json::json!({"process_id": "p7"}), "process ids look like sb-3:p7"),
        ("sandbox_process_wait", serde_json::json!({"process_id": "sb-1"}), "see sandbox_process_list"),
        (
            "sandbox_process_wait",
            serde_json::json!({"process_id": "sb-1:p1", "until_text": "a", "until_regex": "b"}),
            "not both",
        ),
        (
            "sandbox_process_wait",
            serde_json::json!({"process_id": "sb-1:p1", "timeout_secs": 601}),
            "timeout_secs (601) is greater than the maximum of 600",
        ),
        ("sandbox_process_kill", serde_json::json!({"process_id": "sb-1:p1", "signal": "BOOM"}), "unknown signal"),
        (
            "sandbox_process_kill",
            serde_json::json!({"process_id": "sb-1:p1", "signal": 65}),
            "signal (65) is greater than the maximum of 64",
        ),
        (
            "sandbox_process_write",
            serde_json::json!({"process_id": "sb-1:p1", "data": "x".repeat((1 << 20) + 1)}),
            "data (a string of 1048577 characters) is longer than 1048576 characters",
        ),
        (
            "sandbox_exec",
            serde_json::json!({"command": "sleep 100", "background": true, "timeout_secs": 5}),
            "sandbox_process_wait",
        ),
        (
            "sandbox_exec",
            serde_json::json!({"command": "cat", "background": true, "stdin": "x".repeat((64 << 10) + 1)}),
            "sandbox_process_write",
        ),
    ];
    for (i, (tool, args, want)) in cases.into_iter().enumerate() {
        let id = 10 + i as u64;
        let req = serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                                     "params": {"name": tool, "arguments": args}});
        let answer = rpc_answer(send(&app, in_session(&session, req)).await, id).await;
        let result = &answer["result"];
        assert_eq!(result["isError"], true, "{tool}: {answer}");
        let text = result["content"][0]["text"].as_str().unwrap_or_default();
        assert!(text.contains(want), "{tool}: {text:?} should say {want:?}");
    }
}

/// A sandbox event reaches the session that caused it as an MCP log
/// message, on its standalone GET stream: a create on the empty test
/// images fails, and the session gets an `error` message naming the event.
#[tokio::test]
async fn a_failed_create_is_logged_to_its_session() {
    use reqwest::header::{ACCEPT, CONTENT_TYPE};
    let dir = tempfile::tempdir().unwrap();
    let (addr, task) = serve(&dir, 8, Duration::from_secs(5)).await;
    let url = format!("http://{addr}/mcp");
    let http = reqwest::Client::new();
    let post = |session: Option<&str>, body: serde_json::Value| {
        let mut req = http
            .post(&url)
            .header(ACCEPT, "application/json, text/event-stream")
            .header(CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(s) = session {
            req = req.header("mcp-session-id", s).header("mcp-protocol-version", "2025-06-18");
        }
        req.send()
    };
    let r = post(None, serde_json::from_str(&initialize()).unwrap()).await.unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::OK);
    let session = r.headers()["mcp-session-id"].to_str().unwrap().to_string();
    assert!(r.text().await.unwrap().contains("\"logging\""), "logging is declared");
    let note = serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    assert_eq!(post(Some(&session), note).await.unwrap().status(), reqwest::StatusCode::ACCEPTED);

    let mut stream = http
        .get(&url)
        .header(ACCEPT, "text/event-stream")
        .header("mcp-session-id", &session)
        .header("mcp-protocol-version", "2025-06-18")
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), reqwest::StatusCode::OK);

    let call = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                  "params": {"name": "sandbox_create", "arguments": {}}});
    let answer = post(Some(&session), call).await.unwrap().text().await.unwrap();
    assert!(answer.contains("\"isError\":true"), "a create on empty images fails: {answer}");

    let message = tokio::time::timeout(Duration::from_secs(30), async {
        let mut text = String::new();
        loop {
            let chunk = stream.chunk().await.unwrap().expect("the GET stream stays open");
            text.push_str(&String::from_utf8_lossy(&chunk));
            for line in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) else { continue };
                if v["method"] == "notifications/message" {
                    return v;
                }
            }
        }
    })
    .await
    .expect("a log message arrives on the GET stream");
    let params = &message["params"];
    assert_eq!(params["level"], "error", "{message}");
    assert_eq!(params["logger"], "tine.sandbox", "{message}");
    assert_eq!(params["data"]["event"], "create_failed", "{message}");
    assert!(params["data"]["message"].as_str().unwrap().starts_with("creating sandbox"), "{message}");
    task.abort();
}

#[tokio::test]
async fn an_initialize_past_max_sessions_gets_503_saying_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(Some(TOKEN), vec![]);
    opts.max_sessions = 2;
    let app = router(manager(&dir), &opts, files(), &CancellationToken::new()).unwrap();
    let (first, _) = initialized_session(&app).await;
    let _second = initialized_session(&app).await;
    let r = send(&app, post("localhost", Some(&bearer(TOKEN)), initialize())).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().get("mcp-session-id").is_none());
    let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    for part in ["2 MCP sessions open", "DELETE /mcp", "raise max_sessions", "after 60 s without a request"] {
        assert!(message.contains(part), "{part:?} in {body}");
    }
    // Requests in open sessions still pass.
    let list = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    assert_eq!(send(&app, in_session(&first, list)).await.status(), StatusCode::OK);
    // Once one ends, a new session is accepted.
    let delete = Request::delete("/mcp")
        .header(header::HOST, "localhost")
        .header(header::AUTHORIZATION, bearer(TOKEN))
        .header("mcp-session-id", first)
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, delete).await.status(), StatusCode::OK);
    initialized_session(&app).await;
}

/// `GET /ports/{sandbox}/{port}`, upgraded to a port forward unless
/// `upgrade` is false.
fn port_forward(sandbox: &str, authorization: Option<&str>, upgrade: bool) -> Request<Body> {
    let mut req = Request::get(format!("/ports/{sandbox}/8080")).header(header::HOST, "127.0.0.1:5555");
    if upgrade {
        req = req.header(header::CONNECTION, "upgrade").header(header::UPGRADE, crate::port_forward::PROTOCOL);
    }
    if let Some(a) = authorization {
        req = req.header(header::AUTHORIZATION, a);
    }
    req.body(Body::empty()).unwrap()
}

#[tokio::test]
async fn a_port_forward_needs_the_token_an_upgrade_and_a_sandbox_of_this_host() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let auth = bearer(TOKEN);
    let r = send(&app, port_forward("sb-t1-0000000000000000", None, true)).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = send(&app, port_forward("sb-t1-0000000000000000", Some(&auth), false)).await;
    assert_eq!(r.status(), StatusCode::UPGRADE_REQUIRED);
    let r = send(&app, port_forward("sb-t1-0000000000000000", Some(&auth), true)).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = send(&app, port_forward("sb-t2-0000000000000000", Some(&auth), true)).await;
    assert_eq!(r.status(), StatusCode::MISDIRECTED_REQUEST);
    let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
    assert!(String::from_utf8_lossy(&body).contains("lives on host t2"), "{body:?}");
}

/// `tools/list` in session `session`, sent to `uri` with `header` as the
/// toolset header if given: the tools.
async fn tools_at(
    app: &axum::Router,
    session: &axum::http::HeaderValue,
    uri: &str,
    header: Option<&str>,
) -> Vec<serde_json::Value> {
    let mut req = in_session(session, serde_json::json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"}));
    *req.uri_mut() = uri.parse().unwrap();
    if let Some(h) = header {
        req.headers_mut().insert(crate::mcp::toolsets::HEADER, h.parse().unwrap());
    }
    let answer = rpc_answer(send(app, req).await, 7).await;
    answer["result"]["tools"].as_array().cloned().unwrap_or_else(|| panic!("{answer}"))
}

/// Where in `schema` an object takes properties of any name
/// (`additionalProperties` other than `false`): what strict-schema
/// converters refuse.
fn open_maps(schema: &serde_json::Value, at: &str, found: &mut Vec<String>) {
    match schema {
        serde_json::Value::Object(o) => {
            if let Some(ap) = o.get("additionalProperties") {
                if ap != &serde_json::Value::Bool(false) {
                    found.push(at.to_string());
                }
            }
            for (k, v) in o {
                open_maps(v, &format!("{at}/{k}"), found);
            }
        }
        serde_json::Value::Array(a) => {
            a.iter().enumerate().for_each(|(i, v)| open_maps(v, &format!("{at}/{i}"), found))
        }
        _ => {}
    }
}

#[tokio::test]
async fn tools_list_serves_the_connection_toolset_and_core_fits_its_budget() {
    use crate::mcp::toolsets::{CORE_MAX_CHARS, CORE_MAX_TOOLS};
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let (session, _) = initialized_session(&app).await;
    let names =
        |tools: &[serde_json::Value]| tools.iter().map(|t| t["name"].as_str().unwrap().to_string()).collect::<Vec<_>>();
    let cost = |tools: &[serde_json::Value]| -> usize {
        tools.iter().map(|t| t["description"].as_str().map_or(0, str::len) + t["inputSchema"].to_string().len()).sum()
    };
    let full = tools_at(&app, &session, "/mcp", None).await;
    assert!(full.len() >= 30, "{:?}", names(&full));
    let create = full.iter().find(|t| t["name"] == "sandbox_create").unwrap();
    assert_eq!(create["inputSchema"]["properties"]["env"]["type"], "object", "full keeps its maps");
    let core = tools_at(&app, &session, "/mcp?tools=core", None).await;
    eprintln!(
        "core: {} tools, {} characters; full: {} tools, {} characters",
        core.len(),
        cost(&core),
        full.len(),
        cost(&full)
    );
    assert!(core.len() <= CORE_MAX_TOOLS, "{:?}", names(&core));
    assert!(cost(&core) <= CORE_MAX_CHARS, "core costs {} characters: {:?}", cost(&core), names(&core));
    let mut open = Vec::new();
    for t in &core {
        open_maps(&t["inputSchema"], t["name"].as_str().unwrap(), &mut open);
    }
    assert!(open.is_empty(), "maps in core's schemas: {open:?}");
    let create = core.iter().find(|t| t["name"] == "sandbox_create").unwrap();
    assert_eq!(create["inputSchema"]["properties"]["env"]["type"], "array", "core takes pairs");
    // A header, groups combined.
    let procs = tools_at(&app, &session, "/mcp", Some("processes,files")).await;
    let procs = names(&procs);
    assert!(procs.contains(&"sandbox_process_wait".to_string()) && procs.contains(&"sandbox_upload".to_string()));
    assert!(!procs.contains(&"sandbox_branch".to_string()), "{procs:?}");
    // A tool outside the toolset is not called; an unknown toolset is refused.
    let call = serde_json::json!({"jsonrpc": "2.0", "id": 8, "method": "tools/call",
                                  "params": {"name": "sandbox_process_list", "arguments": {}}});
    let mut req = in_session(&session, call);
    *req.uri_mut() = "/mcp?tools=core".parse().unwrap();
    let answer = rpc_answer(send(&app, req).await, 8).await;
    assert_eq!(answer["result"]["isError"], true, "{answer}");
    assert!(answer.to_string().contains("not in this connection's toolset (core)"), "{answer}");
    let mut req = in_session(&session, serde_json::json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"}));
    *req.uri_mut() = "/mcp?tools=nope".parse().unwrap();
    let answer = rpc_answer(send(&app, req).await, 7).await;
    assert!(answer["error"]["message"].as_str().unwrap_or_default().contains("toolset \"nope\""), "{answer}");
}

/// `tine_tool_calls_total` by tool (every tenant and outcome), from
/// `/metrics`.
async fn tool_calls(app: &axum::Router) -> std::collections::BTreeMap<String, u64> {
    let req = Request::get("/metrics")
        .header(header::HOST, "localhost")
        .header(header::AUTHORIZATION, bearer(TOKEN))
        .body(Body::empty())
        .unwrap();
    let body = axum::body::to_bytes(send(app, req).await.into_body(), 1 << 22).await.unwrap();
    let mut calls = std::collections::BTreeMap::new();
    for line in String::from_utf8_lossy(&body).lines() {
        let Some(rest) = line.strip_prefix("tine_tool_calls_total{tool=\"") else { continue };
        let (tool, rest) = rest.split_once('"').unwrap();
        let n: u64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
        *calls.entry(tool.to_string()).or_default() += n;
    }
    calls
}

/// The contract of the seed endpoints (`crate::mcp_seed`): a seed call is
/// the native calls its plan names, made through the native handler (so
/// with its checks, metrics and audit), and nothing else: for each seed's
/// documented calls, the server's count of native tool calls grows by
/// exactly the plan's calls, and the seed's own tool name is never counted
/// as a native one. (The planned arguments are checked in each seed's unit
/// tests; the guest's answers in tests/seeds.rs.) This server has no
/// guest images, so the native calls fail past the seed layer, which the
/// contract does not depend on; a multi-step call stops at its first
/// failed step.
#[tokio::test]
async fn seed_calls_are_the_native_calls_they_map_to() {
    use crate::mcp_seed::seeds;
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let examples: &[(&str, &str, serde_json::Value, &[&str])] = &[
        (
            "microsandbox",
            "sandbox_start",
            serde_json::json!({"sandbox": "py", "namespace": "default", "config": {"image": "microsandbox/python"}}),
            &["sandbox_create"],
        ),
        (
            "microsandbox",
            "sandbox_run_code",
            serde_json::json!({"sandbox": "py", "namespace": "default", "code": "1", "language": "python"}),
            &["sandbox_run_code"],
        ),
        (
            "microsandbox",
            "sandbox_run_command",
            serde_json::json!({"sandbox": "py", "namespace": "default", "command": "ls", "args": ["/"]}),
            &["sandbox_exec"],
        ),
        ("microsandbox", "sandbox_get_metrics", serde_json::json!({"namespace": "default"}), &["sandbox_list"]),
        (
            "microsandbox",
            "sandbox_stop",
            serde_json::json!({"sandbox": "py", "namespace": "default"}),
            &["sandbox_kill"],
        ),
        ("podflare", "fork", serde_json::json!({"n": 2}), &["sandbox_branch"]),
        ("podflare", "merge_into", serde_json::json!({"winner": "sb-x"}), &["sandbox_merge_into"]),
        ("forkd", "spawn_sandboxes", serde_json::json!({"snapshot_tag": "default", "n": 2}), &["sandbox_create"]),
        ("forkd", "list_snapshots", serde_json::json!({}), &["template_list"]),
        ("forkd", "kill_sandbox", serde_json::json!({"sandbox_id": "sb-x"}), &["sandbox_kill"]),
        ("superserve", "sandbox_list", serde_json::json!({"metadata": {"team": "a"}}), &["sandbox_list"]),
        ("superserve", "sandbox_template_list", serde_json::json!({}), &["template_list"]),
        (
            "superserve",
            "sandbox_attach_secret",
            serde_json::json!({"sandbox_id": "sb-x", "env_key": "K", "secret_name": "s"}),
            &["sandbox_info"],
        ),
    ];
    for seed in seeds() {
        let path = format!("/mcp/{}", seed.name());
        let mut init = post("localhost", Some(&bearer(TOKEN)), initialize());
        *init.uri_mut() = path.parse().unwrap();
        let r = send(&app, init).await;
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        let session = r.headers().get("mcp-session-id").expect("a session").clone();
        let listed = {
            let mut req = in_session(&session, serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}));
            *req.uri_mut() = path.parse().unwrap();
            rpc_answer(send(&app, req).await, 2).await
        };
        let names: Vec<&str> =
            listed["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
        let mine = seed.tools();
        assert_eq!(names, mine.iter().map(|t| t.name.as_ref()).collect::<Vec<_>>(), "{path} lists its tools");
        for (_, tool, args, native) in examples.iter().filter(|e| e.0 == seed.name()) {
            let plan = seed.plan(tool, args.clone()).unwrap_or_else(|e| panic!("{tool}: {e}"));
            assert_eq!(plan.tool, native[0], "{path} {tool}: the plan's first call");
            let before = tool_calls(&app).await;
            let call = serde_json::json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                                          "params": {"name": tool, "arguments": args}});
            let mut req = in_session(&session, call);
            *req.uri_mut() = path.parse().unwrap();
            let answer = rpc_answer(send(&app, req).await, 3).await;
            assert!(answer.get("result").is_some(), "{path} {tool}: {answer}");
            let after = tool_calls(&app).await;
            let mut grown: Vec<String> = Vec::new();
            for (t, n) in &after {
                for _ in before.get(t).copied().unwrap_or(0)..*n {
                    grown.push(t.clone());
                }
            }
            let mut want: Vec<String> = native.iter().map(|s| s.to_string()).collect();
            want.sort();
            assert_eq!(grown, want, "{path} {tool}: the native calls made ({answer})");
        }
    }
}
