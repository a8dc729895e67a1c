//! Preview URLs: a URL on this server that reaches a port inside a
//! sandbox's guest, for a person to open in a browser (a web app, a
//! notebook, an API the agent started).
//!
//! `sandbox_preview_url` makes a [`Preview`] (a 12-character id naming
//! sandbox, port, tenant, whether it is public, and its expiry; kept in
//! the data directory, [`store`]) and answers one of two URL forms, both
//! served by the MCP listener:
//!
//! - host-based, `<scheme>://<id>.<domain>[:port]/...`, where
//!   `[preview] domain` is set (the operator's wildcard DNS name and
//!   certificate), or `http://<id>.localhost:<port>/` under `--dev`
//!   (browsers resolve `*.localhost` to loopback, RFC 6761 §6.3). A URL
//!   that is not public carries a token (`?tine_preview_token=...`) that
//!   the first request exchanges for an HttpOnly, SameSite=Lax, `__Host-`
//!   cookie of that host ([`COOKIE`]; a `303` to the same URL without the
//!   token), so the token leaves the address bar and never reaches the
//!   guest; a guest's own cookies lose their `Domain` (all previews are
//!   one site);
//! - path-based, `<public_url>/preview/<id>[.<token>]/...`, off unless
//!   `[preview] path_urls = true`: every path-based preview shares the
//!   server's origin, so no cookie is set (the guest's are taken out, and
//!   its `Service-Worker-Allowed`); the token is part of the path and so
//!   of every relative URL the page uses. Apps that use absolute paths
//!   (`/static/app.js`) break under it. One origin for every sandbox's
//!   pages (their storage, their scripts) suits a single-tenant server.
//!
//! Tokens ([`token`]) are HMAC-SHA256 (RFC 2104) under a key kept in the
//! data directory, over the preview id, sandbox, port, expiry and the
//! tenant's grant ([`crate::auth::Auth::url_grant`]): a token of another
//! preview, sandbox or tenant, an expired one, or one made before the
//! tenant's key was rotated is refused (401); a revoked or unknown preview
//! is 404. The request then goes to the guest ([`proxy`]): HTTP/1.1 over a
//! connection the sandbox's network opens into the guest's port
//! (`tine_sandbox::Manager::connect_port`, which wakes a hibernated
//! sandbox and counts as activity), bodies streamed both ways within
//! `[preview]`'s size limits, WebSocket and other upgrades spliced,
//! `X-Forwarded-*` added and `Host` optionally rewritten to
//! `localhost:<port>`. A guest with nothing on the port gives a 502 page
//! naming it.
//!
//! In a cluster the first two characters of a preview id name the host
//! that made it ([`store::host_tag`]); a request for a preview of another
//! host is passed to that host whole, WebSockets included ([`peer`]), once.
//!
//! [`dispatch`] is the middleware that sees every request first and takes
//! those for a preview; everything else goes on to the MCP routes.

pub mod peer;
pub mod proxy;
pub mod store;
pub mod token;
pub mod upstream;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use serde::Deserialize;
use tine_sandbox::Manager;

pub use store::{Preview, PreviewStore};

/// Default lifetime of a preview (s): 24 h.
pub const DEFAULT_TTL_SECS: u64 = 86_400;
/// Longest lifetime of a preview (s): 30 days.
pub const MAX_TTL_SECS: u64 = 30 * 86_400;
/// Previews one sandbox may have at once.
pub const MAX_PER_SANDBOX: usize = 16;
/// The query parameter a host-based URL carries its token in.
pub const TOKEN_PARAM: &str = "tine_preview_token";
/// The cookie a host-based preview's token is kept in: a `__Host-` one
/// (RFC 6265bis §4.1.3.2), which another preview's host cannot set or
/// shadow.
pub const COOKIE: &str = "__Host-tine_preview";
/// The cookie's name before it was a `__Host-` one: no longer read (a
/// sibling host could plant it), still taken out before the guest.
pub const OLD_COOKIE: &str = "tine_preview";
/// The path prefix of path-based URLs.
pub const PATH_PREFIX: &str = "/preview/";

/// `[preview]` in the configuration file.
///
/// ```toml
/// [preview]
/// domain = "preview.example.com"   # URLs https://<id>.preview.example.com/ (wildcard DNS and TLS: yours)
/// scheme = "https"                 # of host-based URLs (default https; http under --dev)
/// port = 443                       # in host-based URLs (default: none, the scheme's)
/// path_urls = false                # also serve <public_url>/preview/<id>/ (one origin for all: no cookies)
/// public = true                    # allow URLs without a token
/// rewrite_host = true              # the guest sees Host: localhost:<port>
/// max_request_mib = 1024           # request bodies through a preview, at most
/// max_response_mib = 4096          # response bodies, at most
/// wake_timeout_secs = 60           # a hibernated sandbox has this long to wake for a request
/// max_guest_connections = 32       # requests in flight to one sandbox port; more wait
/// ```
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct PreviewConfig {
    /// The DNS name under which preview hosts are `<id>.<domain>`; `None`:
    /// no host-based URLs (except `<id>.localhost` under `--dev`).
    pub domain: Option<String>,
    /// Scheme of host-based URLs (`https` unless `--dev`).
    pub scheme: Option<String>,
    /// Port in host-based URLs (`None`: the scheme's; under `--dev` the
    /// listen port).
    pub port: Option<u16>,
    /// Serve path-based URLs, `/preview/<id>/`.
    pub path_urls: bool,
    /// Allow public URLs (no token).
    pub public: bool,
    /// Rewrite `Host` to `localhost:<port>` (many dev servers refuse
    /// other names); the original is in `X-Forwarded-Host`.
    pub rewrite_host: bool,
    /// Largest request body (MiB).
    pub max_request_mib: u64,
    /// Largest response body (MiB); a longer one is cut off.
    pub max_response_mib: u64,
    /// Longest a request waits for its sandbox to wake and the guest to
    /// accept the connection, or for a place among the port's
    /// `max_guest_connections` (s).
    pub wake_timeout_secs: u64,
    /// Requests in flight to one sandbox's port at once (each on its own
    /// guest connection; WebSockets count while open); more wait.
    pub max_guest_connections: usize,
}

