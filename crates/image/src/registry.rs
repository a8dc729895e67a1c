//! Pulling an image from a registry (OCI distribution-spec v1.1, the
//! Docker registry HTTP API v2) into an OCI image layout directory, which
//! [`crate::source::open`] then reads and checks like any other layout.
//!
//! The pull mirrors the registry's graph: the manifest (or index) the
//! reference names, the platform's manifest under an index, its
//! configuration and its layers, each stored as `blobs/sha256/<hex>`
//! under the digest that names it, then `index.json` naming the top one
//! with the reference as `org.opencontainers.image.ref.name`. Blobs
//! already in the directory with the right digest are not fetched again.
//!
//! A registry named by a tenant's recipe is not trusted, so every request
//! is bounded ([`HostPolicy`], [`PullLimits`]):
//!
//! - it reaches the registry's own `host[:port]`, or a host the operator
//!   allows (`[images] allowed_hosts`): the token service a `401`'s
//!   `WWW-Authenticate` names and every redirect (blob storage) are
//!   checked hop by hop (redirects are followed here, not by the HTTP
//!   client), and credentials go to the registry and its token service
//!   only; plain HTTP only to `insecure` registries;
//! - names resolve through a resolver that refuses loopback, private and
//!   link-local addresses (the judge the caller gives, netstack's
//!   `BLOCKED_RANGES` in the server) unless the host is one the operator
//!   listed as private; IP literals are judged before the request;
//! - manifests, indexes, configurations and token answers are read up to
//!   [`PullLimits::max_document_bytes`]; error answers are not read at
//!   all (the error says the HTTP status, never the registry's text);
//! - declared blob sizes are checked against [`PullLimits`] before
//!   anything is downloaded, and each blob is streamed to disk with its
//!   size and digest checked as it comes (a registry that sends one byte
//!   more is cut off).
//!
//! HTTP and TLS are `reqwest`'s (rustls, the platform's roots).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use oci_spec::distribution::Reference;
use oci_spec::image::ImageIndex;
use reqwest::header::{ACCEPT, LOCATION, WWW_AUTHENTICATE};
use reqwest::{StatusCode, Url};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use crate::source::{check_digest, choose_manifest, digest_of, is_index, sha256_digest};

/// Manifest media types asked for: OCI image manifest and index, Docker
/// schema 2 manifest and manifest list.
const ACCEPTED: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// Redirects followed for one request at most.
pub const MAX_REDIRECTS: usize = 5;

/// Errors of a pull.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Not an image reference (`registry/repository:tag` or `@sha256:...`).
    #[error("{reference:?} is not an image reference: {reason}")]
    Reference {
        /// What was given.
        reference: String,
        /// The parser's reason.
        reason: String,
    },
    /// The registry refused or failed a request (not found, unauthorized,
    /// unreachable, a blob whose size or digest is not the manifest's).
    #[error("pulling {what} of {reference}: {detail}")]
    Pull {
        /// The reference.
        reference: String,
        /// Which part (manifest, blob digest).
        what: String,
        /// What happened: an HTTP status, a transport error, a mismatch
        /// (never the registry's own text).
        detail: String,
    },
    /// A request would reach a host or address the pull may not (see
    /// [`HostPolicy`]); nothing was sent there.
    #[error("pulling {what} of {reference}: refused to reach {target}: {reason}")]
    Refused {
        /// The reference.
        reference: String,
        /// Which part (the manifest, the token service, a blob).
        what: String,
        /// `scheme://host:port` of the refused hop.
        target: String,
        /// Why.
        reason: String,
    },
    /// A manifest or token answer, or a blob as its manifest declares it,
    /// is larger than [`PullLimits`] allow.
    #[error("pulling {what} of {reference}: {size} bytes, more than the limit of {limit} bytes ({which})")]
    TooLarge {
        /// The reference.
        reference: String,
        /// Which part.
        what: String,
        /// Its size (declared or read so far), bytes.
        size: u64,
        /// The limit, bytes.
        limit: u64,
        /// Which limit.
        which: &'static str,
    },
    /// A manifest is malformed or names no usable manifest.
    #[error("{0}")]
    Manifest(String),
    /// The layout directory could not be written.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Credentials for a registry (`[images] auth` in the server's config).
