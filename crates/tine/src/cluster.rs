//! More than one Tine host behind one MCP endpoint.
//!
//! Every host has a name ([`ClusterConfig::host_name`]), and the ids it
//! hands out carry it: sandboxes are `sb-<host>-<n>` (processes
//! `sb-<host>-<n>:p<m>`), MCP sessions `<host>.<uuid>`. A load balancer
//! keeps a session on one host by hashing `Mcp-Session-Id` (nginx
//! `hash $http_mcp_session_id consistent`, `deploy/nginx/`); its first
//! request (`initialize`, which has no id yet) goes to any host, so later
//! requests may land on another host than the one that made the session.
//! A host that gets a request for another host's session or a tool call
//! naming another host's sandbox passes it to that host when it knows its
//! address ([`ClusterConfig::peers`], [`ClusterConfig::peer_url`]) and
//! otherwise answers with an error naming the host:
//!
//! - a session's HTTP request is proxied whole ([`proxy_foreign_session`]),
//!   streams included;
//! - a tool call is made again on the peer over an MCP session this host
//!   keeps with it ([`Cluster::forward`]); its progress notifications stay
//!   on the peer.
//!
//! Both authenticate with the peer key (`[cluster] peer_key_file`, by
//! default the operator's token; never the caller's credential), name the
//! caller's principal in [`crate::auth::TENANT_HEADER`] (which a host
//! believes only with the peer key), so the peer acts for the same tenant
//! and checks its objects as its own calls, and carry a header naming
//! this host ([`PROXIED_HEADER`], [`FORWARDED_HEADER`]):
//! a request is proxied once at most and a tool call forwarded once at
//! most, so a wrong peer table cannot make a loop. Sandboxes do
//! not move between hosts: a host that stops takes its sandboxes and
//! sessions with it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::TryStreamExt;
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::{
    create_local_session, LocalSessionManager, LocalSessionManagerError, LocalSessionWorker,
};
use rmcp::transport::streamable_http_server::session::{SessionId, SessionManager};
use rmcp::transport::{StreamableHttpClientTransport, WorkerTransport};
use rmcp::{RoleClient, ServiceExt};
use serde::Deserialize;

use crate::auth::{Principal, TENANT_HEADER};

/// The header a forwarded tool call carries: the name of the host that
/// made it again here. A host never forwards a call that has it.
pub const FORWARDED_HEADER: &str = "x-tine-forwarded-by";
/// The header a proxied session request carries: the name of the host
/// that passed it on. A host never proxies a request that has it. (A
/// proxied request may still forward its tool call once: two hops at
/// most.)
pub const PROXIED_HEADER: &str = "x-tine-proxied-by";
/// The environment variable that names this host when the configuration
/// does not (e.g. a Kubernetes pod's IP or node name).
pub const HOST_NAME_ENV: &str = "TINE_HOST_NAME";
/// Longest host name (bytes).
pub const MAX_HOST_NAME: usize = 40;
/// How long a connection to a peer may take to open.
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The argument names of tools that hold sandbox or process ids.
const ID_ARGUMENTS: [&str; 6] = ["sandbox_id", "process_id", "a", "b", "winner", "parent"];

/// `[cluster]` in the configuration file.
///
/// ```toml
/// [cluster]
/// host_name = "tine-a"          # default: $TINE_HOST_NAME, else the system's host name
/// peers = { tine-b = "http://10.0.0.2:5555" }
/// peer_url = "http://{host}.tine-peers:5555"   # for hosts not in peers
/// peer_key_file = "/etc/tine/peer-key"         # default: the operator's token
/// ```
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// This host's name, in its sandbox and session ids: letters, digits,
    /// `-` and `.` (a `.` becomes `-`), at most [`MAX_HOST_NAME`] bytes,
    /// lowercased. Default: `$TINE_HOST_NAME`, else the first label of the
    /// system's host name.
    pub host_name: Option<String>,
    /// Other hosts by name: the base URL (`http://10.0.0.2:5555`) this
    /// host forwards their sessions and sandboxes' calls to.
    pub peers: BTreeMap<String, String>,
    /// The base URL of a host not in `peers`, with `{host}` standing for
    /// its name (e.g. a DNS name per host). Unset: only `peers` are
    /// reached, and calls for other hosts are refused with their name.
    pub peer_url: Option<String>,
    /// The file holding the key hosts present to each other (at least 32
    /// printable bytes, mode 0600; the same on every host). Unset: the
    /// operator's token.
    pub peer_key_file: Option<std::path::PathBuf>,
}

