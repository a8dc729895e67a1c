//! `tine-agent`: Tine's in-guest agent. It listens on a virtio-vsock port
//! ([`AGENT_PORT`]) and serves the requests of `tine-protocol`: each
//! request runs on a thread of its own while it runs (see [`workers`]), so
//! several can be in flight on one connection, and answers go back in the
//! order they finish.
//!
//! Run as PID 1 (the image's `/sbin/init` links to it), it is also the
//! guest's tiny init: it mounts `/proc`, `/sys`, `/dev`, `/tmp` and
//! `/run`, brings the network up (see [`net`]), starts the agent in a
//! child and reaps every orphan.
//!
//! Background processes (spawned by one request, outliving it) live in
//! the agent's process table (see [`procs`]). `exec` with progress and a
//! process wait with `progress_ms` send interim `Reply::Progress` frames
//! with the request's id before their answer. `cancel` kills the command
//! of an exec in flight on the same connection (see [`Running`]).
//!
//! The sandbox environment (`set_env`) applies to every later exec,
//! background process and Python or Node.js cell (see [`env`]).
//!
//! `python` cells run in one persistent interpreter per sandbox (see
//! [`python`]), `node` cells in another (see [`node`]); what they share
//! is in [`interp`]. `manifest` lists what the sandbox changed on its
//! overlay root and in `/tmp`, with hashes (see [`manifest`]).

mod child;
mod env;
mod exec;
mod files;
mod init;
mod interp;
mod manifest;
mod mounts;
mod net;
mod node;
mod procs;
mod python;
mod sys;
mod trust;
mod vsock;
mod workers;

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tine_protocol::{read_body, AgentError, Op, Progress, ProtocolError, Reply, Response, Wire, AGENT_PORT};

/// The agent's version.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The protocol versions this agent answers, newest first: the current one
/// and the one before (for a host rolled back one release). Built with the
/// `protocol-v4` feature, it speaks only version 4, as the release before
/// did: the fixture that tests a host against an agent of that release.
#[cfg(not(feature = "protocol-v4"))]
const WIRES: &[Wire] = &[Wire::V5, Wire::V4];
#[cfg(feature = "protocol-v4")]
const WIRES: &[Wire] = &[Wire::V4];

/// The newest protocol version this agent speaks (`info` reports it).
pub const PROTOCOL: Wire = WIRES[0];

/// The execs in flight on one connection, by request id, with their
/// cancellation (`Op::Cancel` names a request of its own connection).
#[derive(Clone, Default)]
struct Running(Arc<Mutex<HashMap<u64, Arc<exec::Cancel>>>>);

