//! Boot benchmark: time from starting the VMM process to the test init's
//! marker on the serial console, for Tine's `tine vm run` and for
//! `qemu-system-x86_64 -M microvm -enable-kvm` and, where a binary is given,
//! Firecracker, booting the same kernel, initramfs and command line, 1
//! vCPU, 256 MiB, alternating runs.
//!
//! Run: `cargo bench -p tine-benches --bench boot` (env BOOT_RUNS, default 5;
//! `FIRECRACKER=/path/to/firecracker` adds its column). Needs /dev/kvm, and
//! qemu-system-x86 for the comparison.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tine_benches::{median, qemu_microvm, record, time_to_marker, which};

fn main() {
    let _changes = tine_benches::report_changes_at_end("boot");
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

    // Firecracker, where a binary is given (built by hand: a project
    // script cannot download its source). It boots from a JSON config with
    // no API socket; `--no-seccomp` since a build for the gnu target has
    // only an allow-all filter. Its guest has no use for Tine's power-off
    // port option.
    let firecracker = std::env::var_os("FIRECRACKER").map(std::path::PathBuf::from).filter(|p| p.exists());
    let fc_config = dir.path().join("firecracker.json");
    let fc_cmdline: Vec<&str> = cmdline.split_whitespace().filter(|w| !w.starts_with("tine_poweroff=")).collect();
    std::fs::write(
        &fc_config,
        serde_json::json!({
            "boot-source": {
                "kernel_image_path": kernel,
                "initrd_path": initrd,
                "boot_args": fc_cmdline.join(" "),
            },
            "drives": [],
            "machine-config": { "vcpu_count": 1, "mem_size_mib": 256 },
        })
        .to_string(),
    )
    .unwrap();
    let fc_cmd = |f: &Path| {
        let mut c = Command::new(f);
        c.args(["--no-api", "--no-seccomp", "--level", "Error", "--config-file"]).arg(&fc_config);
        c
    };

    println!("boot benchmark: {runs} runs each, kernel {}, host profile {profile}", kernel.display());
    // (name, command maker or None when absent, samples); run in turn.
    type Maker<'a> = Box<dyn Fn() -> Command + 'a>;
    let (k, i) = (kernel.as_path(), initrd.as_path());
    let mut vmms: Vec<(&str, Option<Maker>, Vec<Duration>)> = vec![
        ("tine", Some(Box::new(|| tine_cmd(k, i))), Vec::new()),
        ("qemu", qemu.as_ref().map(|q| Box::new(move || qemu_cmd(q, k, i)) as Maker), Vec::new()),
        ("firecracker", firecracker.as_ref().map(|f| Box::new(move || fc_cmd(f)) as Maker), Vec::new()),
    ];
    for run in 0..runs {
        for (name, maker, samples) in vmms.iter_mut() {
            let Some(maker) = maker else { continue };
            match time_to_marker(maker(), testkit::INIT_MARKER, timeout) {
                Some(d) => {
                    println!("  run {run}: {name} {:.2} s", d.as_secs_f64());
                    samples.push(d);
                }
                None => println!("  run {run}: {name} did not reach the marker"),
            }
        }
    }
    let tine_p50 = median(&vmms[0].2);
    for (name, maker, samples) in &vmms {
        if maker.is_none() {
            match *name {
                "qemu" => println!("qemu-system-x86_64 not found: install qemu-system-x86 for the comparison"),
                _ => println!("{name}: no binary given (FIRECRACKER=/path/to/firecracker; see docs/hosts.md)"),
            }
            continue;
        }
        record("boot", &format!("to_marker.{name}.runs"), samples.len() as f64, "count");
        // A median of no runs (printed as 0) is not recorded: it would read as a figure.
        if samples.is_empty() {
            continue;
        }
        let p50 = median(samples);
        println!("{name:<12} median {:.2} s to marker ({} runs)", p50.as_secs_f64(), samples.len());
        record("boot", &format!("to_marker.{name}.p50"), p50.as_secs_f64(), "s");
        if *name != "tine" && !vmms[0].2.is_empty() {
            let ratio = tine_p50.as_secs_f64() / p50.as_secs_f64();
            println!("ratio tine/{name}: {ratio:.3}");
            record("boot", &format!("ratio.to_marker.p50.tine_over_{name}"), ratio, "x");
        }
    }
}
