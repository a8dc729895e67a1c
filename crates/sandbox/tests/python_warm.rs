//! Templates carry a started, warmed-up Python interpreter (real KVM
//! guests, Debian rootfs, agent): the first cell after a restore starts no
//! interpreter and sees an empty namespace; a template made by `snapshot`
//! gets one too; an interpreter's start is not counted in a cell's
//! timeout; a cell's `repr` value is capped in the guest.

mod common;

use tine_sandbox::{ExecRequest, Limits, SandboxSpec};

/// The user-visible names in the cells' namespace.
const NAMES: &str = "[k for k in globals() if not k.startswith('__')]";

/// Waits in bash without a process per step: `nap SECONDS` is bash's own
/// `read -t` on a FIFO no one writes to, and `state PID` reads a process's
/// state letter into `$st` and its number of threads into `$n` from
/// `/proc/PID/status` with `read` (a `ps | grep` and a `sleep` per step
/// were three process starts, seconds of guest kernel work each here).
const WAIT_TOOLS: &str = "[ -p /tmp/nap ] || mkfifo /tmp/nap; exec 9<>/tmp/nap; nap() { read -t \"$1\" -u 9; }; \
                          state() { st= n=; while read -r k v _; do case $k in State:) st=$v ;; \
                          Threads:) n=$v ;; esac; done < /proc/$1/status; } 2>/dev/null; ";

/// Kills the guest's python3 and waits until it has exited (a zombie
/// until the agent looks at it on its next call, or gone), then prints
/// `killed`; prints nothing if it has not within some 100 s. A zombie is
/// one thread: the interpreter has two, and its main thread shows `Z`
/// while the other still exits, seconds of guest kernel work here, during
/// which the agent cannot reap it yet (and so takes it for running).
fn kill_python() -> ExecRequest {
    let command = format!(
        "{WAIT_TOOLS}p=$(pgrep -x python3) && kill $p && for ((i = 0; i < 1000; i++)); do state $p; \
         if [ ! -e /proc/$p ] || [ \"$st\" = Z -a \"$n\" = 1 ]; then echo killed; break; fi; nap 0.1; done"
    );
    ExecRequest { command, timeout_ms: 300_000, ..ExecRequest::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_sandboxes_have_a_warm_python_with_an_empty_namespace() {
    if !testkit::kvm_available("restored_sandboxes_have_a_warm_python_with_an_empty_namespace") {
        return;
    }
    testkit::logging();
    let dir = tempfile::tempdir().unwrap();
    // Its templates directory is its own: this test makes a template.
    let manager = common::manager_with_default_template(dir.path(), Limits::default()).await;

    // The default template's sandboxes: no interpreter start, no names.
    let a = manager.create(SandboxSpec::default()).await.expect("create");
    assert_eq!(a.template.as_deref(), Some("default"));
    let id = a.sandbox_id;
    let r = manager.python(&id, NAMES.into(), 0).await.expect("first cell");
    assert!(r.exception.is_none(), "{:?}", r.exception);
    assert_eq!(r.interpreter_start_ms, None, "the first cell after a restore started the interpreter");
    assert_eq!(r.value.as_deref(), Some("[]"), "the warm-up left names in the namespace");

    // The guest caps a repr (64 KiB, cut on a character boundary) and
    // reports the whole size.
    let r = manager.python(&id, "'x' * 5_000_000".into(), 0).await.expect("a large repr");
    assert!(r.value_truncated);
    assert_eq!(r.value_bytes, 5_000_002);
    assert_eq!(r.value.as_ref().map(String::len), Some(tine_protocol::PYTHON_VALUE_LIMIT as usize));
    let r = manager.python(&id, "'é' * 40_000".into(), 0).await.expect("a multi-byte repr");
    let v = r.value.unwrap();
    assert!(r.value_truncated && r.value_bytes == 80_002 && v.len() <= 65_536 && v.ends_with('é'), "{}", v.len());

    // A sandbox whose interpreter exited: a snapshot of it warms up a new
    // one, so the template's sandboxes again start none.
    manager.python(&id, "x = 21".into(), 0).await.expect("set x");
    let killed = manager.exec(&id, kill_python()).await.expect("kill");
    assert_eq!(String::from_utf8_lossy(&killed.stdout.data).trim(), "killed");
    manager.snapshot(&id, "mine").await.expect("snapshot");
    let b = manager
        .create(SandboxSpec { template: Some("mine".into()), ..SandboxSpec::default() })
        .await
        .expect("create from mine");
    let r = manager.python(&b.sandbox_id, NAMES.into(), 0).await.expect("first cell from mine");
    assert_eq!(r.interpreter_start_ms, None, "a snapshot's template has no warm interpreter");
    assert_eq!(r.value.as_deref(), Some("[]"));
    let r = manager.python(&b.sandbox_id, "y = 2\ny * 21".into(), 0).await.expect("state");
    assert_eq!(r.value.as_deref(), Some("42"));

    // The interpreter's start is not in a cell's timeout: a 1 s cell after
    // the interpreter exited runs whatever the start takes.
    let killed = manager.exec(&b.sandbox_id, kill_python()).await.expect("kill python3");
    assert_eq!(String::from_utf8_lossy(&killed.stdout.data).trim(), "killed");
    let r = manager.python(&b.sandbox_id, "sum(range(10))".into(), 1_000).await.expect("a 1 s cell");
    let start = r.interpreter_start_ms.expect("the cell started an interpreter");
    eprintln!("interpreter start: {start} ms (cell timeout 1000 ms)");
    assert!(!r.timed_out && r.exception.is_none(), "{:?}", r.exception);
    assert_eq!(r.value.as_deref(), Some("45"));

    // A cell whose SIGINT stays pending past the grace period (the
    // interpreter is stopped, as a guest starved of CPU would be) is not
    // killed: once it runs again it gets its KeyboardInterrupt and keeps
    // its state.
    manager.python(&b.sandbox_id, "z = 7".into(), 0).await.expect("set z");
    let stopped = manager.python(
        &b.sandbox_id,
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(600)".into(),
        1_000,
    );
    let resume = manager.exec(
        &b.sandbox_id,
        ExecRequest {
            command: format!(
                "{WAIT_TOOLS}p=$(pgrep -x python3) && for ((i = 0; i < 1000; i++)); do \
                 state $p; [ \"$st\" = T ] && break; nap 0.1; done; nap 8; kill -CONT $p"
            ),
            timeout_ms: 300_000,
            ..ExecRequest::default()
        },
    );
    let (r, resumed) = tokio::join!(stopped, resume);
    resumed.expect("resume python3");
    let r = r.expect("the stopped cell");
    assert!(r.timed_out);
    assert_eq!(r.exception.map(|e| e.name).as_deref(), Some("KeyboardInterrupt"));
    let r = manager.python(&b.sandbox_id, "z".into(), 0).await.expect("z");
    assert_eq!(r.value.as_deref(), Some("7"), "the interpreter was killed while its SIGINT was pending");

    for s in [id, b.sandbox_id] {
        manager.kill(&s).await.unwrap();
    }
    manager.shutdown().await;
}