/// Its `Debug` shows the kind and user, never a password or token.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum Auth {
    /// No credentials (public images; a token service may still issue an
    /// anonymous token).
    #[default]
    Anonymous,
    /// A user name and password (or access token used as one).
    Basic {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// A bearer token sent as is.
    Bearer(String),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Anonymous => f.write_str("Anonymous"),
            Auth::Basic { user, .. } => write!(f, "Basic {{ user: {user:?}, password: <redacted> }}"),
            Auth::Bearer(_) => f.write_str("Bearer(<redacted>)"),
        }
    }
}

/// Judges an address a name resolves to: `Some(reason)` refuses it
/// (e.g. "loopback"). The server's judge is netstack's blocked ranges.
pub type AddressJudge = Arc<dyn Fn(IpAddr) -> Option<String> + Send + Sync>;

/// Which hosts and addresses a pull may reach besides the registry the
/// reference names.
///
/// Host entries are `host` (any port), `host:port`, or `*.domain` (any
/// host under `domain`, any port); IPv6 addresses in brackets.
#[derive(Clone, Default)]
pub struct HostPolicy {
    /// Hosts other than the registry's own that its token service and
    /// redirects may name (`[images] allowed_hosts`: e.g. Docker Hub's
    /// `auth.docker.io` and its blob storage). Default none: only the
    /// registry's own `host:port`.
    pub allowed_hosts: Vec<String>,
    /// Hosts that may resolve to addresses [`HostPolicy::refuse_address`]
    /// refuses (the operator's registries on its own network:
    /// `insecure_registries` and `private_registries`).
    pub private_hosts: Vec<String>,
    /// Judges each address a host resolves to; `None`: every address.
    pub refuse_address: Option<AddressJudge>,
    /// Any host may be reached (the operator's own `tine image build`).
    pub any_host: bool,
}

impl HostPolicy {
    /// Any host, any address: for a pull the operator runs.
    pub fn any() -> Self {
        HostPolicy { any_host: true, ..HostPolicy::default() }
    }
}

impl std::fmt::Debug for HostPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPolicy")
            .field("allowed_hosts", &self.allowed_hosts)
            .field("private_hosts", &self.private_hosts)
            .field("refuse_address", &self.refuse_address.is_some())
            .field("any_host", &self.any_host)
            .finish()
    }
}

/// Bounds on what one pull reads and stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullLimits {
    /// Bytes of one manifest, index, image configuration or token answer
    /// (each is held in memory whole). Default 4 MiB.
    pub max_document_bytes: u64,
    /// Bytes of one layer, as its manifest declares it (checked before
    /// any download, then while it streams). Default 16 GiB.
    pub max_blob_bytes: u64,
    /// Bytes of the configuration and layers together, as the manifest
    /// declares them: what the pull stages on disk at most. Default 16 GiB.
    pub max_total_bytes: u64,
}

impl Default for PullLimits {
    fn default() -> Self {
        PullLimits { max_document_bytes: 4 << 20, max_blob_bytes: 16 << 30, max_total_bytes: 16 << 30 }
    }
}

/// What [`pull`] needs.
#[derive(Debug, Clone)]
pub struct PullRequest<'a> {
    /// `registry[:port]/repository[:tag][@sha256:...]`; a name without a
    /// registry is Docker Hub's, as `docker pull` reads it.
    pub reference: &'a str,
    /// Credentials, sent to the registry and its token service only.
    pub auth: Auth,
    /// Registries and hosts (`host[:port]`) spoken to over plain HTTP (a
    /// local registry); all others over HTTPS.
    pub insecure: &'a [String],
    /// The OCI layout directory to write (created; blobs already there
    /// are reused).
    pub layout: &'a Path,
    /// The hosts and addresses the pull may reach.
    pub hosts: &'a HostPolicy,
    /// Its bounds.
    pub limits: PullLimits,
}

