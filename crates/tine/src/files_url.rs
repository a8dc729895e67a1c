//! Signed file URLs: `sandbox_files_url` hands out short-lived URLs on this
//! server that move one file of one sandbox in one direction over plain
//! HTTP, streamed (a GiB file is never held in memory), for files too large
//! for MCP messages.
//!
//! A URL is `<base>/files/<sandbox_id>?path=<path>&exp=<unix s>&sig=<hex>`,
//! where `sig` is HMAC-SHA256 (RFC 2104) under a key drawn from the kernel
//! at server start over the method, sandbox id, path, expiry and the
//! sandbox's grant (its tenant and the SHA-256 of that tenant's API key,
//! [`crate::auth::Auth::url_grant`]). So a URL needs no bearer token, works
//! only for its method, sandbox and path and only until `exp`, ends when
//! the tenant's key is rotated or the tenant removed, and dies with the
//! server process (a restart draws a new key). Whoever holds a URL can use it until it expires: hand it only
//! to what should read or write that file.
//!
//! `GET` answers the file's bytes (`Content-Length` from its size when the
//! transfer starts) in [`CHUNK_BYTES`] reads through the agent. `PUT`
//! writes the request body to `<path>.tine-upload-<n>` in [`CHUNK_BYTES`]
//! writes, then renames it onto `path` (rename(2): readers never see a
//! half-written file); a failed upload removes the partial file. The
//! server holds at most about two chunks per transfer.

use std::collections::HashMap;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::StreamExt;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tine_protocol::{AgentError, FileKind};
use tine_sandbox::{Manager, SandboxError};

/// Bytes moved per agent read or write (1 MiB): the server's memory per
/// transfer is about twice this.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Default lifetime of a URL (s).
pub const DEFAULT_TTL_SECS: u64 = 900;
/// Longest lifetime of a URL (s): 24 h.
pub const MAX_TTL_SECS: u64 = 86_400;
/// Longest path a URL may name (bytes), as Linux's PATH_MAX.
pub const MAX_PATH_BYTES: usize = 4096;

type HmacSha256 = Hmac<Sha256>;

/// The direction a URL moves its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum UrlMethod {
    /// Download: `curl -o FILE URL`.
    Get,
    /// Upload: `curl -T FILE URL`.
    Put,
}

impl UrlMethod {
    /// The HTTP method's name.
    pub fn as_str(self) -> &'static str {
        match self {
            UrlMethod::Get => "GET",
            UrlMethod::Put => "PUT",
        }
    }
}

/// Why a URL is refused or cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlError {
    /// The signature does not match (another path, sandbox or method, or a
    /// URL made by another server process).
    #[error("this URL is not valid for this method, sandbox and path (or the server restarted since it was made); ask for a new one with sandbox_files_url")]
    BadSignature,
    /// Past its expiry.
    #[error("this URL expired {secs_ago} s ago; ask for a new one with sandbox_files_url")]
    Expired {
        /// Seconds since it expired.
        secs_ago: u64,
    },
    /// A path the server does not sign.
    #[error("path must be absolute, without NUL, at most {MAX_PATH_BYTES} bytes")]
    BadPath,
    /// A lifetime out of range.
    #[error("ttl_secs must be 1..={MAX_TTL_SECS}, got {0}")]
    BadTtl(u64),
    /// The kernel's random source failed at start.
    #[error("cannot draw the URL signing key: {0}")]
    Key(String),
}

/// The signing key and where URLs point.
pub struct FileUrls {
    key: [u8; 32],
    /// `scheme://host[:port]` URLs start with when configured
    /// (`public_url`); else each URL takes the MCP request's `Host`.
    public_url: Option<String>,
    /// Used when neither is known: the listen address.
    fallback_base: String,
    /// Uploads in flight get distinct temporary names.
    next_upload: AtomicU64,
}

/// A URL made by [`FileUrls::url`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedUrl {
    /// The URL.
    pub url: String,
    /// When it expires (ms since the Unix epoch).
    pub expires_at_ms: u64,
}

fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

/// Checks a path a URL may name: absolute, no NUL, at most
/// [`MAX_PATH_BYTES`].
///
/// Errors: [`UrlError::BadPath`].
pub fn check_path(path: &str) -> Result<(), UrlError> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > MAX_PATH_BYTES {
        return Err(UrlError::BadPath);
    }
    Ok(())
}

impl FileUrls {
    /// A new key from the kernel's random source (getrandom(2) through
    /// `/dev/urandom`); URLs point at `public_url` when given, else at the
    /// `Host` of the request that asks, else at `http://<listen>`.
    ///
    /// Errors: [`UrlError::Key`].
    pub fn new(public_url: Option<String>, listen: std::net::SocketAddr) -> Result<Self, UrlError> {
        let mut key = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .map_err(|e| UrlError::Key(e.to_string()))?;
        Ok(FileUrls {
            key,
            public_url: public_url.map(|u| u.trim_end_matches('/').to_string()),
            fallback_base: format!("http://{listen}"),
            next_upload: AtomicU64::new(1),
        })
    }

    fn mac(&self, method: UrlMethod, sandbox: &str, path: &str, exp: u64, grant: &str) -> HmacSha256 {
        // HMAC takes keys of any length (RFC 2104 §2): this cannot fail.
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        // NUL separates the fields: none of them can hold one.
        for part in ["tine-file-url-v2", method.as_str(), sandbox, path, &exp.to_string(), grant] {
            mac.update(part.as_bytes());
            mac.update(&[0]);
        }
        mac
    }

    /// The base URLs start with: the configured `public_url`, else
    /// `scheme://host` from the asking request (`X-Forwarded-Proto` or
    /// http), else the listen address.
    pub fn base_for(&self, parts: Option<&axum::http::request::Parts>) -> String {
        if let Some(u) = &self.public_url {
            return u.clone();
        }
        let header = |name: &str| parts.and_then(|p| p.headers.get(name)).and_then(|v| v.to_str().ok());
        match header("host") {
            Some(host) => {
                let scheme = match header("x-forwarded-proto") {
                    Some("https") => "https",
                    _ => "http",
                };
                format!("{scheme}://{host}")
            }
            None => self.fallback_base.clone(),
        }
    }

    /// A URL for `method` on `path` of `sandbox`, valid `ttl_secs` from now
    /// while the sandbox's `grant` ([`crate::auth::Auth::url_grant`]) holds.
    ///
    /// Errors: [`UrlError::BadPath`], [`UrlError::BadTtl`].
    pub fn url(
        &self,
        base: &str,
        method: UrlMethod,
        (sandbox, grant): (&str, &str),
        path: &str,
        ttl_secs: u64,
    ) -> Result<SignedUrl, UrlError> {
        check_path(path)?;
        if !(1..=MAX_TTL_SECS).contains(&ttl_secs) {
            return Err(UrlError::BadTtl(ttl_secs));
        }
        let exp = unix_secs() + ttl_secs;
        let sig = hex(&self.mac(method, sandbox, path, exp, grant).finalize().into_bytes());
        let query: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("path", path)
            .append_pair("exp", &exp.to_string())
            .append_pair("sig", &sig)
            .finish();
        let id: String = form_urlencoded::byte_serialize(sandbox.as_bytes()).collect();
        Ok(SignedUrl { url: format!("{base}/files/{id}?{query}"), expires_at_ms: exp * 1000 })
    }

    /// Checks a URL's fields at `now` (Unix s) against the sandbox's grant
    /// now: the signature first (in constant time), then the expiry.
    ///
    /// Errors: [`UrlError::BadSignature`], [`UrlError::Expired`].
    pub fn verify(
        &self,
        method: UrlMethod,
        (sandbox, grant): (&str, &str),
        path: &str,
        exp: u64,
        sig: &str,
        now: u64,
    ) -> Result<(), UrlError> {
        let sig = unhex(sig).ok_or(UrlError::BadSignature)?;
        self.mac(method, sandbox, path, exp, grant).verify_slice(&sig).map_err(|_| UrlError::BadSignature)?;
        if now > exp {
            return Err(UrlError::Expired { secs_ago: now - exp });
        }
        Ok(())
    }
}

