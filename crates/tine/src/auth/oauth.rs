//! OAuth 2.1 access tokens: this server as a resource server (MCP
//! 2025-06-18 / 2025-11-25 "Authorization"; RFC 9728, RFC 8707, RFC 9068).
//!
//! The authorization server is the operator's (Keycloak, Dex, Auth0...),
//! named by `[auth.oauth] issuer`. A bearer credential that is not the
//! operator's token, the peer key nor a tenant's API key, and that looks
//! like a JWT (RFC 7519: three base64url parts), is checked here:
//!
//! - its JOSE header's `alg` is one of `allowed_algs` (asymmetric only;
//!   `none` and the HMAC algorithms never), RFC 8725 §3.1 and §3.2;
//! - its signature verifies with a key of the issuer's JWK set (RFC 7517)
//!   named by its `kid` (RFC 7515 §4.1.4), of the algorithm's family and,
//!   where the key states one, of that `alg`; keys with `"use": "enc"` and
//!   symmetric keys are never used. The set comes from `jwks_uri`, else
//!   from the issuer's metadata (RFC 8414 §3, OpenID Connect Discovery 1.0
//!   §4), is fetched again every [`JWKS_REFRESH_EVERY`] (key rotation) and
//!   when a token names a key it does not have (at most once every
//!   [`JWKS_REFETCH_MIN_INTERVAL`]);
//! - `iss` is the issuer, `aud` names `resource` (RFC 8707 §2, RFC 9068
//!   §4), `exp` is in the future and `nbf` (if any) in the past, each
//!   within `leeway_secs`;
//! - the claim `tenant_claim` (default `tenant`) is a string naming a
//!   tenant of the tenants file, or with `create_tenants = true` any
//!   tenant name, which then acts as a tenant with the default quota kept
//!   in memory ([`super::Auth`]).
//!
//! The token is sent nowhere: this module only fetches the issuer's public
//! metadata and keys. `GET /.well-known/oauth-protected-resource[/mcp]`
//! serves the protected resource metadata ([`Verifier::metadata`],
//! RFC 9728 §2), and every 401 names it ([`Verifier::challenge`], RFC 9728
//! §5.1).

use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};
use reqwest::Url;
use serde::Deserialize;
use serde_json::{Map, Value};

/// The default of [`OAuthConfig::tenant_claim`].
pub const DEFAULT_TENANT_CLAIM: &str = "tenant";
/// The default of [`OAuthConfig::allowed_algs`]: RSASSA-PKCS1-v1_5 and
/// ECDSA P-256, both with SHA-256 (RFC 7518 §3.1), what Keycloak, Dex and
/// Auth0 sign with.
pub const DEFAULT_ALLOWED_ALGS: [&str; 2] = ["RS256", "ES256"];
/// The default of [`OAuthConfig::leeway_secs`] (seconds).
pub const DEFAULT_LEEWAY_SECS: u64 = 60;
/// The largest [`OAuthConfig::leeway_secs`] accepted (seconds).
pub const MAX_LEEWAY_SECS: u64 = 3600;
/// Where the protected resource metadata is served (RFC 9728 §3).
pub const METADATA_PATH: &str = "/.well-known/oauth-protected-resource";
/// How often the JWK set is fetched again whatever happens (key rotation).
pub const JWKS_REFRESH_EVERY: Duration = Duration::from_secs(300);
/// The shortest time between two fetches of the JWK set prompted by tokens
/// naming an unknown key (so such tokens cannot make this server hammer
/// the issuer).
pub const JWKS_REFETCH_MIN_INTERVAL: Duration = Duration::from_secs(10);
/// How long one request to the issuer may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest metadata document or JWK set read (bytes).
const MAX_DOCUMENT_BYTES: usize = 1 << 20;
/// The longest bearer token verified (bytes); longer ones are refused.
pub const MAX_TOKEN_BYTES: usize = 16 << 10;
/// Most tenants made from tokens (`create_tenants = true`) kept at once.
pub const MAX_CREATED_TENANTS: usize = 10_000;
/// Keys tried for a token without `kid`.
const MAX_KEYS_TRIED: usize = 8;

