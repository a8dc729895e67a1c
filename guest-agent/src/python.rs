//! The sandbox's persistent Python interpreter: one `python3` process
//! running `repl.py`, fed one cell at a time (JSON lines). Variables,
//! imports and open files live in it between calls. At a cell's timeout
//! the agent sends SIGINT (the cell gets KeyboardInterrupt and the state
//! is kept); a cell that does not stop within [`KILL_GRACE`] after that
//! is killed with the interpreter, which restarts empty on the next call.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use tine_protocol::{effective_limits, AgentError, Output, Python, PythonException, PythonReply, PYTHON_KILL_GRACE_MS};

/// How long a cell has to stop after SIGINT before the interpreter is killed.
pub const KILL_GRACE: Duration = Duration::from_millis(PYTHON_KILL_GRACE_MS as u64);
const REPL: &str = include_str!("repl.py");

struct Interpreter {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
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

fn start() -> Result<Interpreter, AgentError> {
    // Minimal images may have no /root: run from / there.
    let cwd = if std::path::Path::new("/root").is_dir() { "/root" } else { "/" };
    let mut child = Command::new("python3")
        .args(["-u", "-c", REPL])
        .current_dir(cwd)
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
        })?;
    let stdin = child.stdin.take().ok_or_else(|| AgentError::Io { message: "python3 has no stdin".into() })?;
    let stdout =
        BufReader::new(child.stdout.take().ok_or_else(|| AgentError::Io { message: "python3 has no stdout".into() })?);
    Ok(Interpreter { child, stdin, stdout })
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on the interpreter's own process group (process_group(0)).
    unsafe {
        libc::kill(-(pid as i32), sig);
    }
}

/// Runs one cell.
///
/// Errors: `InvalidRequest` for limits out of range; `Unsupported` without
/// python3; `Io` if the interpreter cannot be reached.
pub fn run(req: Python) -> Result<PythonReply, AgentError> {
    let (timeout_ms, limit) = effective_limits(req.timeout_ms, req.output_limit)?;
    let mut guard = INTERPRETER.lock().unwrap_or_else(|p| p.into_inner());
    let interp = match &mut *guard {
        Some(interp) => interp,
        slot @ None => slot.insert(start()?),
    };
    let line = serde_json::json!({ "code": req.code, "limit": limit }).to_string() + "\n";
    if let Err(e) = interp.stdin.write_all(line.as_bytes()).and_then(|()| interp.stdin.flush()) {
        let _ = interp.child.kill();
        *guard = None;
        return Err(AgentError::Io {
            message: format!("the Python interpreter is gone ({e}); the next call starts a new one"),
        });
    }

    // The watchdog: SIGINT at the timeout, SIGKILL after the grace period.
    let pid = interp.child.id();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_millis(u64::from(timeout_ms))).is_err() {
            signal(pid, libc::SIGINT);
            if done_rx.recv_timeout(KILL_GRACE).is_err() {
                signal(pid, libc::SIGKILL);
            }
        }
    });
    let mut reply_line = String::new();
    let read = interp.stdout.read_line(&mut reply_line);
    let _ = done_tx.send(());
    let _ = watchdog.join();

    match read {
        Ok(n) if n > 0 => {
            let w: WireReply = serde_json::from_str(&reply_line)
                .map_err(|e| AgentError::Io { message: format!("bad reply from the Python interpreter: {e}") })?;
            Ok(PythonReply {
                value: w.value,
                stdout: w.stdout.into(),
                stderr: w.stderr.into(),
                exception: w.exception.map(|x| PythonException {
                    name: x.name,
                    message: x.message,
                    traceback: x.traceback,
                }),
                timed_out: w.timed_out,
            })
        }
        _ => {
            // The interpreter died (killed after the grace period, or crashed).
            let _ = interp.child.kill();
            let _ = interp.child.wait();
            *guard = None;
            Ok(PythonReply {
                value: None,
                stdout: Output::default(),
                stderr: Output::default(),
                exception: Some(PythonException {
                    name: "InterpreterRestarted".into(),
                    message: "the cell did not stop at its timeout (or python3 crashed); the interpreter was killed and its state is lost".into(),
                    traceback: String::new(),
                }),
                timed_out: true,
            })
        }
    }
}