/// The routes' state.
#[derive(Clone)]
struct FilesState {
    manager: Arc<Manager>,
    urls: Arc<FileUrls>,
    auth: Arc<crate::auth::Auth>,
}

/// `/files/{sandbox_id}`: `GET` and `PUT` of signed URLs (no bearer token;
/// the signature is the credential).
pub fn routes(manager: Arc<Manager>, urls: Arc<FileUrls>, auth: Arc<crate::auth::Auth>) -> Router {
    Router::new().route("/files/{sandbox}", get(download).put(upload)).with_state(FilesState { manager, urls, auth })
}

/// A refused request: its status and message, answered as JSON
/// (`{"error": reason phrase, "message": ...}`).
#[derive(Debug)]
pub(crate) struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let Refusal(status, message) = self;
        let body = serde_json::json!({ "error": status.canonical_reason().unwrap_or("error"), "message": message });
        (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }
}

pub(crate) fn refuse(status: StatusCode, message: impl std::fmt::Display) -> Refusal {
    Refusal(status, message.to_string())
}

/// The status a sandbox error answers with.
pub(crate) fn sandbox_refusal(e: &SandboxError) -> Refusal {
    let status = match e {
        SandboxError::NotFound(_) | SandboxError::Agent(AgentError::NotFound { .. }) => StatusCode::NOT_FOUND,
        SandboxError::Agent(AgentError::PermissionDenied { .. }) => StatusCode::FORBIDDEN,
        SandboxError::Agent(AgentError::IsADirectory { .. } | AgentError::NotADirectory { .. }) => StatusCode::CONFLICT,
        SandboxError::Agent(AgentError::NoSpace) => StatusCode::INSUFFICIENT_STORAGE,
        SandboxError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    };
    refuse(status, e)
}

/// Verifies the request's URL for `method`; returns the path it names.
fn verified(s: &FilesState, method: UrlMethod, sandbox: &str, q: &HashMap<String, String>) -> Result<String, Refusal> {
    let (Some(path), Some(exp), Some(sig)) = (q.get("path"), q.get("exp"), q.get("sig")) else {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "a file URL carries path, exp and sig; ask sandbox_files_url for one",
        ));
    };
    let exp: u64 = exp.parse().map_err(|_| refuse(StatusCode::FORBIDDEN, UrlError::BadSignature))?;
    let grant = s.auth.url_grant(s.manager.tenant_of(sandbox).flatten().as_deref());
    s.urls
        .verify(method, (sandbox, &grant), path, exp, sig, unix_secs())
        .map_err(|e| refuse(StatusCode::FORBIDDEN, e))?;
    Ok(path.clone())
}

async fn download(
    State(s): State<FilesState>,
    Path(sandbox): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, Refusal> {
    let path = verified(&s, UrlMethod::Get, &sandbox, &q)?;
    let stat = s.manager.stat(&sandbox, path.clone()).await.map_err(|e| sandbox_refusal(&e))?;
    if stat.kind != FileKind::File {
        return Err(refuse(StatusCode::CONFLICT, format!("{path} is not a regular file")));
    }
    let size = stat.size;
    let name = path.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("file").replace(['"', '\\'], "_");
    let manager = s.manager.clone();
    // One chunk at a time, as the client takes them; a read that fails ends
    // the body early (the client sees a short transfer against
    // Content-Length).
    let chunks = futures_util::stream::unfold(0u64, move |offset| {
        let (manager, sandbox, path) = (manager.clone(), sandbox.clone(), path.clone());
        async move {
            if offset >= size {
                return None;
            }
            let want = (size - offset).min(CHUNK_BYTES as u64);
            match manager.read_file(&sandbox, path.clone(), offset, Some(want)).await {
                Ok(d) if !d.data.is_empty() => {
                    let next = offset + d.data.len() as u64;
                    Some((Ok::<Bytes, std::io::Error>(Bytes::from(d.data)), next))
                }
                Ok(_) => {
                    tracing::warn!(sandbox, path, "file shrank during a download at {offset} of {size} bytes");
                    Some((Err(std::io::Error::other("the file shrank during the download")), size))
                }
                Err(e) => {
                    tracing::warn!(sandbox, path, "download failed at {offset} of {size} bytes: {e}");
                    Some((Err(std::io::Error::other(e.to_string())), size))
                }
            }
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
            (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}\"")),
        ],
        Body::from_stream(chunks),
    )
        .into_response())
}

