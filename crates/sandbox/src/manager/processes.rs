//! Background processes in a sandbox's guest: start, list, page output,
//! wait for text, write stdin, signal. The agent keeps the process table
//! in guest memory (so snapshots, templates and branch children carry it,
//! each child with its own copies of the processes under the same local
//! ids); the host names a process by its sandbox and local id,
//! [`ProcessId`] (`sb-3:p7`). Every call goes through
//! [`Manager::with_agent`]: a paused sandbox is resumed, the call counts
//! as busy while it runs. Background processes themselves are not
//! activity: the idle reaper still kills a sandbox nobody calls.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
use serde::Serialize;
use tine_protocol::{
    AgentError, ExitStatus, ProcessOutputRequest, ProcessWait, ProcessWrite, Spawn, StreamKind, StreamSet, WaitFor,
    WaitMatch, WaitOutcome, KILL_ESCALATE_MS, MAX_PROCESS_WRITE, MAX_SPAWN_STDIN,
};

use super::calls::{ExecRequest, CALL_GRACE, IDLE_CALL_HOLD, PROGRESS_MS, PROGRESS_QUEUE, SHORT_CALL};
use super::{Manager, SandboxError, SandboxId};
use crate::progress::{cut, CallContext};

/// Most bytes of [`ProcessInfo::command`] (cut on a character boundary).
pub const PROCESS_COMMAND_BYTES: usize = 512;
/// SIGTERM, the default signal of [`Manager::process_signal`].
const SIGTERM: i32 = 15;
/// Most bytes of a bad process id quoted in [`SandboxError::BadProcessId`].
const QUOTED_ID_BYTES: usize = 64;

/// A background process: its sandbox and its id in that guest's table;
/// written `sb-3:p7`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProcessId {
    /// The sandbox.
    pub sandbox_id: SandboxId,
    /// The id in the guest's table (1, 2, ...).
    pub local: u64,
}

impl ProcessId {
    /// Process `local` of sandbox `sandbox_id`.
    pub fn new(sandbox_id: impl Into<SandboxId>, local: u64) -> Self {
        ProcessId { sandbox_id: sandbox_id.into(), local }
    }
}

impl fmt::Display for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:p{}", self.sandbox_id, self.local)
    }
}

impl FromStr for ProcessId {
    type Err = SandboxError;

    /// Parses `<sandbox_id>:p<n>` (`n` >= 1; the sandbox id at most 64
    /// bytes of `[A-Za-z0-9._-]`, which every id the server makes is).
    ///
    /// Errors: [`SandboxError::BadProcessId`] (quoting at most 64 bytes of
    /// `s`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || SandboxError::BadProcessId(cut(s, QUOTED_ID_BYTES));
        let (sandbox, local) = s.trim().rsplit_once(':').ok_or_else(bad)?;
        let digits = local.strip_prefix('p').ok_or_else(bad)?;
        if sandbox.is_empty()
            || sandbox.len() > QUOTED_ID_BYTES
            || !sandbox.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            || digits.is_empty()
            || !digits.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        match digits.parse::<u64>() {
            Ok(n) if n > 0 => Ok(ProcessId::new(sandbox, n)),
            _ => Err(bad()),
        }
    }
}

/// Whether a background process's leader runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    /// It runs.
    Running,
    /// It ended (`exit_code` or `signal` says how).
    Exited,
}

/// A background process, as the host reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct ProcessInfo {
    /// Its id, `<sandbox_id>:p<n>`.
    pub process_id: String,
    /// The sandbox it runs in.
    pub sandbox_id: SandboxId,
    /// The command line (at most 512 bytes, cut).
    pub command: String,
    /// The leader's pid in the guest (also its process group id).
    pub pid: i32,
    /// Running or exited.
    pub state: ProcessState,
    /// Its exit code, when it exited normally.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Some member of its process group is still alive (a child it left).
    pub group_alive: bool,
    /// Start time, ms since the Unix epoch (the guest's clock).
    pub started_at_ms: u64,
    /// End time of the leader, ms since the Unix epoch (the guest's clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// Bytes it wrote to stdout.
    pub stdout_bytes: u64,
    /// Bytes it wrote to stderr.
    pub stderr_bytes: u64,
    /// Stdout bytes that fell out of the 256 KiB buffer (the oldest).
    pub stdout_dropped_bytes: u64,
    /// Stderr bytes that fell out of the 256 KiB buffer (the oldest).
    pub stderr_dropped_bytes: u64,
    /// Its stdin is open for writes.
    pub stdin_open: bool,
}

