//! Shared helpers for Tine's benchmarks.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Median of `samples` (sorted copy).
pub fn median(samples: &[Duration]) -> Duration {
    let mut s = samples.to_vec();
    s.sort();
    let n = s.len();
    if n == 0 {
        return Duration::ZERO;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2
    }
}

/// Starts `cmd` with stdout piped and returns the time from spawn until a
/// stdout line contains `marker`, then kills the process. `None` if the
/// process ended first or `timeout` passed.
pub fn time_to_marker(mut cmd: Command, marker: &str, timeout: Duration) -> Option<Duration> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::null()).stdin(Stdio::null());
    let start = Instant::now();
    let mut child: Child = cmd.spawn().ok()?;
    let stdout = child.stdout.take()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let marker = marker.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(&marker) {
                let _ = tx.send(start.elapsed());
                break;
            }
        }
    });
    let result = rx.recv_timeout(timeout).ok();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Starts `cmd` with stdout piped and returns the first stdout line that
/// contains `marker`, then kills the process. `Err` holds what the process
/// printed when it ended first or `timeout` passed.
pub fn line_with_marker(mut cmd: Command, marker: &str, timeout: Duration) -> Result<String, String> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::null()).stdin(Stdio::null());
    let mut child: Child = cmd.spawn().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let marker = marker.to_string();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let seen_by_reader = seen.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(&marker) {
                let _ = tx.send(line);
                break;
            }
            let mut s = seen_by_reader.lock().unwrap_or_else(|e| e.into_inner());
            s.push_str(&line);
            s.push('\n');
        }
    });
    let result = rx.recv_timeout(timeout);
    let _ = child.kill();
    let _ = child.wait();
    result.map_err(|_| seen.lock().unwrap_or_else(|e| e.into_inner()).clone())
}

/// `Pss:` of process `pid` (bytes), from `/proc/<pid>/smaps_rollup`
/// (`proc(5)`); 0 if it cannot be read.
pub fn process_pss(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Bytes in MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// `name` found in a directory of `$PATH`, if any.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(name)).find(|p| p.is_file())
}

/// `qemu` as the benchmarks compare against: `-M microvm` with KVM, the
/// legacy PIC/PIT and an ISA serial port on stdio, no default devices,
/// `vcpus` and `memory_mib` (MiB). On a PVM host the CPU model drops what
/// that host's KVM cannot run (cx16, arch-capabilities), as Tine's own
/// CPUID does.
pub fn qemu_microvm(qemu: &Path, profile: vmm::HostProfile, vcpus: u8, memory_mib: u64) -> Command {
    let cpu = if profile == vmm::HostProfile::Pvm { "host,-cx16,-arch-capabilities" } else { "host" };
    let mut c = Command::new(qemu);
    c.args(["-M", "microvm,acpi=off,pic=on,pit=on,rtc=off,isa-serial=on", "-enable-kvm", "-cpu", cpu]);
    c.args(["-m", &memory_mib.to_string(), "-smp", &vcpus.to_string()]);
    c.args(["-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio"]);
    c
}
