//! Hibernating and resuming VMs restored from a template, in the VMM
//! (issue 31): a 512 MiB Debian guest restored from a template writes a
//! share of its RAM (10% and 50% by default: one byte per 4 KiB page of a
//! Python bytearray, so each page is the guest's own), is paused and
//! hibernated against the template's memory (`RunningVm::hibernate`), then
//! resumed from the page file laid over the template
//! (`Snapshot::load_hibernated`, `build_from_snapshot`) until its agent
//! answers and its bytearray is there. Compared with a restore from the
//! template itself.
//!
//! Where `FIRECRACKER=/path/to/firecracker` is given, the same guest (512
//! MiB, the same kernel, root filesystem and agent) in Firecracker: booted,
//! a full snapshot taken (its template), the same share written, a diff
//! snapshot (the pages written since: Firecracker's counterpart of a
//! hibernation that writes only the sandbox's own pages), and the full
//! snapshot loaded in a new process to a first answered exec. Target:
//! Tine's hibernation at most 1.0x Firecracker's diff snapshot.
//!
//! `cargo bench -p tine-benches --bench hibernate`. `HIBERNATE_RUNS=N`
//! (default 3) runs per share; `HIBERNATE_PERCENTS` (default `10,50`) the
//! shares of RAM written. Writing is slow where the guest kernel is
//! emulated (about 4.65 ms per first touch of a page: 50% of 512 MiB is
//! about 5 min per run here).

use std::time::{Duration, Instant};

