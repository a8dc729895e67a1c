//! The file family: `sandbox_files_read`, `_write` and `_list` (text and
//! directories), `sandbox_upload` and `sandbox_download` (bytes as base64,
//! in chunks), and large files: `sandbox_files_url` signs a short-lived
//! URL on this server that streams one file in or out (see
//! [`crate::files_url`]), and `sandbox_download_dir` packs a directory as
//! `.tar.gz`, inline when it is small, else behind such a URL.

use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine as _;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_protocol::{DirEntry, FileKind, MAX_FILE_CHUNK};
use tine_sandbox::ExecRequest;

use crate::files_url::{check_path, UrlMethod, DEFAULT_TTL_SECS, MAX_TTL_SECS};
use crate::mcp::bounds::{MAX_BASE64_CHARS, MAX_ID_CHARS, MAX_MODE, MAX_OFFSET, MAX_PATH_CHARS, MAX_TEXT_CHARS};
use crate::mcp::errors::ToolError;
use crate::mcp::{budget, TineMcp};

/// Largest chunk `sandbox_files_read` reads at once (bytes): 160 KiB;
/// less is returned when its JSON escape would not fit the content budget
/// (control characters take up to 6 bytes each).
pub const MAX_READ_BYTES: u64 = 160 << 10;

/// Bytes of JSON the text of one `sandbox_files_read` may take: 160 KiB.
const READ_TEXT_BUDGET: usize = 160 << 10;

/// Largest chunk `sandbox_download` returns at once (bytes): 128 KiB, i.e.
/// 171 KiB of base64, sent twice (structured and text), well within
/// [`budget::RESULT_BUDGET`].
pub const MAX_DOWNLOAD_BYTES: u64 = 128 << 10;

/// Largest archive `sandbox_download_dir` returns inline (bytes, 96 KiB:
/// its base64 fits the result budget twice over); larger ones come as a URL.
pub const INLINE_ARCHIVE_BYTES: u64 = 96 << 10;

/// Longest `tar` may take in the guest (ms).
const TAR_TIMEOUT_MS: u32 = 600_000;

/// `sandbox_files_read` and `sandbox_download`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReadParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// Byte offset to start at (default 0).
    #[serde(default)]
    #[schemars(range(max = MAX_OFFSET))]
    pub offset: u64,
    /// Bytes to read (default: to the end, up to the tool's limit).
    #[schemars(range(max = MAX_OFFSET))]
    pub length: Option<u64>,
}

/// `sandbox_files_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct WriteParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// The text to write (UTF-8, at most 8 MiB).
    #[schemars(length(max = MAX_TEXT_CHARS))]
    pub content: String,
    /// Append instead of replacing.
    #[serde(default)]
    pub append: bool,
    /// Permission bits for a new file, e.g. 493 (0o755); default 420 (0o644).
    #[schemars(range(max = MAX_MODE))]
    pub mode: Option<u32>,
}

/// `sandbox_upload`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct UploadParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// The bytes, base64 (RFC 4648 §4, with padding); at most 8 MiB decoded.
    #[schemars(length(max = MAX_BASE64_CHARS))]
    pub data_base64: String,
    /// Permission bits for a new file (default 0o644).
    #[schemars(range(max = MAX_MODE))]
    pub mode: Option<u32>,
}

/// `sandbox_files_list`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListDirParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path of a directory (default `/`).
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: Option<String>,
}

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

/// `sandbox_files_read`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ReadResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The path.
    pub path: String,
    /// The text read.
    pub content: String,
    /// Where it started (bytes).
    pub offset: u64,
    /// Bytes of the file in `content`.
    pub bytes: u64,
    /// Where to read on (offset + bytes).
    pub next_offset: u64,
    /// The file's whole size as the sandbox reports it (bytes; 0 for
    /// devices and most /proc files).
    pub size: u64,
    /// Bytes after what was returned, by `size`; read on with
    /// `offset: next_offset`.
    pub remaining: u64,
    /// Fewer bytes than asked for were returned, to fit the result budget
    /// or because the chunk ended inside a character.
    pub truncated: bool,
}

/// `sandbox_download`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DownloadResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The path.
    pub path: String,
    /// The bytes, base64 (RFC 4648 §4).
    pub data_base64: String,
    /// Where they start (bytes).
    pub offset: u64,
    /// How many bytes.
    pub bytes: u64,
    /// Where to download on (offset + bytes).
    pub next_offset: u64,
    /// The file's whole size (bytes).
    pub size: u64,
    /// Bytes after these; download on with `offset: next_offset`.
    pub remaining: u64,
}

/// `sandbox_files_write` and `sandbox_upload`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct WriteResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The path.
    pub path: String,
    /// Bytes written.
    pub bytes_written: u64,
}

/// One directory entry.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Entry {
    /// File name.
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    /// Size (bytes).
    pub size: u64,
    /// Permission bits, octal (e.g. `"644"`).
    pub mode: String,
    /// Modification time, ms since the Unix epoch.
    pub mtime_ms: i64,
}

/// `sandbox_files_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListDirResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The directory.
    pub path: String,
    /// Its entries, by name; the first ones only if `truncated`.
    pub entries: Vec<Entry>,
    /// How many entries the directory has.
    pub total_entries: u64,
    /// Entries were left out to fit the result budget.
    pub truncated: bool,
}

