//! What the persistent interpreters ([`crate::python`], [`crate::node`])
//! share: one process per language, started on first use, fed one cell
//! at a time as a JSON line on a request pipe and answering one JSON line
//! on a reply pipe; the watchdog of a cell's timeout; the sandbox
//! environment's changes sent with the next cell; and, for an interpreter
//! whose fds 1 and 2 the agent reads ([`Capture`]), the cell's stdout and
//! stderr.
//!
//! The interpreter's start has its own deadline ([`START_TIMEOUT`]); a
//! cell's timeout starts once it is ready. At a cell's timeout the agent
//! sends SIGINT to the interpreter's process group (the interpreter
//! interrupts the cell and keeps its state); a cell that does not stop
//! within [`KILL_GRACE`] after that is killed with the interpreter, which
//! restarts empty on the next call, unless the SIGINT is still pending
//! then: the interpreter has not run at all since (host load), so the
//! agent waits for it to run, up to [`PENDING_SIGINT_MAX`] more, and gives
//! it a new grace once the signal is delivered.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::process::Child;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use tine_protocol::{
    effective_limits, AgentError, Cell, CellException, CellReply, Output, PYTHON_KILL_GRACE_MS,
    PYTHON_PENDING_SIGINT_MAX_MS, PYTHON_START_TIMEOUT_MS, PYTHON_VALUE_LIMIT,
};

/// How long a cell has to stop after SIGINT before the interpreter is killed.
pub const KILL_GRACE: Duration = Duration::from_millis(PYTHON_KILL_GRACE_MS as u64);
/// The longest extra wait while a cell's SIGINT is still pending.
pub const PENDING_SIGINT_MAX: Duration = Duration::from_millis(PYTHON_PENDING_SIGINT_MAX_MS as u64);
/// Deadline of an interpreter's start (until it says it is ready).
pub const START_TIMEOUT: Duration = Duration::from_millis(PYTHON_START_TIMEOUT_MS as u64);
/// How often a pending SIGINT is looked at.
const PENDING_POLL: Duration = Duration::from_millis(250);

/// An interpreter process just spawned (not yet ready).
pub struct Spawned {
    /// The process, leader of its own process group.
    pub child: Child,
    /// Where request lines go.
    pub requests: File,
    /// Where reply lines come from.
    pub replies: File,
    /// The agent's capture of the process's fds 1 and 2, when the replies
    /// do not carry the cells' output.
    pub capture: Option<Capture>,
}

/// Starts an interpreter process with the sandbox environment's variables.
pub type SpawnFn = fn(&[(String, String)]) -> Result<Spawned, AgentError>;

/// One language's interpreter.
pub struct Language {
    /// Its name in messages ("Python").
    pub name: &'static str,
    /// The program (`python3`), in messages.
    pub program: &'static str,
    /// Starts the process with the sandbox environment's variables.
    /// Errors: `Unsupported` without the program, `Io` otherwise.
    pub spawn: SpawnFn,
}

impl Language {
    /// The error of a failed spawn of [`Language::program`] in `cwd`:
    /// `NotADirectory` when `cwd` is missing (a working directory removed),
    /// `Unsupported` when the program is not installed, else `Io`.
    pub fn spawn_error(&self, e: std::io::Error, cwd: &str) -> AgentError {
        match e.kind() {
            std::io::ErrorKind::NotFound if !std::path::Path::new(cwd).is_dir() => {
                AgentError::NotADirectory { path: cwd.into() }
            }
            std::io::ErrorKind::NotFound => {
                AgentError::Unsupported { reason: format!("{} is not installed in this sandbox's image", self.program) }
            }
            _ => AgentError::Io { message: format!("cannot start {}: {e}", self.program) },
        }
    }
}

struct Interpreter {
    child: Child,
    requests: File,
    replies: BufReader<File>,
    capture: Option<Capture>,
    /// The sandbox environment's generation and variables it has (see
    /// [`crate::env`]): a cell sent under a newer one carries the change.
    env: (u64, Vec<(String, String)>),
    /// The generation of the process defaults it was started under (see
    /// [`crate::child`]): under newer ones it is replaced.
    defaults: u64,
}

/// A language's one persistent interpreter (started on first use).
pub struct Repl {
    lang: Language,
    slot: Mutex<Option<Interpreter>>,
}

#[derive(Deserialize)]
struct WireOutput {
    data: String,
    truncated: bool,
    total_bytes: u64,
}

