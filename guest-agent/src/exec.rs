//! `exec`: run a command in its own process group, feed stdin, capture
//! stdout and stderr up to a cap (with the true byte count), and kill the
//! whole group at the timeout. With a progress callback, a [`Progress`]
//! (elapsed time, byte counts, the last lines of each stream) goes out at
//! every interval while it runs.

use std::io::{Read, Write};
use std::process::Stdio;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tine_protocol::{
    effective_limits, AgentError, Exec, ExecReply, ExitStatus, Output, Progress, MIN_PROGRESS_MS, PROGRESS_TAIL_BYTES,
};

use crate::child;
use crate::procs::Ring;

/// After a timeout's kill, how long the output streams may take to close
/// (a process that left the group, e.g. with setsid, may hold them open).
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(1);

/// One stream's capture: the first `limit` bytes with the true count,
/// and the newest bytes for progress tails.
struct Captured {
    out: Output,
    /// The last `2 * PROGRESS_TAIL_BYTES` bytes (room to cut to whole
    /// lines); only kept with progress.
    tail: Option<Ring>,
}

/// Reads `r` to EOF into `out`, keeping the first `limit` bytes and
/// counting all of them (`total_bytes`).
fn capture<R: Read>(mut r: R, limit: usize, out: &Mutex<Captured>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let mut c = out.lock().unwrap_or_else(|p| p.into_inner());
                let keep = n.min(limit.saturating_sub(c.out.data.len()));
                c.out.data.extend_from_slice(&buf[..keep]);
                c.out.truncated |= keep < n;
                c.out.total_bytes += n as u64;
                if let Some(t) = c.tail.as_mut() {
                    t.push(&buf[..n]);
                }
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

/// Sends [`Progress`] frames at an interval while waiting on channels.
struct Ticker<'a> {
    send: &'a dyn Fn(Progress),
    every: Duration,
    next: Instant,
    started: Instant,
    outputs: &'a [Arc<Mutex<Captured>>; 2],
}

impl Ticker<'_> {
    fn tick(&mut self) {
        let snap = |c: &Arc<Mutex<Captured>>| {
            let c = c.lock().unwrap_or_else(|p| p.into_inner());
            (c.out.total_bytes, c.tail.as_ref().map(|t| t.tail_lines(PROGRESS_TAIL_BYTES)).unwrap_or_default())
        };
        let ((stdout_bytes, stdout_tail), (stderr_bytes, stderr_tail)) =
            (snap(&self.outputs[0]), snap(&self.outputs[1]));
        (self.send)(Progress {
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            stdout_bytes,
            stderr_bytes,
            stdout_tail,
            stderr_tail,
        });
        self.next = (self.next + self.every).max(Instant::now());
    }
}

/// `rx.recv_timeout` until `until`, sending progress at every tick on the
/// way.
fn recv_ticking<T>(
    rx: &mpsc::Receiver<T>,
    until: Instant,
    ticker: &mut Option<Ticker<'_>>,
) -> Result<T, mpsc::RecvTimeoutError> {
    loop {
        let stop = match ticker {
            Some(t) if t.next < until => t.next,
            _ => until,
        };
        match rx.recv_timeout(stop.saturating_duration_since(Instant::now())) {
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < until => {
                if let Some(t) = ticker.as_mut() {
                    t.tick();
                }
            }
            r => return r,
        }
    }
}

