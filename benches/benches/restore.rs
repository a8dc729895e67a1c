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

use std::time::{Duration, Instant};

use tine_agent_client::AgentClient;
use tine_benches::{agent_ready, env_list, env_or, median, mib, process_pss, record};
use vmm::{MemoryBacking, RunningVm, Snapshot};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("restore");
    if !testkit::kvm_available("bench restore") {
        return;
    }
    let runs: usize = env_or("RESTORE_RUNS", 5);
    let counts: Vec<usize> = env_list("RESTORE_COUNTS", "1,10,50");
    let idle = Duration::from_secs(env_or("RESTORE_IDLE_SECS", 10));
    let dir = tempfile::tempdir().unwrap();

    // The template: a booted guest with a ready agent and a warm Python.
    let uds = dir.path().join("src.vsock");
    let src = vmm::build_for_boot(&testkit::agent_vm_config("bench-src", &uds)).expect("boot");
    let t = Instant::now();
    let agent = agent_ready(&uds, Duration::from_secs(900)).await;
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
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    println!("snapshot load and check (both CRC32s): {load_ms:.0} ms");
    record("restore", "snapshot_load", load_ms, "ms");

    let mut n = 0usize;
    let mut next = |tag: &str| {
        n += 1;
        (format!("{tag}{n}"), dir.path().join(format!("{tag}{n}.vsock")))
    };

    // The backings, with the names their figures are recorded under.
    let backings = [(MemoryBacking::Private, "private"), (MemoryBacking::Userfaultfd, "userfaultfd")];

    // Restore timings.
    for (backing, tag) in backings {
        let (mut restore, mut answer) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let (name, uds) = next("r");
            let config = testkit::agent_vm_config(&name, &uds);
            let t = Instant::now();
            let vm = vmm::build_from_snapshot(&config, &snapshot, backing).expect("restore");
            restore.push(t.elapsed());
            let a = agent_ready(&uds, Duration::from_secs(300)).await;
            answer.push(t.elapsed());
            drop(a);
            drop(vm);
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let stats = |v: &[Duration]| (ms(median(v)), ms(*v.iter().min().unwrap()), ms(*v.iter().max().unwrap()));
        let (build_p50, build_min, build_max) = stats(&restore);
        let (answer_p50, answer_min, answer_max) = stats(&answer);
        println!(
            "{backing:?}: build_from_snapshot median {build_p50:.1} ms (min {build_min:.1}, max {build_max:.1}); restore to agent answering median {answer_p50:.0} ms (min {answer_min:.0}, max {answer_max:.0}); {runs} runs",
        );
        for (what, (p50, min, max)) in [
            ("build_from_snapshot", (build_p50, build_min, build_max)),
            ("restore_to_agent_answer", (answer_p50, answer_min, answer_max)),
        ] {
            for (stat, v) in [("p50", p50), ("min", min), ("max", max)] {
                record("restore", &format!("{what}.{tag}.{stat}"), v, "ms");
            }
        }
    }

    // Memory per restored idle VM.
    for (backing, tag) in backings {
        for &count in &counts {
            let pss_before = process_pss(std::process::id());
            let mut vms: Vec<(RunningVm, AgentClient)> = Vec::with_capacity(count);
            let t = Instant::now();
            for _ in 0..count {
                let (name, uds) = next("m");
                let vm = vmm::build_from_snapshot(&testkit::agent_vm_config(&name, &uds), &snapshot, backing)
                    .expect("restore");
                let a = agent_ready(&uds, Duration::from_secs(600)).await;
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
            let (rss_mib, pss_mib, private_mib, process_mib) =
                (mib(rss / c), mib(pss / c), mib(private / c), mib(process / c));
            println!(
                "{backing:?}, {count} idle VMs (ready after {:.1} s, idle {} s): guest RAM per VM: RSS {rss_mib:.1} MiB, PSS {pss_mib:.1} MiB, private {private_mib:.1} MiB; whole process PSS growth per VM {process_mib:.1} MiB",
                all_ready.as_secs_f64(),
                idle.as_secs(),
            );
            record("restore", &format!("idle_vms.{tag}.all_ready.vms_{count}"), all_ready.as_secs_f64(), "s");
            for (what, v) in [
                ("guest_ram_rss_per_vm", rss_mib),
                ("guest_ram_pss_per_vm", pss_mib),
                ("guest_ram_private_per_vm", private_mib),
                ("process_pss_growth_per_vm", process_mib),
            ] {
                record("restore", &format!("idle_vms.{tag}.{what}.vms_{count}"), v, "MiB");
            }
            drop(vms);
        }
    }
}