impl ProcessInfo {
    /// The host's view of the agent's entry `p` in sandbox `sandbox_id`.
    fn from_agent(sandbox_id: &str, p: tine_protocol::ProcessInfo) -> Self {
        let (state, exit_code, signal) = match p.status {
            None => (ProcessState::Running, None, None),
            Some(ExitStatus::Code(c)) => (ProcessState::Exited, Some(c), None),
            Some(ExitStatus::Signal(s)) => (ProcessState::Exited, None, Some(s)),
            Some(ExitStatus::TimedOut) => (ProcessState::Exited, None, None),
        };
        ProcessInfo {
            process_id: ProcessId::new(sandbox_id, p.id).to_string(),
            sandbox_id: sandbox_id.to_string(),
            command: cut_to(&p.command, PROCESS_COMMAND_BYTES),
            pid: p.pid,
            state,
            exit_code,
            signal,
            group_alive: p.group_alive,
            started_at_ms: p.started_unix_ms,
            ended_at_ms: p.ended_unix_ms,
            stdout_bytes: p.stdout.total_bytes,
            stderr_bytes: p.stderr.total_bytes,
            stdout_dropped_bytes: p.stdout.buffer_start,
            stderr_dropped_bytes: p.stderr.buffer_start,
            stdin_open: p.stdin_open,
        }
    }
}

/// A page of one output stream of a background process.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessPage {
    /// The process now.
    pub info: ProcessInfo,
    /// The stream read.
    pub stream: StreamKind,
    /// Stream offset (bytes since the process started) of `data[0]`.
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
    /// Bytes between the offset asked for and `offset` that fell out of
    /// the buffer before they were read.
    pub skipped: u64,
    /// Bytes the stream produced so far.
    pub total_bytes: u64,
    /// The stream reached end of file: `total_bytes` is final.
    pub closed: bool,
}

/// What [`Manager::process_wait`] waits for.
#[derive(Clone, Debug, PartialEq)]
pub struct WaitSpec {
    /// Give up after this long (ms; 0: 60 s; at most 600 s).
    pub timeout_ms: u32,
    /// A text or a per-line pattern; `None`: the process's end.
    pub until: Option<WaitFor>,
    /// Which streams to search.
    pub streams: StreamSet,
    /// Stdout offset to search from (0: everything still held, so output
    /// printed before the call counts).
    pub stdout_from: u64,
    /// Stderr offset to search from (0: everything still held).
    pub stderr_from: u64,
}

impl Default for WaitSpec {
    /// The process's end, on both streams, within 60 s.
    fn default() -> Self {
        WaitSpec { timeout_ms: 0, until: None, streams: StreamSet::Both, stdout_from: 0, stderr_from: 0 }
    }
}

/// How a wait ended.
#[derive(Clone, Debug, PartialEq)]
pub struct WaitResult {
    /// Matched, exited or timed out.
    pub outcome: WaitOutcome,
    /// Where the text or pattern appeared, when it did.
    pub found: Option<WaitMatch>,
    /// The process at the end of the wait.
    pub info: ProcessInfo,
    /// The last lines of stdout (at most 1 KiB).
    pub stdout_tail: Vec<u8>,
    /// The last lines of stderr (at most 1 KiB).
    pub stderr_tail: Vec<u8>,
    /// How long the wait took (ms).
    pub waited_ms: u64,
    /// Bytes that fell out of the buffer before they were searched.
    pub missed: u64,
    /// (stdout, stderr) offsets the next wait for the same text or
    /// pattern searches from (see `tine_protocol::ProcessWaited::resume`).
    pub resume: (u64, u64),
}

