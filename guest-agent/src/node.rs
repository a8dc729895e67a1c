//! The sandbox's persistent Node.js interpreter: one `node` process
//! running `repl.js`, fed one cell (JavaScript) at a time as JSON lines.
//! Top-level declarations, required modules, timers and servers live in
//! it between calls.
//!
//! The protocol uses neither of the process's fds 1 and 2 (the cells and
//! their child processes write there): requests come on one pipe and
//! replies go out on another, two fds passed by number on the command line
//! that `repl.js` reopens close-on-exec so that the cells' children do not
//! get them. Fds 1 and 2 are pipes the agent reads ([`Capture`]): what is
//! written there during a cell is its stdout and stderr, capped at the
//! cell's output limit (raw bytes) and counted. Fd 0 is /dev/null.
//!
//! The interpreter starts on the first call; its start, a cell's timeout
//! and the kill of a cell that does not stop are [`crate::interp`]'s. At a
//! timeout the SIGINT interrupts synchronous code (the cell runs with
//! `breakOnSigint`) and abandons an `await` (the promise runs on); the
//! state is kept. Code that spins in a callback or after a cell's first
//! `await` is out of the SIGINT's reach: the interpreter is killed after
//! the grace period and restarts empty on the next call.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use tine_protocol::{AgentError, Cell, CellReply};

use crate::child;
use crate::interp::{Capture, Language, Repl, Spawned};

const REPL: &str = include_str!("repl.js");

static INTERPRETER: Repl = Repl::new(Language { name: "Node.js", program: "node", spawn });

fn io_error(what: &str, e: std::io::Error) -> AgentError {
    AgentError::Io { message: format!("cannot start node ({what}): {e}") }
}

/// A close-on-exec copy of `fd` numbered 3 or more, so that the child's
/// fds 0-2, set up before it is made inheritable, cannot be it (an agent
/// started without fds 0-2 gets them from pipe(2)).
fn above_stdio(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl(2) F_DUPFD_CLOEXEC on an fd this function owns.
    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `copy` is a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// Starts `node` running `repl.js` with its request and reply pipes and
/// pipes on fds 1 and 2. `--expose-internals` lets `repl.js` use Node's
/// REPL rewrite of top-level `await`.
fn spawn(env: &[(String, String)]) -> Result<Spawned, AgentError> {
    // std's pipes are close-on-exec: the child keeps two (pre_exec below).
    let (requests_r, requests_w) = std::io::pipe().map_err(|e| io_error("pipe", e))?;
    let (replies_r, replies_w) = std::io::pipe().map_err(|e| io_error("pipe", e))?;
    let requests_r = above_stdio(requests_r.into()).map_err(|e| io_error("dup", e))?;
    let replies_w = above_stdio(replies_w.into()).map_err(|e| io_error("dup", e))?;
    let (stdout_r, stdout_w) = std::io::pipe().map_err(|e| io_error("pipe", e))?;
    let (stderr_r, stderr_w) = std::io::pipe().map_err(|e| io_error("pipe", e))?;
    let inherited = [requests_r.as_raw_fd(), replies_w.as_raw_fd()];
    let argv = ["node", "--expose-internals", "-e", REPL, "--", &inherited[0].to_string(), &inherited[1].to_string()]
        .map(String::from);
    let (mut cmd, cwd) = child::command(&argv, None, child::Home::User, env, &inherited);
    cmd.stdin(Stdio::null()).stdout(stdout_w).stderr(stderr_w);
    // SAFETY: the closure runs in the forked child before exec and only
    // calls fcntl(2), which is async-signal-safe, on two fds that are open
    // there (the parent holds them until `spawn` returns); it allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            for fd in inherited {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let spawned = child::spawn(&mut cmd, &cwd);
    // The parent's copies of the child's ends (the pipes' writers on fds 1
    // and 2 were moved into `cmd`).
    drop(cmd);
    drop(requests_r);
    drop(replies_w);
    let mut child = spawned.map_err(|e| INTERPRETER.language().spawn_error(e, &cwd))?;
    let capture = match Capture::new(stdout_r, stderr_r) {
        Ok(c) => c,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io_error("output capture", e));
        }
    };
    let (requests, replies) = (File::from(OwnedFd::from(requests_w)), File::from(OwnedFd::from(replies_r)));
    Ok(Spawned { child, requests, replies, capture: Some(capture) })
}

