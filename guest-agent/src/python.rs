//! The sandbox's persistent Python interpreter: one `python3` process
//! running `repl.py`, fed one cell at a time (JSON lines). Variables,
//! imports and open files live in it between calls.
//!
//! The interpreter starts on the first call, or before a template's
//! snapshot ([`warm_up`]: a sandbox restored from it has a ready one). Its
//! start has its own deadline ([`START_TIMEOUT`]); a cell's timeout starts
//! once it is ready. At a cell's timeout the agent sends SIGINT (the cell
//! gets KeyboardInterrupt and the state is kept); a cell that does not stop
//! within [`KILL_GRACE`] after that is killed with the interpreter, which
//! restarts empty on the next call, unless the SIGINT is still pending
//! then: the interpreter has not run at all since (host load), so the
//! agent waits for it to run, up to [`PENDING_SIGINT_MAX`] more, and gives
//! it a new grace once the signal is delivered.
//!
//! A restored sandbox's interpreter carries the template's state: its
//! hash randomization secret is the template's (the RNG modules a cell
//! imports are seeded after the restore's reseed).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tine_protocol::{
    effective_limits, AgentError, Output, Python, PythonException, PythonReply, PYTHON_KILL_GRACE_MS,
    PYTHON_PENDING_SIGINT_MAX_MS, PYTHON_START_TIMEOUT_MS, PYTHON_VALUE_LIMIT,
};

/// How long a cell has to stop after SIGINT before the interpreter is killed.
pub const KILL_GRACE: Duration = Duration::from_millis(PYTHON_KILL_GRACE_MS as u64);
/// The longest extra wait while a cell's SIGINT is still pending.
pub const PENDING_SIGINT_MAX: Duration = Duration::from_millis(PYTHON_PENDING_SIGINT_MAX_MS as u64);
/// Deadline of the interpreter's start (until `repl.py` says it is ready).
pub const START_TIMEOUT: Duration = Duration::from_millis(PYTHON_START_TIMEOUT_MS as u64);
/// How often a pending SIGINT is looked at.
const PENDING_POLL: Duration = Duration::from_millis(250);
const REPL: &str = include_str!("repl.py");

struct Interpreter {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The sandbox environment's generation and variables it has (see
    /// [`crate::env`]): a cell sent under a newer one carries the change.
    env: (u64, Vec<(String, String)>),
}

static INTERPRETER: Mutex<Option<Interpreter>> = Mutex::new(None);

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
    stdout: WireOutput,
    stderr: WireOutput,
    exception: Option<WireException>,
    timed_out: bool,
}

impl From<WireOutput> for Output {
    fn from(w: WireOutput) -> Self {
        Output { data: w.data.into_bytes(), truncated: w.truncated, total_bytes: w.total_bytes }
    }
}

fn spawn(env: &[(String, String)]) -> Result<Child, AgentError> {
    // Minimal images may have no /root: run from / there.
    let cwd = if std::path::Path::new("/root").is_dir() { "/root" } else { "/" };
    Command::new("python3")
        .args(["-u", "-c", REPL])
        .current_dir(cwd)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("PYTHONIOENCODING", "utf-8")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                AgentError::Unsupported { reason: "python3 is not installed in this sandbox's image".into() }
            }
            _ => AgentError::Io { message: format!("cannot start python3: {e}") },
        })
}

/// Starts the interpreter and waits (at most [`START_TIMEOUT`]) until
/// `repl.py` says it is ready.
fn start() -> Result<Interpreter, AgentError> {
    let env = crate::env::current();
    let mut child = spawn(&env.1)?;
    let stdin = child.stdin.take().ok_or_else(|| AgentError::Io { message: "python3 has no stdin".into() })?;
    let stdout =
        BufReader::new(child.stdout.take().ok_or_else(|| AgentError::Io { message: "python3 has no stdout".into() })?);
    let mut interp = Interpreter { child, stdin, stdout, env };
    let pid = interp.child.id();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(START_TIMEOUT).is_err() {
            signal(pid, libc::SIGKILL);
        }
    });
    let mut line = String::new();
    let read = interp.stdout.read_line(&mut line);
    let _ = done_tx.send(());
    let _ = watchdog.join();
    let ready = matches!(read, Ok(n) if n > 0)
        && serde_json::from_str::<serde_json::Value>(&line).is_ok_and(|v| v["ready"] == true);
    if !ready {
        let _ = interp.child.kill();
        let _ = interp.child.wait();
        return Err(AgentError::Io {
            message: format!("python3 did not start within {} s (or exited at start)", START_TIMEOUT.as_secs()),
        });
    }
    Ok(interp)
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on the interpreter's own process group (process_group(0)).
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

