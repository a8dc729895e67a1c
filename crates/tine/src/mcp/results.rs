//! The tools' result types (their JSON Schemas are the tools'
//! `outputSchema`; the same JSON is the `structuredContent` and the text),
//! and how the agent's replies become them.

use schemars::JsonSchema;
use serde::Serialize;
use tine_protocol::{DirEntry, ExecReply, ExitStatus, FileKind, Output, PythonReply};
use tine_sandbox::{SandboxInfo, TemplateInfo};

/// `template_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateListResult {
    /// Every template, by name.
    pub templates: Vec<TemplateInfo>,
}

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

/// An output stream as text (invalid UTF-8 replaced).
fn text(o: Output) -> String {
    String::from_utf8_lossy(&o.data).into_owned()
}

impl ExecResult {
    /// The result of `sandbox_exec` on `sandbox_id` that answered `r`.
    pub fn new(sandbox_id: String, r: ExecReply) -> Self {
        let (exit_code, signal, timed_out) = match r.status {
            ExitStatus::Code(c) => (Some(c), None, false),
            ExitStatus::Signal(s) => (None, Some(s), false),
            ExitStatus::TimedOut => (None, None, true),
        };
        ExecResult {
            sandbox_id,
            exit_code,
            signal,
            timed_out,
            truncated: r.stdout.truncated || r.stderr.truncated,
            stdout: text(r.stdout),
            stderr: text(r.stderr),
            duration_ms: r.duration_ms,
        }
    }
}

impl PythonResult {
    /// The result of `sandbox_run_python` on `sandbox_id` that answered `r`.
    pub fn new(sandbox_id: String, r: PythonReply) -> Self {
        PythonResult {
            sandbox_id,
            result: r.value,
            stdout: text(r.stdout),
            stderr: text(r.stderr),
            error: r.exception.map(|e| PythonError { name: e.name, message: e.message, traceback: e.traceback }),
            timed_out: r.timed_out,
        }
    }
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

/// `template_delete`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateDeleteResult {
    /// The template that is gone.
    pub name: String,
    /// Always true.
    pub deleted: bool,
}
