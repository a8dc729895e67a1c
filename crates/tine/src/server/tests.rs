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
    router(manager(dir), &opts, &CancellationToken::new())
}

/// Options as `tine server start` makes them by default.
fn options(token: Option<&str>, allowed_origins: Vec<String>) -> ServeOptions {
    ServeOptions {
        listen: "127.0.0.1:5555".parse().unwrap(),
        token: token.map(str::to_string),
        allowed_hosts: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
        allowed_origins,
        max_connections: super::DEFAULT_MAX_CONNECTIONS,
        header_read_timeout: super::DEFAULT_HEADER_READ_TIMEOUT,
        session_timeout: Duration::from_secs(60),
        build_default_template: false,
    }
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
        templates_dir: dir.path().join("templates"),
        memory_backing: vmm::MemoryBacking::Private,
        profile: vmm::HostProfile::BareMetal,
        limits: tine_sandbox::Limits::default(),
        network: None,
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
    let full = serde_json::json!({"status": "ok", "sandboxes": 0});
    assert_eq!(healthz(&with_token, Some(&bearer(TOKEN))).await, full);
    // --dev has no token: the details are for anyone on loopback.
    let dev = app(&dir, None);
    assert_eq!(healthz(&dev, None).await, serde_json::json!({"status": "ok", "sandboxes": 0}));
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
    let app = router(manager(&dir), &opts, &CancellationToken::new());
    for origin in ["https://app.example", "http://localhost:3000"] {
        assert_eq!(send(&app, post_from(origin, None)).await.status(), StatusCode::OK, "{origin}");
    }
    for origin in ["https://app.example:8443", "http://app.example", "https://evil.example"] {
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
    let mut opts = options(None, vec![]);
    opts.max_connections = max_connections;
    opts.header_read_timeout = header_read_timeout;
    let app = router(manager(dir), &opts, &CancellationToken::new());
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