/// Errors of the cluster configuration, of forwarding and of this host's
/// MCP sessions ([`HostSessions`]).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A host name that cannot be used in ids.
    #[error(
        "host name {name:?}: {reason}; use 1 to {MAX_HOST_NAME} letters, digits, '-' or '.' ([cluster] host_name or \
         ${HOST_NAME_ENV})"
    )]
    BadHostName {
        /// The name given.
        name: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A peer's URL is not `http(s)://host[:port]`.
    #[error("[cluster] peer {name}: {url:?} is not an http:// or https:// base URL")]
    BadPeerUrl {
        /// The peer.
        name: String,
        /// Its URL.
        url: String,
    },
    /// The HTTP client cannot be made.
    #[error("cannot make the HTTP client for peers: {0}")]
    Client(String),
    /// A new MCP session would be one more than `max_sessions`.
    #[error(
        "this server has {max} MCP sessions open, as many as its max_sessions allows: end sessions you no longer \
         use (DELETE /mcp with their Mcp-Session-Id header; a session also ends after {idle_secs} s without a \
         request), or raise max_sessions in the server's configuration"
    )]
    TooManySessions {
        /// The cap.
        max: usize,
        /// After how long without a request a session ends (s).
        idle_secs: u64,
    },
    /// rmcp's session error (an unknown session, a session that ended).
    #[error(transparent)]
    Session(#[from] LocalSessionManagerError),
}

/// `raw` as a host name: lowercased, `.` turned into `-`.
///
/// Errors: [`ClusterError::BadHostName`] for an empty or too long name, or
/// one with other characters or a `-` at either end.
pub fn host_name(raw: &str) -> Result<String, ClusterError> {
    let bad = |reason| ClusterError::BadHostName { name: raw.to_string(), reason };
    let name: String = raw.trim().to_ascii_lowercase().replace('.', "-");
    if name.is_empty() {
        return Err(bad("it is empty"));
    }
    if name.len() > MAX_HOST_NAME {
        return Err(bad("it is too long"));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Err(bad("it has characters other than letters, digits, '-' and '.'"));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(bad("it starts or ends with '-' or '.'"));
    }
    Ok(name)
}

/// The system's host name (gethostname(2)), its first label made into a
/// host name (other characters become `-`); `"tine"` when it has none.
pub fn system_host_name() -> String {
    let raw = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_default();
    let first = raw.split('.').next().unwrap_or_default();
    let mut name: String = first
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .take(MAX_HOST_NAME)
        .collect();
    name = name.trim_matches('-').to_string();
    if name.is_empty() {
        "tine".into()
    } else {
        name
    }
}

/// Whether `h` is a host name as [`host_name`] makes them: ids come from
/// clients, and the name may go into a peer's URL ([`ClusterConfig::peer_url`]).
fn is_host_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= MAX_HOST_NAME
        && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !h.starts_with('-')
        && !h.ends_with('-')
}

