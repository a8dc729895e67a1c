//! Calls into a sandbox's guest agent (commands, Python, files), through
//! the agent client's typed methods: [`Manager::with_agent`] finds the
//! running agent (resuming a paused sandbox), counts the call as busy and
//! turns client errors into [`SandboxError`]s.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_agent_client::{AgentClient, ClientError, AGENT_PORT};
use tine_protocol::{Cell, CellReply, Command, DirEntry, Exec, ExecReply, FileData, FileStat, ReadFile, WriteFile};

use super::{Manager, Sandbox, SandboxError, SandboxState};
use crate::lock;
use crate::progress::CallContext;

/// Extra time a call gets beyond the timeout the agent enforces itself
/// (the agent's answer has to travel back; guests on slow hosts are slow).
pub(super) const CALL_GRACE: Duration = Duration::from_secs(30);
/// Interval of the agent's progress frames for a call with progress (ms).
pub(super) const PROGRESS_MS: u32 = 2000;
/// Progress frames a call buffers between the client's reader and the
/// task that reports them (more are dropped: the next one says it all).
pub(super) const PROGRESS_QUEUE: usize = 8;
/// Timeout of short agent calls (files, stat): the request's write and the
/// reply share it. Unit tests (over the fake VM) use 3 s to see a stalled
/// guest's call fail quickly.
pub(super) const SHORT_CALL: Duration = Duration::from_secs(if cfg!(test) { 3 } else { 60 });

/// What a call that carries file data into the guest waits more per MiB
/// than [`SHORT_CALL`]: every byte goes through the guest kernel (its
/// vsock receive path and page cache); on a host that emulates guest
/// kernel mode a 5 MiB upload to a fresh restore's tmpfs took 24 s alone
/// and more than 60 s with another test's guests beside it. Unit tests
/// (over the fake VM) add nothing, as [`SHORT_CALL`] is short there.
const PER_MIB: Duration = Duration::from_secs(if cfg!(test) { 0 } else { 15 });

/// Timeout of a call that carries `bytes` of file data into the guest:
/// [`SHORT_CALL`] and [`PER_MIB`] for each whole MiB.
pub(super) fn data_call(bytes: usize) -> Duration {
    SHORT_CALL + PER_MIB.saturating_mul(u32::try_from(bytes >> 20).unwrap_or(u32::MAX))
}
/// Longest a call holds its call slot: a long command lets the next call
/// in after this and goes on outside the gate. Trivial calls end well
/// within it, so under load they run a few at a time and finish; 2 s let
/// calls of 16 freshly restored guests pile up past their 60 s timeouts on
/// a 2-CPU nested host.
const CALL_HOLD: Duration = Duration::from_secs(10);
/// Longest a call that mostly waits in the guest holds its call slot
/// ([`Manager::with_agent_holding`]): enough for the agent to take the
/// request in.
pub(super) const IDLE_CALL_HOLD: Duration = Duration::from_secs(1);

/// A command to run.
#[derive(Clone, Debug, Default)]
pub struct ExecRequest {
    /// `bash -c` script (unused when `argv` is not empty).
    pub command: String,
    /// A program and its arguments, run without a shell (the program is
    /// looked up in `PATH`); empty: run `command`.
    pub argv: Vec<String>,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Bytes for stdin.
    pub stdin: Vec<u8>,
    /// Timeout (ms; 0: the agent's default).
    pub timeout_ms: u32,
    /// Output cap per stream (bytes; 0: the agent's default).
    pub output_limit: u32,
}

impl ExecRequest {
    /// What the agent runs: `argv` when given, else `bash -c command`.
    pub(super) fn shell_or_argv(&self) -> Command {
        match self.argv.is_empty() {
            true => Command::Shell(self.command.clone()),
            false => Command::Argv(self.argv.clone()),
        }
    }
}

