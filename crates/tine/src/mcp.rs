//! The MCP tools (MCP 2025-06-18 / 2025-11-25, "Tools"): one
//! [`TineMcp`] per MCP session, all sharing the sandbox [`Manager`].
//!
//! Every tool that takes `sandbox_id` also works without it, on the
//! session's own sandbox: created on first use, killed when the session
//! ends. Results are structured (`structuredContent`, with the same JSON
//! as text); failures are tool results with `isError: true` and a short
//! message that says what to do next.

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{Implementation, ServerCapabilities, ServerConfig};
use rmcp::{tool, tool_handler, tool_router, Json, ServerHandler};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_protocol::{ExitStatus, FileKind, Output, MAX_FILE_CHUNK};
use tine_sandbox::{
    BranchResult, DiffOptions, DiffReport, ExecRequest, Manager, SandboxError, SandboxInfo, SandboxSpec, TemplateInfo,
};

/// The label that marks a session's own sandbox.
pub const SESSION_LABEL: &str = "tine/session-sandbox";
/// Largest text `sandbox_files_read` returns at once (bytes).
pub const MAX_READ_BYTES: u64 = 1 << 20;

/// The session's own sandbox; killed when the session's handler goes.
struct SessionSandbox {
    manager: Arc<Manager>,
    id: tokio::sync::Mutex<Option<String>>,
    runtime: tokio::runtime::Handle,
}

impl Drop for SessionSandbox {
    fn drop(&mut self) {
        if let Some(id) = self.id.get_mut().take() {
            let manager = self.manager.clone();
            tracing::info!(sandbox = %id, "MCP session ended: killing its sandbox");
            self.runtime.spawn(async move {
                let _ = manager.kill(&id).await;
            });
        }
    }
}

/// One MCP session's handler.
#[derive(Clone)]
pub struct TineMcp {
    manager: Arc<Manager>,
    session: Arc<SessionSandbox>,
    tool_router: ToolRouter<Self>,
}

// ---- Parameters -------------------------------------------------------

/// `sandbox_create`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct CreateParams {
    /// vCPUs (default 1).
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (default 512).
    pub memory_mib: Option<u64>,
    /// Labels to find the sandbox by later (`sandbox_list`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Kill the sandbox after this many seconds without a tool call on it
    /// (default 900).
    pub idle_timeout_secs: Option<u64>,
    /// Start from this template (see template_list) instead of the default
    /// one: its memory, processes, files and Python state. vcpus and
    /// memory_mib come from the template.
    pub template: Option<String>,
}

/// `sandbox_snapshot`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct SnapshotParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// The new template's name: 1-63 lowercase letters, digits, '-' or '_'.
    pub name: String,
}

/// `template_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateListResult {
    /// Every template, by name.
    pub templates: Vec<TemplateInfo>,
}

/// `sandbox_branch`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct BranchParams {
    /// The sandbox to branch (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// How many children (at least 1; at most the live-sandbox limit minus
    /// the live sandboxes).
    pub n: usize,
}

/// `sandbox_diff`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct DiffParams {
    /// One sandbox ("before").
    pub a: String,
    /// The other ("after").
    pub b: String,
    /// Also return a unified diff of each changed text file up to
    /// max_text_bytes (default false).
    #[serde(default)]
    pub unified: bool,
    /// Largest file (bytes) that gets a unified diff (default 65536).
    pub max_text_bytes: Option<u64>,
}

/// `sandbox_merge_into`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct MergeParams {
    /// The sandbox whose state wins: a sandbox branched (directly or not)
    /// from parent. Its id ceases to exist.
    pub winner: String,
    /// The sandbox that takes the winner's state and keeps its own id.
    pub parent: String,
}

/// Tools that only need the sandbox.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct SandboxParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
}

/// `sandbox_list`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ListParams {
    /// Only sandboxes that carry all of these labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// `sandbox_exec`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ExecParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// A bash script, run as `bash -c` in its own process group.
    pub command: String,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Text fed to stdin.
    pub stdin: Option<String>,
    /// Kill the command (and its children) after this many seconds
    /// (default 60, at most 600).
    pub timeout_secs: Option<u32>,
}

