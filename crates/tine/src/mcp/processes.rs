//! The background-process tools: `sandbox_exec { background: true }`
//! starts one; `sandbox_process_list`, `_output`, `_wait`, `_write` and
//! `_kill` follow it.
//!
//! A process id is `<sandbox_id>:p<n>`; the same process in a branch child
//! or in a sandbox made from a template of its sandbox is
//! `<that sandbox>:p<n>` (same `n`: the guest's process table is copied
//! with its memory). Output stays in the guest, in a buffer per stream
//! holding its last [`PROCESS_BUFFER_BYTES`]; older bytes are counted
//! (`*_dropped_bytes`, `skipped_bytes`), never silently lost. Pages are
//! cut to [`PROCESS_PAGE_BUDGET`] of JSON ([`budget::fit_bytes`]).

use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use tine_protocol::{
    WaitFor, MAX_PROCESS_CHUNK, MAX_PROCESS_WRITE, MAX_SPAWN_STDIN, MAX_WAIT_PATTERN_BYTES, PROCESS_BUFFER_BYTES,
};
use tine_sandbox::{ExecRequest, ProcessId, WaitSpec};

use super::errors::ToolError;
use super::params::{
    secs_to_ms, ExecParams, ProcessKillParams, ProcessListParams, ProcessOutputParams, ProcessWaitParams,
    ProcessWriteParams, SignalParam, DEFAULT_PAGE_BYTES, DEFAULT_WAIT_SECS,
};
use super::progress::Reporter;
use super::results::{
    stream_name, ExecResult, ProcessKillResult, ProcessListResult, ProcessOutputResult, ProcessWaitResult,
    ProcessWriteResult, PROCESS_PAGE_BUDGET,
};
use super::{budget, TineMcp};

impl TineMcp {
    /// `sandbox_exec { background: true }`: starts the process and returns
    /// at once with its id.
    ///
    /// Errors: [`ToolError::BackgroundTimeout`] with `timeout_secs`,
    /// [`ToolError::SpawnStdinTooLarge`], and the manager's.
    pub(super) async fn exec_background(
        &self,
        p: ExecParams,
        command: String,
        argv: Vec<String>,
    ) -> Result<Json<ExecResult>, ToolError> {
        if p.timeout_secs.is_some() {
            return Err(ToolError::BackgroundTimeout);
        }
        let stdin = p.stdin.map(String::into_bytes).unwrap_or_default();
        if stdin.len() > MAX_SPAWN_STDIN {
            return Err(ToolError::SpawnStdinTooLarge { bytes: stdin.len(), max: MAX_SPAWN_STDIN });
        }
        let id = self.target(p.sandbox_id).await?;
        let req = ExecRequest {
            command,
            argv,
            cwd: p.cwd,
            env: p.env.into_iter().collect(),
            stdin,
            timeout_ms: 0,
            output_limit: 0,
        };
        let info = self.manager.spawn(&id, req, false).await?;
        Ok(Json(ExecResult::background(id, info)))
    }

    /// The process a call names, its sandbox now watched by the session's
    /// log.
    ///
    /// Errors: [`tine_sandbox::SandboxError::BadProcessId`].
    fn process(&self, process_id: &str) -> Result<ProcessId, ToolError> {
        let pid: ProcessId = process_id.trim().parse()?;
        self.watch(&pid.sandbox_id);
        Ok(pid)
    }
}