/// The host a sandbox or process id names: `sb-<host>-<n>[:p<m>]` gives
/// `<host>`; `None` for an id without one (`sb-3`), not of that shape, or
/// whose host part is not a host name.
pub fn host_of(id: &str) -> Option<&str> {
    let sandbox = id.split_once(':').map_or(id, |(s, _)| s);
    let (host, n) = sandbox.strip_prefix("sb-")?.rsplit_once('-')?;
    (is_host_name(host) && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(host)
}

/// The sandbox and process ids a tool call's arguments name (by
/// [`ID_ARGUMENTS`]).
pub fn named_ids(args: Option<&JsonObject>) -> impl Iterator<Item = &str> {
    ID_ARGUMENTS.iter().filter_map(move |key| args.and_then(|a| a.get(*key)).and_then(|v| v.as_str()))
}

/// The host a session id names: `<host>.<uuid>` gives `<host>` (`None`
/// when that part is not a host name).
pub fn session_host(session_id: &str) -> Option<&str> {
    session_id.split_once('.').map(|(h, _)| h).filter(|h| is_host_name(h))
}

/// Where a tool call runs.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// On this host.
    Local,
    /// On the named peer, at this base URL.
    Forward {
        /// The peer's name.
        host: String,
        /// Its base URL.
        url: String,
    },
}

/// This host and how it reaches the others.
pub struct Cluster {
    host: String,
    peers: BTreeMap<String, String>,
    peer_url: Option<String>,
    /// The key this host presents to peers (`None`: `--dev`).
    peer_key: Option<String>,
    http: reqwest::Client,
    /// MCP sessions with peers for forwarded tool calls, by peer name and
    /// the principal they act for.
    /// Each peer's slot is locked while its session is made, so a peer
    /// that is slow to answer holds up only calls to itself.
    clients: std::sync::Mutex<BTreeMap<(String, String), Arc<PeerClient>>>,
    /// Forwarded calls by peer and outcome, for `/metrics`.
    pub(crate) forwarded: crate::metrics::Forwarded,
}

