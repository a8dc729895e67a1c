//! Who a request acts as: the only place a credential is read.
//!
//! Every request to `/mcp` and `/metrics` passes [`authenticate`], which
//! puts the caller's [`Principal`] into the request's extensions (or
//! answers 401 with `WWW-Authenticate: Bearer`, RFC 6750 §3):
//!
//! - the operator's token (`token_file`, `$TINE_TOKEN`, the systemd
//!   credential) is [`Principal::Admin`], which sees and may change every
//!   object;
//! - a tenant's API key (`tine tenant add`, [`tenants`]) is that
//!   [`Principal::Tenant`], which sees only its own sandboxes, templates,
//!   processes and URLs;
//! - the peer key (`[cluster] peer_key_file`; a host without one accepts
//!   the operator's token in its place but sends peers nothing) is a peer
//!   host passing on a call: it acts as the principal
//!   named by [`TENANT_HEADER`] (none: the operator). The header counts on
//!   no other request;
//! - with `[auth.oauth]`, any other credential shaped as a JWT is an OAuth
//!   access token of the operator's authorization server, checked by
//!   [`oauth::Verifier`]: it acts as the tenant its tenant claim names
//!   (never the operator), and 401s then name the protected resource
//!   metadata (RFC 9728 §5.1).
//!
//! `--dev` has no credentials: every request is the operator's.
//!
//! A session is bound to the principal that opened it ([`sessions`]).

pub mod oauth;
pub mod sessions;
pub mod tenants;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tine_sandbox::Quota;

use tenants::{Roster, Tenant, TenantsError, TenantsFile};

/// The header with which a peer host names the tenant it passes a call on
/// for (`admin`, or absent: the operator). Believed only on a request
/// that carries the peer key.
pub const TENANT_HEADER: &str = "x-tine-tenant";
/// How often the tenants file is checked for a change.
const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// Who a request acts as.
#[derive(Clone, Debug)]
pub enum Principal {
    /// The operator: every object, every tenant's included.
    Admin,
    /// A tenant: its own objects and the server's templates.
    Tenant(Arc<Tenant>),
}

impl Principal {
    /// The tenant's name; `None` for the operator.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Admin => None,
            Principal::Tenant(t) => Some(&t.name),
        }
    }

    /// Whether it may see and act on an object of tenant `owner` (`None`:
    /// the server's own, which only the operator may).
    pub fn owns(&self, owner: Option<&str>) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Tenant(t) => owner == Some(t.name.as_str()),
        }
    }

    /// Its name in logs, metrics and session bindings: the tenant's name,
    /// or [`tenants::ADMIN`].
    pub fn name(&self) -> &str {
        self.tenant().unwrap_or(tenants::ADMIN)
    }

    /// Its quota (`None`: the operator, bound by the server's limits only).
    pub fn quota(&self) -> Option<Arc<Quota>> {
        match self {
            Principal::Admin => None,
            Principal::Tenant(t) => Some(t.quota.clone()),
        }
    }
}

/// Errors of authentication and of reading the tenants file.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("send Authorization: Bearer <key> (a tenant's API key from `tine tenant add`, or the operator's token)")]
    Missing,
    /// A credential that is no one's.
    #[error("the bearer credential is not valid here (a rotated or removed key?)")]
    Invalid,
    /// The tenants file cannot be used.
    #[error(transparent)]
    Tenants(#[from] TenantsError),
    /// An OAuth access token refused, or `[auth.oauth]` that cannot be used.
    #[error(transparent)]
    OAuth(#[from] oauth::OAuthError),
}

/// What [`Auth`] is made from.
pub struct AuthConfig {
    /// The operator's token (`None`: `--dev`, no authentication).
    pub admin_token: Option<String>,
    /// The key peers present (`None`: the operator's token).
    pub peer_key: Option<String>,
    /// The tenants file ([`tenants`]).
    pub tenants_file: PathBuf,
    /// Every tenant's quota unless the file says otherwise (`[limits.tenant]`).
    pub default_quota: Quota,
    /// `[auth.oauth]`: OAuth access tokens accepted too ([`oauth`]).
    pub oauth: Option<oauth::OAuthConfig>,
}

/// A file's identity and change time, to tell when it was replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: Option<SystemTime>,
}