#[tool_router(router = process_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "List a sandbox's background processes (started with sandbox_exec { background: true }): \
                       process_id, command, state (running or exited), exit_code or signal, start and end time, \
                       output bytes so far and bytes that fell out of the 256 KiB per-stream buffer \
                       (stdout_dropped_bytes, stderr_dropped_bytes). A sandbox holds up to 32; ended ones stay \
                       listed until room is needed. Processes survive pause/resume, and branch children and \
                       sandboxes made from a template list them under their own ids.",
        annotations(title = "List background processes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_process_list(
        &self,
        Parameters(p): Parameters<ProcessListParams>,
    ) -> Result<Json<ProcessListResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let mut processes = self.manager.processes(&id).await?;
        let room = budget::CONTENT_BUDGET.saturating_sub(256 + budget::escaped_len(&id));
        let truncated = budget::fit_list(&mut processes, room) > 0;
        Ok(Json(ProcessListResult { sandbox_id: id, processes, truncated }))
    }

    #[tool(
        description = "Read a background process's output, a page at a time: stream \"stdout\" (default) or \
                       \"stderr\", from offset (bytes since the process started; default the oldest byte still \
                       held), at most max_bytes (default 65536, at most 262144; fewer when the text would not fit \
                       the result budget). Read on with offset: next_offset until it reaches total_bytes. Each \
                       stream keeps its last 256 KiB (buffer_bytes); bytes asked for that fell out before are \
                       counted in skipped_bytes.",
        annotations(title = "Read process output", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_process_output(
        &self,
        Parameters(p): Parameters<ProcessOutputParams>,
    ) -> Result<Json<ProcessOutputResult>, ToolError> {
        let pid = self.process(&p.process_id)?;
        let max = p.max_bytes.unwrap_or(DEFAULT_PAGE_BYTES).clamp(1, MAX_PROCESS_CHUNK);
        let page = self.manager.process_output(&pid, p.stream.kind(), p.offset, max).await?;
        // A character cut by the page's end is read on the next page,
        // unless the stream can grow no more.
        let end = page.offset.saturating_add(page.data.len() as u64);
        let at_end = end >= page.total_bytes && page.closed;
        let (mut data, mut covered) = budget::fit_bytes(&page.data, PROCESS_PAGE_BUDGET, at_end);
        if covered == 0 && page.data.len() >= max as usize {
            // A max_bytes too small for one character must still move on;
            // else the rest of the character has yet to be written (the
            // page is empty and next_offset stays: ask again later).
            (data, covered) = budget::fit_bytes(&page.data, PROCESS_PAGE_BUDGET, true);
        }
        let bytes = covered as u64;
        Ok(Json(ProcessOutputResult {
            process_id: pid.to_string(),
            stream: stream_name(page.stream).into(),
            data,
            offset: page.offset,
            bytes,
            next_offset: page.offset.saturating_add(bytes),
            total_bytes: page.total_bytes,
            skipped_bytes: page.skipped,
            buffer_bytes: PROCESS_BUFFER_BYTES as u64,
            truncated: covered < page.data.len(),
            process: page.info,
        }))
    }

    #[tool(
        description = "Wait until a background process prints a text (until_text) or a line matching a regular \
                       expression (until_regex), or ends, or timeout_secs (default 30, at most 600) pass; \
                       outcome says which (\"matched\", \"exited\", \"timeout\"), with the matching line and the \
                       output's last lines. Output already printed counts (search from resume offsets of an \
                       earlier wait to find the next occurrence). PYTHONUNBUFFERED=1 is set for background \
                       processes; other programs may buffer output written to a pipe: run them under \
                       `stdbuf -oL`. Reports progress while waiting when the request has a progressToken.",
        annotations(title = "Wait for process output", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_process_wait(
        &self,
        Parameters(p): Parameters<ProcessWaitParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<ProcessWaitResult>, ToolError> {
        let until = match (p.until_text, p.until_regex) {
            (Some(_), Some(_)) => return Err(ToolError::TwoPatterns),
            (Some(t), None) => Some(WaitFor::Text(t)),
            (None, Some(r)) => Some(WaitFor::Regex(r)),
            (None, None) => None,
        };
        if let Some(WaitFor::Text(s) | WaitFor::Regex(s)) = &until {
            if s.len() > MAX_WAIT_PATTERN_BYTES {
                return Err(ToolError::PatternTooLong { bytes: s.len(), max: MAX_WAIT_PATTERN_BYTES });
            }
        }
        let timeout_ms = secs_to_ms(Some(p.timeout_secs.unwrap_or(DEFAULT_WAIT_SECS)))?;
        let pid = self.process(&p.process_id)?;
        let from = (p.stdout_offset.unwrap_or(0), p.stderr_offset.unwrap_or(0));
        let spec = WaitSpec { timeout_ms, until, streams: p.stream.set(), stdout_from: from.0, stderr_from: from.1 };
        let r = Reporter::around(&ctx, self.cx(), async |cx| self.manager.process_wait(&pid, spec, cx).await).await?;
        Ok(Json(ProcessWaitResult::new(pid.to_string(), r)))
    }

    #[tool(
        description = "Write text to a background process's stdin (at most 1 MiB per call; include the newline a \
                       line-reading program waits for); close_stdin: true then closes it, and the process reads \
                       end of file. Returns the bytes written (fewer if the process stopped reading for 10 s).",
        annotations(
            title = "Write to process stdin",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_process_write(
        &self,
        Parameters(p): Parameters<ProcessWriteParams>,
    ) -> Result<Json<ProcessWriteResult>, ToolError> {
        if p.data.len() > MAX_PROCESS_WRITE {
            return Err(ToolError::WriteTooLarge { bytes: p.data.len(), max: MAX_PROCESS_WRITE });
        }
        let pid = self.process(&p.process_id)?;
        let (bytes, info) = self.manager.process_write(&pid, p.data.into_bytes(), p.close_stdin).await?;
        Ok(Json(ProcessWriteResult { process_id: pid.to_string(), bytes_written: bytes, stdin_open: info.stdin_open }))
    }

    #[tool(
        description = "Signal a background process, its whole process group and its descendants (also those \
                       that left the group): default TERM, then KILL after 3 s for whatever is left; or one \
                       signal by name (KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT) or number. Returns the \
                       process's state after it. The process stays listed (exited) in sandbox_process_list.",
        annotations(
            title = "Kill background process",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_process_kill(
        &self,
        Parameters(p): Parameters<ProcessKillParams>,
    ) -> Result<Json<ProcessKillResult>, ToolError> {
        let (signal, name) = SignalParam::resolve(p.signal.as_ref())?;
        let pid = self.process(&p.process_id)?;
        let process = self.manager.process_signal(&pid, signal).await?;
        Ok(Json(ProcessKillResult { process_id: pid.to_string(), signal: name, process }))
    }
}