/// `[auth.oauth]` in the configuration file.
///
/// ```toml
/// [auth.oauth]
/// issuer = "https://keycloak.example.com/realms/tine"
/// resource = "https://tine.example.com/mcp"
/// # jwks_uri = "https://keycloak.example.com/realms/tine/protocol/openid-connect/certs"
/// tenant_claim = "tenant"
/// create_tenants = false
/// # scopes_supported = ["tine"]
/// allowed_algs = ["RS256", "ES256"]
/// leeway_secs = 60
/// ```
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct OAuthConfig {
    /// The authorization server's issuer identifier, an `https` URL
    /// without query or fragment (RFC 8414 §2); tokens' `iss` must equal it
    /// byte for byte (RFC 7519 §4.1.1).
    pub issuer: String,
    /// Where its JWK set is (RFC 7517 §5). Default: the `jwks_uri` of its
    /// metadata, `/.well-known/oauth-authorization-server` (RFC 8414 §3.1)
    /// or `/.well-known/openid-configuration` (OpenID Connect Discovery
    /// 1.0 §4).
    #[serde(default)]
    pub jwks_uri: Option<String>,
    /// This server's canonical resource URI as clients reach it, e.g.
    /// `https://tine.example.com/mcp` (RFC 8707 §2, MCP "Canonical Server
    /// URI"); tokens' `aud` must name it. Its origin is where the
    /// protected resource metadata is said to be.
    pub resource: String,
    /// The claim whose string value names the tenant (default `tenant`).
    #[serde(default = "default_tenant_claim")]
    pub tenant_claim: String,
    /// `false` (default): a token naming a tenant the tenants file does not
    /// have is refused. `true`: it acts as a tenant of that name with the
    /// default quota (`[limits.tenant]`) and no network ceiling, kept in
    /// memory.
    #[serde(default)]
    pub create_tenants: bool,
    /// Scopes listed in the metadata and the 401 challenge (RFC 9728 §2);
    /// not checked in tokens. Default: none listed.
    #[serde(default)]
    pub scopes_supported: Option<Vec<String>>,
    /// The JWS algorithms accepted (RFC 7518 §3.1 names; default `RS256`,
    /// `ES256`). Asymmetric ones only: `RS*`, `PS*`, `ES256`, `ES384`,
    /// `EdDSA`.
    #[serde(default = "default_allowed_algs")]
    pub allowed_algs: Vec<String>,
    /// Clock skew allowed in `exp` and `nbf` (seconds; default 60, at most
    /// [`MAX_LEEWAY_SECS`]).
    #[serde(default = "default_leeway_secs")]
    pub leeway_secs: u64,
}

fn default_tenant_claim() -> String {
    DEFAULT_TENANT_CLAIM.to_string()
}

fn default_allowed_algs() -> Vec<String> {
    DEFAULT_ALLOWED_ALGS.iter().map(|a| a.to_string()).collect()
}

fn default_leeway_secs() -> u64 {
    DEFAULT_LEEWAY_SECS
}

/// Errors of OAuth: of the configuration, of fetching the issuer's keys,
/// and why a token was refused.
#[derive(Debug, thiserror::Error)]
pub enum OAuthError {
    /// `[auth.oauth]` cannot be used.
    #[error("[auth.oauth]: {0}")]
    Config(String),
    /// The issuer's metadata or JWK set cannot be had.
    #[error("cannot get {url}: {reason}")]
    Fetch {
        /// What was asked for.
        url: String,
        /// Why it failed.
        reason: String,
    },
    /// No JWK set: neither `jwks_uri` nor the issuer's metadata names one.
    #[error("no JWK set for issuer {issuer}: {reasons} (set [auth.oauth] jwks_uri)")]
    NoJwks {
        /// The issuer.
        issuer: String,
        /// What each metadata URL gave.
        reasons: String,
    },
    /// Not a JWS in compact serialization, or its header is unreadable.
    #[error("the bearer token is not a JWT this server can read: {0}")]
    Malformed(String),
    /// `alg` is not one of `allowed_algs` (`none` never is).
    #[error("the token's algorithm {0:?} is not accepted here")]
    Algorithm(String),
    /// No key of the issuer's JWK set fits the token's `kid` and `alg`.
    #[error("the token's key {0:?} is not one of the issuer's signing keys")]
    UnknownKey(String),
    /// The signature does not verify.
    #[error("the token's signature does not verify")]
    Signature,
    /// `exp` is past (beyond the leeway).
    #[error("the token has expired")]
    Expired,
    /// `nbf` is in the future (beyond the leeway).
    #[error("the token is not valid yet (nbf)")]
    NotYetValid,
    /// `iss` is not the configured issuer.
    #[error("the token's issuer is not {0}")]
    Issuer(String),
    /// `aud` does not name this resource.
    #[error("the token's audience is not {0} (ask the authorization server for it with resource=, RFC 8707)")]
    Audience(String),
    /// A claim that must be there is missing or not of its type.
    #[error("the token's claim {0:?} is missing or not valid")]
    Claim(String),
    /// The tenant claim does not name a tenant.
    #[error("the token's tenant {0:?} is not a tenant of this server")]
    UnknownTenant(String),
    /// The tenant claim names a tenant marked removed.
    #[error("tenant {0} was removed")]
    RemovedTenant(String),
    /// `create_tenants`: this server holds [`MAX_CREATED_TENANTS`] tenants
    /// made from tokens already.
    #[error("{MAX_CREATED_TENANTS} tenants were made from tokens already; add tenant {0} to the tenants file")]
    TooManyTenants(String),
}