fn stamp(path: &std::path::Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp { dev: m.dev(), ino: m.ino(), len: m.len(), mtime: m.modified().ok() })
}

/// The server's credentials: the operator's token, the peer key and the
/// tenants, read again when their file changes.
pub struct Auth {
    admin_token: Option<String>,
    peer_key: Option<String>,
    tenants_file: PathBuf,
    default_quota: Quota,
    roster: RwLock<Arc<Roster>>,
    stamp: Mutex<Option<Stamp>>,
    changed: tokio::sync::watch::Sender<Arc<Roster>>,
    oauth: Option<oauth::Verifier>,
    /// Tenants made from OAuth tokens (`create_tenants = true`), by name.
    created: Mutex<HashMap<String, Arc<Tenant>>>,
}

impl Auth {
    /// The credentials of `config`, the tenants file read now.
    ///
    /// Errors: [`AuthError::Tenants`] for a tenants file that cannot be
    /// read or is not one (a server does not start on a broken file; it
    /// keeps its last good roster when the file breaks later);
    /// [`AuthError::OAuth`] for `[auth.oauth]` that cannot be used
    /// ([`oauth::Verifier::new`]).
    pub fn new(config: AuthConfig) -> Result<Self, AuthError> {
        let st = stamp(&config.tenants_file);
        let file = TenantsFile::load(&config.tenants_file)?;
        let roster = Arc::new(Roster::new(&file, &config.default_quota));
        let oauth = config.oauth.map(oauth::Verifier::new).transpose()?;
        Ok(Auth {
            admin_token: config.admin_token,
            peer_key: config.peer_key,
            tenants_file: config.tenants_file,
            default_quota: config.default_quota,
            roster: RwLock::new(roster.clone()),
            stamp: Mutex::new(st),
            changed: tokio::sync::watch::channel(roster).0,
            oauth,
            created: Mutex::new(HashMap::new()),
        })
    }

    /// The OAuth verifier (`None`: no `[auth.oauth]`).
    pub fn oauth(&self) -> Option<&oauth::Verifier> {
        self.oauth.as_ref()
    }

    /// Live tenant `name`: of the tenants file, else one made from an
    /// OAuth token before. `None` for a name of neither.
    pub fn tenant_by_name(&self, name: &str) -> Option<Arc<Tenant>> {
        self.roster().by_name(name).or_else(|| self.lock_created().get(name).cloned())
    }