/// The interpreter in `slot`, started if there is none (or it has
/// exited), and how long a start took (ms).
fn ensure(slot: &mut Option<Interpreter>) -> Result<(&mut Interpreter, Option<u64>), AgentError> {
    if let Some(interp) = slot {
        if !matches!(interp.child.try_wait(), Ok(None)) {
            // It exited while idle (killed by the OOM killer, ...): start anew.
            let _ = interp.child.wait();
            *slot = None;
        }
    }
    match slot {
        Some(interp) => Ok((interp, None)),
        None => {
            let t = Instant::now();
            let interp = slot.insert(start()?);
            Ok((interp, Some(t.elapsed().as_millis() as u64)))
        }
    }
}

/// Sends one request line and reads the reply line. With `timeout`, the
/// watchdog sends SIGINT at it and kills the interpreter [`KILL_GRACE`]
/// later, unless the SIGINT is still pending (see the module doc).
fn exchange(interp: &mut Interpreter, line: &str, timeout: Option<Duration>) -> Result<Option<String>, std::io::Error> {
    interp.stdin.write_all(line.as_bytes()).and_then(|()| interp.stdin.flush())?;
    let pid = interp.child.id();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
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
                    eprintln!("tine-agent: python SIGINT still pending after the grace period; waiting");
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
    });
    let mut reply_line = String::new();
    let read = interp.stdout.read_line(&mut reply_line);
    let _ = done_tx.send(());
    let _ = watchdog.join();
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

/// Starts the interpreter if it is not running and runs the warm-up in it
/// (the cells' namespace stays empty). Returns how long a start took (ms).
///
/// Errors: `Unsupported` without python3; `Io` if the interpreter does not
/// start or answer.
pub fn warm_up() -> Result<Option<u64>, AgentError> {
    let mut guard = INTERPRETER.lock().unwrap_or_else(|p| p.into_inner());
    // Twice at most: an interpreter that was exiting (killed) when it was
    // looked at is replaced once.
    loop {
        let (interp, started_ms) = ensure(&mut guard)?;
        match exchange(interp, "{\"warm\": true}\n", Some(START_TIMEOUT)) {
            Ok(Some(line)) if serde_json::from_str::<serde_json::Value>(&line).is_ok_and(|v| v["warm"] == true) => {
                return Ok(started_ms)
            }
            other => {
                discard(&mut guard);
                if started_ms.is_some() {
                    return Err(AgentError::Io { message: format!("the Python warm-up failed: {other:?}") });
                }
            }
        }
    }
}

/// What `repl.py` does to `os.environ` to go from sandbox environment
/// `old` to `new`: `{"set": {name: value}, "unset": [names of old not in
/// new]}`.
fn env_change(old: &[(String, String)], new: &[(String, String)]) -> serde_json::Value {
    let set: serde_json::Map<String, serde_json::Value> =
        new.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
    let unset: Vec<&str> = old.iter().map(|(k, _)| k.as_str()).filter(|k| !new.iter().any(|(n, _)| n == k)).collect();
    serde_json::json!({ "set": set, "unset": unset })
}