use tine_benches::firecracker::{allocated_bytes, Firecracker};
use tine_benches::{agent_ready, env_list, env_or, median, mib, record};
use vmm::{MemoryBacking, Snapshot};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median and max of `v` (ms), printed and recorded as `<what>.p50|max`.
fn report(what: &str, v: &[Duration]) {
    let (p50, max) = (ms(median(v)), ms(*v.iter().max().expect("runs")));
    println!("{what}: median {p50:.1} ms, max {max:.1} ms ({} runs)", v.len());
    record("hibernate", &format!("{what}.p50"), p50, "ms");
    record("hibernate", &format!("{what}.max"), max, "ms");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _changes = tine_benches::report_changes_at_end("hibernate");
    if !testkit::kvm_available("bench hibernate") {
        return;
    }
    let runs: usize = env_or("HIBERNATE_RUNS", 3);
    let percents: Vec<u64> = env_list("HIBERNATE_PERCENTS", "10,50");
    let dir = tempfile::tempdir().unwrap();

    // The template: a booted guest with a ready agent and a warm Python,
    // its memory in a memfd as the server loads templates.
    let uds = dir.path().join("src.vsock");
    let src = vmm::build_for_boot(&testkit::agent_vm_config("hib-src", &uds)).expect("boot");
    let agent = agent_ready(&uds, Duration::from_secs(900)).await;
    agent.python("import os, sys", 0).await.expect("python");
    drop(agent);
    src.pause(Duration::from_secs(5)).expect("pause");
    let snap_dir = dir.path().join("template");
    std::fs::create_dir(&snap_dir).unwrap();
    src.snapshot(&snap_dir).expect("snapshot");
    drop(src);
    let template = Snapshot::load(&snap_dir).expect("load").into_memory("bench").expect("memfd");
    let mem_bytes = template.mem_bytes;

    // The baseline: restore from the template to a first answered exec.
    let mut restores = Vec::new();
    for i in 0..runs {
        let uds = dir.path().join(format!("base{i}.vsock"));
        let t = Instant::now();
        let vm = vmm::build_from_snapshot(
            &testkit::agent_vm_config(&format!("base{i}"), &uds),
            &template,
            MemoryBacking::Private,
        )
        .expect("restore");
        let a = agent_ready(&uds, Duration::from_secs(300)).await;
        a.exec("true", 60_000, 0).await.expect("exec");
        restores.push(t.elapsed());
        drop(vm);
    }
    report("template_restore_to_first_exec", &restores);

    let base = template.memory.open().expect("the template's memfd");
    let mut tine_hibernate_p50 = Vec::new();
    for &pct in &percents {
        let bytes = mem_bytes * pct / 100;
        let (mut writes, mut hibernates, mut resumes, mut sizes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..runs {
            let name = format!("h{pct}-{i}");
            let uds = dir.path().join(format!("{name}.vsock"));
            let vm =
                vmm::build_from_snapshot(&testkit::agent_vm_config(&name, &uds), &template, MemoryBacking::Private)
                    .expect("restore");
            let a = agent_ready(&uds, Duration::from_secs(300)).await;
            let t = Instant::now();
            let code = format!("b = bytearray({bytes}); b[::4096] = b'\\x01' * len(b[::4096]); len(b)");
            let r = a.python(&code, tine_protocol::MAX_TIMEOUT_MS).await.expect("write guest memory");
            assert!(r.exception.is_none(), "{r:?}");
            writes.push(t.elapsed());
            drop(a);
            vm.pause(Duration::from_secs(5)).expect("pause");
            let hib = dir.path().join(format!("{name}.hib"));
            std::fs::create_dir(&hib).unwrap();
            let rep = vm.hibernate(&hib, Some(&base)).expect("hibernate");
            hibernates.push(rep.took);
            sizes.push(rep.pages.file_bytes);
            drop(vm);

            let uds2 = dir.path().join(format!("{name}r.vsock"));
            let t = Instant::now();
            let snapshot =
                Snapshot::load_hibernated(&hib, Some(template.memory.clone())).expect("load the hibernation");
            let vm = vmm::build_from_snapshot(
                &testkit::agent_vm_config(&format!("{name}r"), &uds2),
                &snapshot,
                MemoryBacking::Private,
            )
            .expect("resume");
            let a = agent_ready(&uds2, Duration::from_secs(300)).await;
            a.exec("true", 60_000, 0).await.expect("exec");
            resumes.push(t.elapsed());
            let r = a.python("len(b)", 60_000).await.expect("the bytearray");
            assert_eq!(r.value.as_deref(), Some(bytes.to_string().as_str()), "{r:?}");
            drop(vm);
            std::fs::remove_dir_all(&hib).unwrap();
        }
        let file_mib = mib(*sizes.iter().max().unwrap());
        println!(
            "{pct}% of {} MiB written ({:.0} s median): page file {file_mib:.1} MiB",
            mem_bytes >> 20,
            median(&writes).as_secs_f64()
        );
        record("hibernate", &format!("page_file.pct_{pct}"), file_mib, "MiB");
        report(&format!("hibernate.pct_{pct}"), &hibernates);
        tine_hibernate_p50.push((pct, ms(median(&hibernates))));
        report(&format!("resume_to_first_exec.pct_{pct}"), &resumes);
        let ratio = ms(median(&resumes)) / ms(median(&restores));
        println!("resume / template restore (medians): {ratio:.2}x");
        record("hibernate", &format!("resume_over_restore.pct_{pct}"), ratio, "x");
    }

    drop(base);
    drop(template);
    let Some(fc_bin) = tine_benches::firecracker::binary() else {
        println!("firecracker: no binary given (FIRECRACKER=/path/to/firecracker; see docs/hosts.md)");
        return;
    };
    for (pct, tine_p50) in tine_hibernate_p50 {
        let bytes = mem_bytes * pct / 100;
        let code = format!("b = bytearray({bytes}); b[::4096] = b'\\x01' * len(b[::4096]); len(b)");
        let (mut fulls, mut diffs, mut sizes, mut loads, mut firsts) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..runs {
            let name = format!("fc{pct}-{i}");
            let vsock = dir.path().join(format!("{name}.vsock"));
            let file = |what: &str| dir.path().join(format!("{name}.{what}"));
            let fc = Firecracker::start(&fc_bin, dir.path(), &name).await;
            fc.boot_agent_guest(mem_bytes >> 20, &vsock).await;
            let a = agent_ready(&vsock, Duration::from_secs(900)).await;
            a.python("import os, sys", 0).await.expect("python");
            fc.set_paused(true).await;
            fulls.push(fc.snapshot("Full", &file("state"), &file("mem")).await);
            fc.set_paused(false).await;
            // Firecracker resets the guest's vsock connections when it
            // takes a snapshot (its docs/snapshotting): connect again.
            drop(a);
            let a = agent_ready(&vsock, Duration::from_secs(300)).await;
            let r = a.python(&code, tine_protocol::MAX_TIMEOUT_MS).await.expect("write guest memory");
            assert!(r.exception.is_none(), "{r:?}");
            fc.set_paused(true).await;
            diffs.push(fc.snapshot("Diff", &file("diff-state"), &file("diff-mem")).await);
            sizes.push(allocated_bytes(&file("diff-mem")));
            drop(a);
            drop(fc);

            // The full snapshot loaded in a new process (its vsock socket
            // is made again at the same path).
            let _ = std::fs::remove_file(&vsock);
            let fc = Firecracker::start(&fc_bin, dir.path(), &format!("{name}l")).await;
            let t = Instant::now();
            loads.push(fc.load(&file("state"), &file("mem")).await);
            let a = agent_ready(&vsock, Duration::from_secs(300)).await;
            a.exec("true", 60_000, 0).await.expect("exec");
            firsts.push(t.elapsed());
            drop(a);
            drop(fc);
            for what in ["state", "mem", "diff-state", "diff-mem"] {
                let _ = std::fs::remove_file(file(what));
            }
            let _ = std::fs::remove_file(&vsock);
        }
        let diff_mib = mib(*sizes.iter().max().unwrap());
        println!("firecracker {pct}%: diff memory file {diff_mib:.1} MiB allocated");
        record("hibernate", &format!("firecracker.diff_file.pct_{pct}"), diff_mib, "MiB");
        report(&format!("firecracker.full_snapshot.pct_{pct}"), &fulls);
        report(&format!("firecracker.diff_snapshot.pct_{pct}"), &diffs);
        report(&format!("firecracker.load.pct_{pct}"), &loads);
        report(&format!("firecracker.load_to_first_exec.pct_{pct}"), &firsts);
        let ratio = tine_p50 / ms(median(&diffs));
        println!("tine hibernate / firecracker diff snapshot (medians): {ratio:.2}x");
        record("hibernate", &format!("hibernate_over_firecracker_diff.pct_{pct}"), ratio, "x");
    }
}
