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
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_protocol::{
    WaitFor, MAX_PROCESS_CHUNK, MAX_PROCESS_WRITE, MAX_SPAWN_STDIN, MAX_WAIT_PATTERN_BYTES, PROCESS_BUFFER_BYTES,
};
use tine_sandbox::{ExecRequest, ProcessId, ProcessInfo, WaitSpec};

use super::code::{ExecParams, ExecResult};
use super::common::secs_to_ms;
use crate::mcp::bounds::{
    MAX_ID_CHARS, MAX_OFFSET, MAX_PATTERN_CHARS, MAX_PROCESS_WRITE_CHARS, MAX_SIGNAL_CHARS, MAX_TIMEOUT_SECS,
};
use crate::mcp::errors::ToolError;
use crate::mcp::progress::Reporter;
use crate::mcp::{budget, TineMcp};

/// Default `max_bytes` of `sandbox_process_output`: 64 KiB.
pub const DEFAULT_PAGE_BYTES: u32 = 64 << 10;

/// Default `timeout_secs` of `sandbox_process_wait`: 30 s.
pub const DEFAULT_WAIT_SECS: u32 = 30;

/// A background process's output stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StreamParam {
    /// Standard output.
    #[default]
    Stdout,
    /// Standard error.
    Stderr,
}

impl StreamParam {
    /// The agent's name for it.
    pub fn kind(self) -> tine_protocol::StreamKind {
        match self {
            StreamParam::Stdout => tine_protocol::StreamKind::Stdout,
            StreamParam::Stderr => tine_protocol::StreamKind::Stderr,
        }
    }
}

/// Which streams a wait searches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StreamsParam {
    /// Standard output only.
    Stdout,
    /// Standard error only.
    Stderr,
    /// Both (default).
    #[default]
    Both,
}

impl StreamsParam {
    /// The agent's name for it.
    pub fn set(self) -> tine_protocol::StreamSet {
        match self {
            StreamsParam::Stdout => tine_protocol::StreamSet::Stdout,
            StreamsParam::Stderr => tine_protocol::StreamSet::Stderr,
            StreamsParam::Both => tine_protocol::StreamSet::Both,
        }
    }
}

/// `sandbox_process_list`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ProcessListParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
}

/// `sandbox_process_output`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessOutputParams {
    /// The process, as sandbox_exec { background: true } returned it
    /// (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// "stdout" (default) or "stderr".
    #[serde(default)]
    pub stream: StreamParam,
    /// Stream offset to read from (bytes since the process started;
    /// default: the oldest byte still held). Page on with next_offset.
    #[schemars(range(max = MAX_OFFSET))]
    pub offset: Option<u64>,
    /// Most bytes to read (default 65536, at most 262144); fewer come back
    /// when their JSON text would not fit the result budget.
    #[schemars(range(min = 1, max = tine_protocol::MAX_PROCESS_CHUNK))]
    pub max_bytes: Option<u32>,
}

/// `sandbox_process_wait`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessWaitParams {
    /// The process (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// Give up after this many seconds (default 30, 1..=600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
    /// Return when this text appears in the output (may span lines; at
    /// most 1024 bytes).
    #[schemars(length(min = 1, max = MAX_PATTERN_CHARS))]
    pub until_text: Option<String>,
    /// Return when a line matches this regular expression (Rust regex
    /// syntax, matched per line without its newline, and against the
    /// unfinished last line; at most 1024 bytes). Not with until_text.
    #[schemars(length(min = 1, max = MAX_PATTERN_CHARS))]
    pub until_regex: Option<String>,
    /// Which output to search: "stdout", "stderr" or "both" (default).
    #[serde(default)]
    pub stream: StreamsParam,
    /// Search stdout from this offset (default: all output still held,
    /// so a line printed before the call matches). Pass resume.stdout_offset
    /// of an earlier wait to find the next occurrence.
    #[schemars(range(max = MAX_OFFSET))]
    pub stdout_offset: Option<u64>,
    /// Search stderr from this offset, as stdout_offset.
    #[schemars(range(max = MAX_OFFSET))]
    pub stderr_offset: Option<u64>,
}

/// `sandbox_process_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessWriteParams {
    /// The process (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// Text to write to its stdin (at most 1 MiB); include the newline a
    /// line-reading program waits for.
    #[serde(default)]
    #[schemars(length(max = MAX_PROCESS_WRITE_CHARS))]
    pub data: String,
    /// Close stdin after writing: the process reads end of file (default
    /// false).
    #[serde(default)]
    pub close_stdin: bool,
}