async fn upload(
    State(s): State<FilesState>,
    Path(sandbox): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    req: Request,
) -> Result<Response, Refusal> {
    debug_assert_eq!(req.method(), Method::PUT);
    let path = verified(&s, UrlMethod::Put, &sandbox, &q)?;
    let n = s.urls.next_upload.fetch_add(1, Ordering::Relaxed);
    let part = format!("{path}.tine-upload-{n}");
    let moved = match receive(&s.manager, &sandbox, &part, req.into_body()).await {
        Ok(bytes) => s
            .manager
            .rename(&sandbox, part.clone(), path.clone())
            .await
            .map(|()| bytes)
            .map_err(|e| sandbox_refusal(&e)),
        Err(r) => Err(r),
    };
    match moved {
        Ok(bytes) => {
            let body = serde_json::json!({ "path": path, "bytes_written": bytes });
            Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response())
        }
        Err(r) => {
            let _ = s.manager.remove(&sandbox, part, false).await;
            Err(r)
        }
    }
}

/// Writes `body` to `part` in [`CHUNK_BYTES`] writes (the first creates or
/// truncates it); returns the bytes written.
async fn receive(manager: &Manager, sandbox: &str, part: &str, body: Body) -> Result<u64, Refusal> {
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK_BYTES);
    let mut written = 0u64;
    let flush = async |buf: &mut Vec<u8>, written: &mut u64| -> Result<(), Refusal> {
        let data = std::mem::replace(buf, Vec::with_capacity(CHUNK_BYTES));
        let len = data.len() as u64;
        manager
            .write_file(sandbox, part.to_string(), data, None, *written > 0)
            .await
            .map_err(|e| sandbox_refusal(&e))?;
        *written += len;
        Ok(())
    };
    loop {
        match tokio::time::timeout(BODY_STALL, stream.next()).await {
            Ok(Some(Ok(mut bytes))) => {
                while !bytes.is_empty() {
                    let take = (CHUNK_BYTES - buf.len()).min(bytes.len());
                    buf.extend_from_slice(&bytes.split_to(take));
                    if buf.len() == CHUNK_BYTES {
                        flush(&mut buf, &mut written).await?;
                    }
                }
            }
            Ok(Some(Err(e))) => return Err(refuse(StatusCode::BAD_REQUEST, format!("reading the request body: {e}"))),
            Ok(None) => break,
            Err(_) => {
                return Err(refuse(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("no body bytes for {} s; the upload was dropped", BODY_STALL.as_secs()),
                ))
            }
        }
    }
    // The last piece, or an empty file.
    if !buf.is_empty() || written == 0 {
        flush(&mut buf, &mut written).await?;
    }
    Ok(written)
}