impl Cluster {
    /// This host as `config` names it (see [`ClusterConfig::host_name`]);
    /// `peer_key` authenticates its requests to peers.
    ///
    /// Errors: [`ClusterError`] for a bad name or peer URL.
    pub fn new(config: &ClusterConfig, peer_key: Option<String>) -> Result<Self, ClusterError> {
        let host = match config.host_name.clone().or_else(|| std::env::var(HOST_NAME_ENV).ok()) {
            Some(raw) if !raw.trim().is_empty() => host_name(&raw)?,
            _ => system_host_name(),
        };
        let mut peers = BTreeMap::new();
        for (name, url) in &config.peers {
            let url = url.trim_end_matches('/').to_string();
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ClusterError::BadPeerUrl { name: name.clone(), url });
            }
            peers.insert(host_name(name)?, url);
        }
        if let Some(t) = &config.peer_url {
            if !(t.starts_with("http://") || t.starts_with("https://")) || !t.contains("{host}") {
                return Err(ClusterError::BadPeerUrl { name: "peer_url".into(), url: t.clone() });
            }
        }
        let http = reqwest::Client::builder()
            .connect_timeout(PEER_CONNECT_TIMEOUT)
            // A peer's redirect could send the peer key elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ClusterError::Client(e.to_string()))?;
        Ok(Cluster {
            host,
            peers,
            peer_url: config.peer_url.as_ref().map(|t| t.trim_end_matches('/').to_string()),
            peer_key,
            http,
            clients: std::sync::Mutex::new(BTreeMap::new()),
            forwarded: Default::default(),
        })
    }

    /// This host's name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The host name (without port) peers use for this host through
    /// [`ClusterConfig::peer_url`], if set: the server accepts it as a
    /// `Host`, since the address is this host's own.
    pub fn own_peer_host(&self) -> Option<String> {
        let url = self.peer_url.as_ref()?.replace("{host}", &self.host);
        reqwest::Url::parse(&url).ok()?.host_str().map(str::to_string)
    }

    /// `host` as the `peer` label of the forwarded-calls metric: a peer of
    /// `peers`, or one reached through `peer_url`; a failure to reach a
    /// name only `peer_url` knows counts as `unlisted`, so that clients'
    /// made-up names do not grow the series.
    fn peer_label(&self, host: &str, ok: bool) -> String {
        if ok || self.peers.contains_key(host) {
            host.to_string()
        } else {
            "unlisted".into()
        }
    }

    /// The base URL of peer `host`, if this host can reach it.
    fn peer(&self, host: &str) -> Option<String> {
        self.peers.get(host).cloned().or_else(|| self.peer_url.as_ref().map(|t| t.replace("{host}", host)))
    }

    /// Where a call of `tool` with `args` runs: here unless its ids name
    /// another host. `forwarded_by`: the host that forwarded this call, if
    /// any (it is not forwarded again).
    ///
    /// Errors: a message for the caller, naming the host, when the ids
    /// name two hosts, a host this one cannot reach, or another host in a
    /// call that was already forwarded.
    pub fn route(&self, tool: &str, args: Option<&JsonObject>, forwarded_by: Option<&str>) -> Result<Route, String> {
        // The host of the first id named (an id without one is this
        // host's); every other id must name the same host.
        let mut named: Option<(&str, &str)> = None;
        for id in named_ids(args) {
            let host = host_of(id).unwrap_or(&self.host);
            match named {
                Some((first_host, first)) if first_host != host => {
                    return Err(format!(
                        "{tool} names sandboxes on two hosts ({first} on {first_host}, {id} on {host}); it works \
                         within one host"
                    ))
                }
                Some(_) => {}
                None => named = Some((host, id)),
            }
        }
        let Some((host, id)) = named.filter(|(h, _)| *h != self.host) else { return Ok(Route::Local) };
        if let Some(by) = forwarded_by {
            return Err(format!(
                "{id} is on host {host}, not on {} (which got this call forwarded from {by}); a call is forwarded \
                 once at most: check the hosts' [cluster] peers",
                self.host
            ));
        }
        match self.peer(host) {
            Some(url) => Ok(Route::Forward { host: host.to_string(), url }),
            None => Err(format!(
                "{id} is on host {host}; this is host {}, which has no address for {host} ([cluster] peers or \
                 peer_url): call {host}'s endpoint, or connect through the load balancer",
                self.host
            )),
        }
    }

    /// Calls `request` on peer `host` at `url` over this host's MCP
    /// session with it (made on first use, made again once if it broke),
    /// marked as forwarded by this host.
    ///
    /// Errors: a message naming the peer when it cannot be reached or the
    /// call fails at the protocol level (a tool error is a result).
    pub async fn forward(
        &self,
        host: &str,
        url: &str,
        request: CallToolRequestParams,
        caller: &Principal,
    ) -> Result<CallToolResult, String> {
        let result = self.forward_once((host, url), request.clone(), caller, false).await;
        let result = match result {
            Err(_) => self.forward_once((host, url), request, caller, true).await,
            ok => ok,
        };
        self.forwarded.observe(&self.peer_label(host, result.is_ok()), result.is_ok());
        result.map_err(|e| format!("host {host} ({url}) did not take the forwarded call: {e}"))
    }

    async fn forward_once(
        &self,
        (host, url): (&str, &str),
        request: CallToolRequestParams,
        caller: &Principal,
        reconnect: bool,
    ) -> Result<CallToolResult, String> {
        let slot = {
            let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            clients.entry((host.to_string(), caller.name().to_string())).or_default().clone()
        };
        let client = {
            let mut session = slot.lock().await;
            match session.as_ref() {
                Some(c) if !reconnect && !c.is_transport_closed() => c.clone(),
                _ => {
                    let c = Arc::new(self.connect(url, caller).await?);
                    *session = Some(c.clone());
                    c
                }
            }
        };
        client.call_tool(request).await.map_err(|e| e.to_string())
    }

    /// A new MCP session with the peer at `url`, acting for `caller`.
    async fn connect(&self, url: &str, caller: &Principal) -> Result<RunningService<RoleClient, ()>, String> {
        let mut config = StreamableHttpClientTransportConfig::with_uri(format!("{url}/mcp"));
        if let Some(t) = &self.peer_key {
            config = config.auth_header(t.clone());
        }
        let value = HeaderValue::from_str(&self.host).map_err(|e| e.to_string())?;
        config.custom_headers.insert(HeaderName::from_static(FORWARDED_HEADER), value);
        let tenant = HeaderValue::from_str(caller.name()).map_err(|e| e.to_string())?;
        config.custom_headers.insert(HeaderName::from_static(TENANT_HEADER), tenant);
        let transport = StreamableHttpClientTransport::with_client(self.http.clone(), config);
        tokio::time::timeout(Duration::from_secs(30), ().serve(transport))
            .await
            .map_err(|_| "no MCP initialize answer within 30 s".to_string())?
            .map_err(|e| e.to_string())
    }
}

