//! `exec`: run a command in its own process group, feed stdin, capture
//! stdout and stderr up to a cap (with the true byte count), and kill the
//! whole group at the timeout.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tine_protocol::{effective_limits, AgentError, Command, Exec, ExecReply, ExitStatus, Output};

/// The shell for `Command::Shell`: bash where the image has it, else sh.
fn shell() -> &'static str {
    if Path::new("/bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    }
}

/// Reads `r` to EOF, keeping the first `limit` bytes.
fn capture<R: Read>(mut r: R, limit: usize) -> Output {
    let mut out = Output::default();
    let mut buf = [0u8; 16 * 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let keep = n.min(limit.saturating_sub(out.data.len()));
                out.data.extend_from_slice(&buf[..keep]);
                out.truncated |= keep < n;
                out.total_bytes += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    out
}

fn kill_group(pgid: u32) {
    // SAFETY: kill(2) with a negative pid signals that process group; the
    // group was created for this command (process_group(0)).
    unsafe {
        libc::kill(-(pgid as i32), libc::SIGKILL);
    }
}

/// Runs `req`.
///
/// Errors: `InvalidRequest` for limits out of range or an empty argv,
/// `NotFound`/`PermissionDenied` when the program cannot be started.
pub fn run(req: Exec) -> Result<ExecReply, AgentError> {
    let invalid = |reason: String| AgentError::InvalidRequest { reason };
    let (timeout_ms, limit) = effective_limits(req.timeout_ms, req.output_limit)?;
    let limit = limit as usize;
    let argv: Vec<String> = match req.command {
        Command::Shell(script) => vec![shell().to_string(), "-c".into(), script],
        Command::Argv(v) if !v.is_empty() => v,
        Command::Argv(_) => return Err(invalid("empty argv".into())),
    };
    let started = Instant::now();
    let deadline = started + Duration::from_millis(u64::from(timeout_ms));
    let mut child = Process::new(&argv[0])
        .args(&argv[1..])
        .current_dir(req.cwd.as_deref().unwrap_or("/"))
        .envs(req.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => AgentError::NotFound { path: argv[0].clone() },
            std::io::ErrorKind::PermissionDenied => AgentError::PermissionDenied { path: argv[0].clone() },
            _ => AgentError::Io { message: format!("cannot start {}: {e}", argv[0]) },
        })?;
    let pgid = child.id();

    let (tx, rx) = mpsc::channel::<(u8, Output)>();
    for (which, stream) in [
        (1u8, child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>)),
        (2, child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>)),
    ] {
        if let Some(s) = stream {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _ = tx.send((which, capture(s, limit)));
            });
        }
    }
    drop(tx);
    if let Some(mut stdin) = child.stdin.take() {
        let data = req.stdin;
        std::thread::spawn(move || {
            // A command that does not read its stdin closes the pipe: fine.
            let _ = stdin.write_all(&data);
        });
    }

    // Wait for the command, then for its output streams to close (a
    // background child may hold them), all within the timeout.
    let (wtx, wrx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = wtx.send(child.wait());
    });
    let remaining = |d: Instant| d.saturating_duration_since(Instant::now());
    let mut timed_out = false;
    let status = match wrx.recv_timeout(remaining(deadline)) {
        Ok(s) => s,
        Err(_) => {
            timed_out = true;
            kill_group(pgid);
            wrx.recv().unwrap_or_else(|_| Err(std::io::Error::other("wait thread died")))
        }
    };
    let mut stdout = Output::default();
    let mut stderr = Output::default();
    for _ in 0..2 {
        let got = match rx.recv_timeout(remaining(deadline)) {
            Ok(v) => Some(v),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                timed_out = true;
                kill_group(pgid);
                rx.recv().ok()
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
        };
        match got {
            Some((1, o)) => stdout = o,
            Some((_, o)) => stderr = o,
            None => break,
        }
    }
    let status = match (timed_out, status) {
        (true, _) => ExitStatus::TimedOut,
        (false, Ok(s)) => match (s.code(), s.signal()) {
            (Some(c), _) => ExitStatus::Code(c),
            (None, Some(sig)) => ExitStatus::Signal(sig),
            (None, None) => ExitStatus::Code(-1),
        },
        (false, Err(e)) => return Err(AgentError::Io { message: format!("waiting for {}: {e}", argv[0]) }),
    };
    Ok(ExecReply { status, stdout, stderr, duration_ms: started.elapsed().as_millis() as u64 })
}
