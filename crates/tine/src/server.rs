//! `tine server start`: the MCP endpoint (Streamable HTTP at `/mcp`, MCP
//! 2025-06-18 / 2025-11-25 "Transports"), bearer authentication of the
//! operator, tenants and peers ([`crate::auth`]),
//! `/healthz`, signed file URLs at `/files/` ([`crate::files_url`]), and
//! shutdown that hibernates every sandbox on SIGTERM/SIGINT (listed again
//! by the next start, see `tine_sandbox::Manager::shutdown_keeping`).
//!
//! HTTP hardening: `Host` and `Origin` are checked (the transport spec's
//! "Security Warning": servers MUST validate `Origin`; a foreign one gets
//! 403), at most [`ServeOptions::max_connections`] connections are served
//! at once (more wait in the listen backlog), a client has
//! [`ServeOptions::header_read_timeout`] to send a request's headers, and
//! `DELETE /mcp` answers 200 (the official Python SDK takes only 200 or
//! 204 as a clean close).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tine_sandbox::Manager;
use tokio_util::sync::CancellationToken;

use crate::auth::sessions::SessionOwners;
use crate::auth::{Auth, Principal};
use crate::cluster::{Cluster, HostSessions};
use crate::files_url::FileUrls;
use crate::mcp::{Shared, TineMcp};
use crate::metrics::Metrics;
use body_budget::{BodyBudget, BUDGET_WAIT, MAX_INFLIGHT_BODY_BYTES};

/// Largest MCP request body (bytes): an 8 MiB upload in base64 plus JSON.
pub const MAX_REQUEST_BYTES: usize = 12 << 20;
/// How often the idle reaper looks at sandboxes.
const REAP_PERIOD: Duration = Duration::from_secs(1);
/// Default for [`ServeOptions::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default for [`ServeOptions::header_read_timeout`]: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a shutdown waits for open connections to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What the HTTP server needs.
pub struct ServeOptions {
    /// Listen address.
    pub listen: SocketAddr,
    /// The credentials: the operator's token (none: `--dev`, loopback
    /// only), the tenants, the peer key.
    pub auth: Arc<Auth>,
    /// `Host` header values accepted.
    pub allowed_hosts: Vec<String>,
    /// `Origin` header values accepted (RFC 6454 serializations such as
    /// `https://app.example.com:443`; `:*` for any port). Empty: a request
    /// that carries any `Origin` is refused with 403; requests without one
    /// (non-browser clients) pass.
    pub allowed_origins: Vec<String>,
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// A connection that has not sent a request's headers within this is
    /// closed (HTTP/1).
    pub header_read_timeout: Duration,
    /// An MCP session idle this long ends (and its own sandbox with it).
    pub session_timeout: Duration,
    /// Build the default template in the background if it is missing.
    pub build_default_template: bool,
    /// Where file URLs point (`scheme://host[:port]`); `None`: the `Host`
    /// of the request that asks for one.
    pub public_url: Option<String>,
    /// This host's name and its peers ([`crate::cluster`]).
    pub cluster: Arc<Cluster>,
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
    /// The file-URL signing key cannot be made.
    #[error("{0}")]
    Files(crate::files_url::UrlError),
    /// A tool's input schema does not compile (a bug in a parameter type).
    #[error("{0}")]
    Tools(String),
}