/// This host's MCP session with one peer, made on first use.
type PeerClient = tokio::sync::Mutex<Option<Arc<RunningService<RoleClient, ()>>>>;

/// Sessions named `<host>.<uuid>`, otherwise rmcp's in-process sessions
/// ([`LocalSessionManager`]), so that any host can tell whose a session
/// is from its `Mcp-Session-Id`; at most `max` open at once. A session
/// ends on `DELETE /mcp` or after the session configuration's
/// `keep_alive` without a request (rmcp then removes it).
pub struct HostSessions {
    inner: LocalSessionManager,
    host: String,
    max: usize,
}

impl HostSessions {
    /// Sessions of `host`, configured as `inner`, at most `max` (at least
    /// 1) open at once.
    pub fn new(inner: LocalSessionManager, host: &str, max: usize) -> Self {
        HostSessions { inner, host: host.to_string(), max: max.max(1) }
    }

    /// Sessions open now.
    pub async fn count(&self) -> usize {
        self.inner.sessions.read().await.len()
    }

    /// The ids of the sessions open now.
    pub async fn ids(&self) -> std::collections::HashSet<String> {
        self.inner.sessions.read().await.keys().map(|id| id.to_string()).collect()
    }

    /// Whether as many sessions as allowed are open now.
    pub async fn is_full(&self) -> bool {
        self.count().await >= self.max
    }

    /// The error of a session refused at the cap, which says what to do.
    pub fn full_error(&self) -> ClusterError {
        let idle_secs = self.inner.session_config.keep_alive.map_or(0, |d| d.as_secs());
        ClusterError::TooManySessions { max: self.max, idle_secs }
    }
}

impl SessionManager for HostSessions {
    type Error = ClusterError;
    type Transport = WorkerTransport<LocalSessionWorker>;