impl OAuthError {
    /// Whether the error is this server's or the issuer's, not the
    /// token's: the keys cannot be had (answered 503, not 401).
    pub fn unavailable(&self) -> bool {
        matches!(self, OAuthError::Fetch { .. } | OAuthError::NoJwks { .. })
    }
}

/// What a token acts as: the value of its tenant claim, not yet checked
/// against the tenants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The tenant claim's value.
    pub tenant: String,
    /// `sub`, for logs (RFC 7519 §4.1.2).
    pub subject: Option<String>,
}

/// One verification key of the issuer's JWK set.
struct Key {
    kid: Option<String>,
    /// The `alg` the JWK states (RFC 7517 §4.4), if any.
    alg: Option<Algorithm>,
    family: AlgorithmFamily,
    key: DecodingKey,
}

/// The issuer's keys as last fetched.
#[derive(Default)]
struct KeySet {
    keys: Vec<Key>,
}

/// When the JWK set was last fetched, and from where.
#[derive(Default)]
struct FetchState {
    /// The last fetch (or attempt), whatever prompted it.
    last_fetch: Option<Instant>,
    /// The last fetch prompted by a token naming an unknown key.
    last_prompted: Option<Instant>,
    /// The JWK set's URL found in the issuer's metadata.
    jwks_uri: Option<Url>,
}

/// Verifies access tokens of one issuer for one resource.
pub struct Verifier {
    config: OAuthConfig,
    algorithms: Vec<Algorithm>,
    jwks_uri: Option<Url>,
    metadata_url: String,
    http: reqwest::Client,
    keys: RwLock<Arc<KeySet>>,
    fetch: tokio::sync::Mutex<FetchState>,
}

/// `url` parsed as an absolute `http`/`https` URL without fragment.
fn http_url(what: &str, url: &str) -> Result<Url, OAuthError> {
    let u = Url::parse(url).map_err(|e| OAuthError::Config(format!("{what} {url:?}: {e}")))?;
    if !matches!(u.scheme(), "https" | "http") || u.host_str().is_none() {
        return Err(OAuthError::Config(format!("{what} {url:?}: not an https URL")));
    }
    if u.fragment().is_some() {
        return Err(OAuthError::Config(format!("{what} {url:?}: a fragment is not allowed")));
    }
    Ok(u)
}

/// The URL of the protected resource metadata of `resource` (RFC 9728
/// §3.1): the well-known path inserted between its origin and its path,
/// e.g. `https://tine.example.com/.well-known/oauth-protected-resource/mcp`.
pub fn metadata_url(resource: &Url) -> String {
    let origin = resource.origin().ascii_serialization();
    let path = resource.path().trim_end_matches('/');
    format!("{origin}{METADATA_PATH}{path}")
}

/// Whether `token` has the shape of a JWS in compact serialization (RFC
/// 7515 §7.1): three non-empty base64url parts, the first a JSON object,
/// at most [`MAX_TOKEN_BYTES`].
pub fn looks_like_jwt(token: &str) -> bool {
    if token.len() > MAX_TOKEN_BYTES {
        return false;
    }
    let parts: Vec<&str> = token.split('.').collect();
    parts.len() == 3
        && parts[..2].iter().all(|p| !p.is_empty())
        && token.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && parts[0].starts_with("ey") // base64url of `{"`
}

