//! The code family: `sandbox_exec` (a bash script or a program, waited
//! for; with `background: true` a process the process family follows),
//! `sandbox_run_python` and `sandbox_run_code` (the sandbox's persistent
//! Python and Node.js interpreters). Output is cut to the result budget
//! ([`budget`]), with the whole sizes stated.

use std::collections::BTreeMap;

use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_protocol::{CellReply, ExecReply, ExitStatus, Output};
use tine_sandbox::{CallContext, ExecRequest, ProcessInfo};

use super::common::{env_map, secs_to_ms};
use crate::mcp::bounds::{
    MAX_ARGV_WORDS, MAX_CODE_CHARS, MAX_COMMAND_CHARS, MAX_ID_CHARS, MAX_PATH_CHARS, MAX_TEXT_CHARS, MAX_TIMEOUT_SECS,
};
use crate::mcp::errors::ToolError;
use crate::mcp::progress::Reporter;
use crate::mcp::{budget, TineMcp};

/// `sandbox_exec`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ExecParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// A bash script, run as `bash -c` in its own process group. Give
    /// this or argv.
    #[schemars(length(max = MAX_COMMAND_CHARS))]
    pub command: Option<String>,
    /// A program and its arguments, run without a shell (no bash start-up,
    /// no quoting), e.g. ["python3", "-c", "print(1)"]; the program is
    /// looked up in PATH. Give this or command.
    #[schemars(length(min = 1, max = MAX_ARGV_WORDS), inner(length(max = MAX_COMMAND_CHARS)))]
    pub argv: Option<Vec<String>>,
    /// Working directory (default `/`).
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    #[schemars(transform = env_map)]
    pub env: BTreeMap<String, String>,
    /// Text fed to stdin (at most 8 MiB). With background, the first input
    /// (at most 64 KiB); stdin then stays open for sandbox_process_write.
    #[schemars(length(max = MAX_TEXT_CHARS))]
    pub stdin: Option<String>,
    /// Kill the command (and its children) after this many seconds
    /// (default 60, at most 600). Not with background.
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
    /// Run in the background: return at once with a process_id, and
    /// follow it with the sandbox_process_* tools (default false).
    #[serde(default)]
    pub background: bool,
}

impl ExecParams {
    /// The bash script or the argv to run: exactly one of `command` and
    /// `argv` (`argv` not empty, at most [`MAX_ARGV_WORDS`] words).
    ///
    /// Errors: [`ToolError::ExecCommand`] saying which rule was broken.
    pub fn command_or_argv(&mut self) -> Result<(String, Vec<String>), ToolError> {
        match (self.command.take(), self.argv.take()) {
            (Some(c), None) => Ok((c, Vec::new())),
            (None, Some(a)) if a.is_empty() => Err(ToolError::ExecCommand("argv is empty; give the program first")),
            (None, Some(a)) if a.len() as u64 > MAX_ARGV_WORDS => {
                Err(ToolError::ExecCommand("argv has more than 4096 words; pass long input on stdin"))
            }
            (None, Some(a)) => Ok((String::new(), a)),
            (Some(_), Some(_)) => Err(ToolError::ExecCommand(
                "give command (a bash script) or argv (a program and its arguments), not both",
            )),
            (None, None) => Err(ToolError::ExecCommand(
                "give command (a bash script, e.g. \"ls -l\") or argv (e.g. [\"ls\", \"-l\"])",
            )),
        }
    }
}

/// The language of `sandbox_run_code`.
#[derive(Clone, Copy, Debug, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CodeLanguage {
    /// The persistent Python 3 interpreter (as sandbox_run_python).
    Python,
    /// The persistent Node.js interpreter.
    Javascript,
}

/// `sandbox_run_code`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunCodeParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// "python" or "javascript".
    pub language: CodeLanguage,
    /// The code; variables and definitions persist between calls of the
    /// same language; the value of a final expression is returned.
    #[schemars(length(max = MAX_CODE_CHARS))]
    pub code: String,
    /// Interrupt the code after this many seconds; the interpreter's state
    /// is kept (default 60, at most 600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
}

/// `sandbox_run_python`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PythonParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Python code; variables, imports and definitions persist between
    /// calls; the value of a final expression is returned.
    #[schemars(length(max = MAX_CODE_CHARS))]
    pub code: String,
    /// Interrupt the code after this many seconds; the interpreter's state
    /// is kept (default 60, at most 600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
}

