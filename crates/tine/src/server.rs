//! `tine server start`: the MCP endpoint (Streamable HTTP at `/mcp`, MCP
//! 2025-06-18 / 2025-11-25 "Transports"), bearer authentication,
//! `/healthz`, and shutdown that kills every sandbox on SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use subtle::ConstantTimeEq;
use tine_sandbox::Manager;
use tokio_util::sync::CancellationToken;

use crate::mcp::TineMcp;

/// Largest MCP request body (bytes): an 8 MiB upload in base64 plus JSON.
pub const MAX_REQUEST_BYTES: usize = 12 << 20;
/// How often the idle reaper looks at sandboxes.
const REAP_PERIOD: Duration = Duration::from_secs(1);

/// What the HTTP server needs.
pub struct ServeOptions {
    /// Listen address.
    pub listen: SocketAddr,
    /// The bearer token; `None` serves without auth (`--dev`, loopback only).
    pub token: Option<String>,
    /// `Host` header values accepted.
    pub allowed_hosts: Vec<String>,
    /// An MCP session idle this long ends (and its own sandbox with it).
    pub session_timeout: Duration,
    /// Build the default template in the background if it is missing.
    pub build_default_template: bool,
}

/// Errors of serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address cannot be bound.
    #[error("cannot listen on {addr}: {source} (is another tine server running? pick another --listen)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),
}

/// Checks `Authorization: Bearer <token>` in constant time (RFC 6750 §2.1);
/// answers 401 with `WWW-Authenticate: Bearer` (RFC 6750 §3) otherwise.
async fn require_bearer(State(token): State<Arc<String>>, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let ok = match given {
        Some(g) => bool::from(g.as_bytes().ct_eq(token.as_bytes())),
        None => false,
    };
    if ok {
        return next.run(req).await;
    }
    let challenge =
        if given.is_some() { r#"Bearer realm="tine", error="invalid_token""# } else { r#"Bearer realm="tine""# };
    let mut resp = (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"error":"unauthorized","message":"send Authorization: Bearer <token> (the server's token file)"}"#,
    )
        .into_response();
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    resp
}

async fn healthz(State(manager): State<Arc<Manager>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], format!(r#"{{"status":"ok","sandboxes":{}}}"#, manager.len()))
}

/// Resolves when SIGTERM or SIGINT arrives.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("cannot install SIGTERM/SIGINT handlers; stop the server with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

/// The HTTP routes: `/mcp` (Streamable HTTP, behind the bearer check
/// unless `opts.token` is `None`; `Host` checked against
/// `opts.allowed_hosts`, 403 otherwise; bodies over [`MAX_REQUEST_BYTES`]
/// answered 413) and the open `/healthz`. Cancelling `cancel` ends every
/// MCP session and its streams.
pub fn router(manager: Arc<Manager>, opts: &ServeOptions, cancel: &CancellationToken) -> Router {
    let mcp_config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(opts.allowed_hosts.clone())
        .with_cancellation_token(cancel.child_token())
        .with_max_request_body_bytes(MAX_REQUEST_BYTES);
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(opts.session_timeout);
    let factory_manager = manager.clone();
    let mcp =
        StreamableHttpService::new(move || Ok(TineMcp::new(factory_manager.clone())), Arc::new(sessions), mcp_config);
    let mut mcp_router = Router::new().nest_service("/mcp", mcp);
    if let Some(token) = &opts.token {
        mcp_router = mcp_router.layer(axum::middleware::from_fn_with_state(Arc::new(token.clone()), require_bearer));
    }
    Router::new().route("/healthz", get(healthz)).with_state(manager).merge(mcp_router)
}

/// Serves until SIGTERM/SIGINT, then ends every session and kills every
/// sandbox before returning.
///
/// Errors: [`ServeError`].
pub async fn serve(manager: Arc<Manager>, opts: ServeOptions) -> Result<(), ServeError> {
    let cancel = CancellationToken::new();
    let app = router(manager.clone(), &opts, &cancel);
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|source| ServeError::Bind { addr: opts.listen, source })?;
    let reaper = manager.spawn_reaper(REAP_PERIOD);
    if opts.build_default_template {
        let m = manager.clone();
        tokio::spawn(async move {
            // Errors are logged; sandboxes then boot instead.
            let _ = m.ensure_default_template(false).await;
        });
    }
    tracing::info!("serving MCP at http://{}/mcp", opts.listen);
    // Tests and scripts wait for this line on stdout.
    println!("tine: listening on http://{}/mcp", opts.listen);

    let stop = cancel.clone();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            // Ends SSE streams and sessions so the graceful shutdown can finish.
            stop.cancel();
        })
        .await;
    reaper.abort();
    tracing::info!("killing every sandbox");
    manager.shutdown().await;
    tracing::info!("stopped");
    served.map_err(ServeError::Http)
}

#[cfg(test)]
mod tests;