/// What [`pull`] fetched.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The digest of the manifest (or index) the reference named.
    pub digest: String,
    /// Blobs fetched from the registry.
    pub fetched: usize,
    /// Blobs found in the layout already.
    pub reused: usize,
    /// Bytes fetched.
    pub bytes: u64,
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> RegistryError + 'a {
    move |source| RegistryError::Io { path: path.to_path_buf(), op, source }
}

fn parse_reference(reference: &str) -> Result<Reference, RegistryError> {
    Reference::from_str(reference)
        .map_err(|e| RegistryError::Reference { reference: reference.into(), reason: e.to_string() })
}

/// The registry (`host[:port]`) `reference` names, as a pull reaches it
/// (a name without one is Docker Hub's, `index.docker.io`).
///
/// Errors: [`RegistryError::Reference`].
pub fn registry_of(reference: &str) -> Result<String, RegistryError> {
    parse_reference(reference).map(|r| r.resolve_registry().to_string())
}

/// `host[:port]` split, the host lowercased (IPv6 in brackets).
fn split_authority(s: &str) -> (String, Option<u16>) {
    let s = s.trim();
    if let Some((h, p)) = s.rsplit_once(':') {
        if !h.is_empty() && (!h.contains(':') || h.ends_with(']')) {
            if let Ok(port) = p.parse::<u16>() {
                return (h.to_ascii_lowercase(), Some(port));
            }
        }
    }
    (s.to_ascii_lowercase(), None)
}

/// Whether the entry `host`, `host:port` or `*.domain` names `host` (any
/// port unless the entry gives one).
fn host_matches(entry: &str, host: &str, port: Option<u16>) -> bool {
    let (h, p) = split_authority(entry);
    let host_ok = match h.strip_prefix("*.") {
        Some(domain) => host.len() > domain.len() + 1 && host.ends_with(&format!(".{domain}")),
        None => h == host,
    };
    host_ok && (p.is_none() || port.is_none() || p == port)
}

/// The host (lowercased, IPv6 in brackets) and port of `url`.
fn target_of(url: &Url) -> Option<(String, u16)> {
    Some((url.host_str()?.to_ascii_lowercase(), url.port_or_known_default()?))
}

/// A name resolver that refuses addresses its judge refuses, for hosts
/// the operator did not list as private: checked at every connection, so
/// a name that resolved to a public address once cannot be made to point
/// inside later.
struct GuardedResolver {
    judge: AddressJudge,
    private_hosts: Vec<String>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_ascii_lowercase();
        let exempt = self.private_hosts.iter().any(|e| host_matches(e, &host, None));
        let judge = self.judge.clone();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if !exempt {
                if let Some((ip, why)) = addrs.iter().find_map(|a| judge(a.ip()).map(|why| (a.ip(), why))) {
                    return Err(format!(
                        "{host} resolves to {ip} ({why}), which the server does not fetch from \
                         unless the operator lists the host in [images] private_registries"
                    )
                    .into());
                }
            }
            Ok::<reqwest::dns::Addrs, Box<dyn std::error::Error + Send + Sync>>(Box::new(addrs.into_iter()))
        })
    }
}

/// A transport error, said shortly: what failed and the local causes
/// (never a body; cut to [`MAX_DETAIL_CHARS`]).
fn transport(e: &reqwest::Error) -> String {
    let mut s = String::from(if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "the request failed"
    });
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s.chars().take(MAX_DETAIL_CHARS).collect()
}

/// An HTTP status, as an error says it (the body is not read).
fn status_detail(status: StatusCode) -> String {
    format!("the registry answered HTTP {status}")
}

/// A `WWW-Authenticate` challenge: its scheme (lowercased) and parameters.
fn parse_challenge(header: &str) -> (String, Vec<(String, String)>) {
    let header = header.trim();
    let (scheme, rest) = header.split_once(char::is_whitespace).unwrap_or((header, ""));
    let mut params = Vec::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect::<String>().trim().to_ascii_lowercase();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| *c != ',') {
                value.push(c);
            }
            value = value.trim().to_string();
        }
        params.push((key, value));
    }
    (scheme.to_ascii_lowercase(), params)
}