/// `sandbox_exec`'s result. Each stream is cut to [`EXEC_STREAM_BUDGET`]
/// bytes of JSON (after the agent's own 32 KiB cap per stream);
/// `stdout_bytes` and `stderr_bytes` say how much the command wrote.
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
    /// Standard output (invalid UTF-8 replaced), possibly cut.
    pub stdout: String,
    /// Standard error (invalid UTF-8 replaced), possibly cut.
    pub stderr: String,
    /// Bytes the command wrote to stdout in all.
    pub stdout_bytes: u64,
    /// Bytes the command wrote to stderr in all.
    pub stderr_bytes: u64,
    /// Output was cut: past 32 KiB per stream, or to fit the result
    /// budget. Redirect to a file and read it with sandbox_files_read for
    /// all of it.
    pub truncated: bool,
    /// Wall time (ms).
    pub duration_ms: u64,
    /// With background: the process's id, for the sandbox_process_*
    /// tools (e.g. "sb-3:p7").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process_id: Option<String>,
    /// With background: the process as it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessInfo>,
}

/// A Python exception.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PythonError {
    /// Type name, e.g. `ZeroDivisionError`.
    pub name: String,
    /// `str(exception)`, possibly cut.
    pub message: String,
    /// The traceback, possibly cut (its end, the innermost frames, is kept).
    pub traceback: String,
}

/// `sandbox_run_python`'s result. `result` is cut to
/// [`PY_RESULT_BUDGET`] and each stream to [`PY_STREAM_BUDGET`] bytes of
/// JSON.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PythonResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// `repr()` of the final expression's value, if any; possibly cut
    /// (see result_truncated).
    pub result: Option<String>,
    /// `result` was cut to fit the result budget.
    pub result_truncated: bool,
    /// The whole `repr()`'s length (bytes of UTF-8), if there was one.
    pub result_bytes: Option<u64>,
    /// Printed output, possibly cut.
    pub stdout: String,
    /// Standard error, possibly cut.
    pub stderr: String,
    /// Bytes the cell wrote to stdout in all.
    pub stdout_bytes: u64,
    /// Bytes the cell wrote to stderr in all.
    pub stderr_bytes: u64,
    /// stdout or stderr was cut.
    pub truncated: bool,
    /// The exception raised, if any (the state is kept).
    pub error: Option<PythonError>,
    /// Interrupted at its timeout (the state is kept).
    pub timed_out: bool,
}

/// Bytes of JSON each of `sandbox_exec`'s streams may take: 80 KiB.
pub const EXEC_STREAM_BUDGET: usize = 80 << 10;

/// Bytes of JSON `sandbox_run_python`'s `result` may take: 64 KiB.
pub const PY_RESULT_BUDGET: usize = 64 << 10;

/// Bytes of JSON each of `sandbox_run_python`'s streams may take: 32 KiB.
pub const PY_STREAM_BUDGET: usize = 32 << 10;

/// Bytes of JSON a Python traceback may take (its end is kept): 24 KiB.
pub const PY_TRACEBACK_BUDGET: usize = 24 << 10;

/// Bytes of JSON a Python exception's message may take: 8 KiB.
pub const PY_MESSAGE_BUDGET: usize = 8 << 10;

/// Bytes of JSON a Python exception's type name may take.
pub const PY_NAME_BUDGET: usize = 256;

/// An output stream as text (invalid UTF-8 replaced), cut to `max` bytes
/// of JSON; whether it was cut (here or by the agent).
fn stream(o: Output, max: usize) -> (String, bool) {
    let c = budget::cut(String::from_utf8_lossy(&o.data).into_owned(), max);
    (c.text, c.truncated || o.truncated)
}

/// The end of `s` that fits `max` bytes of JSON, after a marker saying
/// what was cut (tracebacks: the innermost frames are at the end).
fn tail(s: String, max: usize) -> String {
    if budget::escaped_len(&s) <= max {
        return s;
    }
    let marker = format!("[{} bytes cut] ...", s.len());
    let room = max.saturating_sub(budget::escaped_len(&marker));
    marker + budget::fit_suffix(&s, room)
}

impl ExecResult {
    /// The result of `sandbox_exec` on `sandbox_id` that answered `r`.
    pub fn new(sandbox_id: String, r: ExecReply) -> Self {
        let (exit_code, signal, timed_out) = match r.status {
            ExitStatus::Code(c) => (Some(c), None, false),
            ExitStatus::Signal(s) => (None, Some(s), false),
            ExitStatus::TimedOut => (None, None, true),
        };
        let (stdout_bytes, stderr_bytes) = (r.stdout.total_bytes, r.stderr.total_bytes);
        let (stdout, out_cut) = stream(r.stdout, EXEC_STREAM_BUDGET);
        let (stderr, err_cut) = stream(r.stderr, EXEC_STREAM_BUDGET);
        ExecResult {
            sandbox_id,
            exit_code,
            signal,
            timed_out,
            stdout,
            stderr,
            stdout_bytes,
            stderr_bytes,
            truncated: out_cut || err_cut,
            duration_ms: r.duration_ms,
            process_id: None,
            process: None,
        }
    }

