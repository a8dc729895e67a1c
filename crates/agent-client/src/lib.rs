//! Async client of Tine's guest agent.
//!
//! Connects through a VM's hybrid-vsock Unix socket (`CONNECT <port>\n`,
//! answered `OK <host port>\n`), then speaks `tine-protocol`: a first
//! `Ping` in the current version, sent at once, tells which version the
//! agent speaks (an agent of the release before answers in version 4), and
//! the connection keeps that version ([`AgentClient::wire`]). Calls wait
//! for that answer within their own deadlines, so a guest slow to answer
//! after a reconnect costs a call no more than its timeout. One task
//! reads responses and hands each to the caller waiting on its request id,
//! so calls from many tasks run concurrently on one connection. Interim
//! [`tine_protocol::Reply::Progress`] frames (of `ExecWithProgress` and a
//! `ProcessWait` with progress) go to the call's progress channel, when it
//! has one, without ending the call; the reader never blocks on them (a
//! full channel drops the frame).
//!
//! An exec call can be cancelled ([`AgentClient::run_cancellable`]): the
//! client then sends `Op::Cancel` for its request id on the same
//! connection, and the agent kills the command's process group.
//!
//! A call's request write and its reply share one deadline: a guest that
//! stops reading its vsock connection (grants no credit) makes the call
//! time out instead of holding the writer for ever. A request cut off
//! mid-write leaves the stream without frame boundaries, so the
//! connection is then abandoned ([`ClientError::Abandoned`]) and the
//! caller connects anew. Replies are checked against what was asked
//! ([`ClientError::Oversized`]): no more bytes than a read asked for, no
//! more output than the limit, no more than
//! [`tine_protocol::MAX_MANIFEST_ENTRIES`] manifest entries. Replies are
//! never formatted into logs or errors, only their kinds and sizes.

#![deny(missing_docs)]

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tine_protocol::{
    body_len, body_version, AgentError, AgentInfo, Cell, CellReply, Command, DirEntry, Exec, ExecReply, FileData,
    FileStat, Manifest, Op, ProcessDefaults, ProcessInfo, ProcessOutput, ProcessOutputRequest, ProcessWait,
    ProcessWaited, ProcessWrite, Progress, ProtocolError, ReadFile, Reply, Request, Reseed, Response, Spawn, Wire,
    WriteFile, LENGTH_BYTES, MAX_FILE_CHUNK, MAX_MANIFEST_ENTRIES, MAX_PROCESSES, MAX_PROCESS_CHUNK,
    PROGRESS_TAIL_BYTES, WAIT_LINE_BYTES,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

/// The agent's vsock port (defined by the protocol).
pub use tine_protocol::AGENT_PORT;
/// Longest wait for the `OK` of the hybrid-vsock handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// After a call was cancelled, how long the client waits for the agent to
/// take the cancel and for the cancelled call's own answer (the command
/// killed) before it gives up on both: 30 s (guests on slow hosts are
/// slow to run a kill).
pub const CANCEL_WAIT: Duration = Duration::from_secs(30);

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The Unix socket or the handshake failed.
    #[error("cannot reach the agent through {path}: {reason}")]
    Connect {
        /// The VM's vsock socket.
        path: String,
        /// Why.
        reason: String,
    },
    /// The connection is gone (the guest stopped, or the agent died).
    #[error("the connection to the agent is closed")]
    Closed,
    /// No answer within the call's timeout.
    #[error("the agent did not answer within {0:?}")]
    Timeout(Duration),
    /// A framing or encoding error.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The agent answered with an error.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The agent answered with a reply of another kind (named by its kind).
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    /// The agent answered with more than was asked for; the reply is
    /// dropped.
    #[error("the agent's {what} reply is too large: {got}, at most {max} was asked for")]
    Oversized {
        /// The reply's kind and part ("read data (bytes)", ...).
        what: &'static str,
        /// Its size.
        got: u64,
        /// What was asked for.
        max: u64,
    },
    /// The connection was abandoned: an earlier request's write ran out of
    /// time midway (the guest stopped reading), so the stream has lost its
    /// frame boundaries. Connect again.
    #[error("the connection to the agent was abandoned after a request could not be written in time (the guest stopped reading it)")]
    Abandoned,
    /// The caller cancelled the call ([`AgentClient::run_cancellable`]):
    /// the agent was asked to kill its command.
    #[error("the call was cancelled by its caller; its command was stopped in the guest")]
    Cancelled,
}

/// One call waiting for its answer.
struct Waiter {
    /// Takes the final answer.
    done: oneshot::Sender<Result<Reply, AgentError>>,
    /// Takes interim [`Reply::Progress`] frames, when the caller asked for
    /// them.
    progress: Option<mpsc::Sender<Progress>>,
}

type Waiters = Arc<Mutex<HashMap<u64, Waiter>>>;

/// A connection to one guest agent.
pub struct AgentClient {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    waiters: Waiters,
    next_id: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
    /// Set when a request write was cut off midway ([`ClientError::Abandoned`]).
    abandoned: AtomicBool,
    /// The protocol version the agent speaks: `None` until the answer to
    /// the first ping (set by the reader task; its end drops the sender).
    wire: tokio::sync::watch::Receiver<Option<Wire>>,
}

/// Marks the connection abandoned if dropped before the write it guards
/// completed (a deadline or a cancelled caller cut it off).
struct WriteGuard<'a> {
    abandoned: &'a AtomicBool,
    done: bool,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.abandoned.store(true, Ordering::SeqCst);
        }
    }
}

/// A reply's kind, for errors and logs (never its contents).
fn reply_kind(r: &Reply) -> &'static str {
    match r {
        Reply::Pong { .. } => "pong",
        Reply::Exec(_) => "exec",
        Reply::Python(_) => "python",
        Reply::File(_) => "file",
        Reply::Written { .. } => "written",
        Reply::Entries(_) => "entries",
        Reply::Stat(_) => "stat",
        Reply::Info(_) => "info",
        Reply::Done => "done",
        Reply::Manifest(_) => "manifest",
        Reply::PythonWarm { .. } => "python warm-up",
        Reply::Progress(_) => "progress",
        Reply::Process(_) => "process",
        Reply::Processes(_) => "processes",
        Reply::ProcessOutput(_) => "process output",
        Reply::ProcessWaited(_) => "process waited",
        Reply::ProcessWritten { .. } => "process written",
        Reply::ProcessDefaults(_) => "process defaults",
        Reply::Cancelled { .. } => "cancelled",
    }
}

/// [`ClientError::Oversized`] unless `got <= max`.
fn at_most(what: &'static str, got: u64, max: u64) -> Result<(), ClientError> {
    if got <= max {
        Ok(())
    } else {
        Err(ClientError::Oversized { what, got, max })
    }
}