/// A signal: a name ("TERM", "SIGKILL", ...) or a number (1..=64).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SignalParam {
    /// A number, 1..=64.
    Number(#[schemars(range(min = 1, max = 64))] i64),
    /// A name, with or without "SIG": TERM, KILL, INT, HUP, QUIT, USR1,
    /// USR2, STOP, CONT.
    Name(#[schemars(length(min = 1, max = MAX_SIGNAL_CHARS))] String),
}

/// Signals by name (Linux numbering).
const SIGNALS: [(&str, i32); 9] = [
    ("TERM", libc::SIGTERM),
    ("KILL", libc::SIGKILL),
    ("INT", libc::SIGINT),
    ("HUP", libc::SIGHUP),
    ("QUIT", libc::SIGQUIT),
    ("USR1", libc::SIGUSR1),
    ("USR2", libc::SIGUSR2),
    ("STOP", libc::SIGSTOP),
    ("CONT", libc::SIGCONT),
];

impl SignalParam {
    /// The signal to send (`None`: TERM, then KILL after 3 s if the
    /// process group lives on) and its name for the result.
    ///
    /// Errors: [`ToolError::Signal`] for an unknown name or a number
    /// outside 1..=64.
    pub fn resolve(p: Option<&SignalParam>) -> Result<(Option<i32>, String), ToolError> {
        let bad = || {
            ToolError::Signal(match p {
                Some(SignalParam::Number(n)) => n.to_string(),
                Some(SignalParam::Name(s)) => s.clone(),
                None => String::new(),
            })
        };
        match p {
            None => Ok((None, "TERM".into())),
            Some(SignalParam::Number(n)) => {
                let n = i32::try_from(*n).ok().filter(|n| (1..=64).contains(n)).ok_or_else(bad)?;
                let name =
                    SIGNALS.iter().find(|(_, s)| *s == n).map_or_else(|| n.to_string(), |(name, _)| (*name).into());
                // TERM, however it is named, is the default: escalated.
                Ok(((name != "TERM").then_some(n), name))
            }
            Some(SignalParam::Name(s)) => {
                let t = s.trim().to_ascii_uppercase();
                if let Ok(n) = t.parse::<i64>() {
                    return SignalParam::resolve(Some(&SignalParam::Number(n))).map_err(|_| bad());
                }
                let name = t.strip_prefix("SIG").unwrap_or(&t);
                let (name, n) = SIGNALS.iter().find(|(n, _)| *n == name).ok_or_else(bad)?;
                Ok(((*name != "TERM").then_some(*n), (*name).into()))
            }
        }
    }
}

/// `sandbox_process_kill`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessKillParams {
    /// The process (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// Signal for the whole process group and the process's descendants:
    /// "TERM" (default: TERM, then KILL after 3 s for what is left),
    /// "KILL", "INT", "HUP", "QUIT", "USR1", "USR2", "STOP", "CONT", or a
    /// number 1..=64 (sent once).
    pub signal: Option<SignalParam>,
}

/// `sandbox_process_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessListResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its background processes (running, and ended ones still in its
    /// table of 32), by id; the first ones only if `truncated`.
    pub processes: Vec<ProcessInfo>,
    /// Processes were left out to fit the result budget.
    pub truncated: bool,
}

/// Bytes of JSON the `data` of one `sandbox_process_output` page may take:
/// 128 KiB.
pub const PROCESS_PAGE_BUDGET: usize = 128 << 10;

/// `sandbox_process_output`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessOutputResult {
    /// The process.
    pub process_id: String,
    /// "stdout" or "stderr".
    pub stream: String,
    /// The output (invalid UTF-8 replaced by U+FFFD).
    pub data: String,
    /// Stream offset of data's first byte.
    pub offset: u64,
    /// Bytes of the stream data covers.
    pub bytes: u64,
    /// Where to read on (offset + bytes).
    pub next_offset: u64,
    /// Bytes the stream produced so far.
    pub total_bytes: u64,
    /// Bytes between the offset asked for and `offset` that had already
    /// fallen out of the buffer (counted, not shown).
    pub skipped_bytes: u64,
    /// Size of the per-stream buffer (bytes): the last this many bytes are
    /// held.
    pub buffer_bytes: u64,
    /// Fewer bytes than read were returned, to fit the result budget or
    /// because the page ended inside a character; read on at next_offset.
    pub truncated: bool,
    /// The process now.
    pub process: ProcessInfo,
}

/// Where a wait's text or pattern appeared.
#[derive(Debug, Serialize, JsonSchema)]
pub struct WaitMatched {
    /// "stdout" or "stderr".
    pub stream: String,
    /// Stream offset of the match.
    pub offset: u64,
    /// The line holding it (at most 4 KiB).
    pub line: String,
}

/// Offsets to search from to find the next occurrence.
#[derive(Debug, Serialize, JsonSchema)]
pub struct WaitResume {
    /// Pass as stdout_offset.
    pub stdout_offset: u64,
    /// Pass as stderr_offset.
    pub stderr_offset: u64,
}

/// `sandbox_process_wait`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessWaitResult {
    /// The process.
    pub process_id: String,
    /// "matched" (the text or pattern appeared), "exited" (the process
    /// ended) or "timeout".
    pub outcome: String,
    /// Where it matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<WaitMatched>,
    /// How long the wait took (ms).
    pub waited_ms: u64,
    /// The last lines of stdout (at most 4 KiB).
    pub stdout_tail: String,
    /// The last lines of stderr (at most 4 KiB).
    pub stderr_tail: String,
    /// Output that fell out of the buffer before it was searched (bytes).
    pub missed_bytes: u64,
    /// Where a next wait for the next occurrence starts.
    pub resume: WaitResume,
    /// The process now.
    pub process: ProcessInfo,
}