#[derive(Deserialize)]
struct WireException {
    name: String,
    message: String,
    traceback: String,
}

#[derive(Deserialize)]
struct WireReply {
    value: Option<String>,
    #[serde(default)]
    value_bytes: u64,
    #[serde(default)]
    value_truncated: bool,
    /// Absent when the agent captures the output.
    stdout: Option<WireOutput>,
    stderr: Option<WireOutput>,
    exception: Option<WireException>,
    timed_out: bool,
}

impl From<WireOutput> for Output {
    fn from(w: WireOutput) -> Self {
        Output { data: w.data.into_bytes(), truncated: w.truncated, total_bytes: w.total_bytes }
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on the interpreter's own process group (it is
    // spawned with process_group(0)).
    unsafe {
        libc::kill(-(pid as i32), sig);
    }
}

/// Whether `sig` is pending for process `pid` (process-wide or for its
/// main thread: `ShdPnd`/`SigPnd` in /proc/<pid>/status, see proc(5)): it
/// was sent but the process has not run since to take it.
fn signal_pending(pid: u32, sig: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    let bit = 1u64 << (sig - 1);
    status.lines().any(|l| {
        let mask = l.strip_prefix("SigPnd:").or_else(|| l.strip_prefix("ShdPnd:"));
        mask.and_then(|m| u64::from_str_radix(m.trim(), 16).ok()).is_some_and(|m| m & bit != 0)
    })
}

/// Sends one request line and reads the reply line. With `timeout`, the
/// watchdog sends SIGINT at it and kills the interpreter [`KILL_GRACE`]
/// later, unless the SIGINT is still pending (see the module doc). The
/// watchdog covers the write too: an interpreter busy between cells (a
/// callback that spins) may not read a request larger than the pipe.
fn exchange(interp: &mut Interpreter, line: &str, timeout: Option<Duration>) -> Result<Option<String>, std::io::Error> {
    let pid = interp.child.id();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watchdog = crate::workers::start(move || {
        let Some(timeout) = timeout else { return };
        if done_rx.recv_timeout(timeout).is_ok() {
            return;
        }
        signal(pid, libc::SIGINT);
        let sent = Instant::now();
        let mut kill_at = sent + KILL_GRACE;
        let mut was_pending = false;
        loop {
            match done_rx.recv_timeout(kill_at.saturating_duration_since(Instant::now())) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            let now = Instant::now();
            if signal_pending(pid, libc::SIGINT) && now < sent + KILL_GRACE + PENDING_SIGINT_MAX {
                // The interpreter has not run since the SIGINT: load, not
                // a stuck cell. Wait for it.
                if !was_pending {
                    eprintln!("tine-agent: interpreter SIGINT still pending after the grace period; waiting");
                }
                was_pending = true;
                kill_at = now + PENDING_POLL;
            } else if was_pending {
                // Delivered at last: the cell gets its grace from now.
                was_pending = false;
                kill_at = now + KILL_GRACE;
            } else {
                signal(pid, libc::SIGKILL);
                return;
            }
        }
    })?;
    let mut reply_line = String::new();
    let read = interp
        .requests
        .write_all(line.as_bytes())
        .and_then(|()| interp.requests.flush())
        .and_then(|()| interp.replies.read_line(&mut reply_line));
    let _ = done_tx.send(());
    watchdog.wait();
    match read {
        Ok(n) if n > 0 => Ok(Some(reply_line)),
        Ok(_) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Forgets a dead or unusable interpreter.
fn discard(slot: &mut Option<Interpreter>) {
    if let Some(mut interp) = slot.take() {
        let _ = interp.child.kill();
        let _ = interp.child.wait();
    }
}

/// What the interpreter does to its environment to go from sandbox
/// environment `old` to `new`: `{"set": {name: value}, "unset": [names
/// of old not in new]}`; a name of old not in new that has a login default
/// ([`crate::env::login_default`], e.g. `PATH`) goes back to it instead.
fn env_change(old: &[(String, String)], new: &[(String, String)]) -> serde_json::Value {
    let mut set: serde_json::Map<String, serde_json::Value> =
        new.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
    let mut unset = Vec::new();
    for (name, _) in old.iter().filter(|(k, _)| !new.iter().any(|(n, _)| n == k)) {
        match crate::env::login_default(name) {
            Some(default) => {
                set.insert(name.clone(), default.into());
            }
            None => unset.push(name.as_str()),
        }
    }
    serde_json::json!({ "set": set, "unset": unset })
}

impl Repl {
    /// The interpreter of `lang`, not started.
    pub const fn new(lang: Language) -> Self {
        Repl { lang, slot: Mutex::new(None) }
    }

    /// Its language.
    pub fn language(&self) -> &Language {
        &self.lang
    }

    /// Starts the interpreter and waits (at most [`START_TIMEOUT`]) until
    /// it says it is ready (`{"ready": true}`).
    fn start(&self) -> Result<Interpreter, AgentError> {
        let env = crate::env::current();
        let defaults = crate::child::generation();
        let s = (self.lang.spawn)(&env.1)?;
        let mut interp = Interpreter {
            child: s.child,
            requests: s.requests,
            replies: BufReader::new(s.replies),
            capture: s.capture,
            env,
            defaults,
        };
        let pid = interp.child.id();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let watchdog = crate::workers::start(move || {
            if done_rx.recv_timeout(START_TIMEOUT).is_err() {
                signal(pid, libc::SIGKILL);
            }
        });
        let watchdog = match watchdog {
            Ok(w) => w,
            Err(e) => {
                discard(&mut Some(interp));
                return Err(AgentError::Io { message: format!("cannot start the start watchdog: {e}") });
            }
        };
        let mut line = String::new();
        let read = interp.replies.read_line(&mut line);
        let _ = done_tx.send(());
        watchdog.wait();
        let ready = matches!(read, Ok(n) if n > 0)
            && serde_json::from_str::<serde_json::Value>(&line).is_ok_and(|v| v["ready"] == true);
        if !ready {
            discard(&mut Some(interp));
            return Err(AgentError::Io {
                message: format!(
                    "{} did not start within {} s (or exited at start)",
                    self.lang.program,
                    START_TIMEOUT.as_secs()
                ),
            });
        }
        Ok(interp)
    }

    /// The interpreter in `slot`, started if there is none (or it has
    /// exited), and how long a start took (ms).
    fn ensure<'a>(&self, slot: &'a mut Option<Interpreter>) -> Result<(&'a mut Interpreter, Option<u64>), AgentError> {
        if let Some(interp) = slot {
            if !matches!(interp.child.try_wait(), Ok(None)) {
                // It exited while idle (killed by the OOM killer, ...): start anew.
                discard(slot);
            } else if interp.defaults != crate::child::generation() {
                // Another user or working directory: start anew as that.
                discard(slot);
            }
        }
        match slot {
            Some(interp) => Ok((interp, None)),
            None => {
                let t = Instant::now();
                let interp = slot.insert(self.start()?);
                Ok((interp, Some(t.elapsed().as_millis() as u64)))
            }
        }
    }

    /// Starts the interpreter if it is not running and sends it
    /// `{"warm": true}`, which it answers `{"warm": true}` after its
    /// warm-up (the cells' state stays as it was). Returns how long a
    /// start took (ms).
    ///
    /// Errors: `Unsupported` without the program; `Io` if the interpreter
    /// does not start or answer.
    pub fn warm_up(&self) -> Result<Option<u64>, AgentError> {
        let mut guard = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        // Twice at most: an interpreter that was exiting (killed) when it was
        // looked at is replaced once.
        loop {
            let (interp, started_ms) = self.ensure(&mut guard)?;
            match exchange(interp, "{\"warm\": true}\n", Some(START_TIMEOUT)) {
                Ok(Some(line)) if serde_json::from_str::<serde_json::Value>(&line).is_ok_and(|v| v["warm"] == true) => {
                    return Ok(started_ms)
                }
                other => {
                    discard(&mut guard);
                    if started_ms.is_some() {
                        return Err(AgentError::Io {
                            message: format!("the {} warm-up failed: {other:?}", self.lang.name),
                        });
                    }
                }
            }
        }
    }

    /// Runs one cell: `{"code", "limit", "value_limit"}` and, when the
    /// sandbox environment changed since the interpreter last got it,
    /// `"env"` (see [`env_change`]).
    ///
    /// Errors: `InvalidRequest` for limits out of range; `Unsupported`
    /// without the program; `Io` if the interpreter cannot be started or
    /// reached, or answers nonsense.
    pub fn run(&self, req: Cell) -> Result<CellReply, AgentError> {
        let (timeout_ms, limit) = effective_limits(req.timeout_ms, req.output_limit)?;
        let mut guard = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let (interp, interpreter_start_ms) = self.ensure(&mut guard)?;
        let sandbox_env = crate::env::current();
        let mut line = serde_json::json!({ "code": req.code, "limit": limit, "value_limit": PYTHON_VALUE_LIMIT });
        if sandbox_env.0 != interp.env.0 {
            line["env"] = env_change(&interp.env.1, &sandbox_env.1);
        }
        let line = line.to_string() + "\n";
        if let Some(c) = &interp.capture {
            c.begin(limit as usize);
        }
        let exchanged = exchange(interp, &line, Some(Duration::from_millis(u64::from(timeout_ms))));
        let captured = interp.capture.as_ref().map(Capture::finish);
        let reply = match exchanged {
            Ok(Some(reply)) => {
                // The interpreter applies the change before the cell, whatever the cell does.
                interp.env = sandbox_env;
                reply
            }
            Ok(None) => {
                // The interpreter died (killed after the grace period, or crashed).
                discard(&mut guard);
                let (stdout, stderr) = captured.unwrap_or_default();
                return Ok(CellReply {
                    value: None,
                    stdout,
                    stderr,
                    exception: Some(CellException {
                        name: "InterpreterRestarted".into(),
                        message: format!(
                            "the cell did not stop at its timeout (or {} crashed); the interpreter was killed and its state is lost",
                            self.lang.program
                        ),
                        traceback: String::new(),
                    }),
                    timed_out: true,
                    value_truncated: false,
                    value_bytes: 0,
                    interpreter_start_ms,
                });
            }
            Err(e) => {
                discard(&mut guard);
                return Err(AgentError::Io {
                    message: format!(
                        "the {} interpreter is gone ({e}); the next call starts a new one",
                        self.lang.name
                    ),
                });
            }
        };
        let bad =
            |e: String| AgentError::Io { message: format!("bad reply from the {} interpreter: {e}", self.lang.name) };
        let w: WireReply = serde_json::from_str(&reply).map_err(|e| bad(e.to_string()))?;
        let (stdout, stderr) = match (captured, w.stdout, w.stderr) {
            (Some(captured), _, _) => captured,
            (None, Some(out), Some(err)) => (out.into(), err.into()),
            (None, _, _) => return Err(bad("no stdout or stderr".into())),
        };
        Ok(CellReply {
            value: w.value,
            stdout,
            stderr,
            exception: w.exception.map(|x| CellException { name: x.name, message: x.message, traceback: x.traceback }),
            timed_out: w.timed_out,
            value_truncated: w.value_truncated,
            value_bytes: w.value_bytes,
            interpreter_start_ms,
        })
    }
}

#[cfg(test)]
impl Repl {
    /// The inodes of the running interpreter's request and reply pipes.
    pub fn protocol_pipes(&self) -> Option<[u64; 2]> {
        use std::os::unix::fs::MetadataExt;
        let guard = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let interp = guard.as_ref()?;
        Some([interp.requests.metadata().ok()?.ino(), interp.replies.get_ref().metadata().ok()?.ino()])
    }
}

/// Bytes one drain reads of a stream before it lets go of the lock: a
/// child writing as fast as the agent reads must not hold off a cell's
/// end.
const DRAIN_MAX: usize = 1 << 20;

/// The agent's ends of pipes on an interpreter's fds 1 and 2, which the
/// interpreter, the cells' child processes and anything they leave behind
/// write. A pump thread drains them as they fill (so no writer blocks on a
/// full pipe): into the running cell's stdout and stderr (the first
/// `limit` bytes of each, raw, and the count of all), or nowhere between
/// cells. A background child left by an earlier cell writes into whichever
/// cell runs when its bytes arrive.
pub struct Capture {
    shared: Arc<CaptureShared>,
    /// Its drop (with the interpreter's) ends the pump: the pump polls the
    /// other end.
    _stop: std::io::PipeWriter,
}

struct CaptureShared {
    /// Non-blocking read ends of the pipes on fds 1 and 2.
    pipes: [std::io::PipeReader; 2],
    /// The running cell's byte limit, stdout and stderr; `None` between
    /// cells.
    cell: Mutex<Option<(usize, [Output; 2])>>,
}

/// Bytes waiting in pipe `fd` (FIONREAD; 0 on error).
fn pending_bytes(fd: RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int) };
    if r < 0 {
        0
    } else {
        usize::try_from(n).unwrap_or(0)
    }
}

