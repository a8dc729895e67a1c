//! `tine server start`: the MCP endpoint (Streamable HTTP at `/mcp`, MCP
//! 2025-06-18 / 2025-11-25 "Transports"), bearer authentication of the
//! operator, tenants and peers, and OAuth access tokens with `[auth.oauth]`
//! ([`crate::auth`]; their protected resource metadata at
//! `/.well-known/oauth-protected-resource[/mcp]`, RFC 9728),
//! `/healthz`, signed file URLs at `/files/` ([`crate::files_url`]), and
//! shutdown that hibernates every sandbox on SIGTERM/SIGINT (listed again
//! by the next start, see `tine_sandbox::Manager::shutdown_keeping`).
//!
//! HTTP hardening: `Host` and `Origin` are checked (the transport spec's
//! "Security Warning": servers MUST validate `Origin`; a foreign one gets
//! 403; a `--dev` server, which has no credentials, accepts only its own
//! loopback origins, [`loopback_origins`]), at most
//! [`ServeOptions::max_connections`] connections are served at once
//! (more wait in the listen backlog; at most
//! [`ServeOptions::max_connections_per_address`] from one address, by
//! default half of them), a connection has
//! [`ServeOptions::header_read_timeout`] to send its first request,
//! whatever its HTTP version, and is closed after
//! [`ServeOptions::idle_timeout`] without one, or after
//! [`connection::BUSY_IDLE`] while more than 3/4 of the slots are taken
//! ([`connection`]), at most
//! [`ServeOptions::max_sessions`] MCP sessions are open (an `initialize`
//! past it gets 503 saying what to do), and `DELETE /mcp` answers 200 (the
//! official Python SDK takes only 200 or 204 as a clean close).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
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
use connection::{ConnError, ConnLimits, PerAddress, Pressure};