/// An upload whose body sends nothing for this long is dropped.
const BODY_STALL: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    fn urls() -> FileUrls {
        FileUrls::new(None, "127.0.0.1:5555".parse().unwrap()).unwrap()
    }

    fn fields(url: &str) -> (String, HashMap<String, String>) {
        let (head, query) = url.split_once('?').unwrap();
        let id = head.rsplit('/').next().unwrap().to_string();
        (id, form_urlencoded::parse(query.as_bytes()).into_owned().collect())
    }

    #[test]
    fn a_url_is_good_for_its_method_sandbox_and_path_until_it_expires() {
        let u = urls();
        let path = "/root/data dir/file #1?.bin";
        let s = u.url("http://h:1", UrlMethod::Put, ("sb-3", "acme:k1"), path, 60).unwrap();
        assert!(
            s.url.starts_with("http://h:1/files/sb-3?path=%2Froot%2Fdata+dir%2Ffile+%231%3F.bin&exp="),
            "{}",
            s.url
        );
        let (id, q) = fields(&s.url);
        let exp: u64 = q["exp"].parse().unwrap();
        assert_eq!(s.expires_at_ms, exp * 1000);
        let now = exp - 60;
        assert_eq!(u.verify(UrlMethod::Put, (&id, "acme:k1"), &q["path"], exp, &q["sig"], now), Ok(()));
        // Another method, sandbox, path or expiry: refused.
        assert_eq!(
            u.verify(UrlMethod::Get, (&id, "acme:k1"), &q["path"], exp, &q["sig"], now),
            Err(UrlError::BadSignature)
        );
        assert_eq!(
            u.verify(UrlMethod::Put, ("sb-4", "acme:k1"), &q["path"], exp, &q["sig"], now),
            Err(UrlError::BadSignature)
        );
        assert_eq!(
            u.verify(UrlMethod::Put, (&id, "acme:k1"), "/root/other", exp, &q["sig"], now),
            Err(UrlError::BadSignature)
        );
        assert_eq!(
            u.verify(UrlMethod::Put, (&id, "acme:k1"), &q["path"], exp + 1, &q["sig"], now),
            Err(UrlError::BadSignature)
        );
        assert_eq!(u.verify(UrlMethod::Put, (&id, "acme:k1"), &q["path"], exp, "zz", now), Err(UrlError::BadSignature));
        // The tenant's key rotated: another grant.
        assert_eq!(
            u.verify(UrlMethod::Put, (&id, "acme:k2"), &q["path"], exp, &q["sig"], now),
            Err(UrlError::BadSignature)
        );
        // Expired.
        assert_eq!(
            u.verify(UrlMethod::Put, (&id, "acme:k1"), &q["path"], exp, &q["sig"], exp + 5),
            Err(UrlError::Expired { secs_ago: 5 })
        );
        // Another server process (another key) does not take it.
        assert_eq!(
            urls().verify(UrlMethod::Put, (&id, "acme:k1"), &q["path"], exp, &q["sig"], now),
            Err(UrlError::BadSignature)
        );
    }

    #[test]
    fn bad_paths_and_lifetimes_are_refused() {
        let u = urls();
        for p in ["relative", "", "/a\0b"] {
            assert_eq!(u.url("http://h", UrlMethod::Get, ("sb-1", "acme:k1"), p, 60), Err(UrlError::BadPath), "{p:?}");
        }
        assert_eq!(
            u.url("http://h", UrlMethod::Get, ("sb-1", "acme:k1"), &format!("/{}", "a".repeat(4096)), 60),
            Err(UrlError::BadPath)
        );
        assert_eq!(u.url("http://h", UrlMethod::Get, ("sb-1", "acme:k1"), "/a", 0), Err(UrlError::BadTtl(0)));
        assert_eq!(
            u.url("http://h", UrlMethod::Get, ("sb-1", "acme:k1"), "/a", MAX_TTL_SECS + 1),
            Err(UrlError::BadTtl(MAX_TTL_SECS + 1))
        );
    }

    #[test]
    fn the_base_comes_from_the_config_then_the_request() {
        let u = urls();
        assert_eq!(u.base_for(None), "http://127.0.0.1:5555");
        let req = axum::http::Request::builder()
            .header("host", "tine.internal:8080")
            .header("x-forwarded-proto", "https")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        assert_eq!(u.base_for(Some(&parts)), "https://tine.internal:8080");
        let configured = FileUrls::new(Some("https://files.example/".into()), "127.0.0.1:1".parse().unwrap()).unwrap();
        assert_eq!(configured.base_for(Some(&parts)), "https://files.example");
    }
}
