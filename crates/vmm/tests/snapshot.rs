//! Snapshot a running Debian guest (agent, Python state, a file in its
//! overlay) to disk, load it back as another process would, and restore it
//! as a second VM from the memory file mapped copy-on-write and as a third
//! through userfaultfd: the clones have the state, and they diverge. A
//! snapshot of a restored clone keeps the clone's own writes. A fourth
//! clone restores as production restores (mapped copy-on-write, the first
//! clone's working set prefetched) and passes the same checks. (The
//! userfaultfd prefetch has its own test on a real userfaultfd,
//! `memory.rs`'s `uffd_prefetch_fills_runs_before_the_first_touch`.) A
//! clone hibernated against the snapshot it came from writes only its own
//! pages and restores with its state, and so does the booted source,
//! hibernated whole.

use std::time::{Duration, Instant};

#[path = "common/agent.rs"]
mod agent;

use agent::connect;
use tine_agent_client::AgentClient;
use vmm::{MemoryBacking, Snapshot};

fn config(name: &str, uds: &std::path::Path) -> vmm::VmConfig {
    testkit::agent_vm_config(name, uds)
}

async fn sh(agent: &AgentClient, cmd: &str) -> String {
    let r = agent.exec(cmd, 0, 0).await.expect("exec");
    String::from_utf8_lossy(&r.stdout.data).into_owned()
}

/// The guest's `/tmp/marker` (in its tmpfs: guest memory), read by the
/// agent itself: a process start costs seconds where guest kernel mode is
/// emulated, and each clone starts one anyway for its own write.
async fn marker(agent: &AgentClient) -> String {
    let f = agent.read_file("/tmp/marker").await.expect("read /tmp/marker");
    String::from_utf8_lossy(&f.data).into_owned()
}