/// Runs one cell.
///
/// Errors: `InvalidRequest` for limits out of range; `Unsupported` without
/// python3; `Io` if the interpreter cannot be started or reached.
pub fn run(req: Python) -> Result<PythonReply, AgentError> {
    let (timeout_ms, limit) = effective_limits(req.timeout_ms, req.output_limit)?;
    let mut guard = INTERPRETER.lock().unwrap_or_else(|p| p.into_inner());
    let (interp, interpreter_start_ms) = ensure(&mut guard)?;
    let sandbox_env = crate::env::current();
    let mut line = serde_json::json!({ "code": req.code, "limit": limit, "value_limit": PYTHON_VALUE_LIMIT });
    if sandbox_env.0 != interp.env.0 {
        line["env"] = env_change(&interp.env.1, &sandbox_env.1);
    }
    let line = line.to_string() + "\n";
    let reply = match exchange(interp, &line, Some(Duration::from_millis(u64::from(timeout_ms)))) {
        Ok(Some(reply)) => {
            // repl.py applies the change before the cell, whatever the cell does.
            interp.env = sandbox_env;
            reply
        }
        Ok(None) => {
            // The interpreter died (killed after the grace period, or crashed).
            discard(&mut guard);
            return Ok(PythonReply {
                value: None,
                stdout: Output::default(),
                stderr: Output::default(),
                exception: Some(PythonException {
                    name: "InterpreterRestarted".into(),
                    message: "the cell did not stop at its timeout (or python3 crashed); the interpreter was killed and its state is lost".into(),
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
                message: format!("the Python interpreter is gone ({e}); the next call starts a new one"),
            });
        }
    };
    let w: WireReply = serde_json::from_str(&reply)
        .map_err(|e| AgentError::Io { message: format!("bad reply from the Python interpreter: {e}") })?;
    Ok(PythonReply {
        value: w.value,
        stdout: w.stdout.into(),
        stderr: w.stderr.into(),
        exception: w.exception.map(|x| PythonException { name: x.name, message: x.message, traceback: x.traceback }),
        timed_out: w.timed_out,
        value_truncated: w.value_truncated,
        value_bytes: w.value_bytes,
        interpreter_start_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(code: &str) -> PythonReply {
        run(Python { code: code.into(), timeout_ms: 20_000, output_limit: 32 << 10 }).expect("cell runs")
    }

    /// What a cell's child processes write to fds 1 and 2 is in the cell's
    /// output, in order with the cell's own prints, and nothing leaks into
    /// the next cell. Needs python3 on the host (the agent's tests run
    /// there); skipped loudly without it.
    #[test]
    fn child_process_output_is_captured_in_order() {
        if std::process::Command::new("python3").arg("-c").arg("pass").status().is_err() {
            eprintln!("SKIPPED: python3 is not installed on this host");
            return;
        }
        let r = cell("import os, subprocess\nprint('a')\nos.system('echo hi')\nprint('c')");
        assert_eq!(r.stdout.data, b"a\nhi\nc\n", "{r:?}");
        let r = cell("subprocess.run(['sh', '-c', 'echo e >&2; echo o'])\nos.write(2, b'raw\\n')\n'v'");
        assert_eq!(r.stderr.data, b"e\nraw\n", "{r:?}");
        assert_eq!(r.stdout.data, b"o\n", "{r:?}");
        assert_eq!(r.value.as_deref(), Some("'v'"));
        // Larger than a pipe's 64 KiB: the pump drains while the child writes;
        // the cap keeps the first 32 KiB and counts the rest.
        let r = cell("os.system('head -c 300000 /dev/zero | tr \"\\\\0\" x')");
        assert_eq!(r.stdout.total_bytes, 300_000, "{:?}", r.stdout.total_bytes);
        assert!(r.stdout.truncated);
        assert_eq!(r.stdout.data.len(), 32 << 10);
        // A child forked by Python prints to the pipes (its copy of the lock
        // and of the cell's buffers are not used).
        let r = cell(
            "pid = os.fork()\nif pid == 0:\n    print('child')\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('parent')",
        );
        assert_eq!(r.stdout.data, b"child\nparent\n", "{r:?}");
        // A background child's late bytes land in the cell running when they
        // arrive; a cell run before they arrive sees none of them.
        let r = cell("p = subprocess.Popen(['sh', '-c', 'sleep 1; echo late'])\nprint('quiet')");
        assert_eq!(r.stdout.data, b"quiet\n");
        let r = cell("p.wait()\nprint('next')");
        assert_eq!(r.stdout.data, b"late\nnext\n", "{r:?}");
        assert!(warm_up().is_ok());
    }
}