/// Largest MCP request body (bytes): an 8 MiB upload in base64 plus JSON.
pub const MAX_REQUEST_BYTES: usize = 12 << 20;
/// How often the idle reaper looks at sandboxes.
const REAP_PERIOD: Duration = Duration::from_secs(1);
/// Default for [`ServeOptions::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// The default of [`ServeOptions::max_connections_per_address`] for
/// `max_connections` slots: half of them (at least 1), so one address
/// (one client's keep-alive pool, or a flood) cannot take them all. The
/// test suite's busiest binary (`tine::load`, 24 MCP sessions at once
/// from loopback) holds about 50 of the default 256's 128.
pub fn default_max_connections_per_address(max_connections: usize) -> usize {
    (max_connections / 2).max(1)
}
/// Default for [`ServeOptions::header_read_timeout`]: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`ServeOptions::idle_timeout`]: 60 s.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`ServeOptions::http2_keep_alive_interval`]: 30 s.
pub const DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// Default for [`ServeOptions::http2_keep_alive_timeout`]: 20 s.
pub const DEFAULT_HTTP2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Default for [`ServeOptions::http2_max_concurrent_streams`]: 100 (RFC
/// 9113 §6.5.2 advises no fewer).
pub const DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS: u32 = 100;
/// Default for [`ServeOptions::max_sessions`].
pub const DEFAULT_MAX_SESSIONS: usize = 1024;
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
    /// Connections served at once from one client address (0: no cap;
    /// the configuration's default is half of `max_connections`,
    /// [`default_max_connections_per_address`]); more are closed as soon
    /// as they are accepted. Behind a reverse proxy (nginx, a Kubernetes
    /// Ingress) every client has the proxy's address: set it 0 there, or
    /// above the number of connections the proxy keeps open to this
    /// server.
    pub max_connections_per_address: usize,
    /// A new connection that has not sent its first request within this
    /// is closed, whatever its HTTP version (HTTP/1: its request line and
    /// headers; HTTP/2: the preface, SETTINGS and first HEADERS); so is an
    /// HTTP/1 connection whose next request's headers have not arrived
    /// this long after the previous response (hyper's timer).
    pub header_read_timeout: Duration,
    /// A connection that carries no request (none being read or answered,
    /// no response stream open) this long is closed (HTTP/2 with a
    /// GOAWAY); while more than 3/4 of `max_connections` are taken,
    /// [`connection::BUSY_IDLE`] if shorter. HTTP/1 ones are closed by
    /// `header_read_timeout` if it is shorter.
    pub idle_timeout: Duration,
    /// HTTP/2: a PING this often on every connection, to find peers that
    /// are gone (`None`: no PINGs).
    pub http2_keep_alive_interval: Option<Duration>,
    /// HTTP/2: a connection whose PING is not answered within this is
    /// closed.
    pub http2_keep_alive_timeout: Duration,
    /// HTTP/2: requests (streams) open at once on one connection.
    pub http2_max_concurrent_streams: u32,
    /// MCP sessions open at once; an `initialize` past it is refused with
    /// 503 saying to end sessions (`DELETE /mcp`) or raise it.
    pub max_sessions: usize,
    /// An MCP session idle this long ends (and its own sandbox with it).
    pub session_timeout: Duration,
    /// Build the default template in the background if it is missing.
    pub build_default_template: bool,
    /// Where file URLs point (`scheme://host[:port]`); `None`: the `Host`
    /// of the request that asks for one.
    pub public_url: Option<String>,
    /// This host's name and its peers ([`crate::cluster`]).
    pub cluster: Arc<Cluster>,
    /// Preview URLs ([`crate::preview`]): their forms, limits, store and
    /// token key.
    pub previews: Arc<crate::preview::Previews>,
    /// Published host ports ([`crate::published_ports`]).
    pub ports: crate::published_ports::PortsConfig,
    /// The secrets store (`None`: none, in tests of the router alone).
    pub secrets: Option<Arc<crate::secrets::Store>>,
    /// The toolset of connections that name none (`[mcp] tools`).
    pub toolset: crate::mcp::toolsets::Toolset,
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
    /// The MCP session on stdio could not start (`tine mcp stdio`).
    #[error("the MCP session on stdio did not start: {0}")]
    Stdio(String),
}

/// The browser origins (RFC 6454 §6.2 serializations) of a loopback
/// server listening on `listen`, which a `--dev` server accepts and no
/// other: `http://localhost:PORT`, `http://127.0.0.1:PORT`,
/// `http://[::1]:PORT` and the listen address's own, with its port. Not
/// `*.localhost` (a preview's page, `<id>.localhost:PORT`, must not drive
/// a server without credentials), not another port (another local
/// program's page), not https (this server speaks http).
pub fn loopback_origins(listen: SocketAddr) -> Vec<String> {
    let port = listen.port();
    let mut origins: Vec<String> =
        ["localhost", "127.0.0.1", "[::1]"].iter().map(|h| format!("http://{h}:{port}")).collect();
    let own = format!("http://{listen}");
    if listen.ip().is_loopback() && !origins.contains(&own) {
        origins.push(own);
    }
    origins
}