impl From<DirEntry> for Entry {
    fn from(e: DirEntry) -> Self {
        Entry {
            name: e.name,
            kind: match e.stat.kind {
                FileKind::File => "file",
                FileKind::Dir => "dir",
                FileKind::Symlink => "symlink",
                FileKind::Other => "other",
            }
            .into(),
            size: e.stat.size,
            mode: format!("{:o}", e.stat.mode & 0o7777),
            mtime_ms: e.stat.mtime_ms,
        }
    }
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

impl TineMcp {
    /// The base URLs of this request start with.
    pub(super) fn url_base(&self, ctx: &RequestContext<RoleServer>) -> String {
        self.files.base_for(ctx.extensions.get::<axum::http::request::Parts>())
    }

    /// The grant file URLs of sandbox `id` are signed over.
    pub(super) fn url_grant(&self, id: &str) -> String {
        self.auth.url_grant(self.manager.tenant_of(id).flatten().as_deref())
    }
}

#[tool_router(router = files_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "Read a text file from a sandbox (UTF-8, up to 160 KiB per call, less when the text \
                       needs much JSON escaping; read on with offset: next_offset). For binary files use \
                       sandbox_download.",
        annotations(title = "Read file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_read(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<ReadResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let length = p.length.unwrap_or(MAX_READ_BYTES).min(MAX_READ_BYTES);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await?;
        let read = f.data.len();
        let mut data = f.data;
        if let Err(e) = std::str::from_utf8(&data) {
            // A character cut by the chunk's end is read next time.
            let cut_at_end = e.error_len().is_none() && read as u64 == length && e.valid_up_to() > 0;
            if !cut_at_end {
                return Err(ToolError::NotUtf8 {
                    path: p.path,
                    offset: p.offset.saturating_add(e.valid_up_to() as u64),
                });
            }
            data.truncate(e.valid_up_to());
        }
        let text = String::from_utf8(data).unwrap_or_default();
        let content = budget::cut(text, READ_TEXT_BUDGET).text;
        let n = content.len() as u64;
        Ok(Json(ReadResult {
            sandbox_id: id,
            path: p.path,
            content,
            offset: p.offset,
            bytes: n,
            next_offset: p.offset.saturating_add(n),
            size: f.size,
            remaining: f.size.saturating_sub(p.offset.saturating_add(n)),
            truncated: n < read as u64,
        }))
    }

    #[tool(
        description = "Write a text file in a sandbox (replacing it, or appending), making missing parent \
                       directories. For binary data use sandbox_upload.",
        annotations(title = "Write file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_write(
        &self,
        Parameters(p): Parameters<WriteParams>,
    ) -> Result<Json<WriteResult>, ToolError> {
        if p.content.len() as u64 > MAX_FILE_CHUNK {
            return Err(ToolError::WriteTooLargeForOneCall { bytes: p.content.len() });
        }
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), p.content.into_bytes(), p.mode, p.append).await?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "List a directory in a sandbox: names, kinds, sizes, modes and modification times. A \
                       directory too large for the result budget lists its first entries (truncated, \
                       total_entries).",
        annotations(title = "List directory", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_list(
        &self,
        Parameters(p): Parameters<ListDirParams>,
    ) -> Result<Json<ListDirResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let path = p.path.unwrap_or_else(|| "/".into());
        let entries = self.manager.list_dir(&id, path.clone()).await?;
        let mut entries: Vec<Entry> = entries.into_iter().map(Entry::from).collect();
        let total_entries = entries.len() as u64;
        let room = budget::CONTENT_BUDGET.saturating_sub(256 + budget::escaped_len(&path) + budget::escaped_len(&id));
        let truncated = budget::fit_list(&mut entries, room) > 0;
        Ok(Json(ListDirResult { sandbox_id: id, path, entries, total_entries, truncated }))
    }

    #[tool(
        description = "Upload bytes (base64) to a file in a sandbox, at most 8 MiB per call.",
        annotations(title = "Upload file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_upload(&self, Parameters(p): Parameters<UploadParams>) -> Result<Json<WriteResult>, ToolError> {
        let data = base64::engine::general_purpose::STANDARD.decode(p.data_base64.trim())?;
        if data.len() as u64 > MAX_FILE_CHUNK {
            return Err(ToolError::WriteTooLargeForOneCall { bytes: data.len() });
        }
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), data, p.mode, false).await?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "Download a file from a sandbox as base64, at most 128 KiB (131072 bytes) per call: call \
                       again with offset: next_offset until remaining is 0.",
        annotations(title = "Download file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_download(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<DownloadResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let max = MAX_DOWNLOAD_BYTES;
        let length = p.length.unwrap_or(max).min(max);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await?;
        let n = f.data.len() as u64;
        Ok(Json(DownloadResult {
            sandbox_id: id,
            path: p.path,
            data_base64: base64::engine::general_purpose::STANDARD.encode(&f.data),
            offset: p.offset,
            bytes: n,
            next_offset: p.offset.saturating_add(n),
            size: f.size,
            remaining: f.size.saturating_sub(p.offset.saturating_add(n)),
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
        let script =
            format!("tar -czf {} -C {} .", crate::mcp::shell_quote(&archive), crate::mcp::shell_quote(&p.path));
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
            UrlMethod::Get => format!("curl -fsS -o FILE {}", crate::mcp::shell_quote(&signed.url)),
            UrlMethod::Put => format!("curl -fsS -T FILE {}", crate::mcp::shell_quote(&signed.url)),
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
}