    fn lock_created(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Tenant>>> {
        self.created.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The tenant an OAuth token or a peer names: of the tenants file;
    /// else, with `create_tenants = true`, one of that name with the
    /// default quota, made now if need be and kept in memory.
    ///
    /// Errors: [`oauth::OAuthError::UnknownTenant`] (also for a name that
    /// cannot be a tenant's, `admin` included),
    /// [`oauth::OAuthError::RemovedTenant`],
    /// [`oauth::OAuthError::TooManyTenants`].
    fn named_tenant(&self, name: &str) -> Result<Arc<Tenant>, oauth::OAuthError> {
        use oauth::OAuthError as E;
        let roster = self.roster();
        if let Some(t) = roster.by_name(name) {
            return Ok(t);
        }
        if roster.removed.iter().any(|r| r == name) {
            return Err(E::RemovedTenant(name.to_string()));
        }
        let create = self.oauth.as_ref().is_some_and(|o| o.config().create_tenants);
        if !create || tenants::check_name(name).is_err() {
            return Err(E::UnknownTenant(name.to_string()));
        }
        let mut created = self.lock_created();
        if let Some(t) = created.get(name) {
            return Ok(t.clone());
        }
        if created.len() >= oauth::MAX_CREATED_TENANTS {
            return Err(E::TooManyTenants(name.to_string()));
        }
        let t = Arc::new(Tenant {
            name: name.to_string(),
            key_sha256: String::new(),
            quota: Arc::new(self.default_quota.clone()),
            ceiling: None,
            public_previews: None,
            publish_ports: None,
        });
        created.insert(name.to_string(), t.clone());
        crate::audit::change("tenant made from an OAuth token (create_tenants)", name);
        Ok(t)
    }

    /// Whether requests need a credential (not `--dev`).
    pub fn required(&self) -> bool {
        self.admin_token.is_some()
    }

    /// The tenants now.
    pub fn roster(&self) -> Arc<Roster> {
        self.roster.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Follows the roster: a new one each time the file is read again.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Arc<Roster>> {
        self.changed.subscribe()
    }

    /// The key this host presents to its peers: `[cluster] peer_key_file`'s
    /// (`None` without one, and under `--dev`). Never the operator's token,
    /// which stays on this host.
    pub fn peer_key(&self) -> Option<&str> {
        self.peer_key.as_deref()
    }

    /// What a file URL of a sandbox of `tenant` is signed over besides its
    /// own fields ([`crate::files_url`]): the tenant and the SHA-256 of its
    /// key now, so that a new key or the tenant's removal ends its URLs;
    /// empty for the server's own sandboxes.
    pub fn url_grant(&self, tenant: Option<&str>) -> String {
        match tenant {
            None => String::new(),
            Some(t) => match self.tenant_by_name(t) {
                Some(live) => format!("{t}:{}", live.key_sha256),
                None => format!("{t}:removed"),
            },
        }
    }

    /// Who `headers` (`Authorization: Bearer ...`, RFC 6750 §2.1) act as,
    /// by the operator's token, the peer key or a tenant's API key (not
    /// OAuth tokens: [`Auth::authenticate_request`]).
    ///
    /// Errors: [`AuthError::Missing`], [`AuthError::Invalid`].
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, AuthError> {
        let Some(admin) = &self.admin_token else { return Ok(Principal::Admin) };
        let given = bearer(headers).ok_or(AuthError::Missing)?;
        let peer = self.peer_key.as_deref().unwrap_or(admin);
        if bool::from(given.as_bytes().ct_eq(peer.as_bytes())) {
            return match headers.get(TENANT_HEADER).and_then(|v| v.to_str().ok()) {
                None | Some(tenants::ADMIN) => Ok(Principal::Admin),
                Some(name) => self.named_tenant(name).map(Principal::Tenant).map_err(|_| AuthError::Invalid),
            };
        }
        if bool::from(given.as_bytes().ct_eq(admin.as_bytes())) {
            return Ok(Principal::Admin);
        }
        self.roster().by_key(given).map(Principal::Tenant).ok_or(AuthError::Invalid)
    }

    /// Who `headers` act as: [`Auth::authenticate`], then, with
    /// `[auth.oauth]`, a bearer token shaped as a JWT checked as an OAuth
    /// access token ([`oauth::Verifier::verify`], which may fetch the
    /// issuer's keys) and mapped to the tenant it names.
    ///
    /// Errors: [`AuthError::Missing`], [`AuthError::Invalid`],
    /// [`AuthError::OAuth`] saying why a token was refused.
    pub async fn authenticate_request(&self, headers: &HeaderMap) -> Result<Principal, AuthError> {
        let err = match self.authenticate(headers) {
            Err(AuthError::Invalid) => AuthError::Invalid,
            other => return other,
        };
        let (Some(verifier), Some(token)) = (self.oauth.as_ref(), bearer(headers)) else { return Err(err) };
        if !oauth::looks_like_jwt(token) {
            return Err(err);
        }
        let verified = verifier.verify(token).await?;
        let tenant = self.named_tenant(&verified.tenant)?;
        tracing::debug!(tenant = %tenant.name, sub = verified.subject.as_deref().unwrap_or(""), "OAuth token accepted");
        Ok(Principal::Tenant(tenant))
    }

    /// Fetches the OAuth issuer's keys now and every
    /// [`oauth::JWKS_REFRESH_EVERY`] (key rotation); errors are logged
    /// (call in a Tokio runtime). `None` without `[auth.oauth]`.
    pub fn spawn_oauth_refresh(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        self.oauth.as_ref()?;
        let me = self.clone();
        Some(tokio::spawn(async move {
            let Some(verifier) = me.oauth.as_ref() else { return };
            loop {
                match verifier.refresh().await {
                    Ok(()) => {}
                    Err(e) => tracing::warn!("OAuth: {e}; tokens are refused until the issuer's keys can be had"),
                }
                tokio::time::sleep(oauth::JWKS_REFRESH_EVERY).await;
            }
        }))
    }

    /// The answer to a request refused with `e`: 401 with the challenge RFC
    /// 6750 §3 asks for (naming the protected resource metadata with
    /// `[auth.oauth]`, RFC 9728 §5.1), or 503 when the OAuth issuer's keys
    /// cannot be had.
    pub fn unauthorized(&self, e: &AuthError) -> Response {
        let invalid = !matches!(e, AuthError::Missing);
        if matches!(e, AuthError::OAuth(o) if o.unavailable()) {
            let body = serde_json::json!({"error": "unavailable", "message": e.to_string()}).to_string();
            let mut resp =
                (StatusCode::SERVICE_UNAVAILABLE, [(header::CONTENT_TYPE, "application/json")], body).into_response();
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
            return resp;
        }
        let body = serde_json::json!({"error": "unauthorized", "message": e.to_string()}).to_string();
        let challenge = match &self.oauth {
            Some(v) => HeaderValue::from_str(&v.challenge(invalid)).ok(),
            None => None,
        };
        let challenge = challenge.unwrap_or_else(|| {
            HeaderValue::from_static(if invalid {
                r#"Bearer realm="tine", error="invalid_token""#
            } else {
                r#"Bearer realm="tine""#
            })
        });
        let mut resp = (StatusCode::UNAUTHORIZED, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        resp.headers_mut().insert(header::WWW_AUTHENTICATE, challenge);
        resp
    }

    /// Reads the tenants file again if it changed since the last read
    /// (another inode, size or change time). Returns whether it did; a
    /// broken file leaves the roster as it was.
    ///
    /// Errors: [`TenantsError`] of a changed file that cannot be used.
    pub fn reload(&self, force: bool) -> Result<bool, TenantsError> {
        let now = stamp(&self.tenants_file);
        {
            let mut last = self.stamp.lock().unwrap_or_else(|p| p.into_inner());
            if !force && *last == now {
                return Ok(false);
            }
            *last = now;
        }
        let file = TenantsFile::load(&self.tenants_file)?;
        let roster = Arc::new(Roster::new(&file, &self.default_quota));
        *self.roster.write().unwrap_or_else(|p| p.into_inner()) = roster.clone();
        self.changed.send_replace(roster);
        Ok(true)
    }

    /// Reads the tenants file again every [`RELOAD_EVERY`] when it changed,
    /// and on SIGHUP; errors are logged (call in a Tokio runtime).
    pub fn spawn_reload(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let mut hup = signal(SignalKind::hangup()).ok();
            loop {
                let force = tokio::select! {
                    _ = tokio::time::sleep(RELOAD_EVERY) => false,
                    Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
                };
                match me.reload(force) {
                    Ok(true) => tracing::info!(
                        file = %me.tenants_file.display(),
                        tenants = me.roster().names().count(),
                        "tenants read again"
                    ),
                    Ok(false) => {}
                    Err(e) => tracing::error!("{e}; the tenants read before stay in force"),
                }
            }
        })
    }
}

/// A new random token: 32 bytes from the kernel's CSPRNG, as 64 hex
/// digits (the operator's token from `tine server keygen`, and the body of
/// tenants' API keys).
///
/// Errors: reading `/dev/urandom`.
pub fn new_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The token of `Authorization: Bearer <token>` (RFC 6750 §2.1; the
/// scheme's case is not significant, RFC 9110 §11.1).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// The middleware: puts the request's [`Principal`] into its extensions,
/// or answers as [`Auth::unauthorized`] says (401 with `WWW-Authenticate:
/// Bearer`, RFC 6750 §3 and RFC 9728 §5.1).
pub async fn authenticate(State(auth): State<Arc<Auth>>, mut req: Request, next: Next) -> Response {
    match auth.authenticate_request(req.headers()).await {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(e) => {
            if let AuthError::OAuth(o) = &e {
                tracing::debug!("bearer token refused: {o}");
            }
            auth.unauthorized(&e)
        }
    }
}

/// `GET /.well-known/oauth-protected-resource[/mcp]`: the protected
/// resource metadata (RFC 9728 §3.2, 200 with JSON), open to anyone; 404
/// without `[auth.oauth]`.
pub async fn resource_metadata(State(auth): State<Arc<Auth>>) -> Response {
    match &auth.oauth {
        Some(v) => ([(header::CONTENT_TYPE, "application/json")], v.metadata().to_string()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_credential_gives_its_principal_and_the_tenant_header_counts_only_with_the_peer_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        let mut file = TenantsFile::default();
        let key = file.add("acme", Default::default(), &path).unwrap();
        file.save(&path).unwrap();
        let auth = Auth::new(AuthConfig {
            admin_token: Some("admin-token".into()),
            peer_key: Some("peer-key".into()),
            tenants_file: path.clone(),
            default_quota: Quota::default(),
            oauth: None,
        })
        .unwrap();
        let who = |h: &[(&str, &str)]| auth.authenticate(&headers(h)).map(|p| p.name().to_string());
        assert!(matches!(auth.authenticate(&HeaderMap::new()), Err(AuthError::Missing)));
        assert_eq!(who(&[("authorization", "Bearer admin-token")]).unwrap(), "admin");
        assert_eq!(who(&[("authorization", &format!("bearer {key}"))]).unwrap(), "acme");
        assert!(matches!(who(&[("authorization", "Bearer nope")]), Err(AuthError::Invalid)));
        // A tenant cannot name another principal; the peer key can.
        let as_admin = [("authorization", &*format!("Bearer {key}")), (TENANT_HEADER, "admin")];
        assert_eq!(who(&as_admin).unwrap(), "acme");
        assert_eq!(who(&[("authorization", "Bearer peer-key"), (TENANT_HEADER, "acme")]).unwrap(), "acme");
        assert_eq!(who(&[("authorization", "Bearer peer-key")]).unwrap(), "admin");
        assert!(who(&[("authorization", "Bearer peer-key"), (TENANT_HEADER, "ghost")]).is_err());

        // A new key works once the file is read again; the old one ends.
        let new = file.rotate("acme", &path).unwrap();
        file.save(&path).unwrap();
        assert!(auth.reload(false).unwrap(), "the file changed");
        assert!(!auth.reload(false).unwrap(), "and not again");
        assert!(who(&[("authorization", &format!("Bearer {key}"))]).is_err());
        assert_eq!(who(&[("authorization", &format!("Bearer {new}"))]).unwrap(), "acme");
        // A broken file keeps the roster in force.
        std::fs::write(&path, "not toml [").unwrap();
        assert!(auth.reload(true).is_err());
        assert_eq!(who(&[("authorization", &format!("Bearer {new}"))]).unwrap(), "acme");
    }
}
