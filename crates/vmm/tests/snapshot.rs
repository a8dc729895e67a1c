//! Snapshot a running Debian guest (agent, Python state, a file in its
//! overlay) and restore it as a second VM from the memory file mapped
//! copy-on-write: the clone has the state, and the two diverge.

use std::time::{Duration, Instant};

use tine_agent_client::{AgentClient, AGENT_PORT};
use vmm::Vm;

fn config(name: &str, uds: &std::path::Path) -> vmm::VmConfig {
    testkit::agent_vm_config(name, uds)
}

async fn connect(uds: &std::path::Path) -> AgentClient {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match AgentClient::connect(uds, AGENT_PORT).await {
            Ok(a) => return a,
            Err(e) if Instant::now() < deadline => {
                eprintln!("connect: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("agent unreachable: {e}"),
        }
    }
}

async fn sh(agent: &AgentClient, cmd: &str) -> String {
    let r = agent.exec(cmd, 0, 0).await.expect("exec");
    String::from_utf8_lossy(&r.stdout.data).into_owned()
}

#[test]
fn a_restored_clone_has_the_state_and_diverges() {
    if !testkit::kvm_available("snapshot") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (uds_a, uds_b) = (dir.path().join("a.vsock"), dir.path().join("b.vsock"));
    let vm_a = Vm::start(&config("snap-a", &uds_a)).expect("VM A starts");
    let console_a = vm_a.console().clone();
    assert!(console_a.wait_for("listening on vsock port 1024", Duration::from_secs(600)), "agent never started");
    let rt = tokio::runtime::Runtime::new().unwrap();

    let agent_a = rt.block_on(connect(&uds_a));
    rt.block_on(async {
        assert_eq!(sh(&agent_a, "echo before-snapshot > /tmp/marker && cat /tmp/marker").await, "before-snapshot\n");
        let r = agent_a.python("x = 1234", 0).await.unwrap();
        assert!(r.exception.is_none());
    });

    vm_a.pause(Duration::from_secs(5)).expect("pause");
    let t = Instant::now();
    let snapshot = vm_a.snapshot(&dir.path().join("memory")).expect("snapshot");
    let took = t.elapsed();
    vm_a.resume();
    let on_disk = std::fs::metadata(dir.path().join("memory")).unwrap();
    use std::os::unix::fs::MetadataExt;
    eprintln!(
        "snapshot in {took:?}: memory file {} MiB long, {} MiB allocated",
        on_disk.len() >> 20,
        (on_disk.blocks() * 512) >> 20
    );

    let t = Instant::now();
    let vm_b = Vm::restore(&config("snap-b", &uds_b), &snapshot).expect("VM B restores");
    let console_b = vm_b.console().clone();
    testkit::with_console_on_panic(&console_b, || {
        rt.block_on(async {
            let agent_b = connect(&uds_b).await;
            let marker = sh(&agent_b, "cat /tmp/marker").await;
            eprintln!("restore to first answer: {:?}", t.elapsed());
            assert_eq!(marker, "before-snapshot\n");
            let r = agent_b.python("x", 0).await.unwrap();
            assert_eq!(r.value.as_deref(), Some("1234"), "{r:?}");

            // They diverge: a write in the clone is not in the source.
            assert_eq!(sh(&agent_b, "echo clone > /tmp/marker; cat /tmp/marker").await, "clone\n");
            let agent_a = connect(&uds_a).await;
            assert_eq!(sh(&agent_a, "cat /tmp/marker").await, "before-snapshot\n");
            let r = agent_a.python("x += 1\nx", 0).await.unwrap();
            assert_eq!(r.value.as_deref(), Some("1235"));
            let r = agent_b.python("x", 0).await.unwrap();
            assert_eq!(r.value.as_deref(), Some("1234"));
        })
    });
    drop(vm_b);
    drop(vm_a);
}