/// One pull's HTTP: the client, the registry, the credentials it earned.
struct Session<'a> {
    http: reqwest::Client,
    req: &'a PullRequest<'a>,
    reference: Reference,
    /// The registry's host and port.
    registry: (String, u16),
    /// `<scheme>://<registry>/v2/<repository>/`.
    base: Url,
    /// The bearer token sent to the registry (given, or the token
    /// service's).
    token: Option<String>,
    /// Basic credentials are sent to the registry (it asked for them).
    basic: bool,
}

impl<'a> Session<'a> {
    fn new(req: &'a PullRequest<'a>) -> Result<Self, RegistryError> {
        let reference = parse_reference(req.reference)?;
        let registry = reference.resolve_registry().to_string();
        let (host, port) = split_authority(&registry);
        let insecure = req.insecure.iter().any(|e| host_matches(e, &host, port));
        let scheme = if insecure { "http" } else { "https" };
        let bad = |reason: String| RegistryError::Reference { reference: req.reference.into(), reason };
        let base = Url::parse(&format!("{scheme}://{registry}/v2/{}/", reference.repository()))
            .map_err(|e| bad(format!("not a registry URL: {e}")))?;
        let registry = target_of(&base).ok_or_else(|| bad("no registry host".into()))?;
        let mut http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(std::time::Duration::from_secs(30))
            .read_timeout(std::time::Duration::from_secs(120))
            .user_agent(concat!("tine/", env!("CARGO_PKG_VERSION")));
        if let Some(judge) = &req.hosts.refuse_address {
            http = http.no_proxy().dns_resolver(Arc::new(GuardedResolver {
                judge: judge.clone(),
                private_hosts: req.hosts.private_hosts.clone(),
            }));
        }
        let http = http.build().map_err(|e| RegistryError::Pull {
            reference: req.reference.into(),
            what: "the HTTP client".into(),
            detail: transport(&e),
        })?;
        let token = match &req.auth {
            Auth::Bearer(t) => Some(t.clone()),
            _ => None,
        };
        Ok(Session { http, req, reference, registry, base, token, basic: false })
    }

    fn pull_err(&self, what: &str, detail: String) -> RegistryError {
        RegistryError::Pull { reference: self.req.reference.into(), what: what.into(), detail }
    }

    fn too_large(&self, what: &str, size: u64, limit: u64, which: &'static str) -> RegistryError {
        RegistryError::TooLarge { reference: self.req.reference.into(), what: what.into(), size, limit, which }
    }

    fn is_registry(&self, url: &Url) -> bool {
        target_of(url).as_ref() == Some(&self.registry)
    }

    /// Checks a request's URL against [`HostPolicy`] before it is sent.
    ///
    /// Errors: [`RegistryError::Refused`].
    fn check_hop(&self, url: &Url, what: &str) -> Result<(), RegistryError> {
        let refuse = |reason: String| RegistryError::Refused {
            reference: self.req.reference.into(),
            what: what.into(),
            target: format!(
                "{}://{}:{}",
                url.scheme(),
                url.host_str().unwrap_or(""),
                url.port_or_known_default().unwrap_or(0)
            ),
            reason,
        };
        let Some((host, port)) = target_of(url) else { return Err(refuse("no host".into())) };
        let hosts = self.req.hosts;
        let allowed = hosts.any_host
            || (host.as_str(), port) == (self.registry.0.as_str(), self.registry.1)
            || hosts.allowed_hosts.iter().any(|e| host_matches(e, &host, Some(port)));
        if !allowed {
            return Err(refuse(
                "neither the registry's own host nor a host the operator allows ([images] allowed_hosts)".into(),
            ));
        }
        match url.scheme() {
            "https" => {}
            "http" if self.req.insecure.iter().any(|e| host_matches(e, &host, Some(port))) => {}
            "http" => return Err(refuse("plain HTTP to a host not in insecure_registries".into())),
            other => return Err(refuse(format!("scheme {other:?}"))),
        }
        let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok();
        if let (Some(judge), Some(ip)) = (&hosts.refuse_address, literal) {
            let exempt = hosts.private_hosts.iter().any(|e| host_matches(e, &host, Some(port)));
            if let (false, Some(why)) = (exempt, judge(ip)) {
                return Err(refuse(format!(
                    "{ip} is {why}; the operator may list the host in [images] private_registries"
                )));
            }
        }
        Ok(())
    }