/// `/healthz`: `{"status":"ok"}` to anyone; to the operator (or under
/// `--dev`) also this host's name, how many sandboxes exist and the warm
/// pool, `{"status":"ok","host":"h1","sandboxes":3,"pool":{"size":2,"ready":2,"filling":false}}`
/// (hosts ask each other their names so: `crate::cluster::discovery`).
async fn healthz(State((manager, auth, host)): State<(Arc<Manager>, Arc<Auth>, String)>, req: Request) -> Response {
    let body = match auth.authenticate(req.headers()) {
        Ok(Principal::Admin) => serde_json::json!({
            "status": "ok", "host": host, "sandboxes": manager.len(), "pool": manager.pool_status()
        })
        .to_string(),
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

/// Refuses a new MCP session, a `POST /mcp` without `Mcp-Session-Id` (an
/// `initialize`), with 503 and a JSON-RPC error saying what to do when
/// `sessions` has as many as it may. (Two initializes at once may both
/// pass here with one place left; [`HostSessions`] then refuses the
/// second, which rmcp answers with 500 and the same message.)
async fn cap_sessions(State(sessions): State<Arc<HostSessions>>, req: Request, next: Next) -> Response {
    if req.method() == Method::POST && !req.headers().contains_key("mcp-session-id") && sessions.is_full().await {
        let message = sessions.full_error().to_string();
        tracing::warn!("initialize refused: {message}");
        let body = serde_json::json!({
            "jsonrpc": "2.0",
            "id": null,
            "error": {"code": -32000, "message": message},
        });
        return (StatusCode::SERVICE_UNAVAILABLE, [(header::CONTENT_TYPE, "application/json")], body.to_string())
            .into_response();
    }
    next.run(req).await
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
    let sessions = sessions.count().await;
    // Off the async threads: the disk figures walk the data directory.
    let body = tokio::task::spawn_blocking(move || metrics.render(&manager, sessions)).await.unwrap_or_default();
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body).into_response()
}

/// The HTTP routes: `/mcp` (Streamable HTTP, behind the bearer check
/// unless `opts.token` is `None`; `Host` checked against
/// `opts.allowed_hosts` and `Origin` against `opts.allowed_origins`, 403
/// otherwise; bodies over [`MAX_REQUEST_BYTES`] answered 413; `DELETE`
/// answered 200; an `initialize` past `opts.max_sessions` answered 503; a request of another host's session passed to that host,
/// [`crate::cluster::proxy_foreign_session`]), `/metrics` (behind the same
/// bearer check), the open `/healthz` and `/files/{sandbox}`, whose signed
/// URLs (from `files`) need no token, and with `[auth.oauth]` the open
/// protected resource metadata ([`crate::auth::oauth::METADATA_PATH`] and
/// the same followed by `/mcp`, RFC 9728 §3). Before all of them, requests
/// for a preview URL (by `Host`, or by path where on) go to the sandbox
/// ([`crate::preview::dispatch`]). Cancelling `cancel` ends every MCP
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
    router_and_shared(manager, opts, files, cancel).map(|(router, _)| router)
}