/// The JOSE header of `token` as JSON (RFC 7515 §4).
///
/// Errors: [`OAuthError::Malformed`].
fn raw_header(token: &str) -> Result<Map<String, Value>, OAuthError> {
    let first = token.split('.').next().unwrap_or_default();
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(first.trim_end_matches('='))
        .map_err(|e| OAuthError::Malformed(format!("header: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| OAuthError::Malformed(format!("header: {e}")))
}

impl Verifier {
    /// A verifier for `config`, checked. No request is made yet: the keys
    /// are fetched by [`Verifier::refresh`] and on the first token.
    ///
    /// Errors: [`OAuthError::Config`] for an issuer, resource or
    /// `jwks_uri` that is not an http(s) URL, an empty `tenant_claim`, an
    /// algorithm that is unknown or symmetric (or `none`), a leeway over
    /// [`MAX_LEEWAY_SECS`], or an HTTP client that cannot be made.
    pub fn new(config: OAuthConfig) -> Result<Self, OAuthError> {
        let issuer = http_url("issuer", &config.issuer)?;
        if issuer.query().is_some() {
            return Err(OAuthError::Config(format!(
                "issuer {:?}: a query is not allowed (RFC 8414 §2)",
                config.issuer
            )));
        }
        let resource = http_url("resource", &config.resource)?;
        let jwks_uri = config.jwks_uri.as_deref().map(|u| http_url("jwks_uri", u)).transpose()?;
        if config.tenant_claim.is_empty() {
            return Err(OAuthError::Config("tenant_claim is empty".into()));
        }
        if config.leeway_secs > MAX_LEEWAY_SECS {
            return Err(OAuthError::Config(format!(
                "leeway_secs = {} is more than {MAX_LEEWAY_SECS}",
                config.leeway_secs
            )));
        }
        if config.allowed_algs.is_empty() {
            return Err(OAuthError::Config("allowed_algs is empty".into()));
        }
        let mut algorithms = Vec::new();
        for name in &config.allowed_algs {
            let alg = Algorithm::from_str(name).map_err(|_| {
                OAuthError::Config(format!("allowed_algs: {name:?} is not a JWS algorithm this server knows"))
            })?;
            if alg.family() == AlgorithmFamily::Hmac {
                return Err(OAuthError::Config(format!(
                    "allowed_algs: {name} is symmetric; only the issuer's public keys are used here"
                )));
            }
            algorithms.push(alg);
        }
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .connect_timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::limited(3))
            .user_agent(concat!("tine/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| OAuthError::Config(format!("HTTP client: {e}")))?;
        Ok(Verifier {
            metadata_url: metadata_url(&resource),
            algorithms,
            jwks_uri,
            http,
            keys: RwLock::new(Arc::default()),
            fetch: tokio::sync::Mutex::new(FetchState::default()),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &OAuthConfig {
        &self.config
    }

    /// The host of the configured resource URI (clients reach the server
    /// by it, so it is an allowed `Host`).
    pub fn resource_host(&self) -> Option<String> {
        Url::parse(&self.config.resource).ok()?.host_str().map(str::to_string)
    }

    /// The URL of this server's protected resource metadata (RFC 9728
    /// §3.1), from the configured resource's origin.
    pub fn metadata_url(&self) -> &str {
        &self.metadata_url
    }

    /// The protected resource metadata document (RFC 9728 §2):
    /// `resource`, `authorization_servers` (the MCP spec requires it),
    /// `bearer_methods_supported` (`header` only, RFC 6750 §2.1) and, if
    /// configured, `scopes_supported`.
    pub fn metadata(&self) -> Value {
        let mut doc = serde_json::json!({
            "resource": self.config.resource,
            "authorization_servers": [self.config.issuer],
            "bearer_methods_supported": ["header"],
            "resource_name": "Tine",
        });
        if let Some(scopes) = self.config.scopes_supported.as_ref().filter(|s| !s.is_empty()) {
            doc["scopes_supported"] = serde_json::json!(scopes);
        }
        doc
    }

    /// The `WWW-Authenticate` challenge of a 401 (RFC 6750 §3, RFC 9728
    /// §5.1): `Bearer realm="tine", resource_metadata="..."`, with
    /// `scope` when scopes are configured and `error="invalid_token"` when
    /// a credential was sent (`invalid`).
    pub fn challenge(&self, invalid: bool) -> String {
        let mut c = format!(r#"Bearer realm="tine", resource_metadata="{}""#, self.metadata_url);
        if let Some(scopes) = self.config.scopes_supported.as_ref().filter(|s| !s.is_empty()) {
            // RFC 6750 §3: scope-token characters only (no quote or backslash).
            let s: Vec<&str> = scopes
                .iter()
                .map(String::as_str)
                .filter(|s| s.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\'))
                .collect();
            c.push_str(&format!(r#", scope="{}""#, s.join(" ")));
        }
        if invalid {
            c.push_str(r#", error="invalid_token""#);
        }
        c
    }

    /// Checks `token` (see the module's comment) and returns its tenant
    /// claim. May fetch the issuer's JWK set first (no key yet, or none
    /// with the token's `kid`, at most once every
    /// [`JWKS_REFETCH_MIN_INTERVAL`]).
    ///
    /// Errors: every [`OAuthError`] but `Config`; `Fetch` and `NoJwks`
    /// when the keys cannot be had.
    pub async fn verify(&self, token: &str) -> Result<Verified, OAuthError> {
        if !looks_like_jwt(token) {
            return Err(OAuthError::Malformed("not three base64url parts".into()));
        }
        let raw = raw_header(token)?;
        let alg_name = raw.get("alg").and_then(Value::as_str).unwrap_or("none").to_string();
        let alg = Algorithm::from_str(&alg_name)
            .ok()
            .filter(|a| self.algorithms.contains(a))
            .ok_or(OAuthError::Algorithm(alg_name))?;
        if raw.contains_key("crit") {
            // RFC 7515 §4.1.11: extensions this server does not know.
            return Err(OAuthError::Malformed("critical header extensions are not supported".into()));
        }
        let kid = match raw.get("kid") {
            None => None,
            Some(Value::String(k)) => Some(k.clone()),
            Some(_) => return Err(OAuthError::Malformed("kid is not a string".into())),
        };
        let mut keys = self.keys_for(kid.as_deref(), alg);
        if keys.is_empty() {
            self.refetch(true).await?;
            keys = self.keys_for(kid.as_deref(), alg);
        }
        if keys.is_empty() {
            return Err(OAuthError::UnknownKey(kid.unwrap_or_else(|| "(none)".into())));
        }
        let mut validation = Validation::new(alg);
        validation.set_issuer(&[&self.config.issuer]);
        validation.set_audience(&[&self.config.resource]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        validation.leeway = self.config.leeway_secs;
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.validate_aud = true;
        let mut last = OAuthError::Signature;
        for key in keys.iter().take(MAX_KEYS_TRIED) {
            match jsonwebtoken::decode::<Map<String, Value>>(token, key, &validation) {
                Ok(data) => return self.tenant_of(&data.claims),
                Err(e) => {
                    last = self.error_of(e);
                    // Another key may verify a token without `kid`; a claim
                    // error is the token's whatever the key.
                    if !matches!(last, OAuthError::Signature) {
                        break;
                    }
                }
            }
        }
        Err(last)
    }

    /// The tenant claim of verified `claims`.
    fn tenant_of(&self, claims: &Map<String, Value>) -> Result<Verified, OAuthError> {
        let tenant = claims
            .get(&self.config.tenant_claim)
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| OAuthError::Claim(self.config.tenant_claim.clone()))?;
        let subject = claims.get("sub").and_then(Value::as_str).map(str::to_string);
        Ok(Verified { tenant: tenant.to_string(), subject })
    }

    /// What a `jsonwebtoken` error says about the token.
    fn error_of(&self, e: jsonwebtoken::errors::Error) -> OAuthError {
        use jsonwebtoken::errors::ErrorKind as K;
        match e.kind() {
            K::InvalidSignature | K::InvalidEcdsaKey | K::InvalidRsaKey(_) | K::InvalidKeyFormat | K::Provider(_) => {
                OAuthError::Signature
            }
            K::ExpiredSignature => OAuthError::Expired,
            K::ImmatureSignature => OAuthError::NotYetValid,
            K::InvalidIssuer => OAuthError::Issuer(self.config.issuer.clone()),
            K::InvalidAudience => OAuthError::Audience(self.config.resource.clone()),
            K::MissingRequiredClaim(c) | K::InvalidClaimFormat(c) => OAuthError::Claim(c.clone()),
            K::InvalidAlgorithm | K::InvalidAlgorithmName | K::MissingAlgorithm => {
                OAuthError::Algorithm(format!("{e}"))
            }
            _ => OAuthError::Malformed(e.to_string()),
        }
    }

    /// The keys that may have signed a token of `kid` and `alg`.
    fn keys_for(&self, kid: Option<&str>, alg: Algorithm) -> Vec<DecodingKey> {
        let set = self.keys.read().unwrap_or_else(|p| p.into_inner()).clone();
        set.keys
            .iter()
            .filter(|k| k.family == alg.family() && k.alg.is_none_or(|a| a == alg))
            .filter(|k| match kid {
                Some(kid) => k.kid.as_deref() == Some(kid),
                None => true,
            })
            .map(|k| k.key.clone())
            .collect()
    }

    /// Fetches the JWK set now. One fetch at a time: a caller that waited
    /// for another's fetch uses its keys. `prompted` (by a token naming a
    /// key not in the set): not if another such fetch was less than
    /// [`JWKS_REFETCH_MIN_INTERVAL`] ago; the periodic refresh is not
    /// limited, and does not count.
    ///
    /// Errors: [`OAuthError::Fetch`], [`OAuthError::NoJwks`] (the keys
    /// fetched before stay in force).
    async fn refetch(&self, prompted: bool) -> Result<(), OAuthError> {
        let asked = Instant::now();
        let mut state = self.fetch.lock().await;
        if state.last_fetch.is_some_and(|t| t >= asked) {
            return Ok(());
        }
        if prompted {
            if state.last_prompted.is_some_and(|t| t.elapsed() < JWKS_REFETCH_MIN_INTERVAL) {
                return Ok(());
            }
            state.last_prompted = Some(Instant::now());
        }
        state.last_fetch = Some(Instant::now());
        let uri = match (&self.jwks_uri, &state.jwks_uri) {
            (Some(u), _) | (None, Some(u)) => u.clone(),
            (None, None) => {
                let u = self.discover_jwks_uri().await?;
                state.jwks_uri = Some(u.clone());
                u
            }
        };
        let doc = self.get_json(&uri).await?;
        let set = parse_jwks(&doc).map_err(|reason| OAuthError::Fetch { url: uri.to_string(), reason })?;
        tracing::debug!(keys = set.keys.len(), jwks_uri = %uri, "OAuth issuer's keys fetched");
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(set);
        Ok(())
    }

    /// Fetches the JWK set now, whatever the rate limit (at start and every
    /// [`JWKS_REFRESH_EVERY`]).
    ///
    /// Errors: as [`Verifier::verify`]'s `Fetch` and `NoJwks`.
    pub async fn refresh(&self) -> Result<(), OAuthError> {
        self.refetch(false).await
    }

    /// The issuer's `jwks_uri` from its metadata: RFC 8414 §3.1's
    /// `/.well-known/oauth-authorization-server` inserted before the
    /// issuer's path, then OpenID Connect's `openid-configuration` inserted
    /// so and appended (Discovery 1.0 §4), as the MCP spec's clients try
    /// them. The document's `issuer` must be the configured one (RFC 8414
    /// §3.3).
    ///
    /// Errors: [`OAuthError::NoJwks`] saying what each URL gave.
    async fn discover_jwks_uri(&self) -> Result<Url, OAuthError> {
        let issuer = Url::parse(&self.config.issuer)
            .map_err(|e| OAuthError::Config(format!("issuer {:?}: {e}", self.config.issuer)))?;
        let origin = issuer.origin().ascii_serialization();
        let path = issuer.path().trim_end_matches('/');
        let candidates = [
            format!("{origin}/.well-known/oauth-authorization-server{path}"),
            format!("{origin}/.well-known/openid-configuration{path}"),
            format!("{origin}{path}/.well-known/openid-configuration"),
        ];
        let mut reasons = Vec::new();
        let mut tried = std::collections::HashSet::new();
        for c in candidates {
            if !tried.insert(c.clone()) {
                continue;
            }
            let Ok(url) = Url::parse(&c) else { continue };
            match self.get_json(&url).await {
                Ok(doc) => {
                    if doc.get("issuer").and_then(Value::as_str) != Some(self.config.issuer.as_str()) {
                        reasons.push(format!("{c}: its issuer is not {}", self.config.issuer));
                        continue;
                    }
                    match doc.get("jwks_uri").and_then(Value::as_str).map(Url::parse) {
                        Some(Ok(u)) if matches!(u.scheme(), "https" | "http") => return Ok(u),
                        _ => reasons.push(format!("{c}: no jwks_uri")),
                    }
                }
                Err(e) => reasons.push(e.to_string()),
            }
        }
        Err(OAuthError::NoJwks { issuer: self.config.issuer.clone(), reasons: reasons.join("; ") })
    }

    /// GET `url` as JSON, at most [`MAX_DOCUMENT_BYTES`].
    ///
    /// Errors: [`OAuthError::Fetch`].
    async fn get_json(&self, url: &Url) -> Result<Value, OAuthError> {
        let fail = |reason: String| OAuthError::Fetch { url: url.to_string(), reason };
        let mut resp = self
            .http
            .get(url.clone())
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| fail(error_chain(&e)))?;
        if !resp.status().is_success() {
            return Err(fail(format!("HTTP {}", resp.status())));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| fail(error_chain(&e)))? {
            if body.len() + chunk.len() > MAX_DOCUMENT_BYTES {
                return Err(fail(format!("more than {MAX_DOCUMENT_BYTES} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&body).map_err(|e| fail(format!("not JSON: {e}")))
    }
}

/// `e` with its sources, for a log line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// The signing keys of a JWK set document (RFC 7517 §5): keys of another
/// `use` than `sig`, symmetric keys and keys this server cannot read are
/// left out.
///
/// Errors: a document without a `keys` array.
fn parse_jwks(doc: &Value) -> Result<KeySet, String> {
    let list = doc.get("keys").and_then(Value::as_array).ok_or("no \"keys\" array (RFC 7517 §5)")?;
    let mut set = KeySet::default();
    for raw in list {
        let Ok(jwk) = serde_json::from_value::<Jwk>(raw.clone()) else {
            tracing::debug!("JWK set: a key this server cannot read is left out");
            continue;
        };
        if matches!(&jwk.common.public_key_use, Some(u) if *u != PublicKeyUse::Signature) {
            continue;
        }
        let family = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa,
            AlgorithmParameters::EllipticCurve(_) => AlgorithmFamily::Ec,
            AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed,
            // Symmetric keys are never used; nor are kinds this server does not know.
            _ => continue,
        };
        let alg = match jwk.common.key_algorithm {
            None => None,
            Some(a) => match Algorithm::from_str(&a.to_string()) {
                Ok(a) if a.family() == family => Some(a),
                // An encryption algorithm, or one of another family.
                _ => continue,
            },
        };
        let Ok(key) = DecodingKey::from_jwk(&jwk) else { continue };
        set.keys.push(Key { kid: jwk.common.key_id.clone(), alg, family, key });
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OAuthConfig {
        toml::from_str("issuer = \"https://id.example.com/realms/x\"\nresource = \"https://tine.example.com/mcp\"\n")
            .unwrap()
    }

    #[test]
    fn the_configuration_has_its_defaults_and_is_checked() {
        let c = config();
        assert_eq!(c.tenant_claim, "tenant");
        assert_eq!(c.allowed_algs, ["RS256", "ES256"]);
        assert_eq!((c.leeway_secs, c.create_tenants, c.jwks_uri.as_deref()), (60, false, None));
        let v = Verifier::new(c.clone()).unwrap();
        assert_eq!(v.metadata_url(), "https://tine.example.com/.well-known/oauth-protected-resource/mcp");
        let doc = v.metadata();
        assert_eq!(doc["resource"], "https://tine.example.com/mcp");
        assert_eq!(doc["authorization_servers"], serde_json::json!(["https://id.example.com/realms/x"]));
        assert_eq!(doc["bearer_methods_supported"], serde_json::json!(["header"]));
        assert!(doc.get("scopes_supported").is_none());
        assert_eq!(
            v.challenge(true),
            r#"Bearer realm="tine", resource_metadata="https://tine.example.com/.well-known/oauth-protected-resource/mcp", error="invalid_token""#
        );
        let bad = |f: &dyn Fn(&mut OAuthConfig)| {
            let mut c = config();
            f(&mut c);
            matches!(Verifier::new(c), Err(OAuthError::Config(_)))
        };
        assert!(bad(&|c| c.allowed_algs = vec!["HS256".into()]), "symmetric");
        assert!(bad(&|c| c.allowed_algs = vec!["none".into()]));
        assert!(bad(&|c| c.allowed_algs = vec![]));
        assert!(bad(&|c| c.issuer = "ftp://x".into()));
        assert!(bad(&|c| c.issuer = "https://x/?a=b".into()));
        assert!(bad(&|c| c.resource = "tine".into()));
        assert!(bad(&|c| c.leeway_secs = MAX_LEEWAY_SECS + 1));
        assert!(bad(&|c| c.tenant_claim = String::new()));
        assert!(toml::from_str::<OAuthConfig>("issuer = \"https://a\"\nresource = \"https://b\"\nx = 1\n").is_err());

        let mut c = config();
        c.scopes_supported = Some(vec!["tine".into(), "bad\"".into()]);
        c.resource = "https://tine.example.com/".into();
        let v = Verifier::new(c).unwrap();
        assert_eq!(v.metadata_url(), "https://tine.example.com/.well-known/oauth-protected-resource");
        assert_eq!(v.metadata()["scopes_supported"], serde_json::json!(["tine", "bad\""]));
        assert!(v.challenge(false).ends_with(r#", scope="tine""#), "{}", v.challenge(false));
    }

    #[test]
    fn only_jwt_shaped_tokens_are_verified() {
        assert!(looks_like_jwt("eyJhbGciOiJSUzI1NiJ9.eyJ4IjoxfQ.c2ln"));
        assert!(looks_like_jwt("eyJhbGciOiJub25lIn0.eyJ4IjoxfQ."), "alg none: refused later, and said so");
        assert!(!looks_like_jwt("tine_0123456789abcdef"));
        assert!(!looks_like_jwt("a.b.c"));
        assert!(!looks_like_jwt("eyJ.eyJ.c.d"));
        assert!(!looks_like_jwt("eyJ a.eyJ.c"));
        assert!(!looks_like_jwt(&format!("eyJ{}.e.c", "a".repeat(MAX_TOKEN_BYTES))));
    }

    #[tokio::test]
    async fn bad_tokens_are_refused_without_a_fetch() {
        let mut c = config();
        // Nothing listens there: a fetch would fail with Fetch.
        c.jwks_uri = Some("http://127.0.0.1:9/jwks".into());
        let v = Verifier::new(c).unwrap();
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let none = format!("{}.{}.", b64(r#"{"alg":"none"}"#), b64(r#"{"tenant":"acme"}"#));
        assert!(matches!(v.verify(&none).await, Err(OAuthError::Algorithm(a)) if a == "none"));
        let hs = format!("{}.{}.c2ln", b64(r#"{"alg":"HS256"}"#), b64("{}"));
        assert!(matches!(v.verify(&hs).await, Err(OAuthError::Algorithm(_))));
        let garbage = format!("{}.e30.c2ln", b64("{not json"));
        assert!(matches!(v.verify(&garbage).await, Err(OAuthError::Malformed(_))));
        let rs = format!("{}.e30.c2ln", b64(r#"{"alg":"RS256","kid":"k"}"#));
        assert!(matches!(v.verify(&rs).await, Err(OAuthError::Fetch { .. })));
        // The failed fetch is not tried again at once.
        assert!(matches!(v.verify(&rs).await, Err(OAuthError::UnknownKey(k)) if k == "k"));
    }

    #[test]
    fn the_jwk_set_keeps_signing_keys_only() {
        let doc = serde_json::json!({"keys": [
            {"kty": "EC", "crv": "P-256", "kid": "ec", "use": "sig", "alg": "ES256",
             "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"},
            {"kty": "EC", "crv": "P-256", "kid": "enc", "use": "enc",
             "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"},
            {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
            {"kty": "RSA", "kid": "oaep", "alg": "RSA-OAEP", "n": "sXch", "e": "AQAB"},
            {"kty": "XYZ", "kid": "unknown"},
        ]});
        let set = parse_jwks(&doc).unwrap();
        let kids: Vec<_> = set.keys.iter().map(|k| k.kid.as_deref().unwrap_or_default()).collect();
        assert_eq!(kids, ["ec"]);
        assert!(parse_jwks(&serde_json::json!({"nokeys": []})).is_err());
    }
}
