//! Boot benchmark: time from starting the VMM process to the test init's
//! marker on the serial console, for Tine's `tine vm run` and for
//! `qemu-system-x86_64 -M microvm -enable-kvm`, booting the same kernel,
//! initramfs and command line, 1 vCPU, 256 MiB, alternating runs.
//!
//! Run: `cargo bench -p tine-benches --bench boot` (env BOOT_RUNS, default 5).
//! Needs /dev/kvm, and qemu-system-x86 for the comparison.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tine_benches::{median, qemu_microvm, record, time_to_marker, which};

fn main() {
    if !testkit::kvm_available("boot benchmark") {
        return;
    }
    let runs: usize = std::env::var("BOOT_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let dir = tempfile::tempdir().unwrap();
    let initrd = testkit::build_test_initramfs(dir.path());
    let kernel = testkit::kernel();
    // Honours $TINE_BIN and $CARGO_TARGET_DIR.
    let tine = testkit::mcp::tine_binary();
    let profile = vmm::HostProfile::detect();
    let mut cfg = vmm::VmConfig::new("bench", &kernel);
    cfg.profile = profile;
    let cmdline = cfg.full_cmdline();
    let qemu = which("qemu-system-x86_64");
    let timeout = Duration::from_secs(600);

    let tine_cmd = |k: &Path, i: &Path| {
        let mut c = Command::new(&tine);
        c.args(["vm", "run", "--memory-mib", "256", "--vcpus", "1", "--kernel"]).arg(k).arg("--initrd").arg(i);
        c
    };
    let qemu_cmd = |q: &Path, k: &Path, i: &Path| {
        let mut c = qemu_microvm(q, profile, 1, 256);
        c.args(["-device", "isa-debug-exit,iobase=0xf4,iosize=4", "-kernel"]);
        c.arg(k).arg("-initrd").arg(i).arg("-append").arg(&cmdline);
        c
    };

    println!("boot benchmark: {runs} runs each, kernel {}, host profile {profile}", kernel.display());
    let (mut t_samples, mut q_samples) = (Vec::new(), Vec::new());
    for run in 0..runs {
        match time_to_marker(tine_cmd(&kernel, &initrd), testkit::INIT_MARKER, timeout) {
            Some(d) => {
                println!("  run {run}: tine {:.2} s", d.as_secs_f64());
                t_samples.push(d);
            }
            None => println!("  run {run}: tine did not reach the marker"),
        }
        if let Some(q) = &qemu {
            match time_to_marker(qemu_cmd(q, &kernel, &initrd), testkit::INIT_MARKER, timeout) {
                Some(d) => {
                    println!("  run {run}: qemu {:.2} s", d.as_secs_f64());
                    q_samples.push(d);
                }
                None => println!("  run {run}: qemu did not reach the marker"),
            }
        }
    }
    let t = median(&t_samples);
    println!("tine vm run:      median {:.2} s to marker ({} runs)", t.as_secs_f64(), t_samples.len());
    // A median of no runs (printed as 0) is not recorded: it would read as a figure.
    if !t_samples.is_empty() {
        record("boot", "to_marker.tine.p50", t.as_secs_f64(), "s");
    }
    record("boot", "to_marker.tine.runs", t_samples.len() as f64, "count");
    if qemu.is_some() && !q_samples.is_empty() {
        let q = median(&q_samples);
        println!("qemu -M microvm:  median {:.2} s to marker ({} runs)", q.as_secs_f64(), q_samples.len());
        record("boot", "to_marker.qemu.p50", q.as_secs_f64(), "s");
        record("boot", "to_marker.qemu.runs", q_samples.len() as f64, "count");
        println!("ratio tine/qemu:  {:.3}", t.as_secs_f64() / q.as_secs_f64());
        if !t_samples.is_empty() {
            record("boot", "ratio.to_marker.p50.tine_over_qemu", t.as_secs_f64() / q.as_secs_f64(), "x");
        }
    } else {
        println!("qemu-system-x86_64 not found: install qemu-system-x86 for the comparison");
    }
}
