//! `exec`: run a command in its own process group, feed stdin, capture
//! stdout and stderr up to a cap (with the true byte count), and kill the
//! whole group at the timeout. With a progress callback, a [`Progress`]
//! (elapsed time, byte counts, the last lines of each stream) goes out at
//! every interval while it runs. A [`Cancel`] (the host's `Op::Cancel`
//! for the request) kills the group as the timeout does.
//!
//! One thread does it all: poll(2) on the output pipes, the stdin pipe
//! and a pidfd of the command (pidfd_open(2), Linux 5.3). A thread per
//! stream and one to wait cost 100-240 ms each to start and join in a
//! guest whose kernel is emulated (docs/hosts.md), a quarter of a short
//! exec's time there.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tine_protocol::{
    effective_limits, AgentError, Exec, ExecReply, ExitStatus, Output, Progress, MIN_PROGRESS_MS, PROGRESS_TAIL_BYTES,
};

use crate::child;
use crate::procs::Ring;

/// After a timeout's kill, how long the output streams may take to close
/// (a process that left the group, e.g. with setsid, may hold them open).
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(1);

/// How often the command's exit is checked where no pidfd could be
/// opened (a kernel before 5.3).
const EXIT_POLL: Duration = Duration::from_millis(50);

/// One stream's capture: the first `limit` bytes with the true count,
/// and the newest bytes for progress tails.
struct Captured {
    out: Output,
    /// The last `2 * PROGRESS_TAIL_BYTES` bytes (room to cut to whole
    /// lines); only kept with progress.
    tail: Option<Ring>,
}