/// [`router`], and what its MCP sessions share (for a session served
/// another way: [`serve_stdio`]).
///
/// Errors: as [`router`].
fn router_and_shared(
    manager: Arc<Manager>,
    opts: &ServeOptions,
    files: FileUrls,
    cancel: &CancellationToken,
) -> Result<(Router, Shared), ServeError> {
    let mcp_config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(opts.allowed_hosts.clone())
        .with_allowed_origins(opts.allowed_origins.clone())
        .enforce_origin_validation()
        .with_cancellation_token(cancel.child_token())
        .with_max_request_body_bytes(MAX_REQUEST_BYTES);
    let mut local = LocalSessionManager::default();
    local.session_config.keep_alive = Some(opts.session_timeout);
    let sessions = Arc::new(HostSessions::new(local, opts.cluster.host(), opts.max_sessions));
    let cluster = opts.cluster.clone();
    let metrics = Metrics::new(cluster.host(), &cluster.forwarded);
    metrics.follow(&manager);
    let files = Arc::new(files);
    let tools = Arc::new(crate::mcp::Tools::new(&manager, opts.toolset.clone()).map_err(ServeError::Tools)?);
    let auth = opts.auth.clone();
    let ports = crate::published_ports::Publisher::new(manager.clone(), opts.ports.clone());
    ports.watch();
    let restoring = ports.clone();
    tokio::spawn(async move { restoring.restore().await });
    let shared = Shared {
        ports,
        secrets: opts.secrets.clone(),
        manager: manager.clone(),
        files: files.clone(),
        cluster: cluster.clone(),
        metrics: metrics.clone(),
        tools,
        auth: auth.clone(),
        previews: opts.previews.clone(),
    };
    let owners = SessionOwners::new(sessions.clone());
    let forward_owners = owners.clone();
    let for_sessions = shared.clone();
    let mcp = StreamableHttpService::new(move || Ok(TineMcp::new(&for_sessions)), sessions.clone(), mcp_config.clone());
    let mut mcp_router = Router::new();
    for seed in crate::mcp_seed::seeds() {
        let for_seed = shared.clone();
        let tools = crate::mcp_seed::SeedMcp::tools_of(seed);
        mcp_router = mcp_router.route_service(
            &format!("/mcp/{}", seed.name()),
            StreamableHttpService::new(
                move || Ok(crate::mcp_seed::SeedMcp::new(&for_seed, seed, tools.clone())),
                sessions.clone(),
                mcp_config.clone(),
            ),
        );
    }
    let mcp_router = mcp_router
        .nest_service("/mcp", mcp)
        .layer(axum::middleware::from_fn(delete_answers_200))
        .layer(axum::middleware::from_fn_with_state(owners, crate::auth::sessions::bind))
        .layer(axum::middleware::from_fn_with_state(sessions.clone(), cap_sessions))
        .layer(axum::middleware::from_fn_with_state(cluster, crate::cluster::proxy_foreign_session))
        .layer(axum::middleware::from_fn_with_state(
            BodyBudget::new(MAX_INFLIGHT_BODY_BYTES, BUDGET_WAIT),
            body_budget::hold,
        ));
    let protected = Router::new()
        .route("/metrics", get(metrics_text))
        .with_state((manager.clone(), metrics, sessions))
        .merge(mcp_router)
        .merge(crate::port_forward::routes(manager.clone(), opts.cluster.host().to_owned(), forward_owners))
        .layer(axum::middleware::from_fn_with_state(auth.clone(), crate::auth::authenticate));
    let mut open = Router::new().route("/healthz", get(healthz)).with_state((
        manager.clone(),
        auth.clone(),
        opts.cluster.host().to_string(),
    ));
    if auth.oauth().is_some() {
        let path = crate::auth::oauth::METADATA_PATH;
        open = open.merge(
            Router::new()
                .route(path, get(crate::auth::resource_metadata))
                .route(&format!("{path}/mcp"), get(crate::auth::resource_metadata))
                .with_state(auth.clone()),
        );
    }
    let dispatch = crate::preview::Dispatch {
        manager: manager.clone(),
        previews: opts.previews.clone(),
        auth: auth.clone(),
        cluster: opts.cluster.clone(),
        upstream: Arc::new(crate::preview::upstream::Upstream::new(
            manager.clone(),
            opts.previews.wake_timeout(),
            opts.previews.config.max_guest_connections,
        )),
    };
    let app = open
        .merge(protected)
        .merge(crate::files_url::routes(manager, files, auth))
        .layer(axum::middleware::from_fn_with_state(dispatch, crate::preview::dispatch));
    Ok((app, shared))
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
    let jwks = opts.auth.spawn_oauth_refresh();
    let sweeper = tokio::spawn(follow_tenants(manager.clone(), opts.auth.subscribe()));
    let secrets_reload = opts.secrets.as_ref().map(|s| s.spawn_reload());
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

    let open = accept_loop(listener, app, &opts, shutdown_signal()).await;
    // Sessions that end from now on leave their sandboxes to be kept.
    manager.begin_shutdown();
    // Ends SSE streams and sessions so the connections can finish.
    cancel.cancel();
    tokio::select! {
        _ = open.close() => {}
        _ = tokio::time::sleep(DRAIN_TIMEOUT) => tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}"),
    }
    reaper.abort();
    reload.abort();
    if let Some(j) = jwks {
        j.abort();
    }
    sweeper.abort();
    if let Some(s) = secrets_reload {
        s.abort();
    }
    tracing::info!("hibernating every sandbox");
    let kept = manager.shutdown_keeping().await;
    tracing::info!("{kept} sandboxes hibernated; the next start lists them again");
    tracing::info!("stopped");
    Ok(())
}

