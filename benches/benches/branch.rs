//! Branch points in the VMM ([`vmm::RunningVm::branch`]): the source's
//! pause window and the time until the branch point's memory is complete,
//! against guest memory size (256 MiB, 1 GiB, 4 GiB) and how much of it
//! holds data (10% and 80%); with userfaultfd write protection (the source
//! runs on during the copy) and, for comparison, with the copy made while
//! paused (the fallback).
//!
//! Touching 80% of 4 GiB from inside a guest is out of reach on hosts where
//! the guest kernel's page clearing is emulated (about 1.6 ms a page), so
//! the bench fills pages the guest never touched (holes of the guest RAM
//! memfd: free guest memory, whose contents Linux does not rely on) from
//! the host, with non-zero bytes, until the fraction is reached. To the
//! VMM these pages are like pages the guest wrote: data pages of the memfd,
//! mapped in the VMM's page tables, write-protected and copied. The guest's
//! own pages (about 40 MiB of a booted Debian guest) are part of the count.
//!
//! Each point is measured with guest RAM of 4 KiB pages and of 2 MiB huge
//! pages ([`vmm::VmConfig::huge_pages`]): with huge pages one protection
//! entry covers 512 times the memory. The huge-page rows need that much
//! free in the host's hugetlbfs pool (`sysctl vm.nr_hugepages=2304` for
//! the default sizes) and are skipped with a message otherwise.
//!
//! `cargo bench -p tine-benches --bench branch`. `BRANCH_SIZES_MIB`
//! (default `256,1024,4096`), `BRANCH_FRACTIONS` (percent, default
//! `10,80`), `BRANCH_RUNS` (default 10 branches per point), `BRANCH_PAGES`
//! (`4k`, `2m` or both, the default `4k,2m`).

use std::time::Duration;

use tine_benches::{env_list, median, quantile, record};
use vm_memory::{Bytes, GuestAddress};
use vmm::BranchMode;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Fills holes of guest RAM with non-zero host pages (4 KiB, or 2 MiB
/// with huge pages) until `target` bytes hold data; returns the bytes that
/// hold data afterwards.
fn fill_to(vm: &vmm::RunningVm, target: u64) -> u64 {
    let ram = vm.ram();
    let step = ram.page_size();
    let data: u64 = ram.content_ranges().unwrap().iter().map(|(s, e)| e - s).sum();
    let mut missing = target.saturating_sub(data).div_ceil(step) * step;
    let page = vec![0x5au8; step as usize];
    let mut pos = 0u64;
    for (start, end) in ram.content_ranges().unwrap().into_iter().chain(std::iter::once((ram.size, ram.size))) {
        // The hole [pos, start): never touched by the guest.
        let mut at = pos;
        while at < start && missing > 0 {
            let (gpa, left) = ram.offset_to_gpa(at).unwrap();
            let n = step.min(left);
            ram.memory.write_slice(&page[..n as usize], GuestAddress(gpa.0)).unwrap();
            at += n;
            missing = missing.saturating_sub(n);
        }
        pos = end;
    }
    ram.content_ranges().unwrap().iter().map(|(s, e)| e - s).sum()
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("branch");
    if !testkit::kvm_available("bench branch") {
        return;
    }
    let sizes: Vec<u64> = env_list("BRANCH_SIZES_MIB", "256,1024,4096");
    let fractions: Vec<u64> = env_list("BRANCH_FRACTIONS", "10,80");
    let runs = env_list::<usize>("BRANCH_RUNS", "10").first().copied().unwrap_or(10);
    let pages: Vec<bool> = std::env::var("BRANCH_PAGES")
        .unwrap_or_else(|_| "4k,2m".into())
        .split(',')
        .filter_map(|p| match p.trim() {
            "4k" => Some(false),
            "2m" => Some(true),
            _ => None,
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for (&mib, &huge) in sizes.iter().flat_map(|m| pages.iter().map(move |h| (m, h))) {
        let kind = if huge { "2m" } else { "4k" };
        if huge && !testkit::huge_pages_available(&format!("bench branch, {mib} MiB of huge pages"), mib << 20) {
            continue;
        }
        let uds = dir.path().join(format!("b{mib}{kind}.vsock"));
        let mut config = testkit::agent_vm_config(&format!("bench-branch-{mib}-{kind}"), &uds);
        config.memory_mib = mib;
        config.huge_pages = huge;
        let vm = vmm::build_for_boot(&config).expect("the VM starts");
        assert!(
            vm.console().wait_for("listening on vsock port 1024", Duration::from_secs(1800)),
            "the agent never started"
        );
        for &pct in &fractions {
            let before = vm.ram().content_ranges().unwrap().iter().map(|(s, e)| e - s).sum::<u64>();
            let data = fill_to(&vm, (mib << 20) * pct / 100);
            eprintln!(
                "{mib} MiB guest ({kind} pages): {} MiB of data from the guest, {} MiB after filling to {pct}%",
                before >> 20,
                data >> 20
            );
            let (mut pauses, mut totals, mut paused_copies) = (Vec::new(), Vec::new(), Vec::new());
            let mut written = 0;
            for _ in 0..runs {
                let (point, report) = vm.branch(Duration::from_secs(10)).expect("branch");
                assert_eq!(report.mode, BranchMode::WriteProtect, "{:?}", report.fallback_reason);
                pauses.push(report.pause);
                totals.push(report.total);
                written = report.bytes_written;
                drop(point);
            }
            // The fallback: the same copy with the VM paused throughout.
            vm.pause(Duration::from_secs(10)).expect("pause");
            for _ in 0..runs.min(3) {
                let (point, report) = vm.branch(Duration::from_secs(10)).expect("branch while paused");
                assert_eq!(report.mode, BranchMode::CopyWhilePaused);
                paused_copies.push(report.total);
                drop(point);
            }
            vm.resume();
            let (pause_p50, pause_p99) = (ms(median(&pauses)), ms(quantile(&pauses, 0.99)));
            let (copy_p50, paused_copy_p50) = (ms(median(&totals)), ms(median(&paused_copies)));
            let row = format!(
                "{mib:>5} MiB {kind}, {pct:>2}% ({:>5} MiB data, {:>5} MiB copied): write-protect pause median {pause_p50:>7.2} ms, p99 {pause_p99:>7.2} ms; copy complete median {copy_p50:>8.1} ms | copy while paused (= pause) median {paused_copy_p50:>8.1} ms",
                data >> 20,
                written >> 20,
            );
            eprintln!("{row}");
            // Recorded as each row is measured (the rows are printed at the end).
            let point = format!("mem_{mib}mib.data_{pct}pct{}", if huge { ".huge_2m" } else { "" });
            record("branch", &format!("branch.data.{point}"), (data >> 20) as f64, "MiB");
            record("branch", &format!("branch.copied.{point}"), (written >> 20) as f64, "MiB");
            record("branch", &format!("branch.pause.p50.{point}"), pause_p50, "ms");
            record("branch", &format!("branch.pause.p99.{point}"), pause_p99, "ms");
            record("branch", &format!("branch.copy_complete.p50.{point}"), copy_p50, "ms");
            record("branch", &format!("branch.copy_while_paused.p50.{point}"), paused_copy_p50, "ms");
            rows.push(row);
        }
        drop(vm);
    }
    println!("\nbranch point, {runs} runs per row (pause = vCPUs stopped; copy complete = pause to last page copied):");
    for r in rows {
        println!("{r}");
    }
}