/// Runs `req`; with `progress = Some((send, every))`, calls `send` every
/// `every` (at least [`MIN_PROGRESS_MS`]) while it runs.
///
/// Errors: `InvalidRequest` for limits out of range or an empty argv,
/// `NotFound`/`PermissionDenied` when the program cannot be started.
pub fn run(req: Exec, progress: Option<(&dyn Fn(Progress), Duration)>) -> Result<ExecReply, AgentError> {
    let (timeout_ms, limit) = effective_limits(req.timeout_ms, req.output_limit)?;
    let limit = limit as usize;
    let argv = child::argv(req.command)?;
    let started = Instant::now();
    let deadline = started + Duration::from_millis(u64::from(timeout_ms));
    let (mut process, cwd) =
        child::command(&argv, req.cwd.as_deref(), child::Home::Root, &crate::env::current().1, &[]);
    let mut child = process
        .envs(req.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| child::start_error(e, &argv[0], &cwd))?;
    let pgid = child.id();

    let (tx, rx) = mpsc::channel::<()>();
    let captured = || {
        let tail = progress.map(|_| Ring::new(2 * PROGRESS_TAIL_BYTES));
        Arc::new(Mutex::new(Captured { out: Output::default(), tail }))
    };
    let outputs = [captured(), captured()];
    let mut ticker = progress.map(|(send, every)| {
        let every = every.max(Duration::from_millis(u64::from(MIN_PROGRESS_MS)));
        Ticker { send, every, next: started + every, started, outputs: &outputs }
    });
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
    let mut timed_out = false;
    let status = match recv_ticking(&wrx, deadline, &mut ticker) {
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
        match recv_ticking(&rx, until, &mut ticker) {
            Ok(()) => closed += 1,
            Err(mpsc::RecvTimeoutError::Timeout) if !timed_out => {
                timed_out = true;
                kill_group(pgid);
                until = Instant::now() + DRAIN_AFTER_KILL;
            }
            Err(_) => break,
        }
    }
    let take = |o: &Arc<Mutex<Captured>>| std::mem::take(&mut o.lock().unwrap_or_else(|p| p.into_inner()).out);
    let (stdout, stderr) = (take(&outputs[0]), take(&outputs[1]));
    let status = match (timed_out, status) {
        (true, _) => ExitStatus::TimedOut,
        (false, Ok(s)) => child::exit_status(s),
        (false, Err(e)) => return Err(AgentError::Io { message: format!("waiting for {}: {e}", argv[0]) }),
    };
    Ok(ExecReply { status, stdout, stderr, duration_ms: started.elapsed().as_millis() as u64 })
}

#[cfg(test)]
mod tests {
    use tine_protocol::Command;

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
        let r = run(shell("echo before; setsid sleep 60 & echo $!; sleep 60", 1000, 0), None).unwrap();
        let out = String::from_utf8_lossy(&r.stdout.data).into_owned();
        // The escaped sleep, by its pid.
        if let Some(pid) = out.lines().nth(1).and_then(|p| p.parse::<i32>().ok()) {
            // SAFETY: kill(2) of the process this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        assert_eq!(r.status, ExitStatus::TimedOut);
        assert!(out.starts_with("before\n"), "{out}");
    }

    /// With progress, frames come at the interval while the command runs,
    /// each with the byte count and the last whole lines so far.
    #[test]
    fn progress_frames_carry_counts_and_the_last_lines() {
        let frames = Mutex::new(Vec::new());
        let send = |p: Progress| frames.lock().unwrap().push(p);
        let script = "for i in 1 2 3 4 5; do echo line$i; sleep 0.5; done";
        let r = run(shell(script, 0, 0), Some((&send, Duration::from_millis(500)))).unwrap();
        assert_eq!(r.status, ExitStatus::Code(0));
        assert_eq!(r.stdout.data, b"line1\nline2\nline3\nline4\nline5\n");
        let frames = frames.into_inner().unwrap();
        assert!(frames.len() >= 3, "{} frames in 2.5 s at 500 ms", frames.len());
        assert!(frames.windows(2).all(|w| w[0].elapsed_ms <= w[1].elapsed_ms));
        for f in &frames {
            // "lineN\n" is 6 bytes: the tail ends with the last line written.
            let n = f.stdout_bytes / 6;
            let want = if n == 0 { String::new() } else { format!("line{n}\n") };
            let tail = String::from_utf8_lossy(&f.stdout_tail);
            assert!(tail.ends_with(&want) && tail.len() as u64 == f.stdout_bytes, "{f:?}");
        }
        // The same command without progress: no frames, the same answer.
        let plain = run(shell("echo a", 0, 0), None).unwrap();
        assert_eq!(plain.stdout.data, b"a\n");
    }

    /// The per-stream totals count every byte, past the cap too.
    #[test]
    fn totals_count_past_the_cap() {
        let r = run(shell("head -c 100000 /dev/zero; head -c 7 /dev/zero >&2", 0, 1000), None).unwrap();
        assert_eq!((r.stdout.data.len(), r.stdout.truncated, r.stdout.total_bytes), (1000, true, 100_000));
        assert_eq!((r.stderr.data.len(), r.stderr.truncated, r.stderr.total_bytes), (7, false, 7));
    }
}
