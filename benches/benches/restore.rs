//! Restoring VMs from a snapshot, in the VMM: how long `vmm::build_from_snapshot` takes
//! and how long until the restored guest's agent answers, with guest RAM
//! mapped `MAP_PRIVATE` from the memory file and filled by userfaultfd; and
//! the extra host memory (RSS, PSS, private) each restored idle VM costs,
//! for 1, 10 and 50 VMs at once.
//!
//! The snapshot is of a Debian guest (512 MiB, 1 vCPU) whose agent is
//! ready and has run one Python cell, as a template is.
//!
//! `cargo bench -p tine-benches --bench restore`. `RESTORE_RUNS=N`
//! (default 5) restores per backing for the timings; `RESTORE_COUNTS`
//! (default `1,10,50`) the fleet sizes; `RESTORE_IDLE_SECS` (default 10)
//! how long the fleet idles before memory is read.

use std::path::Path;
use std::time::{Duration, Instant};

use tine_agent_client::{AgentClient, AGENT_PORT};
use tine_benches::{median, mib, process_pss};
use tine_protocol::Op;
use vmm::{MemoryBacking, RunningVm, Snapshot};

fn env_or<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn ready(uds: &Path, within: Duration) -> AgentClient {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(a) = AgentClient::connect(uds, AGENT_PORT).await {
            if a.call(Op::Ping, Duration::from_secs(30)).await.is_ok() {
                return a;
            }
        }
        assert!(Instant::now() < deadline, "agent at {} not ready within {within:?}", uds.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !testkit::kvm_available("bench restore") {
        return;
    }
    let runs: usize = env_or("RESTORE_RUNS", 5);
    let counts: Vec<usize> = std::env::var("RESTORE_COUNTS")
        .unwrap_or_else(|_| "1,10,50".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let idle = Duration::from_secs(env_or("RESTORE_IDLE_SECS", 10));
    let dir = tempfile::tempdir().unwrap();

    // The template: a booted guest with a ready agent and a warm Python.
    let uds = dir.path().join("src.vsock");
    let src = vmm::build_for_boot(&testkit::agent_vm_config("bench-src", &uds)).expect("boot");
    let t = Instant::now();
    let agent = ready(&uds, Duration::from_secs(900)).await;
    eprintln!("source booted, agent ready after {:.1} s", t.elapsed().as_secs_f64());
    agent.python("import os, sys", 0).await.expect("python");
    drop(agent);
    src.pause(Duration::from_secs(5)).expect("pause");
    let snap_dir = dir.path().join("snap");
    std::fs::create_dir(&snap_dir).unwrap();
    let t = Instant::now();
    src.snapshot(&snap_dir).expect("snapshot");
    eprintln!("snapshot written in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    drop(src);
    let t = Instant::now();
    let snapshot = Snapshot::load(&snap_dir).expect("load");
    println!("snapshot load and check (both CRC32s): {:.0} ms", t.elapsed().as_secs_f64() * 1e3);

    let mut n = 0usize;
    let mut next = |tag: &str| {
        n += 1;
        (format!("{tag}{n}"), dir.path().join(format!("{tag}{n}.vsock")))
    };

    // Restore timings.
    for backing in [MemoryBacking::Private, MemoryBacking::Userfaultfd] {
        let (mut restore, mut answer) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let (name, uds) = next("r");
            let config = testkit::agent_vm_config(&name, &uds);
            let t = Instant::now();
            let vm = vmm::build_from_snapshot(&config, &snapshot, backing).expect("restore");
            restore.push(t.elapsed());
            let a = ready(&uds, Duration::from_secs(300)).await;
            answer.push(t.elapsed());
            drop(a);
            drop(vm);
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{backing:?}: build_from_snapshot median {:.1} ms (min {:.1}, max {:.1}); restore to agent answering median {:.0} ms (min {:.0}, max {:.0}); {runs} runs",
            ms(median(&restore)),
            ms(*restore.iter().min().unwrap()),
            ms(*restore.iter().max().unwrap()),
            ms(median(&answer)),
            ms(*answer.iter().min().unwrap()),
            ms(*answer.iter().max().unwrap()),
        );
    }

    // Memory per restored idle VM.
    for backing in [MemoryBacking::Private, MemoryBacking::Userfaultfd] {
        for &count in &counts {
            let pss_before = process_pss(std::process::id());
            let mut vms: Vec<(RunningVm, AgentClient)> = Vec::with_capacity(count);
            let t = Instant::now();
            for _ in 0..count {
                let (name, uds) = next("m");
                let vm = vmm::build_from_snapshot(&testkit::agent_vm_config(&name, &uds), &snapshot, backing)
                    .expect("restore");
                let a = ready(&uds, Duration::from_secs(600)).await;
                vms.push((vm, a));
            }
            let all_ready = t.elapsed();
            tokio::time::sleep(idle).await;
            let (mut rss, mut pss, mut private) = (0u64, 0u64, 0u64);
            for (vm, _) in &vms {
                let u = vm.memory_usage().expect("smaps");
                rss += u.rss_bytes;
                pss += u.pss_bytes;
                private += u.private_bytes;
            }
            let process = process_pss(std::process::id()).saturating_sub(pss_before);
            let c = count as u64;
            println!(
                "{backing:?}, {count} idle VMs (ready after {:.1} s, idle {} s): guest RAM per VM: RSS {:.1} MiB, PSS {:.1} MiB, private {:.1} MiB; whole process PSS growth per VM {:.1} MiB",
                all_ready.as_secs_f64(),
                idle.as_secs(),
                mib(rss / c),
                mib(pss / c),
                mib(private / c),
                mib(process / c),
            );
            drop(vms);
        }
    }
}
