//! Router tests: the HTTP layer in front of the MCP tools (bearer auth and
//! its 401 challenge, the `Host` check, the body limit, `--dev`, `/healthz`)
//! through `tower::ServiceExt::oneshot`, with no socket and no VM, so they
//! run on hosts without `/dev/kvm`. The manager is made on two empty image
//! files; nothing here boots a sandbox.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::Response;
use tine_sandbox::{Manager, ManagerConfig};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use super::{router, ServeOptions, MAX_REQUEST_BYTES};

const TOKEN: &str = "router-test-token-0123456789abcdef0123456789abcdef";

/// A router over a manager on empty images in `dir`; `token: None` is `--dev`.
fn app(dir: &tempfile::TempDir, token: Option<&str>) -> axum::Router {
    let (kernel, rootfs) = (dir.path().join("vmlinux"), dir.path().join("rootfs.ext4"));
    std::fs::write(&kernel, b"").unwrap();
    std::fs::write(&rootfs, b"").unwrap();
    let manager = Manager::new(ManagerConfig {
        kernel,
        rootfs,
        run_dir: dir.path().join("sandboxes"),
        templates_dir: dir.path().join("templates"),
        memory_backing: vmm::MemoryBacking::Private,
        profile: vmm::HostProfile::BareMetal,
        limits: tine_sandbox::Limits::default(),
    })
    .expect("a manager on empty images");
    let opts = ServeOptions {
        listen: "127.0.0.1:5555".parse().unwrap(),
        token: token.map(str::to_string),
        allowed_hosts: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
        session_timeout: Duration::from_secs(60),
        build_default_template: false,
    };
    router(manager, &opts, &CancellationToken::new())
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

#[tokio::test]
async fn healthz_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(&dir, Some(TOKEN));
    let r = send(&app, Request::get("/healthz").header(header::HOST, "localhost").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status(), StatusCode::OK);
    let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body, serde_json::json!({"status": "ok", "sandboxes": 0}));
}