impl Default for PreviewConfig {
    fn default() -> Self {
        PreviewConfig {
            domain: None,
            scheme: None,
            port: None,
            path_urls: false,
            public: true,
            rewrite_host: true,
            max_request_mib: 1024,
            max_response_mib: 4096,
            wake_timeout_secs: 60,
            max_guest_connections: 32,
        }
    }
}

/// Errors of previews: making, revoking, loading.
#[derive(Debug, thiserror::Error)]
pub enum PreviewError {
    /// No URL form is on.
    #[error(
        "preview URLs are off on this server: the operator sets [preview] domain (host-based URLs) or \
         [preview] path_urls = true; until then use `tine port-forward` on the host"
    )]
    Off,
    /// Public URLs are not allowed (for this tenant, or on this server).
    #[error("public preview URLs are not allowed here (the operator's [preview] public or the tenant's public_previews): leave public false")]
    PublicOff,
    /// The form asked for is off.
    #[error("{0}-based preview URLs are off on this server; ask for the other form")]
    FormOff(&'static str),
    /// Port 0.
    #[error("port must be 1-65535")]
    BadPort,
    /// A lifetime out of range.
    #[error("ttl_secs must be 1..={MAX_TTL_SECS}, got {0}")]
    BadTtl(u64),
    /// Too many previews for one sandbox.
    #[error("sandbox {0} has {MAX_PER_SANDBOX} preview URLs: revoke some with sandbox_preview_revoke")]
    TooMany(String),
    /// No such preview (of this sandbox).
    #[error("no preview {0} of this sandbox: sandbox_preview_url makes one")]
    NotFound(String),
    /// The random source failed.
    #[error("cannot draw random bytes: {0}")]
    Random(String),
    /// The store or key file cannot be read or written.
    #[error("preview store {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store file is not what this server writes.
    #[error("preview store {path}: {message}")]
    Corrupt {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The URL forms a server serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UrlForms {
    /// Host-based: `(scheme, domain, port)`.
    pub host: Option<(String, String, Option<u16>)>,
    /// Path-based URLs are served.
    pub path: bool,
}

impl UrlForms {
    /// The forms of `config` for a server listening on `listen`: under
    /// `dev` without a domain, `http://<id>.localhost:<listen port>`.
    pub fn new(config: &PreviewConfig, dev: bool, listen: std::net::SocketAddr) -> Self {
        let host = match &config.domain {
            Some(d) => Some((
                config.scheme.clone().unwrap_or_else(|| if dev { "http" } else { "https" }.into()),
                d.trim_matches('.').to_ascii_lowercase(),
                config.port,
            )),
            None if dev => Some(("http".into(), "localhost".into(), Some(config.port.unwrap_or(listen.port())))),
            None => None,
        };
        UrlForms { host, path: config.path_urls }
    }
}

/// Everything previews need: the forms, the limits, the store and the
/// token key.
pub struct Previews {
    /// The configuration.
    pub config: PreviewConfig,
    /// The URL forms served.
    pub forms: UrlForms,
    /// The previews.
    pub store: PreviewStore,
    /// Signs and checks tokens.
    pub tokens: token::TokenKey,
}

impl Previews {
    /// The previews of host `host` kept in `data_dir` (`previews.json`,
    /// `preview.key`, made at the first start).
    ///
    /// Errors: [`PreviewError::Io`], [`PreviewError::Corrupt`],
    /// [`PreviewError::Random`].
    pub fn open(data_dir: &Path, config: PreviewConfig, forms: UrlForms, host: &str) -> Result<Self, PreviewError> {
        Ok(Previews {
            store: PreviewStore::open(&data_dir.join(store::FILE), host)?,
            tokens: token::TokenKey::open(&data_dir.join(token::KEY_FILE))?,
            config,
            forms,
        })
    }

    /// Largest request body (bytes).
    pub fn max_request_bytes(&self) -> u64 {
        self.config.max_request_mib.saturating_mul(1 << 20)
    }

    /// Largest response body (bytes).
    pub fn max_response_bytes(&self) -> u64 {
        self.config.max_response_mib.saturating_mul(1 << 20)
    }

    /// How long a request waits for its sandbox and guest.
    pub fn wake_timeout(&self) -> Duration {
        Duration::from_secs(self.config.wake_timeout_secs.max(1))
    }
}

/// The middleware's state.
#[derive(Clone)]
pub struct Dispatch {
    /// The sandboxes.
    pub manager: Arc<Manager>,
    /// The previews.
    pub previews: Arc<Previews>,
    /// The server's credentials (a tenant's grant binds its tokens).
    pub auth: Arc<crate::auth::Auth>,
    /// This host and its peers: a preview of another host is passed there.
    pub cluster: Arc<crate::cluster::Cluster>,
    /// The pooled connections into guests.
    pub upstream: Arc<upstream::Upstream>,
}

/// Takes requests for a preview (by `Host` or, where on, by path) and
/// answers them through [`proxy`]; passes every other request on.
pub async fn dispatch(State(d): State<Dispatch>, req: Request, next: Next) -> Response {
    match proxy::target(&d.previews.forms, &req) {
        Some(target) => proxy::serve(&d, target, req).await,
        None => next.run(req).await,
    }
}