/// `/healthz`: `{"status":"ok"}` to anyone; to the operator (or under
/// `--dev`) also how many sandboxes exist and the warm pool,
/// `{"status":"ok","sandboxes":3,"pool":{"size":2,"ready":2,"filling":false}}`.
async fn healthz(State((manager, auth)): State<(Arc<Manager>, Arc<Auth>)>, req: Request) -> Response {
    let body = match auth.authenticate(req.headers()) {
        Ok(Principal::Admin) => {
            serde_json::json!({"status": "ok", "sandboxes": manager.len(), "pool": manager.pool_status()}).to_string()
        }
        _ => r#"{"status":"ok"}"#.to_string(),
    };
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `DELETE /mcp` that closed a session answers 200 instead of rmcp's 202:
/// the official Python SDK (`mcp` 2.x, `terminate_session`) logs
/// "Session termination failed: 202" for anything but 200 or 204; the
/// TypeScript SDK takes any 2xx.
async fn delete_answers_200(req: Request, next: Next) -> Response {
    let delete = req.method() == axum::http::Method::DELETE;
    let mut resp = next.run(req).await;
    if delete && resp.status() == StatusCode::ACCEPTED {
        *resp.status_mut() = StatusCode::OK;
    }
    resp
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

/// `/metrics` ([`crate::metrics`]): the text exposition, for the
/// operator (a tenant gets 403: the series name every tenant).
async fn metrics_text(
    State((manager, metrics, sessions)): State<(Arc<Manager>, Arc<Metrics>, Arc<HostSessions>)>,
    req: Request,
) -> Response {
    if !matches!(req.extensions().get::<Principal>(), None | Some(Principal::Admin)) {
        let body = r#"{"error":"forbidden","message":"/metrics is the operator's: use the operator's token"}"#;
        return (StatusCode::FORBIDDEN, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    }
    let body = metrics.render(&manager, sessions.count().await);
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body).into_response()
}

/// The HTTP routes: `/mcp` (Streamable HTTP, behind the bearer check
/// unless `opts.token` is `None`; `Host` checked against
/// `opts.allowed_hosts` and `Origin` against `opts.allowed_origins`, 403
/// otherwise; bodies over [`MAX_REQUEST_BYTES`] answered 413; `DELETE`
/// answered 200; a request of another host's session passed to that host,
/// [`crate::cluster::proxy_foreign_session`]), `/metrics` (behind the same
/// bearer check), the open `/healthz` and `/files/{sandbox}`, whose signed
/// URLs (from `files`) need no token. Cancelling `cancel` ends every MCP
/// session and its streams. Starts following the manager's events for the
/// metrics (call it in a Tokio runtime).
///
/// Errors: [`ServeError::Tools`] for a tool whose input schema does not
/// compile ([`crate::mcp::Tools`]).
pub fn router(
    manager: Arc<Manager>,
    opts: &ServeOptions,
    files: FileUrls,
    cancel: &CancellationToken,
) -> Result<Router, ServeError> {
    let mcp_config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(opts.allowed_hosts.clone())
        .with_allowed_origins(opts.allowed_origins.clone())
        .enforce_origin_validation()
        .with_cancellation_token(cancel.child_token())
        .with_max_request_body_bytes(MAX_REQUEST_BYTES);
    let mut local = LocalSessionManager::default();
    local.session_config.keep_alive = Some(opts.session_timeout);
    let sessions = Arc::new(HostSessions::new(local, opts.cluster.host()));
    let cluster = opts.cluster.clone();
    let metrics = Metrics::new(cluster.host(), &cluster.forwarded);
    metrics.follow(&manager);
    let files = Arc::new(files);
    let tools = Arc::new(crate::mcp::Tools::new(&manager).map_err(ServeError::Tools)?);
    let auth = opts.auth.clone();
    let shared = Shared {
        manager: manager.clone(),
        files: files.clone(),
        cluster: cluster.clone(),
        metrics: metrics.clone(),
        tools,
        auth: auth.clone(),
    };
    let owners = SessionOwners::new(sessions.clone());
    let mcp = StreamableHttpService::new(move || Ok(TineMcp::new(&shared)), sessions.clone(), mcp_config);
    let mcp_router = Router::new()
        .nest_service("/mcp", mcp)
        .layer(axum::middleware::from_fn(delete_answers_200))
        .layer(axum::middleware::from_fn_with_state(owners, crate::auth::sessions::bind))
        .layer(axum::middleware::from_fn_with_state(cluster, crate::cluster::proxy_foreign_session))
        .layer(axum::middleware::from_fn_with_state(
            BodyBudget::new(MAX_INFLIGHT_BODY_BYTES, BUDGET_WAIT),
            body_budget::hold,
        ));
    let protected = Router::new()
        .route("/metrics", get(metrics_text))
        .with_state((manager.clone(), metrics, sessions))
        .merge(mcp_router)
        .layer(axum::middleware::from_fn_with_state(auth.clone(), crate::auth::authenticate));
    Ok(Router::new()
        .route("/healthz", get(healthz))
        .with_state((manager.clone(), auth.clone()))
        .merge(protected)
        .merge(crate::files_url::routes(manager, files, auth)))
}

/// Serves until SIGTERM/SIGINT, then ends every session and kills every
/// sandbox before returning.
///
/// Errors: [`ServeError`].
pub async fn serve(manager: Arc<Manager>, opts: ServeOptions) -> Result<(), ServeError> {
    let cancel = CancellationToken::new();
    let files = FileUrls::new(opts.public_url.clone(), opts.listen).map_err(ServeError::Files)?;
    let app = router(manager.clone(), &opts, files, &cancel)?;
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|source| ServeError::Bind { addr: opts.listen, source })?;
    let reaper = manager.spawn_reaper(REAP_PERIOD);
    let reload = opts.auth.spawn_reload();
    let sweeper = tokio::spawn(remove_tenants(manager.clone(), opts.auth.subscribe()));
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

    let graceful = accept_loop(listener, app, &opts, shutdown_signal()).await;
    // Sessions that end from now on leave their sandboxes to be kept.
    manager.begin_shutdown();
    // Ends SSE streams and sessions so the connections can finish.
    cancel.cancel();
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(DRAIN_TIMEOUT) => tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}"),
    }
    reaper.abort();
    reload.abort();
    sweeper.abort();
    tracing::info!("hibernating every sandbox");
    let kept = manager.shutdown_keeping().await;
    tracing::info!("{kept} sandboxes hibernated; the next start lists them again");
    tracing::info!("stopped");
    Ok(())
}