    /// The result of `sandbox_exec { background: true }`: the process
    /// started; no status or output yet.
    pub fn background(sandbox_id: String, process: ProcessInfo) -> Self {
        ExecResult {
            sandbox_id,
            exit_code: None,
            signal: None,
            timed_out: false,
            stdout: String::new(),
            stderr: String::new(),
            stdout_bytes: 0,
            stderr_bytes: 0,
            truncated: false,
            duration_ms: 0,
            process_id: Some(process.process_id.clone()),
            process: Some(process),
        }
    }
}

impl PythonResult {
    /// The result of `sandbox_run_python` on `sandbox_id` that answered `r`.
    pub fn new(sandbox_id: String, r: CellReply) -> Self {
        // The guest cuts a repr over its own cap and reports the whole
        // size; the host cuts again to its budget.
        let result_bytes = r.value.as_ref().map(|v| if r.value_truncated { r.value_bytes } else { v.len() as u64 });
        let value = r.value.map(|v| budget::cut(v, PY_RESULT_BUDGET));
        let (stdout_bytes, stderr_bytes) = (r.stdout.total_bytes, r.stderr.total_bytes);
        let (stdout, out_cut) = stream(r.stdout, PY_STREAM_BUDGET);
        let (stderr, err_cut) = stream(r.stderr, PY_STREAM_BUDGET);
        PythonResult {
            sandbox_id,
            result_truncated: r.value_truncated || value.as_ref().is_some_and(|c| c.truncated),
            result: value.map(|c| c.text),
            result_bytes,
            stdout,
            stderr,
            stdout_bytes,
            stderr_bytes,
            truncated: out_cut || err_cut,
            error: r.exception.map(|e| PythonError {
                name: budget::cut(e.name, PY_NAME_BUDGET).text,
                message: budget::cut(e.message, PY_MESSAGE_BUDGET).text,
                traceback: tail(e.traceback, PY_TRACEBACK_BUDGET),
            }),
            timed_out: r.timed_out,
        }
    }
}