/// Reads at most `max` bytes from non-blocking `pipe` (less when it runs
/// dry) into `out` (the first `limit` bytes kept, all counted), or
/// nowhere. Returns false at EOF or on an error.
fn drain(mut pipe: &std::io::PipeReader, mut out: Option<&mut Output>, limit: usize, max: usize) -> bool {
    let mut buf = [0u8; 64 * 1024];
    let mut done = 0;
    while done < max {
        let want = buf.len().min(max - done);
        match pipe.read(&mut buf[..want]) {
            Ok(0) => return false,
            Ok(n) => {
                done += n;
                if let Some(o) = out.as_deref_mut() {
                    let keep = n.min(limit.saturating_sub(o.data.len()));
                    o.data.extend_from_slice(&buf[..keep]);
                    o.truncated |= keep < n;
                    o.total_bytes += n as u64;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }
    true
}

impl Capture {
    /// Takes the read ends of the pipes on the interpreter's fds 1 and 2
    /// (stdout, stderr) and starts their pump.
    ///
    /// Errors: making the pipes non-blocking, the stop pipe or the thread.
    pub fn new(stdout: std::io::PipeReader, stderr: std::io::PipeReader) -> std::io::Result<Capture> {
        crate::child::set_nonblocking(stdout.as_raw_fd())?;
        crate::child::set_nonblocking(stderr.as_raw_fd())?;
        let (stop_r, stop_w) = std::io::pipe()?;
        let shared = Arc::new(CaptureShared { pipes: [stdout, stderr], cell: Mutex::new(None) });
        let pumped = shared.clone();
        std::thread::Builder::new().name("fd-capture".into()).spawn(move || pump(&pumped, &stop_r))?;
        Ok(Capture { shared, _stop: stop_w })
    }

    /// Starts a cell's capture, keeping `limit` bytes of each stream, after
    /// discarding what arrived between cells.
    pub fn begin(&self, limit: usize) {
        let mut cell = self.shared.cell.lock().unwrap_or_else(|p| p.into_inner());
        for pipe in &self.shared.pipes {
            drain(pipe, None, 0, pending_bytes(pipe.as_raw_fd()));
        }
        *cell = Some((limit, [Output::default(), Output::default()]));
    }

    /// Ends the cell's capture: takes what is in the pipes now (what the
    /// interpreter wrote before its reply) and returns (stdout, stderr).
    pub fn finish(&self) -> (Output, Output) {
        let mut cell = self.shared.cell.lock().unwrap_or_else(|p| p.into_inner());
        let (limit, [mut out, mut err]) = cell.take().unwrap_or_default();
        for (pipe, o) in self.shared.pipes.iter().zip([&mut out, &mut err]) {
            drain(pipe, Some(o), limit, pending_bytes(pipe.as_raw_fd()));
        }
        (out, err)
    }
}

/// Drains the pipes as they fill until `stop`'s other end closes.
fn pump(shared: &CaptureShared, stop: &std::io::PipeReader) {
    let mut open = [true, true];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: if open[0] { shared.pipes[0].as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: if open[1] { shared.pipes[1].as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: poll(2) on an array of pollfds this function owns, with its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if fds[2].revents != 0 {
            return;
        }
        let mut cell = shared.cell.lock().unwrap_or_else(|p| p.into_inner());
        for (i, fd) in fds[..2].iter().enumerate() {
            if fd.revents != 0 {
                let (limit, out) = match cell.as_mut() {
                    Some((limit, outs)) => (*limit, Some(&mut outs[i])),
                    None => (0, None),
                };
                open[i] = drain(&shared.pipes[i], out, limit, DRAIN_MAX);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// A name the sandbox environment drops is unset, unless it has a
    /// login default, which it then gets back.
    #[test]
    fn a_dropped_name_goes_back_to_its_login_default() {
        let change = env_change(&vars(&[("PATH", "/opt/bin"), ("A", "1"), ("B", "2")]), &vars(&[("B", "3")]));
        assert_eq!(change["set"]["B"], "3");
        assert_eq!(change["set"]["PATH"], crate::env::LOGIN_ENV[0].1);
        assert_eq!(change["unset"], serde_json::json!(["A"]));
    }
}
