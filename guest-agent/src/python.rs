//! The sandbox's persistent Python interpreter: one `python3` process
//! running `repl.py`, fed one cell at a time (JSON lines). Variables,
//! imports and open files live in it between calls.
//!
//! The interpreter starts on the first call, or before a template's
//! snapshot ([`warm_up`]: a sandbox restored from it has a ready one). Its
//! start, a cell's timeout (SIGINT: the cell gets KeyboardInterrupt and the
//! state is kept) and the kill of a cell that does not stop are
//! [`crate::interp`]'s. `repl.py` captures what is written to its fds 1 and
//! 2 (by the cell and its child processes) itself and sends it with its
//! reply.
//!
//! A restored sandbox's interpreter carries the template's state: its
//! hash randomization secret is the template's (the RNG modules a cell
//! imports are seeded after the restore's reseed).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::process::Stdio;

use tine_protocol::{AgentError, Cell, CellReply};

use crate::child;
use crate::interp::{Language, Repl, Spawned};

const REPL: &str = include_str!("repl.py");

static INTERPRETER: Repl = Repl::new(Language { name: "Python", program: "python3", spawn });

/// Starts `python3` running `repl.py`: requests on its stdin, replies on
/// its stdout (`repl.py` moves both off fds 0 and 1 at once).
fn spawn(env: &[(String, String)]) -> Result<Spawned, AgentError> {
    let argv = ["python3", "-u", "-c", REPL].map(String::from);
    let (mut process, cwd) = child::command(&argv, None, child::Home::User, env, &[]);
    process.env("PYTHONIOENCODING", "utf-8").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = child::spawn(&mut process, &cwd).map_err(|e| INTERPRETER.language().spawn_error(e, &cwd))?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(AgentError::Io { message: "python3 has no stdin or stdout".into() });
    };
    Ok(Spawned {
        child,
        requests: File::from(OwnedFd::from(stdin)),
        replies: File::from(OwnedFd::from(stdout)),
        capture: None,
    })
}

/// Starts the interpreter if it is not running and runs the warm-up in it
/// (the cells' namespace stays empty). Returns how long a start took (ms).
///
/// Errors: `Unsupported` without python3; `Io` if the interpreter does not
/// start or answer.
pub fn warm_up() -> Result<Option<u64>, AgentError> {
    INTERPRETER.warm_up()
}

/// Runs one cell.
///
/// Errors: `InvalidRequest` for limits out of range; `Unsupported` without
/// python3; `Io` if the interpreter cannot be started or reached.
pub fn run(req: Cell) -> Result<CellReply, AgentError> {
    INTERPRETER.run(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(code: &str) -> CellReply {
        run(Cell { code: code.into(), timeout_ms: 20_000, output_limit: 32 << 10 }).expect("cell runs")
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
