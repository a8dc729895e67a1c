//! `exec`: run a command in its own process group, feed stdin, capture
//! stdout and stderr up to a cap (with the true byte count), and kill the
//! whole group at the timeout.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::sync::{mpsc, Arc, Mutex};
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

/// After a timeout's kill, how long the output streams may take to close
/// (a process that left the group, e.g. with setsid, may hold them open).
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(1);

/// Reads `r` to EOF into `out`, keeping the first `limit` bytes and
/// counting all of them (`total_bytes`).
fn capture<R: Read>(mut r: R, limit: usize, out: &Mutex<Output>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
                let keep = n.min(limit.saturating_sub(out.data.len()));
                out.data.extend_from_slice(&buf[..keep]);
                out.truncated |= keep < n;
                out.total_bytes += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
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

    let (tx, rx) = mpsc::channel::<()>();
    let outputs = [Arc::new(Mutex::new(Output::default())), Arc::new(Mutex::new(Output::default()))];
    for (out, stream) in [
        (outputs[0].clone(), child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>)),
        (outputs[1].clone(), child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>)),
    ] {
        if let Some(s) = stream {
            let tx = tx.clone();
            std::thread::spawn(move || {
                capture(s, limit, &out);
                let _ = tx.send(());
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
    // Wait for both streams to close: until the deadline, and after a
    // timeout's kill at most DRAIN_AFTER_KILL more; then take what they
    // produced (a process that left the group may hold them open).
    let mut closed = 0;
    let mut until = if timed_out { Instant::now() + DRAIN_AFTER_KILL } else { deadline };
    while closed < 2 {
        match rx.recv_timeout(remaining(until)) {
            Ok(()) => closed += 1,
            Err(mpsc::RecvTimeoutError::Timeout) if !timed_out => {
                timed_out = true;
                kill_group(pgid);
                until = Instant::now() + DRAIN_AFTER_KILL;
            }
            Err(_) => break,
        }
    }
    let take = |o: &Arc<Mutex<Output>>| std::mem::take(&mut *o.lock().unwrap_or_else(|p| p.into_inner()));
    let (stdout, stderr) = (take(&outputs[0]), take(&outputs[1]));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str, timeout_ms: u32, output_limit: u32) -> Exec {
        Exec {
            command: Command::Shell(script.into()),
            cwd: None,
            env: Vec::new(),
            stdin: Vec::new(),
            timeout_ms,
            output_limit,
        }
    }

    /// A process that left the command's group (setsid) and holds stdout
    /// open does not keep the call from answering at its timeout, and the
    /// output written before is kept.
    #[test]
    fn a_timeout_answers_while_an_escaped_process_holds_stdout() {
        let r = run(shell("echo before; setsid sleep 60 & echo $!; sleep 60", 1000, 0)).unwrap();
        let out = String::from_utf8_lossy(&r.stdout.data).into_owned();
        // The escaped sleep, by its pid.
        if let Some(pid) = out.lines().nth(1).and_then(|p| p.parse::<i32>().ok()) {
            // SAFETY: kill(2) of the process this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        assert_eq!(r.status, ExitStatus::TimedOut);
        assert!(out.starts_with("before\n"), "{out}");
    }

    /// The per-stream totals count every byte, past the cap too.
    #[test]
    fn totals_count_past_the_cap() {
        let r = run(shell("head -c 100000 /dev/zero; head -c 7 /dev/zero >&2", 0, 1000)).unwrap();
        assert_eq!((r.stdout.data.len(), r.stdout.truncated, r.stdout.total_bytes), (1000, true, 100_000));
        assert_eq!((r.stderr.data.len(), r.stderr.truncated, r.stderr.total_bytes), (7, false, 7));
    }
}
