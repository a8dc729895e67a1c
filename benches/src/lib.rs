//! Shared helpers for Tine's benchmarks.

use std::io::{BufRead, BufReader};
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