    /// GETs `url` from the registry: its token service asked when it
    /// answers `401`, redirects followed hop by hop (each checked, no
    /// credentials past the registry), a status other than 2xx an error.
    ///
    /// Errors: [`RegistryError::Pull`], [`RegistryError::Refused`],
    /// [`RegistryError::TooLarge`] (a token answer).
    async fn get(
        &mut self,
        mut url: Url,
        accept: Option<&str>,
        what: &str,
    ) -> Result<reqwest::Response, RegistryError> {
        let mut hops = 0;
        let mut authenticated = false;
        loop {
            self.check_hop(&url, what)?;
            let to_registry = self.is_registry(&url);
            let mut rb = self.http.get(url.clone());
            if let Some(a) = accept {
                rb = rb.header(ACCEPT, a);
            }
            if to_registry {
                rb = self.authorize(rb);
            }
            let resp = rb.send().await.map_err(|e| self.pull_err(what, transport(&e)))?;
            let status = resp.status();
            if status.is_redirection() {
                hops += 1;
                if hops > MAX_REDIRECTS {
                    return Err(self.pull_err(what, format!("more than {MAX_REDIRECTS} redirects")));
                }
                let location = resp.headers().get(LOCATION).and_then(|v| v.to_str().ok()).map(str::to_string);
                let next = location.and_then(|l| url.join(&l).ok());
                url = next.ok_or_else(|| self.pull_err(what, format!("HTTP {status} without a usable Location")))?;
                continue;
            }
            if status == StatusCode::UNAUTHORIZED && to_registry && !authenticated {
                authenticated = true;
                let challenge = resp.headers().get(WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).map(str::to_string);
                drop(resp);
                self.authenticate(challenge.as_deref(), what).await?;
                continue;
            }
            if !status.is_success() {
                return Err(self.pull_err(what, status_detail(status)));
            }
            return Ok(resp);
        }
    }

    fn authorize(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match (&self.token, &self.req.auth) {
            (Some(t), _) => rb.bearer_auth(t),
            (None, Auth::Basic { user, password }) if self.basic => rb.basic_auth(user, Some(password)),
            _ => rb,
        }
    }