#[test]
fn a_restored_clone_has_the_state_and_diverges() {
    if !testkit::kvm_available("snapshot") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds_a = dir.path().join("a.vsock");
    let vm_a = vmm::build_for_boot(&config("snap-a", &uds_a)).expect("VM A starts");
    let console_a = vm_a.console().clone();
    assert!(console_a.wait_for("listening on vsock port 1024", Duration::from_secs(600)), "agent never started");
    let rt = tokio::runtime::Runtime::new().unwrap();

    let agent_a = rt.block_on(connect(&uds_a));
    rt.block_on(async {
        assert_eq!(sh(&agent_a, "echo before-snapshot > /tmp/marker && echo written").await, "written\n");
        let r = agent_a.python("x = 1234", 0).await.unwrap();
        assert!(r.exception.is_none());
    });

    vm_a.pause(Duration::from_secs(5)).expect("pause");
    let snap_dir = dir.path().join("snap");
    std::fs::create_dir(&snap_dir).unwrap();
    let t = Instant::now();
    vm_a.snapshot(&snap_dir).expect("snapshot");
    let took = t.elapsed();
    vm_a.resume();
    let on_disk = std::fs::metadata(snap_dir.join("memory")).unwrap();
    use std::os::unix::fs::MetadataExt;
    eprintln!(
        "snapshot in {took:?}: memory file {} MiB long, {} MiB allocated",
        on_disk.len() >> 20,
        (on_disk.blocks() * 512) >> 20
    );
    let t = Instant::now();
    let snapshot = Snapshot::load(&snap_dir).expect("the snapshot loads");
    eprintln!("snapshot loaded and checked in {:?}", t.elapsed());

    // The first clone's working set (pages touched until its first exec
    // and Python cell answered) is prefetched into the last, as every
    // production restore does (`Private`, templates' `prefetch = true`).
    let mut recorded: Option<std::sync::Arc<vmm::WorkingSet>> = None;
    for (name, backing, prefetch) in [
        ("snap-b", MemoryBacking::Private, false),
        ("snap-c", MemoryBacking::Userfaultfd, false),
        ("snap-d", MemoryBacking::Private, true),
    ] {
        let uds = dir.path().join(format!("{name}.vsock"));
        let mut cfg = config(name, &uds);
        if prefetch {
            cfg.prefetch = Some(recorded.clone().expect("recorded from snap-b"));
        }
        let t = Instant::now();
        let vm = vmm::build_from_snapshot(&cfg, &snapshot, backing).expect("the clone restores");
        eprintln!("{backing:?}: VM restored in {:?}", t.elapsed());
        let console = vm.console().clone();
        testkit::with_console_on_panic(&console, || {
            rt.block_on(async {
                let agent = connect(&uds).await;
                let got = marker(&agent).await;
                eprintln!("{backing:?}: restore to first answer: {:?}", t.elapsed());
                assert_eq!(got, "before-snapshot\n");
                let r = agent.python("x", 0).await.unwrap();
                assert_eq!(r.value.as_deref(), Some("1234"), "{r:?}");
                let first = recorded.is_none();
                if first {
                    let ws = vm.working_set().expect("read the working set");
                    let (read, written) = ws.bytes();
                    eprintln!("{backing:?}: working set {} KiB read, {} KiB written", read >> 10, written >> 10);
                    assert!(read > 0 && written > 0, "the first calls read and wrote guest pages: {ws:?}");
                    assert!(ws.fits(snapshot.mem_bytes));
                    recorded = Some(std::sync::Arc::new(ws));
                }

                // The clone's own write (its snapshot below must hold it).
                assert_eq!(sh(&agent, &format!("echo {name} > /tmp/marker && echo written")).await, "written\n");
                if !first {
                    return;
                }
                // They diverge (checked once; the source is the same for
                // every clone): the clone's write is not in the source,
                // and the source's is not in the clone.
                let agent_a = connect(&uds_a).await;
                assert_eq!(self::marker(&agent_a).await, "before-snapshot\n");
                let r = agent_a.python("x += 1\nx", 0).await.unwrap();
                assert!(r.value.as_deref().is_some_and(|v| v.parse::<u32>().unwrap() > 1234), "{r:?}");
                let r = agent.python("x", 0).await.unwrap();
                assert_eq!(r.value.as_deref(), Some("1234"));
            })
        });
        let usage = vm.memory_usage();
        eprintln!("{backing:?} (prefetch {prefetch}): clone's guest RAM usage {usage:?}");
        if prefetch {
            continue;
        }

        // A snapshot of the clone holds the clone's writes, not only the
        // pages of the file it was restored from.
        vm.pause(Duration::from_secs(5)).expect("pause the clone");
        let again = dir.path().join(format!("{name}-snap"));
        std::fs::create_dir(&again).unwrap();
        vm.snapshot(&again).expect("snapshot of the clone");
        // Hibernated against the snapshot it was restored from: only the
        // pages it changed are written.
        let hib = dir.path().join(format!("{name}-hib"));
        std::fs::create_dir(&hib).unwrap();
        let base = snapshot.memory.open().unwrap();
        let report = vm.hibernate(&hib, Some(&base)).expect("hibernate the clone");
        eprintln!("{backing:?}: hibernated {report:?}");
        assert!(report.based && report.pages.data_pages > 0, "{report:?}");
        assert!(
            report.pages.file_bytes < snapshot.mem_bytes / 8,
            "{} bytes written for a clone that changed a few pages of {}",
            report.pages.file_bytes,
            snapshot.mem_bytes
        );
        drop(vm);
        resume_hibernated(&rt, dir.path(), &format!("{name}-r"), &hib, Some(&snapshot.memory), backing, name);
        let snap2 = Snapshot::load(&again).expect("the clone's snapshot loads");
        let uds2 = dir.path().join(format!("{name}-2.vsock"));
        let vm2 = vmm::build_from_snapshot(&config(&format!("{name}-2"), &uds2), &snap2, backing)
            .expect("restore of the clone's snapshot");
        let console2 = vm2.console().clone();
        testkit::with_console_on_panic(&console2, || {
            rt.block_on(async {
                let agent = connect(&uds2).await;
                assert_eq!(self::marker(&agent).await, format!("{name}\n"));
            })
        });
    }
    // The booted source has no base: every non-zero page is written.
    vm_a.pause(Duration::from_secs(5)).expect("pause A");
    let hib = dir.path().join("a-hib");
    std::fs::create_dir(&hib).unwrap();
    let report = vm_a.hibernate(&hib, None).expect("hibernate A");
    eprintln!("booted: hibernated {report:?}");
    assert!(!report.based && report.pages.data_pages > 0, "{report:?}");
    drop(vm_a);
    resume_hibernated(&rt, dir.path(), "snap-a-r", &hib, None, MemoryBacking::Private, "before-snapshot");
}

/// Restores the VM hibernated in `hib` over `base` and checks its marker
/// file and that its Python interpreter still has `x`.
fn resume_hibernated(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    name: &str,
    hib: &std::path::Path,
    base: Option<&vmm::SnapshotMemory>,
    backing: MemoryBacking,
    marker: &str,
) {
    let snapshot = Snapshot::load_hibernated(hib, base.cloned()).expect("the hibernated VM loads");
    let uds = dir.join(format!("{name}.vsock"));
    let t = Instant::now();
    let vm = vmm::build_from_snapshot(&config(name, &uds), &snapshot, backing).expect("resume from the page file");
    let console = vm.console().clone();
    testkit::with_console_on_panic(&console, || {
        rt.block_on(async {
            let agent = connect(&uds).await;
            assert_eq!(self::marker(&agent).await, format!("{marker}\n"));
            eprintln!("{name}: resumed to first answer in {:?}", t.elapsed());
            let r = agent.python("x", 0).await.unwrap();
            assert!(r.value.as_deref().is_some_and(|v| v.parse::<u32>().unwrap() >= 1234), "{r:?}");
        })
    });
}
