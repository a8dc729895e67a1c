//! This process's VMM threads as /proc/self/task shows them. Their CPU
//! time, for the tests that hold an idle device thread to sleeping
//! (device_thread.rs, agent.rs): its utime + stime over a few seconds must
//! stay a small fraction of wall time: a generous bound, not a timing
//! target (a spinning thread takes ~100%). Their seccomp mode, for the
//! tests that find them filtered (seccomp.rs, boot.rs).

#![allow(dead_code)]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Longest share of wall time the device thread may spend on the CPU
/// while it has nothing to do.
pub const MAX_SHARE: f64 = 0.05;
/// How long each measurement runs.
pub const WINDOW: Duration = Duration::from_secs(4);

/// The CPU time (user + system) of this process's thread named `comm`,
/// waiting up to 10 s for it to exist (a new thread names itself once it
/// runs).
pub fn thread_cpu(comm: &str) -> Duration {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(t) = find_thread_cpu(comm) {
            return t;
        }
        assert!(Instant::now() < deadline, "no thread named {comm}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn find_thread_cpu(comm: &str) -> Option<Duration> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        if std::fs::read_to_string(dir.join("comm")).map(|c| c.trim_end() == comm).unwrap_or(false) {
            let stat = std::fs::read_to_string(dir.join("stat")).unwrap();
            // Fields after the ")" that ends the name: state is field 3,
            // utime 14 and stime 15 (proc(5)).
            let rest: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().collect();
            let ticks: u64 = rest[11].parse::<u64>().unwrap() + rest[12].parse::<u64>().unwrap();
            return Some(Duration::from_millis(ticks * 1000 / hz));
        }
    }
    None
}

/// The device thread's name for a VM named `vm` (Linux keeps 15 bytes).
pub fn device_thread(vm: &str) -> String {
    format!("devices-{vm}").chars().take(15).collect()
}

/// Measures the device thread of VM `vm` over [`WINDOW`]; asserts it
/// stayed under [`MAX_SHARE`] of the wall time. `what` names the case.
pub fn assert_sleeps(vm: &str, what: &str) {
    let name = device_thread(vm);
    let (cpu0, t0) = (thread_cpu(&name), Instant::now());
    std::thread::sleep(WINDOW);
    let (cpu, wall) = (thread_cpu(&name) - cpu0, t0.elapsed());
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    eprintln!("{what}: device thread used {cpu:?} of CPU in {wall:?} ({:.1}%)", share * 100.0);
    assert!(share < MAX_SHARE, "{what}: the device thread used {cpu:?} of CPU in {wall:?}");
}

/// Host clients knocking on the vsock socket at `uds`: connected, their
/// `CONNECT` line sent, never answered. They keep the muxer's listener or
/// handshakes readable.
pub fn knock(uds: &std::path::Path, n: usize) -> Vec<UnixStream> {
    (0..n)
        .map(|i| {
            let mut s = UnixStream::connect(uds).expect("connect to the vsock socket");
            s.write_all(format!("CONNECT {}\n", 5000 + i).as_bytes()).unwrap();
            s
        })
        .collect()
}

/// The `Seccomp:` mode (0 none, 1 strict, 2 filter) of this process's
/// threads whose name (`comm`) is `name`.
pub fn seccomp_of_threads(name: &str) -> Vec<u32> {
    let mut modes = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        if let Some(m) = status.lines().find_map(|l| l.strip_prefix("Seccomp:")) {
            modes.push(m.trim().parse().unwrap());
        }
    }
    modes
}

/// Waits until the threads named `name` exist and installed a filter (a
/// thread installs it as its first step, just after it starts).
pub fn wait_filtered(name: &str) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let modes = seccomp_of_threads(name);
        if (!modes.is_empty() && modes.iter().all(|&m| m == 2)) || Instant::now() > deadline {
            return modes;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