/// `sandbox_run_python`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PythonParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Python code; variables, imports and definitions persist between
    /// calls; the value of a final expression is returned.
    pub code: String,
    /// Interrupt the code after this many seconds; the interpreter's state
    /// is kept (default 60, at most 600).
    pub timeout_secs: Option<u32>,
}

/// `sandbox_files_read` and `sandbox_download`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReadParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox.
    pub path: String,
    /// Byte offset to start at (default 0).
    #[serde(default)]
    pub offset: u64,
    /// Bytes to read (default: to the end, up to the tool's limit).
    pub length: Option<u64>,
}

/// `sandbox_files_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct WriteParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    pub path: String,
    /// The text to write (UTF-8).
    pub content: String,
    /// Append instead of replacing.
    #[serde(default)]
    pub append: bool,
    /// Permission bits for a new file, e.g. 493 (0o755); default 420 (0o644).
    pub mode: Option<u32>,
}

/// `sandbox_upload`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct UploadParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    pub path: String,
    /// The bytes, base64 (RFC 4648 §4, with padding); at most 8 MiB decoded.
    pub data_base64: String,
    /// Permission bits for a new file (default 0o644).
    pub mode: Option<u32>,
}

/// `sandbox_files_list`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListDirParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path of a directory (default `/`).
    pub path: Option<String>,
}

// ---- Results ----------------------------------------------------------

/// `sandbox_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListResult {
    /// The sandboxes, by id.
    pub sandboxes: Vec<SandboxInfo>,
}

/// `sandbox_kill`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct KillResult {
    /// The sandbox that is gone.
    pub sandbox_id: String,
    /// Always true.
    pub killed: bool,
}

/// `sandbox_exec`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ExecResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The exit code, if the command exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// Killed at its timeout.
    pub timed_out: bool,
    /// Standard output (invalid UTF-8 replaced).
    pub stdout: String,
    /// Standard error (invalid UTF-8 replaced).
    pub stderr: String,
    /// Output past the 32 KiB cap per stream was dropped.
    pub truncated: bool,
    /// Wall time (ms).
    pub duration_ms: u64,
}

/// A Python exception.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PythonError {
    /// Type name, e.g. `ZeroDivisionError`.
    pub name: String,
    /// `str(exception)`.
    pub message: String,
    /// The traceback.
    pub traceback: String,
}

/// `sandbox_run_python`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PythonResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// `repr()` of the final expression's value, if any.
    pub result: Option<String>,
    /// Printed output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// The exception raised, if any (the state is kept).
    pub error: Option<PythonError>,
    /// Interrupted at its timeout (the state is kept).
    pub timed_out: bool,
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
    /// The file's whole size (bytes).
    pub size: u64,
    /// Bytes after what was returned; read on with `offset`.
    pub remaining: u64,
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
    /// The file's whole size (bytes).
    pub size: u64,
    /// Bytes after these; download on with `offset`.
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
    /// Its entries, by name.
    pub entries: Vec<Entry>,
}

fn text(o: Output) -> String {
    String::from_utf8_lossy(&o.data).into_owned()
}

/// A tool's `timeout_secs` as the agent's milliseconds (0: its default).
fn secs_to_ms(secs: Option<u32>) -> Result<u32, String> {
    let max = tine_protocol::MAX_TIMEOUT_MS / 1000;
    match secs {
        None => Ok(0),
        Some(s) if (1..=max).contains(&s) => Ok(s * 1000),
        Some(s) => Err(format!("timeout_secs must be 1..={max}, got {s}")),
    }
}

fn err(e: SandboxError) -> String {
    e.to_string()
}

#[tool_router]
impl TineMcp {
    /// A handler for a new MCP session.
    pub fn new(manager: Arc<Manager>) -> Self {
        TineMcp {
            session: Arc::new(SessionSandbox {
                manager: manager.clone(),
                id: tokio::sync::Mutex::new(None),
                runtime: tokio::runtime::Handle::current(),
            }),
            manager,
            tool_router: Self::tool_router(),
        }
    }

    /// The sandbox a call is about: the given id, or the session's own
    /// sandbox (created now if it has none, or if it was killed).
    async fn target(&self, id: Option<String>) -> Result<String, String> {
        if let Some(id) = id {
            return Ok(id);
        }
        let mut own = self.session.id.lock().await;
        if let Some(id) = own.as_ref() {
            if self.manager.contains(id) {
                return Ok(id.clone());
            }
        }
        let spec = SandboxSpec {
            labels: BTreeMap::from([(SESSION_LABEL.to_string(), "true".to_string())]),
            ..SandboxSpec::default()
        };
        let info = self.manager.create(spec).await.map_err(err)?;
        *own = Some(info.sandbox_id.clone());
        Ok(info.sandbox_id)
    }