/// Serves one MCP session on this process's stdin and stdout (`tine mcp
/// stdio` without `--url`) until the client closes stdin (or SIGTERM or
/// SIGINT), beside the HTTP routes of [`router`] on `listener` (a loopback
/// one, bound at `opts.listen`) for what the tools hand out as URLs:
/// signed file URLs and preview URLs. `opts.auth` should hold a token
/// nobody has: the session needs none, and `/mcp` then serves no one else.
/// When the session ends, the sandbox it made on first use is killed and
/// the others are hibernated, as at a server's stop. Nothing but the
/// protocol goes to stdout (the log goes to stderr).
///
/// Errors: [`ServeError`]; [`ServeError::Stdio`] when the session cannot
/// start.
pub async fn serve_stdio(
    manager: Arc<Manager>,
    mut opts: ServeOptions,
    listener: std::net::TcpListener,
) -> Result<(), ServeError> {
    use rmcp::ServiceExt;
    let cancel = CancellationToken::new();
    let bind = |source| ServeError::Bind { addr: opts.listen, source };
    let listener =
        listener.set_nonblocking(true).and_then(|()| tokio::net::TcpListener::from_std(listener)).map_err(bind)?;
    let local = listener.local_addr().map_err(bind)?;
    opts.listen = local;
    opts.allowed_hosts.push(local.to_string());
    let files = FileUrls::new(opts.public_url.clone(), local).map_err(ServeError::Files)?;
    let (app, shared) = router_and_shared(manager.clone(), &opts, files, &cancel)?;
    let reaper = manager.spawn_reaper(REAP_PERIOD);
    let secrets_reload = opts.secrets.as_ref().map(|s| s.spawn_reload());
    if opts.build_default_template {
        let m = manager.clone();
        tokio::spawn(async move {
            let _ = m.ensure_default_template(false).await;
        });
    }
    let ended = CancellationToken::new();
    let http_ended = ended.clone();
    let http = tokio::spawn(async move {
        let open = accept_loop(listener, app, &opts, http_ended.cancelled()).await;
        tokio::select! {
            _ = open.close() => {}
            _ = tokio::time::sleep(DRAIN_TIMEOUT) => {}
        }
    });
    tracing::info!("serving one MCP session on stdio; file and preview URLs at http://{local}");
    let handler = TineMcp::new(&shared);
    let (stdin, stdout) = rmcp::transport::stdio_pipes();
    let session = handler.clone().serve((stdin, stdout)).await.map_err(|e| ServeError::Stdio(e.to_string()));
    match session {
        Ok(running) => {
            let stop = running.cancellation_token();
            tokio::select! {
                reason = running.waiting() => tracing::info!("the stdio session ended: {reason:?}"),
                () = shutdown_signal() => stop.cancel(),
            }
        }
        Err(e) => tracing::error!("{e}"),
    }
    handler.end_session().await;
    ended.cancel();
    let _ = http.await;
    manager.begin_shutdown();
    cancel.cancel();
    reaper.abort();
    if let Some(s) = secrets_reload {
        s.abort();
    }
    let kept = manager.shutdown_keeping().await;
    tracing::info!("{kept} sandboxes hibernated; the next start lists them again");
    Ok(())
}