impl Manager {
    /// Runs `call` on the agent of running sandbox `id` (a paused one is
    /// resumed first), keeping the sandbox busy meanwhile.
    ///
    /// Every call waits for a call slot (`Slots::calls`, one per host CPU,
    /// first come first served) before `call` starts, so before its
    /// timeout, and holds it until the call ends or for `CALL_HOLD` (10 s).
    /// On an idle host a slot is free at once; under load, calls start a
    /// few at a time instead of all guests competing for the CPUs inside
    /// their timeouts.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::Starting`],
    /// [`SandboxError::NotRunning`], [`SandboxError::Agent`],
    /// [`SandboxError::Timeout`], [`SandboxError::Connection`],
    /// [`SandboxError::ShuttingDown`] (while waiting for a slot).
    pub(super) async fn with_agent<T, F, Fut>(&self, id: &str, call: F) -> Result<T, SandboxError>
    where
        F: FnOnce(Arc<AgentClient>) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        self.with_agent_holding(id, CALL_HOLD, call).await
    }

    /// Makes sandbox `sb` run for a use (`what`, for the log): waits for a
    /// pool hand-out to finish, wakes it if hibernated, resumes it if
    /// paused; returns its agent connection (`None`: gone).
    ///
    /// Errors: as [`Manager::resume`], the wake's (quotas, memory),
    /// [`SandboxError::Starting`], [`SandboxError::NotRunning`] (it failed
    /// or was stopped).
    pub(super) async fn wake_for_use(
        &self,
        sb: &Arc<Sandbox>,
        what: &str,
    ) -> Result<Option<Arc<AgentClient>>, SandboxError> {
        sb.handed_out().await?;
        self.awake(sb).await?;
        if sb.state() == SandboxState::Paused {
            tracing::info!(sandbox = %sb.id, "resuming a paused sandbox for {what}");
            self.resume(&sb.id).await?;
        }
        let st = lock(&sb.status);
        match st.state {
            SandboxState::Running => Ok(st.agent.clone()),
            SandboxState::Starting => Err(SandboxError::Starting(sb.id.clone())),
            state => Err(SandboxError::NotRunning {
                id: sb.id.clone(),
                state,
                reason: st.error.clone().unwrap_or_else(|| "it ended".into()),
            }),
        }
    }

    /// As [`Manager::with_agent`], holding the call slot at most `hold`:
    /// [`IDLE_CALL_HOLD`] for calls that mostly wait in the guest (a
    /// process wait, a kill waiting for the tree to go), which must not
    /// keep other calls out while they wait.
    ///
    /// Errors: as [`Manager::with_agent`].
    pub(super) async fn with_agent_holding<T, F, Fut>(
        &self,
        id: &str,
        hold: Duration,
        call: F,
    ) -> Result<T, SandboxError>
    where
        F: FnOnce(Arc<AgentClient>) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let sb = self.get(id)?;
        let agent = self.wake_for_use(&sb, "a call").await?;
        let Some(agent) = agent else {
            return Err(SandboxError::Connection { id: sb.id.clone(), reason: "the agent connection is gone".into() });
        };
        let r = {
            let _busy = sb.mark_busy();
            match self.usable_agent(&sb, agent).await {
                Err(e) => Err(e),
                Ok(agent) => {
                    // Every call waits for a call slot before its timeout
                    // starts (the call's future is made after).
                    let slot = match self.slots.calls.try_acquire() {
                        Ok(slot) => slot,
                        Err(_) => {
                            let waited = Instant::now();
                            tracing::info!(sandbox = %sb.id, "call waits for admission: calls start at most one \
                                per host CPU at a time");
                            let slot = self.slots.calls.acquire().await.map_err(|_| SandboxError::ShuttingDown)?;
                            tracing::info!(sandbox = %sb.id, "call admitted after {} ms", waited.elapsed().as_millis());
                            slot
                        }
                    };
                    let fut = call(agent);
                    tokio::pin!(fut);
                    let r = tokio::select! {
                        r = &mut fut => Some(r),
                        () = tokio::time::sleep(hold) => None,
                    };
                    drop(slot);
                    let r = match r {
                        Some(r) => r,
                        None => fut.await,
                    };
                    r
                }
            }
        };
        match r {
            Ok(reply) => Ok(reply),
            Err(ClientError::Agent(e)) => Err(SandboxError::Agent(e)),
            Err(ClientError::Timeout(t)) => Err(SandboxError::Timeout { id: sb.id.clone(), secs: t.as_secs() }),
            Err(ClientError::Cancelled) => Err(SandboxError::Cancelled { id: sb.id.clone() }),
            Err(ClientError::Unexpected(reply)) => Err(SandboxError::Connection {
                id: sb.id.clone(),
                reason: format!("the agent answered with an unexpected {reply}"),
            }),
            Err(e @ ClientError::Oversized { .. }) => {
                tracing::warn!(sandbox = %sb.id, "refused a guest reply: {e}");
                Err(SandboxError::Connection { id: sb.id.clone(), reason: e.to_string() })
            }
            Err(e) => {
                // A dead connection usually means a dead guest: let the
                // monitor record why before answering.
                // (Off the async threads: a snapshot holds `vm` for its copy.)
                let s = sb.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    if let Some(w) = s.exit_watch() {
                        w.wait(Some(Duration::from_secs(2)));
                    }
                })
                .await;
                let st = lock(&sb.status);
                match st.state {
                    SandboxState::Running => Err(SandboxError::Connection { id: sb.id.clone(), reason: e.to_string() }),
                    state => Err(SandboxError::NotRunning {
                        id: sb.id.clone(),
                        state,
                        reason: st.error.clone().unwrap_or_default(),
                    }),
                }
            }
        }
    }

    /// `agent`, or when its connection is broken (closed, or abandoned
    /// after a request write ran out of time) a new connection to the
    /// same guest, which replaces it in the sandbox.
    ///
    /// Errors: the new connection's ([`ClientError::Connect`]).
    async fn usable_agent(&self, sb: &Sandbox, agent: Arc<AgentClient>) -> Result<Arc<AgentClient>, ClientError> {
        if !agent.is_broken() {
            return Ok(agent);
        }
        tracing::info!(sandbox = %sb.id, "the agent connection is broken; connecting again");
        let fresh = Arc::new(AgentClient::connect(&sb.dir().join("vsock.sock"), AGENT_PORT).await?);
        let mut st = lock(&sb.status);
        match &st.agent {
            // A call that raced this one put a working connection there.
            Some(a) if !Arc::ptr_eq(a, &agent) && !a.is_broken() => return Ok(a.clone()),
            // The broken one (this call's, or another call's replacement
            // that broke since, e.g. to an agent that was exiting): the new
            // one replaces it, so later calls and the records (the agent's
            // protocol in a hibernation) see the agent that answers now.
            Some(_) => st.agent = Some(fresh.clone()),
            // The sandbox ended meanwhile.
            None => {}
        }
        Ok(fresh)
    }

    /// Runs a `bash -c` command, or a program without a shell (`argv`).
    /// The call's `env` follows the sandbox environment's rules (at most
    /// 256 variables and 64 KiB, names of `[A-Za-z0-9_]`), checked before
    /// anything is sent.
    ///
    /// Errors: [`SandboxError::Agent`] with `InvalidRequest` for the
    /// environment, and those of agent calls ([`SandboxError::NotFound`],
    /// [`SandboxError::Starting`], [`SandboxError::NotRunning`],
    /// [`SandboxError::Agent`], [`SandboxError::Timeout`],
    /// [`SandboxError::Connection`]).
    pub async fn exec(&self, id: &str, req: ExecRequest) -> Result<ExecReply, SandboxError> {
        self.exec_with(id, req, &CallContext::default()).await
    }

    /// As [`Manager::exec`]; with an active `cx.progress`, the agent sends
    /// progress every 2 s, reported as "running 12 s of 60 s; stdout
    /// 3.1 KiB, stderr 0 B" and the latest output lines (at most 3, each
    /// at most 200 bytes); progress: seconds, total: the timeout (s).
    /// When `cx.cancel` is cancelled while the command runs, the agent
    /// kills the command's process group and the call ends with
    /// [`SandboxError::Cancelled`] once it is gone (a call cancelled before
    /// it started sends nothing).
    ///
    /// Errors: as [`Manager::exec`], [`SandboxError::Cancelled`].
    pub async fn exec_with(&self, id: &str, req: ExecRequest, cx: &CallContext) -> Result<ExecReply, SandboxError> {
        let limits = tine_protocol::effective_limits(req.timeout_ms, req.output_limit)?;
        tine_protocol::check_sandbox_env(&req.env)?;
        let exec = Exec {
            command: req.shell_or_argv(),
            cwd: req.cwd,
            env: req.env,
            stdin: req.stdin,
            timeout_ms: req.timeout_ms,
            output_limit: req.output_limit,
        };
        let timeout = Duration::from_millis(u64::from(limits.0)) + CALL_GRACE;
        let cancel = cx.cancel.clone();
        if cancel.is_cancelled() {
            return Err(SandboxError::Cancelled { id: id.to_string() });
        }
        if !cx.progress.is_active() {
            return self
                .with_agent(id, |a| async move { a.run_cancellable(exec, None, timeout, cancel.cancelled()).await })
                .await;
        }
        let (sink, total_secs) = (cx.progress.clone(), u64::from(limits.0) / 1000);
        self.with_agent(id, |a| async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<tine_protocol::Progress>(PROGRESS_QUEUE);
            // The client drops its sender with the call's end, which ends
            // the pump.
            let pump = crate::progress::report_frames(rx, &sink, "running ", total_secs);
            let call = a.run_cancellable(exec, Some((PROGRESS_MS, tx)), timeout, cancel.cancelled());
            let (r, ()) = tokio::join!(call, pump);
            r
        })
        .await
    }

    /// Runs a cell in the sandbox's persistent Python interpreter.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn python(&self, id: &str, code: String, timeout_ms: u32) -> Result<CellReply, SandboxError> {
        tine_protocol::effective_limits(timeout_ms, 0)?;
        let python = Cell { code, timeout_ms, output_limit: 0 };
        // The agent may start the interpreter (own deadline) and wait out a
        // SIGINT pending under load before it answers.
        let timeout = Duration::from_millis(tine_protocol::python_agent_budget_ms(timeout_ms)) + CALL_GRACE;
        self.with_agent(id, |a| async move { a.run_python(python, timeout).await }).await
    }

    /// Runs a cell in the sandbox's persistent Node.js interpreter (the
    /// shapes and limits of [`Manager::python`]; `value` from
    /// `util.inspect`, `exception.traceback` the JS stack).
    ///
    /// Errors: as [`Manager::exec`]; [`SandboxError::Agent`] with
    /// `Unsupported` when the image has no `node`.
    pub async fn node(&self, id: &str, code: String, timeout_ms: u32) -> Result<CellReply, SandboxError> {
        tine_protocol::effective_limits(timeout_ms, 0)?;
        let cell = Cell { code, timeout_ms, output_limit: 0 };
        let timeout = Duration::from_millis(tine_protocol::python_agent_budget_ms(timeout_ms)) + CALL_GRACE;
        self.with_agent(id, |a| async move { a.run_node(cell, timeout).await }).await
    }

    /// Reads `length` bytes (default: to the end) at `offset` of a file.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn read_file(
        &self,
        id: &str,
        path: String,
        offset: u64,
        length: Option<u64>,
    ) -> Result<FileData, SandboxError> {
        let read = ReadFile { path, offset, length };
        self.with_agent(id, |a| async move { a.read(read, SHORT_CALL).await }).await
    }

    /// Writes (or appends to) a file, creating parent directories.
    /// Returns the bytes written. The agent's answer is awaited for
    /// [`data_call`] of the data's size.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn write_file(
        &self,
        id: &str,
        path: String,
        data: Vec<u8>,
        mode: Option<u32>,
        append: bool,
    ) -> Result<u64, SandboxError> {
        let timeout = data_call(data.len());
        let write = WriteFile { path, data, mode, append, create_parents: true };
        self.with_agent(id, |a| async move { a.write(write, timeout).await }).await
    }

    /// Renames `from` to `to` in the guest (rename(2): atomic within one
    /// file system, replacing a file at `to`).
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn rename(&self, id: &str, from: String, to: String) -> Result<(), SandboxError> {
        self.with_agent(id, |a| async move { a.rename(from, to, SHORT_CALL).await }).await
    }

    /// Removes a file, or a directory (`recursive` for a non-empty one).
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn remove(&self, id: &str, path: String, recursive: bool) -> Result<(), SandboxError> {
        self.with_agent(id, |a| async move { a.remove(path, recursive, SHORT_CALL).await }).await
    }

    /// Lists a directory, sorted by name.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn list_dir(&self, id: &str, path: String) -> Result<Vec<DirEntry>, SandboxError> {
        self.with_agent(id, |a| async move { a.list_dir(path, SHORT_CALL).await }).await
    }

    /// Facts about one path.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn stat(&self, id: &str, path: String) -> Result<FileStat, SandboxError> {
        self.with_agent(id, |a| async move { a.stat(path, SHORT_CALL).await }).await
    }
}