    /// Answers the registry's `401` challenge: a bearer token from the
    /// token service it names (which must pass [`Session::check_hop`]),
    /// or basic credentials.
    async fn authenticate(&mut self, challenge: Option<&str>, what: &str) -> Result<(), RegistryError> {
        let unauthorized = || status_detail(StatusCode::UNAUTHORIZED);
        let Some(challenge) = challenge else { return Err(self.pull_err(what, unauthorized())) };
        let (scheme, params) = parse_challenge(challenge);
        let param = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        match scheme.as_str() {
            "basic" if matches!(self.req.auth, Auth::Basic { .. }) && !self.basic => {
                self.basic = true;
                Ok(())
            }
            "bearer" if !matches!(self.req.auth, Auth::Bearer(_)) => {
                let token_what = "the token service";
                let realm =
                    param("realm").ok_or_else(|| self.pull_err(what, "a bearer challenge without a realm".into()))?;
                let mut url = Url::parse(&realm)
                    .map_err(|e| self.pull_err(token_what, format!("the realm is not a URL: {e}")))?;
                self.check_hop(&url, token_what)?;
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(service) = param("service") {
                        q.append_pair("service", &service);
                    }
                    let scope =
                        param("scope").unwrap_or_else(|| format!("repository:{}:pull", self.reference.repository()));
                    q.append_pair("scope", &scope);
                }
                let mut rb = self.http.get(url);
                if let Auth::Basic { user, password } = &self.req.auth {
                    rb = rb.basic_auth(user, Some(password));
                }
                let resp = rb.send().await.map_err(|e| self.pull_err(token_what, transport(&e)))?;
                if !resp.status().is_success() {
                    return Err(self.pull_err(token_what, status_detail(resp.status())));
                }
                let body = self.read_document(resp, token_what).await?;
                #[derive(serde::Deserialize)]
                struct TokenAnswer {
                    token: Option<String>,
                    access_token: Option<String>,
                }
                let answer: TokenAnswer = serde_json::from_slice(&body)
                    .map_err(|_| self.pull_err(token_what, "its answer is not a token (JSON)".into()))?;
                let token = answer
                    .token
                    .or(answer.access_token)
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| self.pull_err(token_what, "its answer holds no token".into()))?;
                self.token = Some(token);
                Ok(())
            }
            _ => Err(self.pull_err(what, unauthorized())),
        }
    }

    /// The body of `resp`, at most [`PullLimits::max_document_bytes`].
    ///
    /// Errors: [`RegistryError::TooLarge`], [`RegistryError::Pull`].
    async fn read_document(&self, mut resp: reqwest::Response, what: &str) -> Result<Vec<u8>, RegistryError> {
        let limit = self.req.limits.max_document_bytes;
        if let Some(n) = resp.content_length().filter(|n| *n > limit) {
            return Err(self.too_large(what, n, limit, "max_document_bytes"));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.pull_err(what, transport(&e)))? {
            let size = body.len() as u64 + chunk.len() as u64;
            if size > limit {
                return Err(self.too_large(what, size, limit, "max_document_bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// The manifest (or index) `tag_or_digest` names, its bytes checked
    /// against the digest when one is given, and its digest.
    async fn manifest(&mut self, tag_or_digest: &str, what: &str) -> Result<(Vec<u8>, String), RegistryError> {
        let url = self
            .base
            .join(&format!("manifests/{tag_or_digest}"))
            .map_err(|e| self.pull_err(what, format!("not a URL: {e}")))?;
        let resp = self.get(url, Some(&ACCEPTED.join(", ")), what).await?;
        let bytes = self.read_document(resp, what).await?;
        let found = sha256_digest(&bytes);
        if tag_or_digest.starts_with("sha256:") && found != tag_or_digest {
            return Err(self.pull_err(what, format!("its bytes hash to {found}, not the digest asked for")));
        }
        Ok((bytes, found))
    }

    /// The reference's own manifest or index, and its digest.
    async fn top(&mut self) -> Result<(Vec<u8>, String), RegistryError> {
        let name = match (self.reference.digest(), self.reference.tag()) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.to_string(),
            (None, None) => "latest".to_string(),
        };
        self.manifest(&name, "the manifest").await
    }

    /// Streams the blob `digest` of `size` bytes into `out`, checking its
    /// size and digest as it comes; the bytes written.
    async fn blob(
        &mut self,
        digest: &str,
        size: u64,
        out: &mut tokio::fs::File,
        partial: &Path,
    ) -> Result<u64, RegistryError> {
        let what = format!("blob {digest}");
        let url =
            self.base.join(&format!("blobs/{digest}")).map_err(|e| self.pull_err(&what, format!("not a URL: {e}")))?;
        let mut resp = self.get(url, None, &what).await?;
        let longer = |got: u64| format!("the registry sent {got} bytes or more, the manifest declares {size}");
        if let Some(n) = resp.content_length().filter(|n| *n > size) {
            return Err(self.pull_err(&what, longer(n)));
        }
        let mut hash = Sha256::new();
        let mut got = 0u64;
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.pull_err(&what, transport(&e)))? {
            got += chunk.len() as u64;
            if got > size {
                return Err(self.pull_err(&what, longer(got)));
            }
            hash.update(&chunk);
            out.write_all(&chunk).await.map_err(io_err(partial, "write"))?;
        }
        if got < size {
            return Err(self.pull_err(&what, format!("the registry sent {got} bytes, the manifest declares {size}")));
        }
        let found = digest_of(hash);
        if found != digest {
            return Err(self.pull_err(&what, format!("its bytes hash to {found}, not its digest")));
        }
        Ok(got)
    }
}

/// The digest of the manifest (or index) `req.reference` names now: one
/// bounded request (its token service's too), nothing written.
///
/// Errors: as [`pull`].
pub async fn resolve(req: &PullRequest<'_>) -> Result<String, RegistryError> {
    let mut session = Session::new(req)?;
    Ok(session.top().await?.1)
}

/// A layout pulled by [`pull_staged`]: its directory is removed when this
/// is dropped.
#[derive(Debug)]
pub struct Staged {
    layout: PathBuf,
    /// What the pull fetched.
    pub pulled: Pulled,
}

impl Staged {
    /// The layout directory.
    pub fn layout(&self) -> &Path {
        &self.layout
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.layout);
    }
}

/// Removes a directory when dropped unless disarmed.
struct RemoveDir(Option<PathBuf>);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// [`pull`] into `req.layout` (a directory of this pull's own, which it
/// creates) that is removed when the pull fails or is cancelled, and
/// when the [`Staged`] it returns is dropped (the build that reads it is
/// done): staging takes disk only while a build runs.
///
/// Errors: as [`pull`].
pub async fn pull_staged(
    req: &PullRequest<'_>,
    progress: &mut (dyn FnMut(&str) + Send),
) -> Result<Staged, RegistryError> {
    let mut guard = RemoveDir(Some(req.layout.to_path_buf()));
    let pulled = pull(req, progress).await?;
    guard.0 = None;
    Ok(Staged { layout: req.layout.to_path_buf(), pulled })
}

/// Pulls `req.reference` into the layout `req.layout` (see the module's
/// documentation); `progress` hears each blob as it starts.
///
/// Errors: [`RegistryError`]; a blob fetch that fails leaves no partial
/// file.
pub async fn pull(req: &PullRequest<'_>, progress: &mut (dyn FnMut(&str) + Send)) -> Result<Pulled, RegistryError> {
    let mut session = Session::new(req)?;
    let blobs = req.layout.join("blobs/sha256");
    tokio::fs::create_dir_all(&blobs).await.map_err(io_err(&blobs, "make directory"))?;
    let mut pulled = Pulled { digest: String::new(), fetched: 0, reused: 0, bytes: 0 };

    progress("manifest");
    let (top, top_digest) = session.top().await?;
    store(&blobs, &top_digest, &top).await?;
    let top_type = media_type(&top)?;
    pulled.digest = top_digest.clone();

    // Under an index: the platform's manifest, by digest.
    let manifest_bytes = if is_index(&top_type) {
        let index: ImageIndex =
            serde_json::from_slice(&top).map_err(|e| RegistryError::Manifest(format!("index {top_digest}: {e}")))?;
        let chosen = choose_manifest(&index, None, &format!("index {top_digest}"))
            .map_err(|e| RegistryError::Manifest(e.to_string()))?
            .digest()
            .to_string();
        check_digest(&chosen).map_err(|e| RegistryError::Manifest(e.to_string()))?;
        let (bytes, _) = session.manifest(&chosen, &format!("manifest {chosen}")).await?;
        store(&blobs, &chosen, &bytes).await?;
        bytes
    } else {
        top.clone()
    };
    let manifest: oci_spec::image::ImageManifest =
        serde_json::from_slice(&manifest_bytes).map_err(|e| RegistryError::Manifest(format!("manifest: {e}")))?;
    let wanted: Vec<oci_spec::image::Descriptor> =
        std::iter::once(manifest.config().clone()).chain(manifest.layers().iter().cloned()).collect();

    // The declared sizes against the limits, before anything is staged.
    let limits = req.limits;
    let mut total = 0u64;
    for (i, desc) in wanted.iter().enumerate() {
        let what = if i == 0 { "the configuration".to_string() } else { format!("layer {i} ({})", desc.digest()) };
        let (limit, which) = match i {
            0 => (limits.max_document_bytes, "max_document_bytes"),
            _ => (limits.max_blob_bytes, "max_blob_bytes"),
        };
        if desc.size() > limit {
            return Err(session.too_large(&what, desc.size(), limit, which));
        }
        total = total.saturating_add(desc.size());
        if total > limits.max_total_bytes {
            return Err(session.too_large("the image's blobs", total, limits.max_total_bytes, "max_total_bytes"));
        }
    }

    for (i, desc) in wanted.iter().enumerate() {
        let digest = desc.digest().to_string();
        let hex_name = check_digest(&digest).map_err(|e| RegistryError::Manifest(e.to_string()))?;
        let path = blobs.join(hex_name);
        if has_blob(&path, &digest, desc.size()).await {
            pulled.reused += 1;
            continue;
        }
        progress(&if i == 0 {
            "configuration".to_string()
        } else {
            format!("layer {i} of {} ({} bytes)", wanted.len() - 1, desc.size())
        });
        // A temporary file of this pull's own (another pull of the
        // repository may fetch the same blob), removed if the fetch fails.
        let (file, partial) = tempfile::Builder::new()
            .prefix(&format!("{hex_name}.partial."))
            .tempfile_in(&blobs)
            .map_err(io_err(&blobs, "make a file in"))?
            .into_parts();
        let mut out = tokio::fs::File::from_std(file);
        let got = session.blob(&digest, desc.size(), &mut out, &partial).await?;
        out.flush().await.map_err(io_err(&partial, "write"))?;
        out.sync_all().await.map_err(io_err(&partial, "sync"))?;
        partial.persist(&path).map_err(|e| RegistryError::Io {
            path: path.clone(),
            op: "rename to",
            source: e.error,
        })?;
        pulled.fetched += 1;
        pulled.bytes += got;
    }

    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": top_type,
            "digest": top_digest,
            "size": top.len(),
            "annotations": {"org.opencontainers.image.ref.name": req.reference},
        }],
    });
    let write = |name: &str, bytes: Vec<u8>| {
        let path = req.layout.join(name);
        async move { tokio::fs::write(&path, bytes).await.map_err(io_err(&path, "write")) }
    };
    write("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()).await?;
    write("index.json", serde_json::to_vec(&index).expect("JSON of a value")).await?;
    Ok(pulled)
}

