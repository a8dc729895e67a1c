//! Pause and resume a real sandbox (KVM guest, Debian rootfs, agent).

use std::collections::BTreeMap;
use std::time::Duration;

mod common;

use tine_sandbox::{ExecRequest, Limits, Manager, SandboxSpec, SandboxState};

async fn python(m: &Manager, id: &str, code: &str) -> String {
    let r = m.python(id, code.to_string(), 0).await.expect("python");
    assert!(r.exception.is_none(), "{code}: {:?}", r.exception);
    r.value.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_guest_stops_and_goes_on_after_resume() {
    if !testkit::kvm_available("a_paused_guest_stops_and_goes_on_after_resume") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let manager = common::manager_with_default_template(dir.path(), Limits::default()).await;
    let id = manager.create(SandboxSpec::default()).await.expect("create").sandbox_id;

    // A thread in the guest records a timestamp every 20 ms.
    python(
        &manager,
        &id,
        "import threading, time\nts = []\ndef _tick():\n    while True:\n        ts.append(time.monotonic())\n        \
         time.sleep(0.02)\nthreading.Thread(target=_tick, daemon=True).start()",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before: usize = python(&manager, &id, "len(ts)").await.parse().unwrap();
    assert!(before > 0, "the counter runs");

    let info = manager.pause(&id).await.expect("pause");
    assert_eq!(info.state, SandboxState::Paused);
    let cpu_at_pause = manager.info(&id).await.unwrap().usage.unwrap().cpu_time_ms;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let paused_info = manager.info(&id).await.unwrap();
    assert_eq!(paused_info.state, SandboxState::Paused);
    let cpu_after = paused_info.usage.unwrap().cpu_time_ms;
    assert!(cpu_after - cpu_at_pause <= 5, "vCPUs used {} ms while paused", cpu_after - cpu_at_pause);

    assert_eq!(manager.resume(&id).await.unwrap().state, SandboxState::Running);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The guest's clock went on; its counter did not: the longest gap
    // between two ticks spans the pause, and ticks go on after it.
    let report = python(
        &manager,
        &id,
        "gaps = [b - a for a, b in zip(ts, ts[1:])]\ni = max(range(len(gaps)), key=gaps.__getitem__)\n\
         f'{gaps[i]:.3f} {len(ts) - i - 1} {len(ts)}'",
    )
    .await;
    let fields: Vec<f64> = report.trim_matches('\'').split(' ').map(|f| f.parse().unwrap()).collect();
    let (gap, ticks_after_gap, total) = (fields[0], fields[1] as usize, fields[2] as usize);
    eprintln!("longest gap {gap:.3} s, {ticks_after_gap} ticks after it, {total} in all ({before} before the pause)");
    assert!(gap >= 3.5, "no tick during the 4 s pause: longest gap {gap} s");
    assert!(ticks_after_gap >= 10, "the counter goes on after resume ({ticks_after_gap} ticks)");
    assert!(total > before);

    // A call on a paused sandbox resumes it.
    manager.pause(&id).await.expect("pause again");
    let out = manager
        .exec(&id, ExecRequest { command: "echo awake".into(), ..ExecRequest::default() })
        .await
        .expect("exec on a paused sandbox");
    assert_eq!(out.stdout.data, b"awake\n");
    assert_eq!(manager.list(&BTreeMap::new())[0].state, SandboxState::Running);

    manager.kill(&id).await.unwrap();
    assert!(manager.resume(&id).await.is_err());
}