impl Running {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<exec::Cancel>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A cancellation for request `id` when `op` is an exec (none when
    /// no eventfd can be made: the exec then runs uncancellable).
    fn register(&self, id: u64, op: &Op) -> Option<Arc<exec::Cancel>> {
        if !matches!(op, Op::Exec(_) | Op::ExecWithProgress { .. }) {
            return None;
        }
        let cancel = Arc::new(exec::Cancel::new().ok()?);
        self.lock().insert(id, cancel.clone());
        Some(cancel)
    }

    /// Request `id` ended: its cancellation goes (if it is still `cancel`).
    fn done(&self, id: u64, cancel: &Arc<exec::Cancel>) {
        let mut map = self.lock();
        if map.get(&id).is_some_and(|c| Arc::ptr_eq(c, cancel)) {
            map.remove(&id);
        }
    }

    /// `Op::Cancel { id }`: fires request `id`'s cancellation; whether it
    /// was running.
    fn cancel(&self, id: u64) -> bool {
        self.lock().get(&id).map(|c| c.fire()).is_some()
    }
}

/// Runs one request; `progress` sends an interim `Reply::Progress` frame
/// for it (used by `ExecWithProgress` and `ProcessWait`); `cancel`, an
/// exec's cancellation.
fn handle(
    op: Op,
    started: Instant,
    progress: &dyn Fn(Progress),
    cancel: Option<&exec::Cancel>,
) -> Result<Reply, AgentError> {
    match op {
        Op::Ping => Ok(Reply::Pong { agent_version: AGENT_VERSION.to_string() }),
        Op::Exec(e) => exec::run(e, None, cancel).map(Reply::Exec),
        Op::ExecWithProgress { exec, progress_ms } => {
            exec::run(exec, Some((progress, Duration::from_millis(u64::from(progress_ms)))), cancel).map(Reply::Exec)
        }
        // Answered by `serve` itself, on its reader thread.
        Op::Cancel { .. } => Err(AgentError::InvalidRequest { reason: "cancel is answered by the reader".into() }),
        Op::Spawn(s) => procs::spawn(s).map(Reply::Process),
        Op::ProcessList => Ok(Reply::Processes(procs::list())),
        Op::ProcessOutput(r) => procs::output(r).map(Reply::ProcessOutput),
        Op::ProcessWait(w) => procs::wait(w, progress).map(Reply::ProcessWaited),
        Op::ProcessWrite(w) => procs::write(w).map(|(bytes, info)| Reply::ProcessWritten { bytes, info }),
        Op::ProcessSignal { id, signal, escalate_ms } => procs::signal(id, signal, escalate_ms).map(Reply::Process),
        Op::Python(p) => python::run(p).map(Reply::Python),
        Op::ReadFile(r) => files::read(&r).map(Reply::File),
        Op::WriteFile(w) => files::write(&w).map(|bytes| Reply::Written { bytes }),
        Op::ListDir { path } => files::list(&path).map(Reply::Entries),
        Op::Stat { path } => files::stat(&path).map(Reply::Stat),
        Op::Remove { path, recursive } => files::remove(&path, recursive).map(|()| Reply::Done),
        Op::Mkdir { path, parents, mode } => files::mkdir(&path, parents, mode).map(|()| Reply::Done),
        Op::Info => Ok(Reply::Info(sys::info(started))),
        Op::Reseed(r) => sys::reseed(&r).map(|()| Reply::Done),
        Op::Manifest { paths } => manifest::handle(paths).map(Reply::Manifest),
        Op::SetEnv { env } => env::set(env).map(|()| Reply::Done),
        Op::Rename { from, to } => files::rename(&from, &to).map(|()| Reply::Done),
        Op::PythonWarmUp => python::warm_up().map(|interpreter_start_ms| Reply::PythonWarm { interpreter_start_ms }),
        Op::Node(p) => node::run(p).map(Reply::Python),
        Op::SetProcessDefaults(d) => child::set_defaults(d).map(Reply::ProcessDefaults),
        Op::Mount(m) => mounts::mount(&m).map(|()| Reply::Done),
        Op::Unmount { path } => mounts::unmount(&path).map(|()| Reply::Done),
        Op::InstallTrust { pem } => trust::install(&pem).map(|()| Reply::Done),
        Op::SetHostEnv { env } => env::set_host(env).map(|()| Reply::Done),
    }
}

/// Sends one whole frame under the writer's lock. Progress frames ignore
/// its error (the connection may be gone: after a branch the copy's host
/// side is a new connection); a final answer's error is logged.
fn send(writer: &Mutex<std::fs::File>, frame: &[u8]) -> std::io::Result<()> {
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    w.write_all(frame).and_then(|()| w.flush())
}

/// Serves one connection until the host closes it. Each request is
/// answered in its own frame's protocol version; a frame of a version this
/// agent does not speak, or one without a readable id, is answered with id
/// `u64::MAX` and `InvalidRequest` in the newest version it speaks (so a
/// host learns which that is); an operation it does not know, for that
/// request's id with `Unsupported`.
fn serve(conn: std::fs::File, started: Instant) {
    let writer = match conn.try_clone() {
        Ok(w) => Arc::new(Mutex::new(w)),
        Err(e) => {
            eprintln!("tine-agent: cannot clone the connection: {e}");
            return;
        }
    };
    let mut reader = conn;
    let running = Running::default();
    loop {
        let body = match read_body(&mut reader) {
            Ok(b) => b,
            Err(ProtocolError::Closed) => return,
            Err(e) => {
                // Framing is lost (oversized frame, I/O): drop the connection.
                eprintln!("tine-agent: connection dropped: {e}");
                return;
            }
        };
        let wire = tine_protocol::body_version(&body)
            .ok()
            .and_then(Wire::of_version)
            .filter(|w| WIRES.contains(w))
            .unwrap_or(PROTOCOL);
        let req = match wire.decode_request(&body) {
            Ok(r) => r,
            Err(ProtocolError::UnknownOp { id, reason }) => {
                eprintln!("tine-agent: request {id}: {reason}");
                let resp = Response { id, result: Err(AgentError::Unsupported { reason }) };
                if wire.encode_response(&resp).and_then(|f| send(&writer, &f).map_err(Into::into)).is_err() {
                    return;
                }
                continue;
            }
            Err(e) => {
                // The frame was read whole: report it and go on.
                eprintln!("tine-agent: bad request frame: {e}");
                let resp = Response { id: u64::MAX, result: Err(AgentError::InvalidRequest { reason: e.to_string() }) };
                if wire.encode_response(&resp).and_then(|f| send(&writer, &f).map_err(Into::into)).is_err() {
                    return;
                }
                continue;
            }
        };
        if let Op::Cancel { id } = req.op {
            // On the reader: at once, whatever the workers do.
            let found = running.cancel(id);
            let resp = Response { id: req.id, result: Ok(Reply::Cancelled { found }) };
            if wire.encode_response(&resp).and_then(|f| send(&writer, &f).map_err(Into::into)).is_err() {
                return;
            }
            continue;
        }
        let writer = writer.clone();
        let cancel = running.register(req.id, &req.op);
        let running = running.clone();
        let spawned = workers::run(Box::new(move || {
            let id = req.id;
            let progress = |p: Progress| {
                if let Ok(frame) = wire.encode_response(&Response { id, result: Ok(Reply::Progress(p)) }) {
                    let _ = send(&writer, &frame);
                }
            };
            let resp = Response { id, result: handle(req.op, started, &progress, cancel.as_deref()) };
            if let Some(c) = &cancel {
                running.done(id, c);
            }
            // A reply too large for a frame (a huge directory listing, say)
            // is answered with that error rather than not at all, so the
            // host does not wait for it until its deadline.
            let frame = match wire.encode_response(&resp) {
                Err(ProtocolError::FrameTooLarge { len, max }) => wire.encode_response(&Response {
                    id,
                    result: Err(AgentError::TooLarge { size: len, limit: max as u64 }),
                }),
                r => r,
            };
            if let Err(e) = frame.and_then(|f| send(&writer, &f).map_err(Into::into)) {
                eprintln!("tine-agent: cannot send response {id}: {e}");
            }
        }));
        if let Err(e) = spawned {
            eprintln!("tine-agent: cannot start a request thread: {e}");
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // SAFETY: getpid has no preconditions.
    if unsafe { libc::getpid() } == 1 {
        init::run_as_pid1();
    }
    let port = args
        .iter()
        .position(|a| a == "--port")
        .and_then(|i| args.get(i + 1))
        .and_then(|p| p.parse().ok())
        .unwrap_or(AGENT_PORT);
    let started = Instant::now();
    let listener = match vsock::listen(port) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tine-agent: cannot listen on vsock port {port}: {e}");
            std::process::exit(1);
        }
    };
    println!("tine-agent {AGENT_VERSION} listening on vsock port {port}");
    loop {
        match vsock::accept(&listener) {
            Ok(conn) => {
                if let Err(e) = std::thread::Builder::new().name("conn".into()).spawn(move || serve(conn, started)) {
                    eprintln!("tine-agent: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                eprintln!("tine-agent: accept: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use tine_protocol::{
        read_message, write_message, Command, Exec, ExitStatus, ProcessOutputRequest, Request, StreamKind,
    };

    use super::*;

    /// Over a real connection (a socket pair): an exec with progress gets
    /// interim frames with its id before its answer; the process ops are
    /// dispatched (an unknown process is a typed error).
    #[test]
    fn progress_frames_precede_the_answer_on_the_wire() {
        let (agent_end, mut host) = UnixStream::pair().unwrap();
        let conn = std::fs::File::from(OwnedFd::from(agent_end));
        std::thread::spawn(move || serve(conn, Instant::now()));
        let exec = Exec {
            command: Command::Shell("echo a; sleep 1.2; echo b".into()),
            cwd: None,
            env: vec![],
            stdin: vec![],
            timeout_ms: 0,
            output_limit: 0,
        };
        write_message(&mut host, &Request { id: 7, op: Op::ExecWithProgress { exec, progress_ms: 500 } }).unwrap();
        let mut frames = 0;
        let done = loop {
            let r: Response = read_message(&mut host).unwrap();
            assert_eq!(r.id, 7);
            match r.result {
                Ok(Reply::Progress(p)) => {
                    // "a" at once, "b" after 1.2 s (a late frame may see it).
                    let want: &[u8] = if p.stdout_bytes == 2 { b"a\n" } else { b"a\nb\n" };
                    assert_eq!(p.stdout_tail, want, "{p:?}");
                    frames += 1;
                }
                Ok(Reply::Exec(e)) => break e,
                other => panic!("unexpected {other:?}"),
            }
        };
        assert!(frames >= 1);
        assert_eq!((done.status, done.stdout.data.as_slice()), (ExitStatus::Code(0), &b"a\nb\n"[..]));
        let op = Op::ProcessOutput(ProcessOutputRequest {
            id: u64::MAX,
            stream: StreamKind::Stdout,
            offset: None,
            max_bytes: 0,
        });
        write_message(&mut host, &Request { id: 8, op }).unwrap();
        let r: Response = read_message(&mut host).unwrap();
        assert_eq!((r.id, r.result), (8, Err(AgentError::NoSuchProcess { id: u64::MAX })));
        write_message(&mut host, &Request { id: 9, op: Op::ProcessList }).unwrap();
        let r: Response = read_message(&mut host).unwrap();
        assert!(matches!(r.result, Ok(Reply::Processes(_))), "{r:?}");
    }

    /// `Cancel` over the wire: a running exec of the connection is killed
    /// and answers with the kill's signal; a cancel of no running request
    /// says it found none. (Version 4 has no `Cancel`.)
    #[cfg(not(feature = "protocol-v4"))]
    #[test]
    fn a_cancel_stops_a_running_exec_of_its_connection() {
        let (agent_end, mut host) = UnixStream::pair().unwrap();
        let conn = std::fs::File::from(OwnedFd::from(agent_end));
        std::thread::spawn(move || serve(conn, Instant::now()));
        let exec = Exec {
            command: Command::Shell("echo started; sleep 300".into()),
            cwd: None,
            env: vec![],
            stdin: vec![],
            timeout_ms: 600_000,
            output_limit: 0,
        };
        let t = Instant::now();
        write_message(&mut host, &Request { id: 10, op: Op::Exec(exec) }).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        write_message(&mut host, &Request { id: 11, op: Op::Cancel { id: 10 } }).unwrap();
        let (mut cancelled, mut exec) = (None, None);
        while cancelled.is_none() || exec.is_none() {
            let r: Response = read_message(&mut host).unwrap();
            match (r.id, r.result) {
                (11, Ok(Reply::Cancelled { found })) => cancelled = Some(found),
                (10, Ok(Reply::Exec(e))) => exec = Some(e),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(cancelled, Some(true));
        let exec = exec.unwrap();
        assert_eq!((exec.status, exec.stdout.data.as_slice()), (ExitStatus::Signal(libc::SIGKILL), &b"started\n"[..]));
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
        write_message(&mut host, &Request { id: 12, op: Op::Cancel { id: 10 } }).unwrap();
        let r: Response = read_message(&mut host).unwrap();
        assert_eq!((r.id, r.result), (12, Ok(Reply::Cancelled { found: false })));
    }

    /// Each request is answered in its frame's version: version 4 frames
    /// (a host rolled back one release) get version 4 answers; an unknown
    /// operation is answered for its id; a frame of an unknown version
    /// gets `u64::MAX` and `InvalidRequest` in the newest version.
    #[cfg(not(feature = "protocol-v4"))]
    #[test]
    fn answers_each_frame_in_its_version() {
        use tine_protocol::LENGTH_BYTES;
        let (agent_end, mut host) = UnixStream::pair().unwrap();
        let conn = std::fs::File::from(OwnedFd::from(agent_end));
        std::thread::spawn(move || serve(conn, Instant::now()));
        let body = |host: &mut UnixStream| read_body(host).unwrap();

        host.write_all(&Wire::V4.encode_request(&Request { id: 3, op: Op::Ping }).unwrap()).unwrap();
        let resp = Wire::V4.decode_response(&body(&mut host)).unwrap();
        assert!(matches!(resp, Response { id: 3, result: Ok(Reply::Pong { .. }) }), "{resp:?}");

        // {"id": 4, "op": "Teleport"} in CBOR.
        let mut frame = Wire::V5.encode_request(&Request { id: 4, op: Op::Ping }).unwrap();
        frame.truncate(LENGTH_BYTES + 2);
        frame.extend_from_slice(&[0xa2, 0x62, b'i', b'd', 0x04, 0x62, b'o', b'p', 0x68]);
        frame.extend_from_slice(b"Teleport");
        let len = (frame.len() - LENGTH_BYTES) as u32;
        frame[..LENGTH_BYTES].copy_from_slice(&len.to_le_bytes());
        host.write_all(&frame).unwrap();
        let resp = Wire::V5.decode_response(&body(&mut host)).unwrap();
        assert!(matches!(resp, Response { id: 4, result: Err(AgentError::Unsupported { .. }) }), "{resp:?}");

        let mut frame = Wire::V5.encode_request(&Request { id: 5, op: Op::Ping }).unwrap();
        frame[LENGTH_BYTES] = 9;
        host.write_all(&frame).unwrap();
        let resp = Wire::V5.decode_response(&body(&mut host)).unwrap();
        assert!(matches!(resp, Response { id: u64::MAX, result: Err(AgentError::InvalidRequest { .. }) }), "{resp:?}");
        // The connection goes on in version 5.
        write_message(&mut host, &Request { id: 6, op: Op::Ping }).unwrap();
        let r: Response = read_message(&mut host).unwrap();
        assert!(matches!(r, Response { id: 6, result: Ok(Reply::Pong { .. }) }), "{r:?}");
    }
}