/// The longest transport error kept in [`RegistryError::Pull`],
/// characters.
pub const MAX_DETAIL_CHARS: usize = 300;

/// Stores a manifest's bytes under the digest that names it.
async fn store(blobs: &Path, digest: &str, bytes: &[u8]) -> Result<(), RegistryError> {
    let found = sha256_digest(bytes);
    if found != digest {
        return Err(RegistryError::Manifest(format!("manifest {digest}: its bytes hash to {found}")));
    }
    let path = blobs.join(check_digest(digest).map_err(|e| RegistryError::Manifest(e.to_string()))?);
    tokio::fs::write(&path, bytes).await.map_err(io_err(&path, "write"))
}

/// Whether `path` holds the blob `digest` of `size` bytes already.
async fn has_blob(path: &Path, digest: &str, size: u64) -> bool {
    let path = path.to_path_buf();
    let digest = digest.to_string();
    tokio::task::spawn_blocking(move || {
        let Ok(meta) = std::fs::metadata(&path) else { return false };
        if meta.len() != size {
            return false;
        }
        let Ok(mut f) = std::fs::File::open(&path) else { return false };
        let mut h = Sha256::new();
        if std::io::copy(&mut f, &mut h).is_err() {
            return false;
        }
        digest_of(h) == digest
    })
    .await
    .unwrap_or(false)
}

/// The `mediaType` a manifest or index declares (Docker schema 2 and OCI
/// both carry it; an OCI index or manifest without it is told apart by
/// its `manifests` key).
fn media_type(bytes: &[u8]) -> Result<String, RegistryError> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| RegistryError::Manifest(format!("manifest: {e}")))?;
    Ok(match v.get("mediaType").and_then(|m| m.as_str()) {
        Some(m) => m.to_string(),
        None if v.get("manifests").is_some() => ACCEPTED[1].to_string(),
        None => ACCEPTED[0].to_string(),
    })
}