/// Runs one cell: the value of its last expression (`util.inspect`, a
/// returned promise awaited first; `undefined` gives none), a thrown
/// error as `exception` (`name`, `message`, its stack as `traceback`), the
/// output it and its children wrote.
///
/// Errors: `InvalidRequest` for limits out of range; `Unsupported` without
/// node; `Io` if the interpreter cannot be started or reached.
pub fn run(req: Cell) -> Result<CellReply, AgentError> {
    INTERPRETER.run(req)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::process::Command;
    use std::sync::{Mutex, MutexGuard};

    use super::*;

    /// The interpreter is one per process: its tests take this.
    static SERIAL: Mutex<()> = Mutex::new(());

    pub(crate) fn serial() -> MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `node` runs here; says so loudly when it does not.
    pub(crate) fn have_node() -> bool {
        let ok = Command::new("node").arg("-e").arg("0").status().is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: node is not installed");
        }
        ok
    }

    fn cell_with(code: &str, timeout_ms: u32, output_limit: u32) -> CellReply {
        run(Cell { code: code.into(), timeout_ms, output_limit }).expect("cell runs")
    }

    fn cell(code: &str) -> CellReply {
        cell_with(code, 20_000, 32 << 10)
    }

    fn value(code: &str) -> Option<String> {
        let r = cell(code);
        assert!(r.exception.is_none(), "{code}: {r:?}");
        r.value
    }

    /// An image without node: the call is `Unsupported`, saying so.
    #[test]
    fn a_missing_program_is_unsupported() {
        let e = Command::new("tine-test-no-such-node").spawn().expect_err("no such program");
        match INTERPRETER.language().spawn_error(e, "/") {
            AgentError::Unsupported { reason } => {
                assert_eq!(reason, "node is not installed in this sandbox's image")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn state_errors_and_timeouts() {
        let _s = serial();
        if !have_node() {
            return;
        }
        let r = cell("let x = 41");
        assert!(r.exception.is_none() && r.value.is_none(), "a declaration has no value: {r:?}");
        assert_eq!(value("x + 1").as_deref(), Some("42"));
        assert_eq!(value("undefined"), None);
        assert_eq!(value("({a: [1, 'b'], s: 'q'})").as_deref(), Some("{ a: [ 1, 'b' ], s: 'q' }"));

        let r = cell("throw new TypeError('boom')");
        let e = r.exception.expect("an exception");
        assert_eq!((e.name.as_str(), e.message.as_str(), r.timed_out), ("TypeError", "boom", false));
        assert!(e.traceback.contains("TypeError: boom") && e.traceback.contains("<cell>:1"), "{}", e.traceback);
        assert!(!e.traceback.contains("[eval]"), "repl.js's frames are cut: {}", e.traceback);
        assert_eq!(value("x").as_deref(), Some("41"), "the state outlives an error");
        let r = cell("let = ;");
        assert_eq!(r.exception.map(|e| e.name).as_deref(), Some("SyntaxError"));

        // Synchronous code is interrupted at the timeout; the state is kept.
        let t = std::time::Instant::now();
        let r = cell_with("while (true) {}", 2_000, 0);
        assert!(r.timed_out, "{r:?}");
        assert_eq!(r.exception.map(|e| e.name).as_deref(), Some("Interrupted"));
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(value("x").as_deref(), Some("41"));
        // So is an await that does not end.
        let r = cell_with("await new Promise(() => {})", 1_000, 0);
        assert!(r.timed_out, "{r:?}");
        assert_eq!(value("x").as_deref(), Some("41"));

        // A returned promise is awaited; top-level await keeps declarations.
        assert_eq!(value("Promise.resolve(5)").as_deref(), Some("5"));
        assert_eq!(value("new Promise(r => setTimeout(() => r('later'), 200))").as_deref(), Some("'later'"));
        assert_eq!(value("var y = await Promise.resolve(7); y * 2").as_deref(), Some("14"));
        assert_eq!(value("y").as_deref(), Some("7"));
        let r = cell("await Promise.reject(new RangeError('no'))");
        assert_eq!(r.exception.map(|e| (e.name, e.message)), Some(("RangeError".into(), "no".into())));

        // A callback's error and an unawaited rejection go to stderr, and
        // the interpreter lives on.
        let r = cell("setTimeout(() => { throw new Error('late') }, 0); await new Promise(r => setTimeout(r, 100)); 1");
        assert!(String::from_utf8_lossy(&r.stderr.data).contains("Error: late"), "{r:?}");
        assert_eq!(value("x").as_deref(), Some("41"));

        // A value over the limit (64 KiB) is cut and counted.
        let r = cell("'é'.repeat(40000)");
        assert!(r.value_truncated);
        assert_eq!(r.value_bytes, 80_002);
        assert!(r.value.is_some_and(|v| v.len() <= 64 << 10));

        // Code out of the SIGINT's reach (spinning after an await) is killed
        // with the interpreter after the grace period; a fresh one comes next.
        let r = cell_with("await null; console.log('spin'); for (;;) {}", 1_000, 0);
        assert!(r.timed_out, "{r:?}");
        assert_eq!(r.exception.map(|e| e.name).as_deref(), Some("InterpreterRestarted"));
        assert_eq!(r.stdout.data, b"spin\n", "what it wrote is kept");
        let r = cell("typeof x");
        assert!(r.interpreter_start_ms.is_some(), "{r:?}");
        assert_eq!(r.value.as_deref(), Some("'undefined'"));
        // So does a cell that ends its interpreter.
        let r = cell("let z = 1; process.exit(3)");
        assert_eq!(r.exception.map(|e| e.name).as_deref(), Some("InterpreterRestarted"));
        assert_eq!(value("typeof z").as_deref(), Some("'undefined'"));
    }

    /// What the cell and its child processes write to fds 1 and 2 is its
    /// output, in order; nothing leaks into the next cell; the cap cuts
    /// and counts.
    #[test]
    fn output_is_captured_in_order_and_capped() {
        let _s = serial();
        if !have_node() {
            return;
        }
        let r = cell(
            "console.log('a'); process.stdout.write('b\\n');\n\
             require('child_process').execSync('echo hi; echo oops >&2', {stdio: 'inherit'});\n\
             console.error('e'); console.log('c')",
        );
        assert_eq!(String::from_utf8_lossy(&r.stdout.data), "a\nb\nhi\nc\n", "{r:?}");
        assert_eq!(String::from_utf8_lossy(&r.stderr.data), "oops\ne\n", "{r:?}");
        assert_eq!(r.value, None, "console.log gives undefined");

        // Larger than a pipe: drained while written; the first 1 KiB kept.
        let r = cell_with("process.stdout.write('x'.repeat(300000)); require('child_process').execSync('head -c 100000 /dev/zero', {stdio: 'inherit'}); 0", 20_000, 1024);
        assert_eq!((r.stdout.total_bytes, r.stdout.truncated, r.stdout.data.len()), (400_000, true, 1024));
        assert!(r.stdout.data.iter().all(|&b| b == b'x'));

        // A background child's late bytes land in the cell running when they
        // arrive.
        let r = cell("require('child_process').spawn('sh', ['-c', 'sleep 1; echo late'], {stdio: 'inherit'}); 'quiet'");
        assert!(r.stdout.data.is_empty(), "{r:?}");
        let r = cell("await new Promise(r => setTimeout(r, 2000)); console.log('next')");
        assert_eq!(String::from_utf8_lossy(&r.stdout.data), "late\nnext\n", "{r:?}");
        // The protocol's pipes are the interpreter's, not its children's.
        let [requests, replies] = INTERPRETER.protocol_pipes().expect("running");
        let links = "require('fs').readdirSync('/proc/self/fd').map(fd => { try { return require('fs').readlinkSync('/proc/self/fd/' + fd) } catch { return '' } }).join(' ')";
        let own = value(links).unwrap_or_default();
        let children =
            "require('child_process').execSync('for f in /proc/self/fd/*; do readlink $f; done', {stdio: 'inherit'})";
        let r = cell(children);
        let inherited = String::from_utf8_lossy(&r.stdout.data).to_string();
        assert!(inherited.contains("/dev/null"), "{inherited}");
        for ino in [requests, replies] {
            let pipe = format!("pipe:[{ino}]");
            assert!(own.contains(&pipe), "{own} lacks {pipe}");
            assert!(!inherited.contains(&pipe), "{inherited} has {pipe}");
        }
    }
}