    #[tool(
        description = "Create a new sandbox: an isolated Linux microVM (Debian, bash, Python 3) with its own \
                       kernel. Returns its sandbox_id. Tools called without sandbox_id use this session's own \
                       sandbox instead, created on first use.",
        annotations(
            title = "Create sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_create(&self, Parameters(p): Parameters<CreateParams>) -> Result<Json<SandboxInfo>, String> {
        let spec = SandboxSpec {
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            labels: p.labels,
            idle_timeout_secs: p.idle_timeout_secs,
            template: p.template,
        };
        self.manager.create(spec).await.map(Json).map_err(err)
    }

    #[tool(
        description = "List templates: snapshots of a ready sandbox that sandbox_create { template } starts from \
                       in a fraction of a boot's time. 'default' is what sandbox_create uses when none is named.",
        annotations(title = "List templates", read_only_hint = true, open_world_hint = false)
    )]
    async fn template_list(&self) -> Result<Json<TemplateListResult>, String> {
        Ok(Json(TemplateListResult { templates: self.manager.templates() }))
    }

    #[tool(
        description = "Save a running sandbox as a new template under a name: its memory, running processes, \
                       files and Python state as they are now. The sandbox pauses for the copy and goes on. \
                       Then sandbox_create { template: name } makes copies of it, each with fresh randomness \
                       and the current clock.",
        annotations(
            title = "Snapshot sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_snapshot(&self, Parameters(p): Parameters<SnapshotParams>) -> Result<Json<TemplateInfo>, String> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.snapshot(&id, &p.name).await.map(Json).map_err(err)
    }

    #[tool(
        description = "Branch a running sandbox into n children: each child starts from the sandbox's exact \
                       state at this instant (memory, running processes, Python variables, files) and then goes \
                       its own way; the source keeps running, paused for milliseconds. Children share unchanged \
                       memory. Returns the children's ids. Compare children with sandbox_diff, keep the best with \
                       sandbox_merge_into, kill the rest with sandbox_kill.",
        annotations(
            title = "Branch sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_branch(&self, Parameters(p): Parameters<BranchParams>) -> Result<Json<BranchResult>, String> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.branch(&id, p.n).await.map(Json).map_err(err)
    }

    #[tool(
        description = "Compare two sandboxes' filesystems (everything written since boot, and /tmp): the paths \
                       added, removed and modified from a to b, with size, mode and SHA-256, and on request a \
                       unified diff of small text files.",
        annotations(title = "Diff sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_diff(&self, Parameters(p): Parameters<DiffParams>) -> Result<Json<DiffReport>, String> {
        let mut opts = DiffOptions { unified: p.unified, ..DiffOptions::default() };
        if let Some(max) = p.max_text_bytes {
            opts.max_text_bytes = max;
        }
        self.manager.diff(&p.a, &p.b, opts).await.map(Json).map_err(err)
    }

    #[tool(
        description = "Merge a branched sandbox (winner) into the sandbox it was branched from (parent): the \
                       parent's VM is replaced by the winner's, so the parent's id now has the winner's memory, \
                       processes, Python state and files; the winner's id ceases to exist; other children are \
                       untouched.",
        annotations(
            title = "Merge sandbox into its parent",
            read_only_hint = false,
            destructive_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_merge_into(&self, Parameters(p): Parameters<MergeParams>) -> Result<Json<SandboxInfo>, String> {
        let info = self.manager.merge_into(&p.winner, &p.parent).await.map_err(err)?;
        let mut own = self.session.id.lock().await;
        if own.as_deref() == Some(p.winner.as_str()) {
            *own = None;
        }
        Ok(Json(info))
    }

    #[tool(
        description = "List sandboxes (all sessions'), optionally only those carrying all the given labels.",
        annotations(title = "List sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_list(&self, Parameters(p): Parameters<ListParams>) -> Result<Json<ListResult>, String> {
        Ok(Json(ListResult { sandboxes: self.manager.list(&p.labels) }))
    }

    #[tool(
        description = "A sandbox's state (starting, running, paused, stopped, failed), vCPUs, memory, uptime, labels, \
                       and CPU and memory use.",
        annotations(title = "Sandbox info", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_info(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, String> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.info(&id).await.map(Json).map_err(err)
    }

    #[tool(
        description = "Kill a sandbox: stop its VM and delete everything in it. Without sandbox_id, kills this \
                       session's own sandbox (a new one is made on next use).",
        annotations(
            title = "Kill sandbox",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_kill(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<KillResult>, String> {
        let id = match p.sandbox_id {
            Some(id) => id,
            None => self.session.id.lock().await.clone().ok_or("this session has no sandbox of its own to kill")?,
        };
        self.manager.kill(&id).await.map_err(err)?;
        let mut own = self.session.id.lock().await;
        if own.as_deref() == Some(id.as_str()) {
            *own = None;
        }
        Ok(Json(KillResult { sandbox_id: id, killed: true }))
    }

    #[tool(
        description = "Pause a sandbox: its vCPUs stop and use no CPU; memory, processes, files and Python state \
                       are kept. sandbox_exec, sandbox_run_python and the file tools resume it by themselves.",
        annotations(
            title = "Pause sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_pause(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, String> {
        let id = self.target(p.sandbox_id).await?;
        let manager = self.manager.clone();
        // Pausing waits (milliseconds) for every vCPU to leave KVM_RUN.
        let paused = tokio::task::spawn_blocking(move || manager.pause(&id))
            .await
            .map_err(|e| format!("pause task failed: {e}"))?;
        paused.map(Json).map_err(err)
    }

    #[tool(
        description = "Resume a paused sandbox where it left off.",
        annotations(
            title = "Resume sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_resume(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, String> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.resume(&id).map(Json).map_err(err)
    }

    #[tool(
        description = "Run a bash command in a sandbox and return its exit code, stdout and stderr (each capped \
                       at 32 KiB). The command and its children are killed at the timeout.",
        annotations(title = "Run command", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_exec(&self, Parameters(p): Parameters<ExecParams>) -> Result<Json<ExecResult>, String> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let id = self.target(p.sandbox_id).await?;
        let req = ExecRequest {
            command: p.command,
            cwd: p.cwd,
            env: p.env.into_iter().collect(),
            stdin: p.stdin.map(String::into_bytes).unwrap_or_default(),
            timeout_ms,
            output_limit: 0,
        };
        let r = self.manager.exec(&id, req).await.map_err(err)?;
        let (exit_code, signal, timed_out) = match r.status {
            ExitStatus::Code(c) => (Some(c), None, false),
            ExitStatus::Signal(s) => (None, Some(s), false),
            ExitStatus::TimedOut => (None, None, true),
        };
        Ok(Json(ExecResult {
            sandbox_id: id,
            exit_code,
            signal,
            timed_out,
            truncated: r.stdout.truncated || r.stderr.truncated,
            stdout: text(r.stdout),
            stderr: text(r.stderr),
            duration_ms: r.duration_ms,
        }))
    }

    #[tool(
        description = "Run Python code in the sandbox's persistent interpreter: variables, imports and functions \
                       stay defined between calls. Returns the final expression's repr, printed output, and any \
                       exception with its traceback.",
        annotations(title = "Run Python", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_run_python(&self, Parameters(p): Parameters<PythonParams>) -> Result<Json<PythonResult>, String> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let id = self.target(p.sandbox_id).await?;
        let r = self.manager.python(&id, p.code, timeout_ms).await.map_err(err)?;
        Ok(Json(PythonResult {
            sandbox_id: id,
            result: r.value,
            stdout: text(r.stdout),
            stderr: text(r.stderr),
            error: r.exception.map(|e| PythonError { name: e.name, message: e.message, traceback: e.traceback }),
            timed_out: r.timed_out,
        }))
    }

    #[tool(
        description = "Read a text file from a sandbox (UTF-8, up to 1 MiB per call; use offset to read on). \
                       For binary files use sandbox_download.",
        annotations(title = "Read file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_read(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<ReadResult>, String> {
        let id = self.target(p.sandbox_id).await?;
        let length = p.length.unwrap_or(MAX_READ_BYTES).min(MAX_READ_BYTES);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await.map_err(err)?;
        let n = f.data.len() as u64;
        let content = String::from_utf8(f.data).map_err(|e| {
            format!(
                "{} is not UTF-8 text (invalid byte at offset {}); use sandbox_download for binary files",
                p.path,
                p.offset + e.utf8_error().valid_up_to() as u64
            )
        })?;
        Ok(Json(ReadResult {
            sandbox_id: id,
            path: p.path,
            content,
            offset: p.offset,
            size: f.size,
            remaining: f.size.saturating_sub(p.offset + n),
        }))
    }

    #[tool(
        description = "Write a text file in a sandbox (replacing it, or appending), making missing parent \
                       directories. For binary data use sandbox_upload.",
        annotations(title = "Write file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_write(&self, Parameters(p): Parameters<WriteParams>) -> Result<Json<WriteResult>, String> {
        let id = self.target(p.sandbox_id).await?;
        let n = self
            .manager
            .write_file(&id, p.path.clone(), p.content.into_bytes(), p.mode, p.append)
            .await
            .map_err(err)?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "List a directory in a sandbox: names, kinds, sizes, modes and modification times.",
        annotations(title = "List directory", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_files_list(
        &self,
        Parameters(p): Parameters<ListDirParams>,
    ) -> Result<Json<ListDirResult>, String> {
        let id = self.target(p.sandbox_id).await?;
        let path = p.path.unwrap_or_else(|| "/".into());
        let entries = self.manager.list_dir(&id, path.clone()).await.map_err(err)?;
        let entries = entries
            .into_iter()
            .map(|e| Entry {
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
            })
            .collect();
        Ok(Json(ListDirResult { sandbox_id: id, path, entries }))
    }

    #[tool(
        description = "Upload bytes (base64) to a file in a sandbox, at most 8 MiB per call.",
        annotations(title = "Upload file", read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn sandbox_upload(&self, Parameters(p): Parameters<UploadParams>) -> Result<Json<WriteResult>, String> {
        let data = base64::engine::general_purpose::STANDARD
            .decode(p.data_base64.trim())
            .map_err(|e| format!("data_base64 is not valid base64: {e}"))?;
        if data.len() as u64 > MAX_FILE_CHUNK {
            return Err(format!("{} bytes exceed the 8 MiB upload limit; split the file", data.len()));
        }
        let id = self.target(p.sandbox_id).await?;
        let n = self.manager.write_file(&id, p.path.clone(), data, p.mode, false).await.map_err(err)?;
        Ok(Json(WriteResult { sandbox_id: id, path: p.path, bytes_written: n }))
    }

    #[tool(
        description = "Download a file from a sandbox as base64, at most 8 MiB per call (use offset to read on).",
        annotations(title = "Download file", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_download(&self, Parameters(p): Parameters<ReadParams>) -> Result<Json<DownloadResult>, String> {
        let id = self.target(p.sandbox_id).await?;
        let max = MAX_FILE_CHUNK;
        let length = p.length.unwrap_or(max).min(max);
        let f = self.manager.read_file(&id, p.path.clone(), p.offset, Some(length)).await.map_err(err)?;
        let n = f.data.len() as u64;
        Ok(Json(DownloadResult {
            sandbox_id: id,
            path: p.path,
            data_base64: base64::engine::general_purpose::STANDARD.encode(&f.data),
            offset: p.offset,
            bytes: n,
            size: f.size,
            remaining: f.size.saturating_sub(p.offset + n),
        }))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for TineMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("tine", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Tine gives you isolated Linux microVM sandboxes (Debian with bash and Python 3). Call \
                 sandbox_exec or sandbox_run_python directly to work in this session's own sandbox (made on \
                 first use, removed when the session ends), or sandbox_create for more sandboxes and pass \
                 their sandbox_id. Python state persists between sandbox_run_python calls.",
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_checked_in_seconds() {
        assert_eq!(secs_to_ms(None), Ok(0));
        assert_eq!(secs_to_ms(Some(2)), Ok(2000));
        assert_eq!(secs_to_ms(Some(600)), Ok(600_000));
        assert_eq!(secs_to_ms(Some(0)), Err("timeout_secs must be 1..=600, got 0".into()));
        assert!(secs_to_ms(Some(601)).is_err());
        assert!(secs_to_ms(Some(u32::MAX)).is_err());
    }
}