async fn read_frame(r: &mut BufReader<OwnedReadHalf>) -> Result<Vec<u8>, ProtocolError> {
    let mut prefix = [0u8; LENGTH_BYTES];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ProtocolError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = body_len(prefix)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(body)
}

async fn read_loop(
    mut r: BufReader<OwnedReadHalf>,
    waiters: Waiters,
    wire_tx: tokio::sync::watch::Sender<Option<Wire>>,
) {
    let wire = match read_frame(&mut r).await.map_err(|e| e.to_string()).and_then(|b| wire_of_first_answer(&b)) {
        Ok(wire) => {
            wire_tx.send_replace(Some(wire));
            wire
        }
        Err(e) => {
            tracing::warn!("agent connection: {e}; closing it");
            return;
        }
    };
    loop {
        let resp: Response = match read_frame(&mut r).await.and_then(|b| wire.decode_response(&b)) {
            Ok(resp) => resp,
            Err(ProtocolError::Closed) => break,
            Err(e) => {
                tracing::warn!("agent connection: {e}; closing it");
                break;
            }
        };
        if let Ok(Reply::Progress(p)) = resp.result {
            route_progress(&waiters, resp.id, p);
            continue;
        }
        let waiter = waiters.lock().unwrap_or_else(|p| p.into_inner()).remove(&resp.id);
        match waiter {
            Some(w) => {
                let _ = w.done.send(resp.result);
            }
            None => tracing::debug!("agent answered request {} after its caller stopped waiting", resp.id),
        }
    }
    // Wake every waiter: their senders drop here.
    waiters.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// The version the agent speaks, from its answer to the first ping (id 0,
/// sent in the current version): a `Pong` in the current version, or, from
/// an agent of the release before (which refuses a frame of another
/// version with id `u64::MAX`), a frame of version 4.
///
/// Errors: a description of what is wrong (a version this host does not
/// speak, a frame that does not decode, another answer).
fn wire_of_first_answer(body: &[u8]) -> Result<Wire, String> {
    let version = body_version(body).map_err(|e| e.to_string())?;
    let Some(wire) = Wire::of_version(version) else {
        return Err(format!(
            "the agent speaks protocol version {version}; this host speaks {}",
            Wire::ALL.map(|w| w.version().to_string()).join(" and ")
        ));
    };
    let resp = wire.decode_response(body).map_err(|e| format!("the answer to the first ping: {e}"))?;
    match (wire, resp) {
        (Wire::V5, Response { id: 0, result: Ok(Reply::Pong { .. }) }) => Ok(wire),
        (Wire::V4, Response { id: u64::MAX, result: Err(AgentError::InvalidRequest { .. }) }) => {
            tracing::debug!("the agent speaks protocol version 4 (the release before)");
            Ok(wire)
        }
        (_, other) => Err(format!(
            "unexpected answer to the first ping in protocol version {version}: {}",
            match other.result {
                Ok(r) => reply_kind(&r).to_string(),
                Err(e) => e.to_string(),
            }
        )),
    }
}

/// Hands an interim progress frame to the call `id` waits on, if it asked
/// for progress: never blocks the reader (a full channel drops the frame),
/// and drops a frame whose tails exceed [`PROGRESS_TAIL_BYTES`]. The call
/// keeps waiting for its final answer either way.
fn route_progress(waiters: &Waiters, id: u64, p: Progress) {
    let tails = at_most("progress stdout tail (bytes)", p.stdout_tail.len() as u64, PROGRESS_TAIL_BYTES as u64)
        .and_then(|()| at_most("progress stderr tail (bytes)", p.stderr_tail.len() as u64, PROGRESS_TAIL_BYTES as u64));
    if let Err(e) = tails {
        tracing::warn!("agent request {id}: {e}; progress frame dropped");
        return;
    }
    let map = waiters.lock().unwrap_or_else(|p| p.into_inner());
    match map.get(&id).map(|w| w.progress.as_ref()) {
        Some(Some(tx)) => {
            if tx.try_send(p).is_err() {
                tracing::debug!("agent request {id}: progress frame dropped (its reader is behind or gone)");
            }
        }
        Some(None) => tracing::debug!("agent request {id}: progress frame for a call that asked for none"),
        None => tracing::debug!("agent request {id}: progress frame after its caller stopped waiting"),
    }
}

impl AgentClient {
    /// Connects to guest port `port` through the VM's vsock socket `uds`.
    ///
    /// Errors: [`ClientError::Connect`].
    pub async fn connect(uds: &Path, port: u32) -> Result<Self, ClientError> {
        let fail = |reason: String| ClientError::Connect { path: uds.display().to_string(), reason };
        let stream = UnixStream::connect(uds).await.map_err(|e| fail(e.to_string()))?;
        let (r, mut w) = stream.into_split();
        w.write_all(format!("CONNECT {port}\n").as_bytes()).await.map_err(|e| fail(e.to_string()))?;
        let mut r = BufReader::new(r);
        let mut line = String::new();
        // The reply is one short line; read_line on a BufReader keeps any
        // following bytes buffered for the frames.
        match tokio::time::timeout(CONNECT_TIMEOUT, r.read_line(&mut line)).await {
            Ok(Ok(n)) if n > 0 && line.starts_with("OK ") => {}
            Ok(Ok(_)) => return Err(fail(format!("the guest refused port {port} (is the agent running?)"))),
            Ok(Err(e)) => return Err(fail(e.to_string())),
            Err(_) => return Err(fail(format!("no answer within {CONNECT_TIMEOUT:?}"))),
        }
        let ping = Wire::V5.encode_request(&Request { id: 0, op: Op::Ping })?;
        w.write_all(&ping).await.map_err(|e| fail(format!("sending the first ping: {e}")))?;
        let waiters: Waiters = Arc::default();
        let (wire_tx, wire) = tokio::sync::watch::channel(None);
        let reader = tokio::spawn(read_loop(r, waiters.clone(), wire_tx));
        Ok(AgentClient {
            writer: tokio::sync::Mutex::new(w),
            waiters,
            next_id: AtomicU64::new(1),
            reader,
            abandoned: AtomicBool::new(false),
            wire,
        })
    }

    /// The protocol version the agent speaks ([`Wire::V5`], or
    /// [`Wire::V4`] for an agent of the release before); `None` until it
    /// answered the first ping.
    pub fn wire(&self) -> Option<Wire> {
        *self.wire.borrow()
    }

    /// Waits until the agent answered the first ping, at most `timeout`;
    /// returns the version it speaks. A booting guest's agent is up once
    /// this returns.
    ///
    /// Errors: [`ClientError::Timeout`], [`ClientError::Closed`] (the
    /// connection ended, or the answer was not one this host speaks).
    pub async fn handshake(&self, timeout: Duration) -> Result<Wire, ClientError> {
        self.wire_by(tokio::time::Instant::now() + timeout, timeout).await
    }

    /// [`AgentClient::handshake`] with a deadline; `timeout` is what the
    /// error reports.
    async fn wire_by(&self, deadline: tokio::time::Instant, timeout: Duration) -> Result<Wire, ClientError> {
        let mut rx = self.wire.clone();
        let known = tokio::time::timeout_at(deadline, async { rx.wait_for(Option::is_some).await.map(|w| *w) }).await;
        match known {
            Ok(Ok(wire)) => wire.ok_or(ClientError::Closed),
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) => Err(ClientError::Timeout(timeout)),
        }
    }

    /// Whether the connection can take no more calls (closed, or
    /// abandoned after a write ran out of time): connect again.
    pub fn is_broken(&self) -> bool {
        self.abandoned.load(Ordering::SeqCst) || self.reader.is_finished()
    }

    /// Sends `op` and waits for its answer; waiting for the writer, writing
    /// the request and waiting for the reply share one deadline, `timeout`
    /// from now.
    ///
    /// Errors: [`ClientError::Agent`] for the agent's typed errors,
    /// [`ClientError::Timeout`], [`ClientError::Closed`],
    /// [`ClientError::Abandoned`], [`ClientError::Protocol`].
    pub async fn call(&self, op: Op, timeout: Duration) -> Result<Reply, ClientError> {
        self.call_inner(op, timeout, None, std::future::pending()).await
    }

    /// As [`AgentClient::call`]; interim [`Reply::Progress`] frames of the
    /// request go to `progress` (when given; a full channel drops them),
    /// and the call returns the final answer. When `cancel` resolves
    /// first, the agent is sent `Op::Cancel` for the request and the call
    /// ends with [`ClientError::Cancelled`] once the agent has answered
    /// the request (its command killed), at most [`CANCEL_WAIT`] later.
    async fn call_inner(
        &self,
        op: Op,
        timeout: Duration,
        progress: Option<mpsc::Sender<Progress>>,
        cancel: impl Future<Output = ()>,
    ) -> Result<Reply, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let (id, rx) = self.start(op, deadline, timeout, progress).await?;
        tokio::pin!(cancel);
        let answer = tokio::select! {
            biased;
            r = tokio::time::timeout_at(deadline, rx) => r,
            () = &mut cancel => return Err(self.cancelled(id).await),
        };
        match answer {
            Ok(Ok(result)) => Ok(result?),
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) => {
                self.forget(id);
                Err(ClientError::Timeout(timeout))
            }
        }
    }

    /// Sends `op` as a new request, its writer's wait and the write due by
    /// `deadline` (`timeout` from the call's start): the request's id and
    /// where its answer will come.
    ///
    /// Errors: as [`AgentClient::call`].
    async fn start(
        &self,
        op: Op,
        deadline: tokio::time::Instant,
        timeout: Duration,
        progress: Option<mpsc::Sender<Progress>>,
    ) -> Result<(u64, oneshot::Receiver<Result<Reply, AgentError>>), ClientError> {
        if self.abandoned.load(Ordering::SeqCst) {
            return Err(ClientError::Abandoned);
        }
        let wire = self.wire_by(deadline, timeout).await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = match wire.encode_request(&Request { id, op }) {
            Ok(f) => f,
            // An operation the agent's version lacks: nothing is sent.
            Err(ProtocolError::UnknownOp { reason, .. }) => return Err(AgentError::Unsupported { reason }.into()),
            Err(e) => return Err(e.into()),
        };
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Waiter { done: tx, progress });
        if self.reader.is_finished() {
            self.forget(id);
            return Err(ClientError::Closed);
        }
        let write = async {
            let mut w = self.writer.lock().await;
            // A call that timed out mid-write while we waited for the lock.
            if self.abandoned.load(Ordering::SeqCst) {
                return Err(ClientError::Abandoned);
            }
            let mut guard = WriteGuard { abandoned: &self.abandoned, done: false };
            let r = w.write_all(&frame).await;
            guard.done = r.is_ok();
            r.map_err(|_| ClientError::Closed)
        };
        match tokio::time::timeout_at(deadline, write).await {
            Ok(Ok(())) => Ok((id, rx)),
            Ok(Err(e)) => {
                self.forget(id);
                Err(e)
            }
            Err(_) => {
                self.forget(id);
                if self.abandoned.load(Ordering::SeqCst) {
                    tracing::warn!(
                        request_bytes = frame.len(),
                        "a request to the agent could not be written within {timeout:?}; abandoning the connection"
                    );
                }
                Err(ClientError::Timeout(timeout))
            }
        }
    }

    /// Stops waiting for request `id`'s answer.
    fn forget(&self, id: u64) {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Request `id` was cancelled by its caller: asks the agent to cancel
    /// it (`Op::Cancel`), and when it was running waits for its answer
    /// (the command killed), all within [`CANCEL_WAIT`]. An agent that
    /// cannot cancel (an earlier release: `Unsupported`) leaves the
    /// command to its timeout; that is logged.
    async fn cancelled(&self, id: u64) -> ClientError {
        let deadline = tokio::time::Instant::now() + CANCEL_WAIT;
        // The request's own answer, taken over from the waiter.
        let answer = self.waiters.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&id).map(|w| {
            let (tx, rx) = oneshot::channel();
            (std::mem::replace(&mut w.done, tx), rx)
        });
        let found = match self.start(Op::Cancel { id }, deadline, CANCEL_WAIT, None).await {
            Ok((cid, rx)) => match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(Ok(Reply::Cancelled { found }))) => found,
                Ok(Ok(Err(e))) => {
                    tracing::warn!("agent request {id} was cancelled but the agent cannot stop it ({e}); its command runs to its timeout");
                    false
                }
                other => {
                    self.forget(cid);
                    tracing::warn!("agent request {id}: the cancel got no answer ({other:?})");
                    false
                }
            },
            Err(e) => {
                tracing::warn!("agent request {id}: cannot send the cancel: {e}");
                false
            }
        };
        if let (true, Some((_, rx))) = (found, answer) {
            // The kill's answer: the command is gone.
            let _ = tokio::time::timeout_at(deadline, rx).await;
        }
        self.forget(id);
        ClientError::Cancelled
    }

    /// Sends `op` and hands its reply to `pick`, which returns the typed
    /// answer or gives back a reply of another kind. The one place a
    /// [`Reply`] is unwrapped.
    async fn call_for<T>(
        &self,
        op: Op,
        timeout: Duration,
        pick: impl FnOnce(Reply) -> Result<T, Box<Reply>>,
    ) -> Result<T, ClientError> {
        self.call_for_with(op, timeout, None, std::future::pending(), pick).await
    }

    /// As [`AgentClient::call_for`], with interim progress frames sent to
    /// `progress`, cancelled when `cancel` resolves ([`AgentClient::call_inner`]).
    async fn call_for_with<T>(
        &self,
        op: Op,
        timeout: Duration,
        progress: Option<mpsc::Sender<Progress>>,
        cancel: impl Future<Output = ()>,
        pick: impl FnOnce(Reply) -> Result<T, Box<Reply>>,
    ) -> Result<T, ClientError> {
        pick(self.call_inner(op, timeout, progress, cancel).await?)
            .map_err(|other| ClientError::Unexpected(reply_kind(&other).to_string()))
    }

    /// Asks whether the agent is up; returns its version string.
    ///
    /// Errors: as [`AgentClient::call`], and [`ClientError::Unexpected`]
    /// (as every typed call).
    pub async fn ping(&self, timeout: Duration) -> Result<String, ClientError> {
        self.call_for(Op::Ping, timeout, |r| match r {
            Reply::Pong { agent_version } => Ok(agent_version),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Hands the guest host entropy and the host's clock.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn reseed(&self, reseed: Reseed, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::Reseed(reseed), timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Replaces the sandbox environment (`Op::SetEnv`): the variables
    /// every later exec, background process and Python cell gets.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `InvalidRequest` for a variable `check_sandbox_env` refuses.
    pub async fn set_env(&self, env: Vec<(String, String)>, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::SetEnv { env }, timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Replaces the host's environment (`Op::SetHostEnv`): the server's
    /// own variables (secrets' placeholders), above the sandbox
    /// environment.
    ///
    /// Errors: as [`AgentClient::set_env`]; `Unsupported` from an agent
    /// older than the operation.
    pub async fn set_host_env(&self, env: Vec<(String, String)>, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::SetHostEnv { env }, timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Trusts the CA certificates `pem` beside the guest's own store
    /// (`Op::InstallTrust`).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `InvalidRequest` (not PEM, too large), `Io`, or `Unsupported` from
    /// an agent older than the operation.
    pub async fn install_trust(&self, pem: String, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::InstallTrust { pem }, timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Sets who every later exec, background process and interpreter runs
    /// as, and where (`Op::SetProcessDefaults`: an OCI image's `User` and
    /// `WorkingDir`); returns the defaults it replaced.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `InvalidRequest` for a user or group the guest lacks or a bad
    /// directory, `Io` when the directory cannot be made, `Unsupported`
    /// from an agent older than the operation.
    pub async fn set_process_defaults(
        &self,
        defaults: ProcessDefaults,
        timeout: Duration,
    ) -> Result<ProcessDefaults, ClientError> {
        self.call_for(Op::SetProcessDefaults(defaults), timeout, |r| match r {
            Reply::ProcessDefaults(before) => Ok(before),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Mounts the disk of serial `mount.serial` at `mount.path`
    /// (`Op::Mount`: a volume just put in a device slot).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `InvalidRequest` (bad path, no such disk) or `Io` (no capacity yet,
    /// the mount failed); `Unsupported` from an agent older than the
    /// operation.
    pub async fn mount(&self, mount: tine_protocol::Mount, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::Mount(mount), timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Writes out and unmounts the file system at `path` (`Op::Unmount`).
    ///
    /// Errors: as [`AgentClient::mount`] (`Io`: busy).
    pub async fn unmount(&self, path: String, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::Unmount { path }, timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Renames `from` to `to` in the guest (rename(2)).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with the
    /// file error.
    pub async fn rename(&self, from: String, to: String, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::Rename { from, to }, timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Removes a file, or a directory (`recursive` for a non-empty one).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with the
    /// file error.
    pub async fn remove(&self, path: String, recursive: bool, timeout: Duration) -> Result<(), ClientError> {
        self.call_for(Op::Remove { path, recursive }, timeout, |r| match r {
            Reply::Done => Ok(()),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// The guest's memory, disk and uptime figures.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn info(&self, timeout: Duration) -> Result<AgentInfo, ClientError> {
        self.call_for(Op::Info, timeout, |r| match r {
            Reply::Info(i) => Ok(i),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Runs `exec`, waiting up to `timeout` (give it more than the
    /// command's own timeout: the answer has to travel back).
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn run(&self, exec: Exec, timeout: Duration) -> Result<ExecReply, ClientError> {
        self.run_cancellable(exec, None, timeout, std::future::pending()).await
    }

    /// Runs `exec` as [`AgentClient::run`]; with `progress =
    /// Some((progress_ms, sender))` as [`AgentClient::run_with_progress`].
    /// When `cancel` resolves before the answer, the agent kills the
    /// command's process group (`Op::Cancel`) and the call ends with
    /// [`ClientError::Cancelled`] once the command is gone (at most
    /// [`CANCEL_WAIT`] later; an agent of an earlier release cannot
    /// cancel, and its command runs on to its timeout).
    ///
    /// Errors: as [`AgentClient::run`], [`ClientError::Cancelled`].
    pub async fn run_cancellable(
        &self,
        exec: Exec,
        progress: Option<(u32, mpsc::Sender<Progress>)>,
        timeout: Duration,
        cancel: impl Future<Output = ()>,
    ) -> Result<ExecReply, ClientError> {
        let limit = output_limit(exec.timeout_ms, exec.output_limit);
        let (op, progress) = match progress {
            Some((progress_ms, tx)) => (Op::ExecWithProgress { exec, progress_ms }, Some(tx)),
            None => (Op::Exec(exec), None),
        };
        self.exec_op(op, limit, timeout, progress, cancel).await
    }

    /// One exec op's call, with its answer's streams checked against `limit`.
    async fn exec_op(
        &self,
        op: Op,
        limit: u64,
        timeout: Duration,
        progress: Option<mpsc::Sender<Progress>>,
        cancel: impl Future<Output = ()>,
    ) -> Result<ExecReply, ClientError> {
        let r = self
            .call_for_with(op, timeout, progress, cancel, |r| match r {
                Reply::Exec(r) => Ok(r),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("exec stdout (bytes)", r.stdout.data.len() as u64, limit)?;
        at_most("exec stderr (bytes)", r.stderr.data.len() as u64, limit)?;
        Ok(r)
    }

    /// As [`AgentClient::run`], asking the agent for a [`Progress`] frame
    /// every `progress_ms` (at least [`tine_protocol::MIN_PROGRESS_MS`])
    /// while the command runs; the frames go to `progress` (a full channel
    /// drops them; frames with tails over
    /// [`PROGRESS_TAIL_BYTES`] are dropped).
    ///
    /// Errors: as [`AgentClient::run`].
    pub async fn run_with_progress(
        &self,
        exec: Exec,
        progress_ms: u32,
        timeout: Duration,
        progress: mpsc::Sender<Progress>,
    ) -> Result<ExecReply, ClientError> {
        self.run_cancellable(exec, Some((progress_ms, progress)), timeout, std::future::pending()).await
    }

    /// Starts a background process; returns its table entry.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `TooManyProcesses`, `TooLarge` (initial stdin) or a spawn failure.
    pub async fn spawn(&self, spawn: Spawn, timeout: Duration) -> Result<ProcessInfo, ClientError> {
        self.call_for(Op::Spawn(spawn), timeout, |r| match r {
            Reply::Process(p) => Ok(p),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// The agent's background process table, by id (at most
    /// [`MAX_PROCESSES`]).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Oversized`] past
    /// [`MAX_PROCESSES`].
    pub async fn processes(&self, timeout: Duration) -> Result<Vec<ProcessInfo>, ClientError> {
        let list = self
            .call_for(Op::ProcessList, timeout, |r| match r {
                Reply::Processes(p) => Ok(p),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("process list entries", list.len() as u64, MAX_PROCESSES as u64)?;
        Ok(list)
    }

    /// A page of a background process's output (at most `req.max_bytes`,
    /// clamped to [`MAX_PROCESS_CHUNK`]; 0 = that).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `NoSuchProcess`; [`ClientError::Oversized`].
    pub async fn process_output(
        &self,
        req: ProcessOutputRequest,
        timeout: Duration,
    ) -> Result<ProcessOutput, ClientError> {
        let max = match req.max_bytes {
            0 => MAX_PROCESS_CHUNK,
            m => m.min(MAX_PROCESS_CHUNK),
        };
        let out = self
            .call_for(Op::ProcessOutput(req), timeout, |r| match r {
                Reply::ProcessOutput(o) => Ok(o),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("process output data (bytes)", out.data.len() as u64, u64::from(max))?;
        Ok(out)
    }

    /// Waits until a text or pattern appears in a background process's
    /// output, it ends, or the wait's timeout passes (give `timeout` more
    /// than `wait.timeout_ms`). With `progress` and `wait.progress_ms > 0`
    /// interim frames go to it.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `NoSuchProcess` or `InvalidRequest`; [`ClientError::Oversized`] for
    /// tails over [`PROGRESS_TAIL_BYTES`] or a line over [`WAIT_LINE_BYTES`].
    pub async fn process_wait(
        &self,
        wait: ProcessWait,
        timeout: Duration,
        progress: Option<mpsc::Sender<Progress>>,
    ) -> Result<ProcessWaited, ClientError> {
        let w = self
            .call_for_with(Op::ProcessWait(wait), timeout, progress, std::future::pending(), |r| match r {
                Reply::ProcessWaited(w) => Ok(w),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("wait stdout tail (bytes)", w.stdout_tail.len() as u64, PROGRESS_TAIL_BYTES as u64)?;
        at_most("wait stderr tail (bytes)", w.stderr_tail.len() as u64, PROGRESS_TAIL_BYTES as u64)?;
        if let Some(m) = &w.found {
            at_most("wait match line (bytes)", m.line.len() as u64, WAIT_LINE_BYTES as u64)?;
        }
        Ok(w)
    }

    /// Writes to a background process's stdin (and/or closes it); returns
    /// the bytes written and the process after the write.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `NoSuchProcess`; [`ClientError::Oversized`] when more bytes are
    /// reported written than were sent.
    pub async fn process_write(
        &self,
        write: ProcessWrite,
        timeout: Duration,
    ) -> Result<(u64, ProcessInfo), ClientError> {
        let sent = write.data.len() as u64;
        let (bytes, info) = self
            .call_for(Op::ProcessWrite(write), timeout, |r| match r {
                Reply::ProcessWritten { bytes, info } => Ok((bytes, info)),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("process write count (bytes)", bytes, sent)?;
        Ok((bytes, info))
    }

    /// Sends `signal` to a background process's group (and its marked
    /// descendants), SIGKILL after `escalate_ms` (0: never) if any remain;
    /// returns the process afterwards.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `NoSuchProcess` or `InvalidRequest` (signal number).
    pub async fn process_signal(
        &self,
        id: u64,
        signal: i32,
        escalate_ms: u32,
        timeout: Duration,
    ) -> Result<ProcessInfo, ClientError> {
        self.call_for(Op::ProcessSignal { id, signal, escalate_ms }, timeout, |r| match r {
            Reply::Process(p) => Ok(p),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Runs a cell in the persistent Python interpreter, waiting up to
    /// `timeout`.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn run_python(&self, python: Cell, timeout: Duration) -> Result<CellReply, ClientError> {
        let limit = output_limit(python.timeout_ms, python.output_limit);
        let r = self.run_cell(Op::Python(python), timeout).await?;
        at_most("python stdout (bytes)", r.stdout.data.len() as u64, limit)?;
        at_most("python stderr (bytes)", r.stderr.data.len() as u64, limit)?;
        Ok(r)
    }

    /// Runs a cell (JavaScript) in the persistent Node.js interpreter,
    /// waiting up to `timeout` (the agent may take up to
    /// [`tine_protocol::python_agent_budget_ms`] of the cell's timeout).
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `Unsupported` when the image has no `node`;
    /// [`ClientError::Oversized`] when stdout or stderr is over the
    /// request's output limit.
    pub async fn run_node(&self, code: Cell, timeout: Duration) -> Result<CellReply, ClientError> {
        let limit = output_limit(code.timeout_ms, code.output_limit);
        let r = self.run_cell(Op::Node(code), timeout).await?;
        at_most("node stdout (bytes)", r.stdout.data.len() as u64, limit)?;
        at_most("node stderr (bytes)", r.stderr.data.len() as u64, limit)?;
        Ok(r)
    }

    /// Sends a cell (`Op::Python` or `Op::Node`) and takes its
    /// [`Reply::Python`].
    async fn run_cell(&self, op: Op, timeout: Duration) -> Result<CellReply, ClientError> {
        self.call_for(op, timeout, |r| match r {
            Reply::Python(r) => Ok(r),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Starts the guest's persistent Python interpreter if it is not
    /// running and warms it up (its cells' namespace stays empty); returns
    /// how long a start took (ms), `None` if it was running. Done before a
    /// template's snapshot, so restored sandboxes have a ready interpreter.
    ///
    /// Errors: as [`AgentClient::ping`]; [`ClientError::Agent`] with
    /// `Unsupported` when the image has no python3.
    pub async fn warm_up_python(&self, timeout: Duration) -> Result<Option<u64>, ClientError> {
        self.call_for(Op::PythonWarmUp, timeout, |r| match r {
            Reply::PythonWarm { interpreter_start_ms } => Ok(interpreter_start_ms),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Reads part of a file (at most one chunk, [`tine_protocol::MAX_FILE_CHUNK`]).
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn read(&self, read: ReadFile, timeout: Duration) -> Result<FileData, ClientError> {
        let max = read.length.unwrap_or(MAX_FILE_CHUNK).min(MAX_FILE_CHUNK);
        let f = self
            .call_for(Op::ReadFile(read), timeout, |r| match r {
                Reply::File(f) => Ok(f),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("read data (bytes)", f.data.len() as u64, max)?;
        Ok(f)
    }

    /// Writes (or appends to) a file; returns the bytes written.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn write(&self, write: WriteFile, timeout: Duration) -> Result<u64, ClientError> {
        self.call_for(Op::WriteFile(write), timeout, |r| match r {
            Reply::Written { bytes } => Ok(bytes),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Lists a directory, sorted by name.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn list_dir(&self, path: String, timeout: Duration) -> Result<Vec<DirEntry>, ClientError> {
        self.call_for(Op::ListDir { path }, timeout, |r| match r {
            Reply::Entries(e) => Ok(e),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Facts about one path.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn stat(&self, path: String, timeout: Duration) -> Result<FileStat, ClientError> {
        self.call_for(Op::Stat { path }, timeout, |r| match r {
            Reply::Stat(s) => Ok(s),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// The paths the guest changed from its image (`paths: None`), or the
    /// guest's view of the given paths.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn manifest(&self, paths: Option<Vec<String>>, timeout: Duration) -> Result<Manifest, ClientError> {
        // The agent answers for each path asked, or lists at most the limit.
        let max = paths.as_ref().map_or(MAX_MANIFEST_ENTRIES, |p| p.len().min(MAX_MANIFEST_ENTRIES));
        let m = self
            .call_for(Op::Manifest { paths }, timeout, |r| match r {
                Reply::Manifest(m) => Ok(m),
                other => Err(Box::new(other)),
            })
            .await?;
        at_most("manifest entries", m.entries.len() as u64, max as u64)?;
        Ok(m)
    }

    /// Runs `bash -c script` with the given limits (0: defaults).
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn exec(&self, script: &str, timeout_ms: u32, output_limit: u32) -> Result<ExecReply, ClientError> {
        let exec = Exec {
            command: Command::Shell(script.to_string()),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms,
            output_limit,
        };
        self.run(exec, call_timeout(timeout_ms)).await
    }

    /// Runs a cell in the persistent Python interpreter.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn python(&self, code: &str, timeout_ms: u32) -> Result<CellReply, ClientError> {
        let python = Cell { code: code.to_string(), timeout_ms, output_limit: 0 };
        let budget = Duration::from_millis(tine_protocol::python_agent_budget_ms(timeout_ms));
        self.run_python(python, budget + Duration::from_secs(60)).await
    }

    /// Writes a whole file (at most one chunk, 8 MiB), making parents.
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn write_file(&self, path: &str, data: Vec<u8>, mode: Option<u32>) -> Result<u64, ClientError> {
        let write = WriteFile { path: path.to_string(), data, mode, append: false, create_parents: true };
        self.write(write, FILE_TIMEOUT).await
    }

    /// Reads a whole file (at most one chunk, 8 MiB).
    ///
    /// Errors: as [`AgentClient::ping`].
    pub async fn read_file(&self, path: &str) -> Result<FileData, ClientError> {
        self.read(ReadFile { path: path.to_string(), offset: 0, length: None }, FILE_TIMEOUT).await
    }
}

/// The output limit (bytes per stream) the agent applies to a call with
/// these limits (see [`tine_protocol::effective_limits`]; out-of-range
/// limits are refused by the agent, so the largest is allowed here).
fn output_limit(timeout_ms: u32, output_limit: u32) -> u64 {
    let limit = tine_protocol::effective_limits(timeout_ms, output_limit)
        .map(|l| l.1)
        .unwrap_or(tine_protocol::MAX_OUTPUT_LIMIT);
    u64::from(limit)
}

/// How long a file call may take (bytes cross an emulated guest kernel
/// slowly on some hosts).
const FILE_TIMEOUT: Duration = Duration::from_secs(300);

/// The wait for a call with a guest-side timeout: that timeout plus slack
/// for the round trip.
fn call_timeout(timeout_ms: u32) -> Duration {
    let t = if timeout_ms == 0 { tine_protocol::DEFAULT_TIMEOUT_MS } else { timeout_ms };
    Duration::from_millis(u64::from(t)) + Duration::from_secs(60)
}

impl Drop for AgentClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, Write};
    use std::os::unix::net::UnixListener;

    use tine_protocol::FileData;

    use super::*;

    /// A peer that does the handshake, answers each request in `answers`
    /// (by request id, in order) without reading further, and then stops
    /// reading: as a guest that grants no more vsock credit.
    fn peer(dir: &Path, answers: Vec<Reply>) -> std::path::PathBuf {
        peer_frames(dir, answers.into_iter().map(|r| vec![r]).collect())
    }

    /// As [`peer`], answering each request with several frames (interim
    /// progress frames, then the final reply).
    fn peer_frames(dir: &Path, answers: Vec<Vec<Reply>>) -> std::path::PathBuf {
        peer_speaking(dir, Wire::V5, answers)
    }

    /// Accepts one connection on `listener` and answers its hybrid-vsock
    /// `CONNECT` line: the writer and a reader for the frames.
    fn accept_connect(
        listener: &UnixListener,
    ) -> (std::os::unix::net::UnixStream, std::io::BufReader<std::os::unix::net::UnixStream>) {
        let (stream, _) = listener.accept().unwrap();
        let mut w = stream.try_clone().unwrap();
        let mut r = std::io::BufReader::new(stream);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        w.write_all(b"OK 1\n").unwrap();
        (w, r)
    }

    /// As [`peer_frames`], speaking `wire` as an agent of that version
    /// does: version 4 refuses the first ping (a version 5 frame) with id
    /// `u64::MAX` in version 4, as the release before did.
    fn peer_speaking(dir: &Path, wire: Wire, answers: Vec<Vec<Reply>>) -> std::path::PathBuf {
        let path = dir.join("vsock.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut w, mut r) = accept_connect(&listener);
            let ping = tine_protocol::read_body(&mut r).unwrap();
            let answer = match wire.decode_request(&ping) {
                Ok(req) => Response { id: req.id, result: Ok(Reply::Pong { agent_version: "peer".into() }) },
                Err(e) => Response { id: u64::MAX, result: Err(AgentError::InvalidRequest { reason: e.to_string() }) },
            };
            w.write_all(&wire.encode_response(&answer).unwrap()).unwrap();
            for (i, frames) in answers.into_iter().enumerate() {
                let req = wire.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
                assert_eq!(req.id, i as u64 + 1);
                for reply in frames {
                    w.write_all(&wire.encode_response(&Response { id: req.id, result: Ok(reply) }).unwrap()).unwrap();
                }
            }
            // Never read again; keep the socket open.
            std::thread::sleep(Duration::from_secs(600));
            drop(r);
        });
        path
    }

    /// An agent of the release before (protocol version 4) is recognised
    /// by its answer to the first ping, and then spoken to in version 4.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_of_the_release_before_is_spoken_to_in_its_version() {
        let dir = tempfile::tempdir().unwrap();
        let path =
            peer_speaking(dir.path(), Wire::V4, vec![vec![Reply::Progress(progress(1, b"a")), exec_reply(b"v4\n")]]);
        let c = AgentClient::connect(&path, AGENT_PORT).await.unwrap();
        assert_eq!(c.handshake(Duration::from_secs(5)).await.unwrap(), Wire::V4);
        assert_eq!(c.wire(), Some(Wire::V4));
        let exec = Exec {
            command: Command::Shell("echo v4".into()),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms: 0,
            output_limit: 0,
        };
        let (tx, mut rx) = mpsc::channel(8);
        let r = c.run_with_progress(exec, 500, Duration::from_secs(5), tx).await.unwrap();
        assert_eq!(r.stdout.data, b"v4\n");
        assert_eq!(rx.recv().await.unwrap().stdout_tail, b"a");
        let dir = tempfile::tempdir().unwrap();
        let c = AgentClient::connect(&peer(dir.path(), Vec::new()), AGENT_PORT).await.unwrap();
        assert_eq!(c.handshake(Duration::from_secs(5)).await.unwrap(), Wire::V5);
    }

    /// Connecting does not wait for the agent's answer to the first ping:
    /// a call waits for it within its own timeout (a stopped agent after
    /// a reconnect costs the call its timeout, no more, no less).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_wait_for_the_first_answer_within_their_own_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vsock.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut w, mut r) = accept_connect(&listener);
            // The first ping is answered 1.5 s late.
            let ping = tine_protocol::read_body(&mut r).unwrap();
            std::thread::sleep(Duration::from_millis(1500));
            let id = Wire::V5.decode_request(&ping).unwrap().id;
            let pong = Response { id, result: Ok(Reply::Pong { agent_version: "late".into() }) };
            w.write_all(&Wire::V5.encode_response(&pong).unwrap()).unwrap();
            let req = Wire::V5.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
            let pong = Response { id: req.id, result: Ok(Reply::Pong { agent_version: "late".into() }) };
            w.write_all(&Wire::V5.encode_response(&pong).unwrap()).unwrap();
            std::thread::sleep(Duration::from_secs(60));
        });
        let t = std::time::Instant::now();
        let c = AgentClient::connect(&path, AGENT_PORT).await.unwrap();
        assert!(t.elapsed() < Duration::from_millis(1000), "connect waited for the ping: {:?}", t.elapsed());
        assert_eq!(c.wire(), None);
        let e = c.ping(Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(e, ClientError::Timeout(d) if d == Duration::from_millis(300)), "{e}");
        assert_eq!(c.ping(Duration::from_secs(10)).await.unwrap(), "late");
        assert_eq!(c.wire(), Some(Wire::V5));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guest_that_stops_reading_times_out_the_write_and_the_connection_is_abandoned() {
        let dir = tempfile::tempdir().unwrap();
        let c = AgentClient::connect(&peer(dir.path(), Vec::new()), AGENT_PORT).await.unwrap();
        // 8 MiB cannot fit the socket buffers of a peer that does not read.
        let write =
            WriteFile { path: "/x".into(), data: vec![0; 8 << 20], mode: None, append: false, create_parents: false };
        let e = c.write(write, Duration::from_millis(500)).await.unwrap_err();
        assert!(matches!(e, ClientError::Timeout(_)), "{e}");
        assert!(c.is_broken());
        // The next call fails at once, saying why.
        let e = c.ping(Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, ClientError::Abandoned), "{e}");
        assert!(e.to_string().contains("the guest stopped reading"), "{e}");
    }

    /// A cancelled exec: the client sends `Cancel` with the exec's id on the
    /// same connection, waits for the exec's (killed) answer and ends with
    /// `Cancelled`; an agent that answers the cancel `Unsupported` (an
    /// earlier release) ends the call at once all the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_exec_sends_cancel_for_its_id_and_waits_for_the_kill() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vsock.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (seen_tx, seen) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut w, mut r) = accept_connect(&listener);
            let mut answer = |id: u64, result: Result<Reply, AgentError>| {
                w.write_all(&Wire::V5.encode_response(&Response { id, result }).unwrap()).unwrap();
            };
            let ping = Wire::V5.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
            answer(ping.id, Ok(Reply::Pong { agent_version: "peer".into() }));
            // First exec: cancel answered, then the killed exec's answer.
            let exec = Wire::V5.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
            let cancel = Wire::V5.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
            seen_tx.send(cancel.op.clone()).unwrap();
            assert_eq!(cancel.op, Op::Cancel { id: exec.id });
            answer(cancel.id, Ok(Reply::Cancelled { found: true }));
            std::thread::sleep(Duration::from_millis(200));
            let killed = ExecReply {
                status: tine_protocol::ExitStatus::Signal(9),
                stdout: Default::default(),
                stderr: Default::default(),
                duration_ms: 1,
            };
            answer(exec.id, Ok(Reply::Exec(killed)));
            // Second exec: an agent that cannot cancel.
            let _exec = Wire::V5.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
            let cancel = Wire::V5.decode_request(&tine_protocol::read_body(&mut r).unwrap()).unwrap();
            answer(cancel.id, Err(AgentError::Unsupported { reason: "old".into() }));
            std::thread::sleep(Duration::from_secs(600));
        });
        let c = AgentClient::connect(&path, AGENT_PORT).await.unwrap();
        let exec = Exec {
            command: Command::Shell("sleep 600".into()),
            cwd: None,
            env: vec![],
            stdin: vec![],
            timeout_ms: 600_000,
            output_limit: 0,
        };
        for _ in 0..2 {
            let t = std::time::Instant::now();
            let cancel = tokio::time::sleep(Duration::from_millis(100));
            let e = c.run_cancellable(exec.clone(), None, Duration::from_secs(700), cancel).await.unwrap_err();
            assert!(matches!(e, ClientError::Cancelled), "{e}");
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        }
        assert!(matches!(seen.recv().unwrap(), Op::Cancel { .. }));
        // The connection goes on.
        assert!(!c.is_broken());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replies_larger_than_asked_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let big = Reply::File(FileData { data: vec![1; 16 << 10], size: 16 << 10 });
        let manifest = Reply::Manifest(Manifest {
            entries: vec![
                tine_protocol::ManifestEntry {
                    path: "/a".into(),
                    kind: tine_protocol::EntryKind::File,
                    size: 0,
                    mode: 0,
                    sha256: None
                };
                3
            ],
            truncated: false,
        });
        let c = AgentClient::connect(&peer(dir.path(), vec![big, manifest, Reply::Done]), AGENT_PORT).await.unwrap();
        let read = ReadFile { path: "/f".into(), offset: 0, length: Some(1024) };
        let e = c.read(read, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, ClientError::Oversized { what: "read data (bytes)", got: 16384, max: 1024 }), "{e}");
        let e = c.manifest(Some(vec!["/a".into()]), Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, ClientError::Oversized { what: "manifest entries", got: 3, max: 1 }), "{e}");
        // A reply of another kind is named by its kind, not its contents.
        let e = c.ping(Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(e.to_string(), "unexpected reply: done");
    }

    fn cell_reply(stdout: usize) -> Reply {
        Reply::Python(CellReply {
            value: Some("42".into()),
            stdout: tine_protocol::Output { data: vec![b'x'; stdout], truncated: false, total_bytes: stdout as u64 },
            stderr: tine_protocol::Output::default(),
            exception: None,
            timed_out: false,
            value_truncated: false,
            value_bytes: 2,
            interpreter_start_ms: None,
        })
    }

    /// A Node.js cell's reply is checked against its output limit as a
    /// Python cell's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn node_cells_are_checked_against_their_output_limit() {
        let dir = tempfile::tempdir().unwrap();
        let c = AgentClient::connect(&peer(dir.path(), vec![cell_reply(1024), cell_reply(1025)]), AGENT_PORT)
            .await
            .unwrap();
        let code = Cell { code: "x + 1".into(), timeout_ms: 0, output_limit: 1024 };
        let r = c.run_node(code.clone(), Duration::from_secs(5)).await.unwrap();
        assert_eq!((r.value.as_deref(), r.stdout.data.len()), (Some("42"), 1024));
        let e = c.run_node(code, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, ClientError::Oversized { what: "node stdout (bytes)", got: 1025, max: 1024 }), "{e}");
    }

    fn progress(elapsed_ms: u64, stdout_tail: &[u8]) -> Progress {
        Progress {
            elapsed_ms,
            stdout_bytes: stdout_tail.len() as u64,
            stderr_bytes: 0,
            stdout_tail: stdout_tail.to_vec(),
            stderr_tail: Vec::new(),
        }
    }

    fn exec_reply(out: &[u8]) -> Reply {
        Reply::Exec(ExecReply {
            status: tine_protocol::ExitStatus::Code(0),
            stdout: tine_protocol::Output { data: out.to_vec(), truncated: false, total_bytes: out.len() as u64 },
            stderr: tine_protocol::Output::default(),
            duration_ms: 1500,
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn progress_frames_before_the_answer_reach_the_caller_and_the_call_completes() {
        let dir = tempfile::tempdir().unwrap();
        let frames = vec![
            Reply::Progress(progress(500, b"line1\n")),
            Reply::Progress(progress(1000, b"line1\nline2\n")),
            exec_reply(b"line1\nline2\nline3\n"),
        ];
        // A second call without a progress channel: frames for it are
        // ignored and it still gets its answer.
        let quiet = vec![Reply::Progress(progress(500, b"x\n")), exec_reply(b"x\n")];
        let c = AgentClient::connect(&peer_frames(dir.path(), vec![frames, quiet]), AGENT_PORT).await.unwrap();
        let (tx, mut rx) = mpsc::channel(8);
        let exec = Exec {
            command: Command::Shell("for i in 1 2 3; do echo line$i; sleep 0.5; done".into()),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms: 0,
            output_limit: 0,
        };
        let r = c.run_with_progress(exec.clone(), 500, Duration::from_secs(5), tx).await.unwrap();
        assert_eq!(r.stdout.data, b"line1\nline2\nline3\n");
        let first = rx.recv().await.unwrap();
        assert_eq!((first.elapsed_ms, first.stdout_tail.as_slice()), (500, &b"line1\n"[..]));
        let second = rx.recv().await.unwrap();
        assert_eq!((second.elapsed_ms, second.stdout_tail.as_slice()), (1000, &b"line1\nline2\n"[..]));
        // The call's sender is dropped with its waiter: no more frames.
        assert!(rx.recv().await.is_none());
        let r = c.run(exec, Duration::from_secs(5)).await.unwrap();
        assert_eq!(r.stdout.data, b"x\n");
        assert!(!c.is_broken());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_progress_tail_is_dropped_and_the_call_still_completes() {
        let dir = tempfile::tempdir().unwrap();
        let frames = vec![
            Reply::Progress(progress(500, &vec![b'a'; PROGRESS_TAIL_BYTES + 1])),
            Reply::Progress(progress(1000, b"ok\n")),
            exec_reply(b"ok\n"),
        ];
        let c = AgentClient::connect(&peer_frames(dir.path(), vec![frames]), AGENT_PORT).await.unwrap();
        let (tx, mut rx) = mpsc::channel(8);
        let exec = Exec {
            command: Command::Shell("echo ok".into()),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms: 0,
            output_limit: 0,
        };
        let r = c.run_with_progress(exec, 500, Duration::from_secs(5), tx).await.unwrap();
        assert_eq!(r.stdout.data, b"ok\n");
        // Only the well-formed frame arrived.
        let only = rx.recv().await.unwrap();
        assert_eq!(only.elapsed_ms, 1000);
        assert!(rx.recv().await.is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn process_replies_are_checked_against_what_was_asked() {
        let dir = tempfile::tempdir().unwrap();
        let info = ProcessInfo {
            id: 1,
            command: "cat".into(),
            pid: 42,
            status: None,
            group_alive: true,
            started_unix_ms: 1,
            ended_unix_ms: None,
            stdout: tine_protocol::StreamState::default(),
            stderr: tine_protocol::StreamState::default(),
            stdin_open: true,
        };
        let page = Reply::ProcessOutput(ProcessOutput {
            info: info.clone(),
            stream: tine_protocol::StreamKind::Stdout,
            offset: 0,
            data: vec![b'x'; 100],
            skipped: 0,
        });
        let written = Reply::ProcessWritten { bytes: 10, info: info.clone() };
        let list = Reply::Processes(vec![info.clone(); MAX_PROCESSES + 1]);
        let c = AgentClient::connect(&peer(dir.path(), vec![page, written, list, Reply::Process(info)]), AGENT_PORT)
            .await
            .unwrap();
        let t = Duration::from_secs(5);
        let req =
            ProcessOutputRequest { id: 1, stream: tine_protocol::StreamKind::Stdout, offset: None, max_bytes: 10 };
        let e = c.process_output(req, t).await.unwrap_err();
        assert!(matches!(e, ClientError::Oversized { got: 100, max: 10, .. }), "{e}");
        let write = ProcessWrite { id: 1, data: b"hi".to_vec(), close: false, timeout_ms: 0 };
        let e = c.process_write(write, t).await.unwrap_err();
        assert!(matches!(e, ClientError::Oversized { got: 10, max: 2, .. }), "{e}");
        let e = c.processes(t).await.unwrap_err();
        assert!(matches!(e, ClientError::Oversized { what: "process list entries", .. }), "{e}");
        let p = c.process_signal(1, 15, 3000, t).await.unwrap();
        assert_eq!(p.pid, 42);
    }
}