/// Follows the tenants file each time it is read (the first time at
/// start): gives the manager the tenants' quotas (a resumed sandbox counts
/// against them) and deletes the sandboxes, templates and volumes of
/// tenants it marks removed (their volumes not with `keep_data`). What cannot be deleted now is logged and tried again at
/// the next read.
async fn follow_tenants(
    manager: Arc<Manager>,
    mut roster: tokio::sync::watch::Receiver<Arc<crate::auth::tenants::Roster>>,
) {
    loop {
        let (removed, keeping_data) = {
            let now = roster.borrow_and_update();
            manager.set_tenant_quotas(now.quotas());
            (now.removed.clone(), now.keeping_data.clone())
        };
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
            if keeping_data.contains(&tenant) {
                continue;
            }
            // Its sandboxes are gone, so none has a volume attached.
            let cx = tine_sandbox::CallContext { tenant: Some(tenant.clone()), ..Default::default() };
            for v in manager.volume_list(&cx) {
                match manager.volume_delete(&cx, &v.name).await {
                    Ok(()) => {
                        crate::audit::change("volume deleted: its tenant was removed", &format!("{tenant}/{}", v.name))
                    }
                    Err(e) => tracing::warn!(volume = %v.name, "removed tenant {tenant}: {e}"),
                }
            }
        }
        if roster.changed().await.is_err() {
            return;
        }
    }
}

/// The connections [`accept_loop`] left open when it returned.
struct OpenConnections {
    /// Asks every connection to close gracefully.
    shutdown: CancellationToken,
    /// A permit per connection slot, held while a connection is open.
    slots: Arc<tokio::sync::Semaphore>,
    /// Slots in all.
    total: u32,
}

impl OpenConnections {
    /// Asks every open connection to close gracefully (requests in
    /// progress finish; HTTP/2 gets a GOAWAY) and waits until all have
    /// closed. The caller bounds the wait.
    async fn close(self) {
        self.shutdown.cancel();
        // Fails only if the semaphore was closed, which nothing does.
        let _ = self.slots.acquire_many(self.total).await;
    }
}

/// Serves `app` on `listener` until `shutdown` resolves: at most
/// `opts.max_connections` connections at once (the next is accepted when
/// one closes), at most `opts.max_connections_per_address` of them from
/// one address (more are closed at once), each under
/// [`connection::serve_connection`]'s deadlines (first request within
/// `opts.header_read_timeout`, closed after `opts.idle_timeout` without
/// one, or [`connection::BUSY_IDLE`] while the slots run low,
/// [`connection::Pressure`]) with the HTTP/2 keep-alive and stream limits of `opts`. Returns
/// the open connections, to be closed. Accept errors (such as `EMFILE`)
/// are logged and retried.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    opts: &ServeOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> OpenConnections {
    let total = u32::try_from(opts.max_connections.max(1)).unwrap_or(u32::MAX);
    let slots = Arc::new(tokio::sync::Semaphore::new(total as usize));
    let open = OpenConnections { shutdown: CancellationToken::new(), slots: slots.clone(), total };
    let per_address = PerAddress::new(opts.max_connections_per_address);
    let pressure = Arc::new(Pressure::new(slots.clone(), total as usize));
    let limits = ConnLimits { first_request: opts.header_read_timeout, idle: opts.idle_timeout };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(opts.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(opts.http2_keep_alive_interval)
        .keep_alive_timeout(opts.http2_keep_alive_timeout)
        .max_concurrent_streams(opts.http2_max_concurrent_streams);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break, // never closed
            },
            _ = &mut shutdown => break,
        };
        pressure.update();
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    // EMFILE and the like: wait a moment rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Some(address_slot) = per_address.take(peer.ip()) else {
            tracing::debug!(
                "{peer}: closed, {} connections from its address are open (max_connections_per_address)",
                opts.max_connections_per_address
            );
            continue;
        };
        let conn = connection::serve_connection(
            &builder,
            stream,
            Some(peer),
            app.clone(),
            limits,
            pressure.subscribe(),
            open.shutdown.clone(),
        );
        let pressure = pressure.clone();
        tokio::spawn(async move {
            match conn.await {
                Ok(()) => {}
                Err(e @ (ConnError::NoFirstRequest(_) | ConnError::CloseTimeout)) => tracing::debug!("{peer}: {e}"),
                Err(e) => tracing::debug!("connection from {peer}: {e}"),
            }
            drop(address_slot);
            drop(slot);
            pressure.update();
        });
    }
    open
}

mod body_budget;
pub mod connection;
#[cfg(test)]
mod tests;