impl Captured {
    /// Takes `data` read from the stream: keeps what fits under `limit`
    /// and counts all of it (`total_bytes`).
    fn absorb(&mut self, data: &[u8], limit: usize) {
        let keep = data.len().min(limit.saturating_sub(self.out.data.len()));
        self.out.data.extend_from_slice(&data[..keep]);
        self.out.truncated |= keep < data.len();
        self.out.total_bytes += data.len() as u64;
        if let Some(t) = self.tail.as_mut() {
            t.push(data);
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

/// A pidfd of process `pid` (readable once it has exited), or `None`
/// where the kernel has no pidfd_open(2).
fn pidfd(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd or
    // -1; the fd is owned by nothing else.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: `fd` was just returned by the kernel and is ours alone.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A running exec's cancellation (the host's `Op::Cancel`): an eventfd
/// that [`run`]'s poll loop watches; [`Cancel::fire`] makes it readable,
/// and the loop then kills the command's process group.
pub struct Cancel {
    fd: OwnedFd,
}

impl Cancel {
    /// A cancellation not yet fired.
    ///
    /// Errors: eventfd(2) failed (out of file descriptors).
    pub fn new() -> std::io::Result<Cancel> {
        // SAFETY: eventfd(2) takes an initial value and flags and returns
        // a new fd or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by the kernel and is ours alone.
        Ok(Cancel { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Fires it: the exec watching it kills its command (at once if it
    /// is polling, else at its next poll).
    pub fn fire(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: write(2) of 8 bytes from a live buffer to our eventfd; a
        // full counter (EAGAIN) means it was fired already.
        unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Whether it was fired (consumes the event).
    fn take(&self) -> bool {
        let mut buf = [0u8; 8];
        // SAFETY: read(2) of up to 8 bytes into a live buffer from our
        // non-blocking eventfd; -1 (EAGAIN) means not fired.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        n == 8 && u64::from_ne_bytes(buf) > 0
    }
}

/// Sends [`Progress`] frames at an interval.
struct Ticker<'a> {
    send: &'a dyn Fn(Progress),
    every: Duration,
    next: Instant,
    started: Instant,
}

impl Ticker<'_> {
    fn tick(&mut self, outputs: &[Captured; 2]) {
        let snap = |c: &Captured| {
            (c.out.total_bytes, c.tail.as_ref().map(|t| t.tail_lines(PROGRESS_TAIL_BYTES)).unwrap_or_default())
        };
        let ((stdout_bytes, stdout_tail), (stderr_bytes, stderr_tail)) = (snap(&outputs[0]), snap(&outputs[1]));
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

/// Runs `req`; with `progress = Some((send, every))`, calls `send` every
/// `every` (at least [`MIN_PROGRESS_MS`]) while it runs.
///
/// The answer comes when the command has exited and both output streams
/// are closed (a background child may hold them), all within the timeout;
/// at the timeout the command's process group is killed and the streams
/// get [`DRAIN_AFTER_KILL`] more to close (a process that left the group
/// may hold them open), and the status is `TimedOut`. When `cancel` fires
/// first, the group is killed the same way and the status is the
/// command's (`Signal(9)`).
///
/// Errors: `InvalidRequest` for limits out of range or an empty argv,
/// `NotFound`/`PermissionDenied` when the program cannot be started,
/// `Io` when waiting for it fails.
pub fn run(
    req: Exec,
    progress: Option<(&dyn Fn(Progress), Duration)>,
    cancel: Option<&Cancel>,
) -> Result<ExecReply, AgentError> {
    let (timeout_ms, limit) = effective_limits(req.timeout_ms, req.output_limit)?;
    let limit = limit as usize;
    let argv = child::argv(req.command)?;
    let started = Instant::now();
    let deadline = started + Duration::from_millis(u64::from(timeout_ms));
    let (mut process, cwd) =
        child::command(&argv, req.cwd.as_deref(), child::Home::Root, &crate::env::current().1, &[]);
    process
        .envs(req.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = child::spawn(&mut process, &cwd).map_err(|e| child::start_error(e, &argv[0], &cwd))?;
    let pgid = child.id();
    let exited = pidfd(pgid);

    let captured = || Captured { out: Output::default(), tail: progress.map(|_| Ring::new(2 * PROGRESS_TAIL_BYTES)) };
    let mut outputs = [captured(), captured()];
    let mut streams: [Option<File>; 2] = [
        child.stdout.take().map(|s| File::from(OwnedFd::from(s))),
        child.stderr.take().map(|s| File::from(OwnedFd::from(s))),
    ];
    // A command that does not read its stdin closes the pipe (EPIPE, and
    // Rust ignores SIGPIPE): fine. Empty stdin is closed at once.
    let mut stdin = child.stdin.take().map(|s| File::from(OwnedFd::from(s))).filter(|_| !req.stdin.is_empty());
    let mut stdin_done = 0usize;
    for s in streams.iter().flatten().chain(stdin.iter()) {
        // Should this fail, a read or write blocks until the pipe moves.
        let _ = child::set_nonblocking(s.as_raw_fd());
    }
    let mut ticker = progress.map(|(send, every)| {
        let every = every.max(Duration::from_millis(u64::from(MIN_PROGRESS_MS)));
        Ticker { send, every, next: started + every, started }
    });

    let mut status = None;
    let mut timed_out = false;
    // The group was killed (at the timeout, or cancelled): the streams
    // are being drained.
    let mut killed = false;
    // Until when the streams may stay open: the deadline, and after a
    // kill DRAIN_AFTER_KILL more.
    let mut until = deadline;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if status.is_none() {
            match child.try_wait() {
                Ok(Some(s)) => status = Some(s),
                Ok(None) => {}
                Err(e) => {
                    // Not left running where nobody waits for it.
                    kill_group(pgid);
                    return Err(AgentError::Io { message: format!("waiting for {}: {e}", argv[0]) });
                }
            }
        }
        let now = Instant::now();
        if status.is_some() && streams.iter().all(Option::is_none) {
            break;
        }
        if now >= until {
            if killed {
                // Drained as long as we wait: the command itself was
                // killed; what holds the streams is outside its group.
                if status.is_some() {
                    break;
                }
            } else {
                timed_out = true;
                killed = true;
                kill_group(pgid);
                until = now + DRAIN_AFTER_KILL;
                continue;
            }
        }
        if let Some(t) = ticker.as_mut().filter(|t| t.next <= now) {
            t.tick(&outputs);
        }

        // What to wait for, and how long.
        let mut fds = Vec::with_capacity(4);
        for s in streams.iter().flatten() {
            fds.push(libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        if let Some(s) = &stdin {
            fds.push(libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLOUT, revents: 0 });
        }
        if let (None, Some(p)) = (&status, &exited) {
            fds.push(libc::pollfd { fd: p.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        if let (false, Some(c)) = (killed, cancel) {
            fds.push(libc::pollfd { fd: c.raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        let mut wake = if killed && status.is_none() { now + EXIT_POLL } else { until };
        if let Some(t) = &ticker {
            wake = wake.min(t.next);
        }
        if status.is_none() && exited.is_none() {
            wake = wake.min(now + EXIT_POLL);
        }
        let wait_ms = wake.saturating_duration_since(now).as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for
        // the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms.max(1)) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                kill_group(pgid);
                let _ = child.wait();
                return Err(AgentError::Io { message: format!("poll: {e}") });
            }
        }

        if !killed && cancel.is_some_and(Cancel::take) {
            killed = true;
            kill_group(pgid);
            until = Instant::now() + DRAIN_AFTER_KILL;
        }
        // Read each stream until it would block; EOF or an error closes it.
        for (stream, out) in streams.iter_mut().zip(outputs.iter_mut()) {
            while let Some(s) = stream.as_mut() {
                match s.read(&mut buf) {
                    Ok(0) => *stream = None,
                    Ok(n) => out.absorb(&buf[..n], limit),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => *stream = None,
                }
            }
        }
        // Write stdin while the pipe takes it; close it when all is written
        // or the command closed its end.
        while let Some(s) = stdin.as_mut() {
            match s.write(&req.stdin[stdin_done..]) {
                Ok(n) => {
                    stdin_done += n;
                    if stdin_done == req.stdin.len() {
                        stdin = None;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => stdin = None,
            }
        }
        if status.is_some() {
            // Nobody reads what is left of stdin.
            stdin = None;
        }
    }
    let status = match (timed_out, status) {
        (true, _) => ExitStatus::TimedOut,
        (false, Some(s)) => child::exit_status(s),
        // The loop ends without a status only after a timeout.
        (false, None) => ExitStatus::TimedOut,
    };
    let [stdout, stderr] = outputs.map(|c| c.out);
    Ok(ExecReply { status, stdout, stderr, duration_ms: started.elapsed().as_millis() as u64 })
}

#[cfg(test)]
mod tests {
    use tine_protocol::Command;

    use std::sync::Mutex;

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
        let r = run(shell("echo before; setsid sleep 60 & echo $!; sleep 60", 1000, 0), None, None).unwrap();
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
        let r = run(shell(script, 0, 0), Some((&send, Duration::from_millis(500))), None).unwrap();
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
        let plain = run(shell("echo a", 0, 0), None, None).unwrap();
        assert_eq!(plain.stdout.data, b"a\n");
    }

    /// Stdin reaches the command, larger than a pipe's buffer while the
    /// command writes as much back; a command that never reads its stdin
    /// answers all the same (the pipe is closed when it exits).
    #[test]
    fn stdin_is_fed_and_an_unread_stdin_does_not_block() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut req = shell("cat", 10_000, 1 << 20);
        req.stdin = data.clone();
        let r = run(req, None, None).unwrap();
        assert_eq!(r.status, ExitStatus::Code(0));
        assert_eq!(r.stdout.data, data);
        let mut req = shell("echo skipped", 10_000, 0);
        req.stdin = data;
        let r = run(req, None, None).unwrap();
        assert_eq!((r.status, r.stdout.data.as_slice()), (ExitStatus::Code(0), b"skipped\n".as_slice()));
    }

    /// A command that outlives its timeout is killed with its group, and
    /// the call answers soon after the timeout with what it wrote.
    #[test]
    fn a_timeout_kills_the_command() {
        let t = Instant::now();
        let r = run(shell("echo started; sleep 60", 500, 0), None, None).unwrap();
        assert_eq!(r.status, ExitStatus::TimedOut);
        assert_eq!(r.stdout.data, b"started\n");
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }

    /// A fired cancel kills the command's group at once, long before its
    /// timeout: its answer has the kill's signal and what it wrote, and
    /// a child in the group is gone too.
    #[test]
    fn a_cancel_kills_the_group_long_before_the_timeout() {
        let cancel = Cancel::new().unwrap();
        let t = Instant::now();
        let r = std::thread::scope(|s| {
            let exec = s.spawn(|| run(shell("sleep 300 & echo $!; wait", 600_000, 0), None, Some(&cancel)));
            std::thread::sleep(Duration::from_millis(300));
            cancel.fire();
            exec.join().unwrap().unwrap()
        });
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
        assert_eq!(r.status, ExitStatus::Signal(libc::SIGKILL));
        let out = String::from_utf8_lossy(&r.stdout.data).into_owned();
        let pid: i32 = out.trim().parse().unwrap_or_else(|_| panic!("the child's pid in {out:?}"));
        // The child got the same SIGKILL; once reaped by init (or by us,
        // the test being its parent's parent), kill(2) finds it no more.
        let gone = (0..200).any(|_| {
            // SAFETY: kill(2) with signal 0 only checks for the process.
            let alive = unsafe { libc::kill(pid, 0) } == 0 && !zombie(pid);
            if alive {
                std::thread::sleep(Duration::from_millis(50));
            }
            !alive
        });
        assert!(gone, "the sleep {pid} of the cancelled group is still running");
        // A fired cancel that no exec watches changes nothing for the next.
        let r = run(shell("echo a", 0, 0), None, None).unwrap();
        assert_eq!(r.stdout.data, b"a\n");
    }

    /// Whether `pid` is a zombie (dead, not yet reaped).
    fn zombie(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')))
            .unwrap_or(true)
    }

    /// The per-stream totals count every byte, past the cap too.
    #[test]
    fn totals_count_past_the_cap() {
        let r = run(shell("head -c 100000 /dev/zero; head -c 7 /dev/zero >&2", 0, 1000), None, None).unwrap();
        assert_eq!((r.stdout.data.len(), r.stdout.truncated, r.stdout.total_bytes), (1000, true, 100_000));
        assert_eq!((r.stderr.data.len(), r.stderr.truncated, r.stderr.total_bytes), (7, false, 7));
    }
}