/// Deletes the sandboxes and templates of tenants the tenants file marks
/// removed, each time it is read (the first time at start). What cannot be
/// deleted now is logged and tried again at the next read.
async fn remove_tenants(
    manager: Arc<Manager>,
    mut roster: tokio::sync::watch::Receiver<Arc<crate::auth::tenants::Roster>>,
) {
    loop {
        let removed = roster.borrow_and_update().removed.clone();
        for tenant in removed {
            let theirs: Vec<_> = manager
                .list(&Default::default())
                .into_iter()
                .filter(|s| s.tenant.as_deref() == Some(tenant.as_str()))
                .collect();
            for s in theirs {
                match manager.kill(&s.sandbox_id).await {
                    Ok(()) => crate::audit::change("sandbox deleted: its tenant was removed", &s.sandbox_id),
                    Err(e) => tracing::warn!(sandbox = %s.sandbox_id, "removed tenant {tenant}: {e}"),
                }
            }
            for t in manager.templates() {
                if tine_sandbox::templates::split_qualified(&t.name).0 == Some(tenant.as_str()) {
                    match manager.template_delete(&t.name).await {
                        Ok(()) => crate::audit::change("template deleted: its tenant was removed", &t.name),
                        Err(e) => tracing::warn!(template = %t.name, "removed tenant {tenant}: {e}"),
                    }
                }
            }
        }
        if roster.changed().await.is_err() {
            return;
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves: at most
/// `opts.max_connections` connections at once (the next is accepted when
/// one closes), each HTTP/1 request's headers within
/// `opts.header_read_timeout`. Returns the open connections' shutdown
/// handle. Accept errors (such as `EMFILE`) are logged and retried.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    opts: &ServeOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> GracefulShutdown {
    let slots = Arc::new(tokio::sync::Semaphore::new(opts.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(opts.header_read_timeout);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break, // never closed
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // EMFILE and the like: wait a moment rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service).into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection: {e}");
            }
            drop(slot);
        });
    }
    graceful
}

mod body_budget;
#[cfg(test)]
mod tests;