    /// Errors: [`ClusterError::TooManySessions`] when `max` are open.
    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        let id: SessionId = format!("{}.{}", self.host, uuid::Uuid::new_v4()).into();
        let mut sessions = self.inner.sessions.write().await;
        if sessions.len() >= self.max {
            return Err(self.full_error());
        }
        let (handle, worker) = create_local_session(id.clone(), self.inner.session_config.clone());
        sessions.insert(id.clone(), handle);
        drop(sessions);
        Ok((id, WorkerTransport::spawn(worker)))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<rmcp::model::ServerJsonRpcMessage, Self::Error> {
        Ok(self.inner.initialize_session(id, message).await?)
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        Ok(self.inner.has_session(id).await?)
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        Ok(self.inner.close_session(id).await?)
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<
        impl futures_util::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        Self::Error,
    > {
        Ok(self.inner.create_stream(id, message).await?)
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        Ok(self.inner.accept_message(id, message).await?)
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<
        impl futures_util::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        Self::Error,
    > {
        Ok(self.inner.create_standalone_stream(id).await?)
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<
        impl futures_util::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        Self::Error,
    > {
        Ok(self.inner.resume(id, last_event_id).await?)
    }
}

/// Headers that belong to one connection (RFC 9110 §7.6.1) and are not
/// passed on by the proxy, with `Host` (the peer's own is sent).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// A 404 for a session this host cannot serve: the Streamable HTTP
/// transport's answer to an unknown session (MCP 2025-11-25, "Session
/// Management": the client starts a new one), with why in a JSON-RPC error.
fn session_not_here(message: String) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": -32001, "message": message},
    });
    (StatusCode::NOT_FOUND, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// Middleware before `/mcp`: a request whose `Mcp-Session-Id` names
/// another host goes to that host (once: not when it was forwarded to
/// this one), streamed both ways, its headers kept but hop-by-hop ones;
/// a session of a host this one cannot reach gets 404 saying whose it is.
pub async fn proxy_foreign_session(State(cluster): State<Arc<Cluster>>, req: Request, next: Next) -> Response {
    let Some(host) = req
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .and_then(session_host)
        .filter(|h| *h != cluster.host)
        .map(str::to_string)
    else {
        return next.run(req).await;
    };
    if let Some(by) = req.headers().get(PROXIED_HEADER).and_then(|v| v.to_str().ok()) {
        return session_not_here(format!(
            "session of host {host}, passed on here ({}) by {by}: a request is passed on once at most; check the \
             hosts' [cluster] peers",
            cluster.host
        ));
    }
    let Some(base) = cluster.peer(&host) else {
        return session_not_here(format!(
            "this session is on host {host}, and this host ({}) has no address for it ([cluster] peers or peer_url); \
             start a new session",
            cluster.host
        ));
    };
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/mcp");
    let caller = parts.extensions.get::<Principal>().cloned().unwrap_or(Principal::Admin);
    let mut headers = HeaderMap::new();
    for (name, value) in &parts.headers {
        // The caller's credential stays here; the peer key goes instead.
        if !hop_by_hop(name) && name != header::AUTHORIZATION && name.as_str() != TENANT_HEADER {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Some(key) = &cluster.peer_key {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
            headers.insert(header::AUTHORIZATION, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(caller.name()) {
        headers.insert(HeaderName::from_static(TENANT_HEADER), v);
    }
    if let Ok(v) = HeaderValue::from_str(&cluster.host) {
        headers.insert(HeaderName::from_static(PROXIED_HEADER), v);
    }
    let sent = cluster
        .http
        .request(parts.method.clone(), format!("{base}{path}"))
        .headers(headers)
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            cluster.forwarded.observe(&cluster.peer_label(&host, false), false);
            tracing::warn!("session of host {host}: {base} does not answer: {e}");
            return session_not_here(format!(
                "this session is on host {host}, which does not answer ({e}); its sandboxes are gone with it: start \
                 a new session"
            ));
        }
    };
    cluster.forwarded.observe(&host, true);
    let mut out = Response::builder().status(resp.status());
    for (name, value) in resp.headers() {
        if !hop_by_hop(name) {
            out = out.header(name, value);
        }
    }
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    out.body(Body::from_stream(stream)).unwrap_or_else(|e| {
        tracing::warn!("session of host {host}: bad answer from {base}: {e}");
        StatusCode::BAD_GATEWAY.into_response()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(peers: &[(&str, &str)], peer_url: Option<&str>) -> Cluster {
        let config = ClusterConfig {
            host_name: Some("h1".into()),
            peers: peers.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            peer_url: peer_url.map(str::to_string),
            peer_key_file: None,
        };
        Cluster::new(&config, None).unwrap()
    }

    fn args(pairs: &[(&str, &str)]) -> JsonObject {
        pairs.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect()
    }

    #[test]
    fn host_names_are_checked_and_normalized() {
        assert_eq!(host_name("Node-7.example.com").unwrap(), "node-7-example-com");
        assert_eq!(host_name("10.1.2.3").unwrap(), "10-1-2-3");
        for bad in ["", "-a", "a-", "a_b", "a/b", "é", &"a".repeat(MAX_HOST_NAME + 1)] {
            let e = host_name(bad).unwrap_err();
            assert!(e.to_string().contains("host_name"), "{bad:?}: {e}");
        }
        let sys = system_host_name();
        assert_eq!(host_name(&sys).unwrap(), sys, "the system's name is usable as it is");
    }

    #[test]
    fn ids_name_their_host() {
        assert_eq!(host_of("sb-h2-17"), Some("h2"));
        assert_eq!(host_of("sb-node-7-17:p3"), Some("node-7"));
        assert_eq!(host_of("sb-17"), None);
        assert_eq!(host_of("sb-h2-x"), None);
        assert_eq!(host_of("default"), None);
        // Client-supplied ids cannot point a peer URL elsewhere.
        for evil in ["sb-evil.com/x-1", "sb-a@b-1", "sb-A-1", "sb--1", "sb-a:b-1"] {
            assert_eq!(host_of(evil), None, "{evil}");
        }
        assert_eq!(session_host("evil.com/x.0f7c"), Some("evil"));
        assert_eq!(session_host("a/b.0f7c"), None);
        assert_eq!(session_host("http://x.0f7c"), None);
        assert_eq!(session_host("h2.0f7c"), Some("h2"));
        assert_eq!(session_host("0f7c"), None);
    }

    #[test]
    fn calls_route_by_the_hosts_their_ids_name() {
        let c = cluster(&[("h2", "http://10.0.0.2:5555/")], None);
        assert_eq!(c.route("sandbox_exec", None, None), Ok(Route::Local));
        assert_eq!(c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h1-3")])), None), Ok(Route::Local));
        assert_eq!(
            c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h2-3")])), None),
            Ok(Route::Forward { host: "h2".into(), url: "http://10.0.0.2:5555".into() })
        );
        assert_eq!(
            c.route("sandbox_process_wait", Some(&args(&[("process_id", "sb-h2-3:p1")])), None),
            Ok(Route::Forward { host: "h2".into(), url: "http://10.0.0.2:5555".into() })
        );
        let e = c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h3-3")])), None).unwrap_err();
        assert!(e.contains("sb-h3-3 is on host h3; this is host h1, which has no address for h3"), "{e}");
        let e = c.route("sandbox_diff", Some(&args(&[("a", "sb-h1-1"), ("b", "sb-h2-2")])), None).unwrap_err();
        assert!(e.contains("two hosts") && e.contains("sb-h2-2 on h2"), "{e}");
        let e = c.route("sandbox_exec", Some(&args(&[("sandbox_id", "sb-h2-3")])), Some("h3")).unwrap_err();
        assert!(e.contains("forwarded once at most") && e.contains("from h3"), "{e}");
        assert_eq!(c.own_peer_host(), None);
        let t = cluster(&[], Some("http://{host}.peers:5555"));
        assert_eq!(t.own_peer_host().as_deref(), Some("h1.peers"));
        assert_eq!(
            t.route("sandbox_kill", Some(&args(&[("sandbox_id", "sb-h9-1")])), None),
            Ok(Route::Forward { host: "h9".into(), url: "http://h9.peers:5555".into() })
        );
    }

    #[tokio::test]
    async fn sessions_past_the_cap_are_not_made() {
        let mut local = LocalSessionManager::default();
        local.session_config.keep_alive = Some(Duration::from_secs(30));
        let sessions = HostSessions::new(local, "h1", 2);
        let (a, _ta) = sessions.create_session().await.unwrap();
        assert!(a.starts_with("h1."), "{a}");
        let _b = sessions.create_session().await.unwrap();
        assert!(sessions.is_full().await);
        let e = sessions.create_session().await.err().expect("a third is refused");
        assert!(matches!(e, ClusterError::TooManySessions { max: 2, idle_secs: 30 }), "{e}");
        assert_eq!(sessions.count().await, 2);
        sessions.close_session(&a).await.unwrap();
        assert!(!sessions.is_full().await);
        sessions.create_session().await.expect("a place came free");
    }

    #[test]
    fn bad_peers_are_refused() {
        let config =
            ClusterConfig { peers: BTreeMap::from([("h2".into(), "10.0.0.2:5555".into())]), ..Default::default() };
        assert!(matches!(Cluster::new(&config, None), Err(ClusterError::BadPeerUrl { .. })));
        let config = ClusterConfig { peer_url: Some("http://peers:5555".into()), ..Default::default() };
        assert!(matches!(Cluster::new(&config, None), Err(ClusterError::BadPeerUrl { .. })));
    }
}
