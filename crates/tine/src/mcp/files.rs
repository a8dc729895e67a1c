//! Large files: `sandbox_files_url` signs a short-lived URL on this server
//! that streams one file in or out (see [`crate::files_url`]), and
//! `sandbox_download_dir` packs a directory as `.tar.gz`, inline when it is
//! small, else behind such a URL.

use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine as _;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_protocol::FileKind;
use tine_sandbox::ExecRequest;

use super::bounds::{MAX_ID_CHARS, MAX_PATH_CHARS};
use super::errors::ToolError;
use super::TineMcp;
use crate::files_url::{check_path, UrlMethod, DEFAULT_TTL_SECS, MAX_TTL_SECS};

/// Largest archive `sandbox_download_dir` returns inline (bytes, 96 KiB:
/// its base64 fits the result budget twice over); larger ones come as a URL.
pub const INLINE_ARCHIVE_BYTES: u64 = 96 << 10;
/// Longest `tar` may take in the guest (ms).
const TAR_TIMEOUT_MS: u32 = 600_000;

/// `sandbox_files_url`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct FilesUrlParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path of the file in the sandbox (for PUT: created or
    /// replaced once the upload completes).
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// "GET" to download the file, "PUT" to upload it.
    pub method: UrlMethod,
    /// Seconds the URL stays valid (default 900, at most 86400).
    #[schemars(range(min = 1, max = MAX_TTL_SECS))]
    pub ttl_secs: Option<u64>,
}

/// `sandbox_files_url`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct FilesUrlResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The file.
    pub path: String,
    /// "GET" or "PUT".
    pub method: String,
    /// The URL: no Authorization header needed; valid only for this
    /// method, sandbox and path, until `expires_at_ms`.
    pub url: String,
    /// Expiry (ms since the Unix epoch).
    pub expires_at_ms: u64,
    /// A curl command line that uses it (FILE: a local file).
    pub curl: String,
}

/// `sandbox_download_dir`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct DownloadDirParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path of the directory in the sandbox.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
}

/// `sandbox_download_dir`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DownloadDirResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The directory.
    pub path: String,
    /// Size of the `.tar.gz` (bytes).
    pub bytes: u64,
    /// The archive itself (base64), when at most 96 KiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// Else a GET URL for it (see sandbox_files_url).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The URL's expiry (ms since the Unix epoch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Where the archive stays in the sandbox while the URL is used
    /// (remove it when done); absent when returned inline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archive_path: Option<String>,
}

/// `s` quoted for bash: inside single quotes, each `'` as `'\''`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

impl TineMcp {
    /// The base URLs of this request start with.
    fn url_base(&self, ctx: &RequestContext<RoleServer>) -> String {
        self.files.base_for(ctx.extensions.get::<axum::http::request::Parts>())
    }

    /// The grant file URLs of sandbox `id` are signed over.
    fn url_grant(&self, id: &str) -> String {
        self.auth.url_grant(self.manager.tenant_of(id).flatten().as_deref())
    }
}

#[tool_router(router = files_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "Get a short-lived URL on this server that moves one sandbox file over plain HTTP, streamed, \
                       for files of any size (MCP messages cap at about 1 MiB): method GET downloads it \
                       (curl -o FILE URL), PUT uploads it (curl -T FILE URL; the file appears whole when the \
                       upload ends). The URL needs no token, works only for this sandbox, path and method, and \
                       expires after ttl_secs (default 900). Anyone holding it can use it until then.",
        annotations(title = "File URL", read_only_hint = false, destructive_hint = false, open_world_hint = false)
    )]
    async fn sandbox_files_url(
        &self,
        Parameters(p): Parameters<FilesUrlParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<FilesUrlResult>, ToolError> {
        check_path(&p.path)?;
        let ttl = p.ttl_secs.unwrap_or(DEFAULT_TTL_SECS);
        if !(1..=MAX_TTL_SECS).contains(&ttl) {
            return Err(crate::files_url::UrlError::BadTtl(ttl).into());
        }
        let id = self.target(p.sandbox_id).await?;
        if p.method == UrlMethod::Get {
            // Refuse now what the URL could not serve.
            let st = self.manager.stat(&id, p.path.clone()).await?;
            if st.kind != FileKind::File {
                return Err(ToolError::NotAFile { path: p.path });
            }
        }
        let signed = self.files.url(&self.url_base(&ctx), p.method, (&id, &self.url_grant(&id)), &p.path, ttl)?;
        let curl = match p.method {
            UrlMethod::Get => format!("curl -fsS -o FILE {}", shell_quote(&signed.url)),
            UrlMethod::Put => format!("curl -fsS -T FILE {}", shell_quote(&signed.url)),
        };
        Ok(Json(FilesUrlResult {
            sandbox_id: id,
            path: p.path,
            method: p.method.as_str().into(),
            url: signed.url,
            expires_at_ms: signed.expires_at_ms,
            curl,
        }))
    }

    #[tool(
        description = "Download a directory of a sandbox as a .tar.gz: inline as base64 when it is at most \
                       96 KiB, else as a GET URL (see sandbox_files_url) to an archive left in the sandbox's /tmp.",
        annotations(
            title = "Download directory",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_download_dir(
        &self,
        Parameters(p): Parameters<DownloadDirParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<DownloadDirResult>, ToolError> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        check_path(&p.path)?;
        let id = self.target(p.sandbox_id).await?;
        let st = self.manager.stat(&id, p.path.clone()).await?;
        if st.kind != FileKind::Dir {
            return Err(ToolError::NotADir { path: p.path });
        }
        let archive = format!("/tmp/tine-dir-{}-{}.tar.gz", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let script = format!("tar -czf {} -C {} .", shell_quote(&archive), shell_quote(&p.path));
        let req = ExecRequest { command: script, timeout_ms: TAR_TIMEOUT_MS, ..ExecRequest::default() };
        let x = self.manager.exec(&id, req).await?;
        if x.status != tine_protocol::ExitStatus::Code(0) {
            let _ = self.manager.remove(&id, archive, false).await;
            return Err(ToolError::Tar {
                stderr: String::from_utf8_lossy(&x.stderr.data).chars().take(2000).collect(),
            });
        }
        let size = self.manager.stat(&id, archive.clone()).await?.size;
        let mut r = DownloadDirResult {
            sandbox_id: id.clone(),
            path: p.path,
            bytes: size,
            data_base64: None,
            url: None,
            expires_at_ms: None,
            archive_path: None,
        };
        if size <= INLINE_ARCHIVE_BYTES {
            let f = self.manager.read_file(&id, archive.clone(), 0, Some(size)).await?;
            let _ = self.manager.remove(&id, archive, false).await;
            r.data_base64 = Some(base64::engine::general_purpose::STANDARD.encode(&f.data));
        } else {
            let grant = self.url_grant(&id);
            let signed =
                self.files.url(&self.url_base(&ctx), UrlMethod::Get, (&id, &grant), &archive, DEFAULT_TTL_SECS)?;
            r.url = Some(signed.url);
            r.expires_at_ms = Some(signed.expires_at_ms);
            r.archive_path = Some(archive);
        }
        Ok(Json(r))
    }
}