/// Bytes of JSON a wait's tail or matched line may take: 4 KiB.
pub const WAIT_TEXT_BUDGET: usize = 4 << 10;

/// The stream's name in results.
pub fn stream_name(s: tine_protocol::StreamKind) -> &'static str {
    match s {
        tine_protocol::StreamKind::Stdout => "stdout",
        tine_protocol::StreamKind::Stderr => "stderr",
    }
}

/// The end of `bytes` as text (invalid UTF-8 replaced) that fits `max`
/// bytes of JSON, starting on a line when one fits.
fn tail_text(bytes: &[u8], max: usize) -> String {
    let s = String::from_utf8_lossy(bytes);
    if budget::escaped_len(&s) <= max {
        return s.into_owned();
    }
    let kept = budget::fit_suffix(&s, max);
    // Start on a whole line when the kept part holds a line break.
    match kept.find('\n') {
        Some(n) if n + 1 < kept.len() => kept[n + 1..].to_string(),
        _ => kept.to_string(),
    }
}

impl ProcessWaitResult {
    /// The result of a wait on `process_id` that answered `r`; it resumes
    /// at the agent's offsets (where its search stopped on each stream).
    pub fn new(process_id: String, r: tine_sandbox::WaitResult) -> Self {
        use tine_protocol::WaitOutcome;
        let outcome = match r.outcome {
            WaitOutcome::Matched => "matched",
            WaitOutcome::Exited => "exited",
            WaitOutcome::TimedOut => "timeout",
        };
        let resume = WaitResume { stdout_offset: r.resume.0, stderr_offset: r.resume.1 };
        let matched = r.found.map(|m| WaitMatched {
            stream: stream_name(m.stream).into(),
            offset: m.offset,
            line: budget::cut(String::from_utf8_lossy(&m.line).into_owned(), WAIT_TEXT_BUDGET).text,
        });
        ProcessWaitResult {
            process_id,
            outcome: outcome.into(),
            matched,
            waited_ms: r.waited_ms,
            stdout_tail: tail_text(&r.stdout_tail, WAIT_TEXT_BUDGET),
            stderr_tail: tail_text(&r.stderr_tail, WAIT_TEXT_BUDGET),
            missed_bytes: r.missed,
            resume,
            process: r.info,
        }
    }
}

/// `sandbox_process_write`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessWriteResult {
    /// The process.
    pub process_id: String,
    /// Bytes written to its stdin (fewer than given when the process
    /// stopped reading for 10 s, or closed stdin).
    pub bytes_written: u64,
    /// Stdin is still open for writes.
    pub stdin_open: bool,
}

/// `sandbox_process_kill`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessKillResult {
    /// The process.
    pub process_id: String,
    /// The signal sent ("TERM" by default, then KILL after 3 s if needed).
    pub signal: String,
    /// The process after the signal (state, exit_code or signal).
    pub process: ProcessInfo,
}

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

#[tool_router(router = processes_router, vis = "pub(super)")]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_resolve_by_name_or_number() {
        let r = |v: serde_json::Value| {
            let p: Option<SignalParam> = serde_json::from_value(v).unwrap();
            SignalParam::resolve(p.as_ref()).map_err(|e| e.to_string())
        };
        assert_eq!(r(serde_json::Value::Null), Ok((None, "TERM".into())), "default: TERM, then KILL");
        assert_eq!(r("TERM".into()), Ok((None, "TERM".into())));
        assert_eq!(r("sigkill".into()), Ok((Some(9), "KILL".into())));
        assert_eq!(r("INT".into()), Ok((Some(2), "INT".into())));
        assert_eq!(r(9.into()), Ok((Some(9), "KILL".into())));
        assert_eq!(r("15".into()), Ok((None, "TERM".into())), "TERM by number escalates too");
        assert_eq!(r(15.into()), Ok((None, "TERM".into())));
        assert_eq!(r(40.into()), Ok((Some(40), "40".into())));
        for bad in [serde_json::json!(0), serde_json::json!(65), serde_json::json!(-9), serde_json::json!("BOOM")] {
            assert!(r(bad.clone()).unwrap_err().contains("signal"), "{bad}");
        }
    }

    #[test]
    fn wait_tails_keep_whole_last_lines_within_the_budget() {
        let out: Vec<u8> = (0..2000).flat_map(|i| format!("line {i}\n").into_bytes()).collect();
        let t = tail_text(&out, 100);
        assert!(budget::escaped_len(&t) <= 100, "{t:?}");
        assert!(t.starts_with("line ") && t.ends_with("line 1999\n"), "{t:?}");
        assert_eq!(tail_text(b"short\xff", 100), "short\u{fffd}");
        // One long line: its end, cut on a character boundary.
        let t = tail_text("é".repeat(1000).as_bytes(), 101);
        assert_eq!(t, "é".repeat(50));
    }
}