/// `s` cut to at most `max` bytes on a character boundary.
fn cut_to(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The agent's process errors named in the host's terms (the process id
/// with its sandbox); other errors unchanged.
fn process_error(sandbox_id: &str, e: SandboxError) -> SandboxError {
    match e {
        SandboxError::Agent(AgentError::NoSuchProcess { id }) => {
            SandboxError::NoSuchProcess { process_id: ProcessId::new(sandbox_id, id).to_string() }
        }
        SandboxError::Agent(AgentError::TooManyProcesses { max }) => {
            SandboxError::TooManyProcesses { id: sandbox_id.to_string(), max }
        }
        e => e,
    }
}

/// [`SandboxError::Agent`] with [`AgentError::InvalidRequest`].
fn invalid(reason: String) -> SandboxError {
    SandboxError::Agent(AgentError::InvalidRequest { reason })
}

/// What a wait waits for, for its progress messages.
fn wait_target(until: &Option<WaitFor>) -> String {
    match until {
        None => "the process's end".into(),
        Some(WaitFor::Text(t)) => format!("text {:?}", cut(t, 60)),
        Some(WaitFor::Regex(r)) => format!("pattern /{}/", cut(r, 60)),
    }
}

impl Manager {
    /// Starts `req.command` (`bash -c`; or `req.argv`, no shell) as a background process in
    /// sandbox `id`, in its own process group, with `PYTHONUNBUFFERED=1`
    /// (overridable) and `TINE_PROCESS_ID=p<n>` in its environment;
    /// `req.stdin` (at most 64 KiB) is its initial input, and its stdin
    /// stays open for [`Manager::process_write`] unless `close_stdin`.
    /// `req.timeout_ms` and `req.output_limit` do not apply (it runs until
    /// it ends or is signalled; its buffers hold the last 256 KiB per
    /// stream).
    ///
    /// Errors: those of agent calls (as [`Manager::exec`], the
    /// environment's check included), [`SandboxError::TooManyProcesses`],
    /// [`SandboxError::Agent`] with `TooLarge` (stdin).
    pub async fn spawn(&self, id: &str, req: ExecRequest, close_stdin: bool) -> Result<ProcessInfo, SandboxError> {
        if req.stdin.len() > MAX_SPAWN_STDIN {
            return Err(SandboxError::Agent(AgentError::TooLarge {
                size: req.stdin.len() as u64,
                limit: MAX_SPAWN_STDIN as u64,
            }));
        }
        tine_protocol::check_sandbox_env(&req.env)?;
        let spawn = Spawn { command: req.shell_or_argv(), cwd: req.cwd, env: req.env, stdin: req.stdin, close_stdin };
        let p = self
            .with_agent(id, |a| async move { a.spawn(spawn, SHORT_CALL).await })
            .await
            .map_err(|e| process_error(id, e))?;
        Ok(ProcessInfo::from_agent(id, p))
    }

    /// The background processes of sandbox `id` (running or ended, at
    /// most 32), by id.
    ///
    /// Errors: those of agent calls (as [`Manager::exec`]).
    pub async fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, SandboxError> {
        let list = self.with_agent(id, |a| async move { a.processes(SHORT_CALL).await }).await?;
        Ok(list.into_iter().map(|p| ProcessInfo::from_agent(id, p)).collect())
    }

    /// A page of `stream` of process `p`: at most `max_bytes` (0 or more
    /// than 256 KiB: 256 KiB) from stream offset `offset` (`None`: the
    /// oldest byte still held; past the end: empty at the end). Bytes
    /// that fell out of the buffer are counted in `skipped`.
    ///
    /// Errors: those of agent calls, [`SandboxError::NoSuchProcess`].
    pub async fn process_output(
        &self,
        p: &ProcessId,
        stream: StreamKind,
        offset: Option<u64>,
        max_bytes: u32,
    ) -> Result<ProcessPage, SandboxError> {
        let req = ProcessOutputRequest { id: p.local, stream, offset, max_bytes };
        let sb = p.sandbox_id.as_str();
        let out = self
            .with_agent(sb, |a| async move { a.process_output(req, SHORT_CALL).await })
            .await
            .map_err(|e| process_error(sb, e))?;
        let state = match out.stream {
            StreamKind::Stdout => out.info.stdout,
            StreamKind::Stderr => out.info.stderr,
        };
        Ok(ProcessPage {
            info: ProcessInfo::from_agent(sb, out.info),
            stream: out.stream,
            offset: out.offset,
            data: out.data,
            skipped: out.skipped,
            total_bytes: state.total_bytes,
            closed: state.closed,
        })
    }

    /// Waits until `w.until` appears in process `p`'s output, the process
    /// ends (and its streams close, or 1 s passes), or `w.timeout_ms`
    /// passes; says which. With an active `cx.progress`, reports every
    /// 2 s "waiting for <what> in <process>: 12 s of 30 s; stdout ...,
    /// stderr ..." with the latest output lines (progress: seconds, total:
    /// the timeout).
    ///
    /// Errors: those of agent calls, [`SandboxError::NoSuchProcess`],
    /// [`SandboxError::Agent`] with `InvalidRequest` (pattern too long or
    /// not a valid regex, timeout over 600 s).
    pub async fn process_wait(&self, p: &ProcessId, w: WaitSpec, cx: &CallContext) -> Result<WaitResult, SandboxError> {
        let (timeout_ms, _) = tine_protocol::effective_limits(w.timeout_ms, 0)?;
        let timeout = Duration::from_millis(u64::from(timeout_ms)) + CALL_GRACE;
        let sb = p.sandbox_id.as_str();
        let active = cx.progress.is_active();
        let (what, shown) = (wait_target(&w.until), p.to_string());
        let wait = ProcessWait {
            id: p.local,
            timeout_ms: w.timeout_ms,
            until: w.until,
            streams: w.streams,
            stdout_from: w.stdout_from,
            stderr_from: w.stderr_from,
            progress_ms: if active { PROGRESS_MS } else { 0 },
        };
        let sink = cx.progress.clone();
        let total_secs = u64::from(timeout_ms) / 1000;
        let waited = self
            .with_agent_holding(sb, IDLE_CALL_HOLD, |a| async move {
                if !active {
                    return a.process_wait(wait, timeout, None).await;
                }
                let (tx, rx) = tokio::sync::mpsc::channel::<tine_protocol::Progress>(PROGRESS_QUEUE);
                let head = format!("waiting for {what} in {shown}: ");
                let pump = crate::progress::report_frames(rx, &sink, &head, total_secs);
                let (r, ()) = tokio::join!(a.process_wait(wait, timeout, Some(tx)), pump);
                r
            })
            .await
            .map_err(|e| process_error(sb, e))?;
        Ok(WaitResult {
            outcome: waited.outcome,
            found: waited.found,
            info: ProcessInfo::from_agent(sb, waited.info),
            stdout_tail: waited.stdout_tail,
            stderr_tail: waited.stderr_tail,
            waited_ms: waited.waited_ms,
            missed: waited.missed,
            resume: (waited.resume[0], waited.resume[1]),
        })
    }

    /// Writes `data` (at most 1 MiB) to process `p`'s stdin, then closes
    /// it if `close`; returns the bytes written (fewer when the process
    /// stops reading for 10 s or closed its stdin) and the process after.
    ///
    /// Errors: those of agent calls, [`SandboxError::NoSuchProcess`],
    /// [`SandboxError::Agent`] with `TooLarge`.
    pub async fn process_write(
        &self,
        p: &ProcessId,
        data: Vec<u8>,
        close: bool,
    ) -> Result<(u64, ProcessInfo), SandboxError> {
        if data.len() > MAX_PROCESS_WRITE {
            return Err(SandboxError::Agent(AgentError::TooLarge {
                size: data.len() as u64,
                limit: MAX_PROCESS_WRITE as u64,
            }));
        }
        let write = ProcessWrite { id: p.local, data, close, timeout_ms: 0 };
        let sb = p.sandbox_id.as_str();
        let (bytes, info) = self
            .with_agent(sb, |a| async move { a.process_write(write, SHORT_CALL).await })
            .await
            .map_err(|e| process_error(sb, e))?;
        Ok((bytes, ProcessInfo::from_agent(sb, info)))
    }

    /// Sends `signal` (1..=64) to process `p`'s process group and the
    /// processes that carry its `TINE_PROCESS_ID` mark; `None`: SIGTERM,
    /// then SIGKILL after 3 s to whatever remains. For a terminating signal
    /// it returns once the leader, its group and the marked processes are
    /// gone (or at most 5 s after the signal or the SIGKILL), with the
    /// process then.
    ///
    /// Errors: those of agent calls, [`SandboxError::NoSuchProcess`],
    /// [`SandboxError::Agent`] with `InvalidRequest` (signal number).
    pub async fn process_signal(&self, p: &ProcessId, signal: Option<i32>) -> Result<ProcessInfo, SandboxError> {
        let (signal, escalate_ms) = match signal {
            None => (SIGTERM, KILL_ESCALATE_MS),
            Some(s) if (1..=64).contains(&s) => (s, 0),
            Some(s) => return Err(invalid(format!("signal {s} is not 1..=64"))),
        };
        let (sb, local) = (p.sandbox_id.as_str(), p.local);
        let info = self
            .with_agent_holding(sb, IDLE_CALL_HOLD, |a| async move {
                a.process_signal(local, signal, escalate_ms, SHORT_CALL).await
            })
            .await
            .map_err(|e| process_error(sb, e))?;
        Ok(ProcessInfo::from_agent(sb, info))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_ids_read_and_write_as_sandbox_colon_p_n() {
        let p: ProcessId = "sb-3:p7".parse().unwrap();
        assert_eq!(p, ProcessId::new("sb-3", 7));
        assert_eq!(p.to_string(), "sb-3:p7");
        assert_eq!(" sb-12:p1 ".parse::<ProcessId>().unwrap(), ProcessId::new("sb-12", 1));
        for bad in
            ["", "sb-3", "sb-3:7", "sb-3:p", "sb-3:p0", ":p1", "sb-3:p-1", "sb-3:p+1", "a b:p1", "sb:3:p1x", "sb-é:p1"]
        {
            let e = bad.parse::<ProcessId>().unwrap_err();
            assert!(matches!(&e, SandboxError::BadProcessId(q) if q == bad), "{bad:?}: {e}");
            assert!(e.to_string().contains("sb-3:p7"), "{e}");
        }
        assert!(format!("{}:p1", "s".repeat(65)).parse::<ProcessId>().is_err(), "a sandbox id over 64 bytes");
        let e = "x".repeat(10_000).parse::<ProcessId>().unwrap_err();
        assert!(e.to_string().len() < 200, "a long id is quoted cut: {e}");
        assert!("sb-3:p99999999999999999999".parse::<ProcessId>().is_err());
    }

    #[test]
    fn agent_entries_map_to_the_hosts_terms() {
        let entry = |status| tine_protocol::ProcessInfo {
            id: 4,
            command: "é".repeat(600),
            pid: 120,
            status,
            group_alive: false,
            started_unix_ms: 10,
            ended_unix_ms: Some(20),
            stdout: tine_protocol::StreamState { total_bytes: 600_000, buffer_start: 337_856, closed: true },
            stderr: tine_protocol::StreamState::default(),
            stdin_open: false,
        };
        let i = ProcessInfo::from_agent("sb-2", entry(Some(ExitStatus::Signal(15))));
        assert_eq!(
            (i.process_id.as_str(), i.state, i.exit_code, i.signal),
            ("sb-2:p4", ProcessState::Exited, None, Some(15))
        );
        assert_eq!((i.stdout_bytes, i.stdout_dropped_bytes), (600_000, 337_856));
        assert!(i.command.len() <= PROCESS_COMMAND_BYTES && i.command.chars().all(|c| c == 'é'));
        let v = serde_json::to_value(ProcessInfo::from_agent("sb-2", entry(None))).unwrap();
        assert_eq!(v["state"], "running");
        assert!(v.get("exit_code").is_none());
        let e = process_error("sb-2", SandboxError::Agent(AgentError::NoSuchProcess { id: 9 }));
        assert!(matches!(&e, SandboxError::NoSuchProcess { process_id } if process_id == "sb-2:p9"), "{e}");
        let e = process_error("sb-2", SandboxError::Agent(AgentError::TooManyProcesses { max: 32 }));
        assert!(matches!(&e, SandboxError::TooManyProcesses { id, max: 32 } if id == "sb-2"), "{e}");
    }
}