#[tool_router(router = code_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "Run a bash command (or argv: a program without a shell) in the sandbox; returns \
                       exit_code, stdout and stderr (each cut at 32 KiB: truncated and stdout_bytes/stderr_bytes \
                       say so). It is killed with its children at timeout_secs (default 60) or when the request is cancelled. For servers and long \
                       jobs use background: true: it returns a process_id at once (follow it with \
                       sandbox_process_wait, _output, _kill; its output keeps the last 256 KiB). The idle timeout \
                       counts tool calls, not running processes.",
        annotations(title = "Run command", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_exec(
        &self,
        Parameters(mut p): Parameters<ExecParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<ExecResult>, ToolError> {
        let (command, argv) = p.command_or_argv()?;
        if p.background {
            return self.exec_background(p, command, argv).await;
        }
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let req = ExecRequest {
            command,
            argv,
            cwd: p.cwd,
            env: p.env.into_iter().collect(),
            stdin: p.stdin.map(String::into_bytes).unwrap_or_default(),
            timeout_ms,
            output_limit: 0,
        };
        // A cancelled request (`notifications/cancelled`, or the session's
        // end) kills the command in the guest.
        let base = CallContext { cancel: ctx.ct.clone(), ..self.cx() };
        Reporter::around(&ctx, base, async |cx| {
            let id = self.target_with(p.sandbox_id, cx).await?;
            let r = self.manager.exec_with(&id, req, cx).await?;
            Ok(Json(ExecResult::new(id, r)))
        })
        .await
    }

    #[tool(
        description = "Run Python code in the sandbox's persistent interpreter: variables, imports and functions \
                       stay defined between calls. Returns the final expression's repr (cut at 64 KiB: \
                       result_truncated, result_bytes), printed output (cut at 32 KiB per stream), and any \
                       exception with its traceback.",
        annotations(title = "Run Python", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_run_python(
        &self,
        Parameters(p): Parameters<PythonParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<PythonResult>, ToolError> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        // Progress only for a sandbox made on first use.
        let id = Reporter::around(&ctx, self.cx(), async |cx| self.target_with(p.sandbox_id, cx).await).await?;
        let r = self.manager.python(&id, p.code, timeout_ms).await?;
        Ok(Json(PythonResult::new(id, r)))
    }

    #[tool(
        description = "Run code in the sandbox's persistent interpreter for language \"python\" or \
                       \"javascript\" (Node.js; top-level let/const and await work): variables, imports and \
                       functions stay defined between calls. Returns the last expression's value (repr or \
                       util.inspect, cut at 64 KiB), printed output (32 KiB per stream) and any error with its \
                       traceback.",
        annotations(title = "Run code", read_only_hint = false, destructive_hint = true, open_world_hint = true)
    )]
    async fn sandbox_run_code(
        &self,
        Parameters(p): Parameters<RunCodeParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<PythonResult>, ToolError> {
        let timeout_ms = secs_to_ms(p.timeout_secs)?;
        let id = Reporter::around(&ctx, self.cx(), async |cx| self.target_with(p.sandbox_id, cx).await).await?;
        let r = match p.language {
            CodeLanguage::Python => self.manager.python(&id, p.code, timeout_ms).await?,
            CodeLanguage::Javascript => self.manager.node(&id, p.code, timeout_ms).await?,
        };
        Ok(Json(PythonResult::new(id, r)))
    }
}

#[cfg(test)]
mod tests {
    use tine_protocol::CellException;

    use super::*;
    use crate::mcp::budget::{json_len, CONTENT_BUDGET};

    fn output(data: Vec<u8>, truncated: bool) -> Output {
        let total_bytes = data.len() as u64 * if truncated { 10 } else { 1 };
        Output { data, truncated, total_bytes }
    }

    #[test]
    fn a_5_mb_repr_and_nul_floods_fit_the_budget() {
        let r = CellReply {
            value: Some(format!("'{}'", "x".repeat(5_000_000))),
            stdout: output(vec![0; 32 << 10], true),
            stderr: output(vec![b'"'; 32 << 10], true),
            exception: Some(CellException {
                name: "E".repeat(10_000),
                message: "\0".repeat(100_000),
                traceback: "\u{1}".repeat(100_000) + "innermost",
            }),
            timed_out: false,
            value_truncated: false,
            value_bytes: 0,
            interpreter_start_ms: None,
        };
        let p = PythonResult::new("sb-1".into(), r);
        assert!(json_len(&p) <= CONTENT_BUDGET, "{}", json_len(&p));
        assert!(p.result_truncated && p.truncated);
        assert_eq!(p.result_bytes, Some(5_000_002));
        assert!(p.result.as_ref().unwrap().starts_with("'xxx"));
        assert_eq!(p.stdout_bytes, 10 * (32 << 10));
        let e = p.error.unwrap();
        assert!(e.traceback.starts_with("[100009 bytes cut] ...") && e.traceback.ends_with("innermost"), "{e:?}");

        let small = PythonResult::new(
            "sb-1".into(),
            CellReply {
                value: Some("42".into()),
                stdout: output(b"hi\n".to_vec(), false),
                stderr: output(vec![], false),
                exception: None,
                timed_out: false,
                value_truncated: false,
                value_bytes: 0,
                interpreter_start_ms: None,
            },
        );
        assert_eq!((small.result.as_deref(), small.result_truncated, small.truncated), (Some("42"), false, false));
        assert_eq!((small.stdout.as_str(), small.stdout_bytes), ("hi\n", 3));
    }

    #[test]
    fn a_repr_the_guest_cut_keeps_its_whole_size() {
        let r = CellReply {
            value: Some("x".repeat(64 << 10)),
            stdout: output(vec![], false),
            stderr: output(vec![], false),
            exception: None,
            timed_out: false,
            value_truncated: true,
            value_bytes: 5_000_002,
            interpreter_start_ms: None,
        };
        let p = PythonResult::new("sb-1".into(), r);
        assert!(p.result_truncated);
        assert_eq!(p.result_bytes, Some(5_000_002));
    }

    #[test]
    fn exec_streams_of_control_bytes_fit_the_budget() {
        let r = ExecReply {
            status: ExitStatus::Code(0),
            stdout: output(vec![1; 32 << 10], true),
            stderr: output(vec![0xff; 32 << 10], false),
            duration_ms: 1,
        };
        let x = ExecResult::new("sb-1".into(), r);
        assert!(json_len(&x) <= CONTENT_BUDGET, "{}", json_len(&x));
        assert!(x.truncated);
        assert_eq!((x.stdout_bytes, x.stderr_bytes), (10 * (32 << 10), 32 << 10));
        let v = serde_json::to_value(&x).unwrap();
        assert!(v.get("process_id").is_none() && v.get("process").is_none(), "only background execs name a process");
    }
}
