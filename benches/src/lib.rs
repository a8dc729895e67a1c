//! Shared helpers for Tine's benchmarks.

pub mod changes;
pub mod firecracker;

pub use changes::{report_changes_at_end, ChangeReport};

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

/// Where [`record`] appends its JSON lines: `$TINE_BENCH_RESULTS`, else
/// `target/bench-results.jsonl` under the workspace.
pub fn results_path() -> PathBuf {
    match std::env::var_os("TINE_BENCH_RESULTS") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results.jsonl"),
    }
}

/// The commit the bench runs on (`git rev-parse --short HEAD`, with
/// `-dirty` when the work tree has changes); `unknown` outside a work tree.
pub fn commit() -> String {
    static COMMIT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    COMMIT
        .get_or_init(|| {
            let dir = env!("CARGO_MANIFEST_DIR");
            let git = |args: &[&str]| {
                Command::new("git")
                    .current_dir(dir)
                    .args(args)
                    .stderr(Stdio::null())
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            };
            match git(&["rev-parse", "--short=12", "HEAD"]) {
                Some(c) if git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()) => {
                    format!("{c}-dirty")
                }
                Some(c) => c,
                None => "unknown".into(),
            }
        })
        .clone()
}

/// Records one figure: appends `{"bench", "name", "value", "unit",
/// "commit", "unix_ms", "run"}` as a JSON line to [`results_path`], so runs can
/// be compared (`jq -s 'group_by(.name)'`). `bench` is the bench's name
/// (`mcp`), `name` what was measured (`sandbox_create.pool.p50`), `unit`
/// `ms`, `us`, `MiB/s`, `x`, ... A results file that cannot be written is
/// reported on stderr once per figure; the bench goes on. `run` tells
/// this process's figures from an earlier run's ([`changes::run_id`]);
/// [`report_changes_at_end`] compares them.
pub fn record(bench: &str, name: &str, value: f64, unit: &str) {
    use std::io::Write;
    let unix_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let line = serde_json::json!({
        "bench": bench, "name": name, "value": value, "unit": unit, "commit": commit(), "unix_ms": unix_ms,
        "run": changes::run_id(),
    });
    let path = results_path();
    let written =
        std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        eprintln!("cannot append to {}: {e}", path.display());
    }
}

/// `q`-quantile (0.0..=1.0, nearest rank) of `samples`; zero when empty.
pub fn quantile(samples: &[Duration], q: f64) -> Duration {
    let mut s = samples.to_vec();
    s.sort();
    if s.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// The value of environment variable `var` parsed as `T`, else `default`.
pub fn env_or<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The comma-separated values of environment variable `var` parsed as
/// `T` (those that do not parse are left out), else those of `default`.
pub fn env_list<T: std::str::FromStr>(var: &str, default: &str) -> Vec<T> {
    std::env::var(var).unwrap_or_else(|_| default.into()).split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

/// Connects to the agent behind the hybrid-vsock socket `uds`, retrying
/// every 50 ms until it answers a ping; panics after `within`.
pub async fn agent_ready(uds: &Path, within: Duration) -> tine_agent_client::AgentClient {
    use tine_agent_client::{AgentClient, AGENT_PORT};
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Ok(a) = AgentClient::connect(uds, AGENT_PORT).await {
            if a.call(tine_protocol::Op::Ping, Duration::from_secs(30)).await.is_ok() {
                return a;
            }
        }
        assert!(std::time::Instant::now() < deadline, "agent at {} not ready within {within:?}", uds.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `text` padded with newlines to a whole number of 512-byte sectors (a
/// virtio-blk disk's size unit): a guest program for
/// `init=/usr/bin/python3 /dev/vdb` (Python ignores the blank lines).
pub fn sector_padded(text: &str) -> Vec<u8> {
    let mut bytes = text.as_bytes().to_vec();
    bytes.resize(bytes.len().div_ceil(512) * 512, b'\n');
    bytes
}

/// The last 30 lines of `text` (a console), for a failure's message.
pub fn console_tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Waits up to `timeout` for a whole line with `marker` on a Tine VM's
/// serial console and returns the console's text (the serial device
/// delivers a line a byte at a time, so the line's end is waited for too);
/// the console's last lines as the error when none came.
pub fn tine_console_marker(
    console: &vmm::devices::ConsoleTail,
    marker: &str,
    timeout: Duration,
) -> Result<String, String> {
    let found = console.wait_for(marker, timeout);
    let mut text = console.text();
    for _ in 0..100 {
        if text.split_once(marker).is_some_and(|(_, rest)| rest.contains('\n')) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        text = console.text();
    }
    if found {
        Ok(text)
    } else {
        Err(console_tail(&text))
    }
}

/// Boots a Tine VM of `config` in this process, waits for a `marker` line
/// on its console (up to `timeout`), stops it and returns the JSON after
/// the marker; `None` after printing why (the VM did not start; no line in
/// time, with the console's last lines; an unreadable line).
pub fn tine_marker_result(config: &vmm::VmConfig, marker: &str, timeout: Duration) -> Option<serde_json::Value> {
    let mut vm = match vmm::build_for_boot(config) {
        Ok(vm) => vm,
        Err(e) => {
            println!("tine: the VM did not start: {e}");
            return None;
        }
    };
    let console = vm.console().clone();
    let text = tine_console_marker(&console, marker, timeout);
    let _ = vm.stop();
    match text {
        Ok(text) => marker_json(&text, marker).map_err(|e| println!("tine: {e}")).ok(),
        Err(tail) => {
            println!("tine: no result within {} s; console tail:\n{tail}", timeout.as_secs());
            None
        }
    }
}

/// A guest that boots the test root filesystem with a Python program as
/// init (`init=/usr/bin/python3 /dev/vdb`): the program on a raw second
/// disk (see [`sector_padded`]), results on the serial console. The same
/// guest for Tine's VMM and QEMU, so that a benchmark compares the VMMs.
pub struct ProgramGuest {
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The root filesystem, /dev/vda, read-only.
    pub rootfs: PathBuf,
    /// The program's disk, /dev/vdb, read-only.
    pub program: PathBuf,
    /// The kernel command line (root, init and the program's parameters).
    pub cmdline: String,
}

impl ProgramGuest {
    /// Tine's VM for it: one vCPU, 512 MiB, the two disks. The caller
    /// adds its own devices.
    pub fn tine(&self, name: &str) -> vmm::VmConfig {
        let mut config = vmm::VmConfig::new(name, &self.kernel);
        config.memory_mib = 512;
        config.disks = vec![
            vmm::DiskConfig::raw(&self.rootfs, true, "root"),
            vmm::DiskConfig::raw(&self.program, true, "program"),
        ];
        config.cmdline = self.cmdline.clone();
        config
    }

    /// QEMU's `-M microvm` for it as [`qemu_microvm`] sets it up (one vCPU,
    /// 512 MiB), not rebooting, with the two disks in the same order
    /// (microvm's virtio-mmio slots follow the order of `-device`), booting
    /// the kernel with the command line after the profile's parameters as
    /// Tine's VMM would. The caller adds its own devices.
    pub fn qemu(&self, qemu: &Path, profile: vmm::HostProfile) -> Command {
        let mut cfg = vmm::VmConfig::new("bench", &self.kernel);
        cfg.profile = profile;
        cfg.cmdline = self.cmdline.clone();
        let drive = |id: &str, path: &Path| format!("id={id},file={},format=raw,if=none,readonly=on", path.display());
        let mut c = qemu_microvm(qemu, profile, 1, 512);
        c.arg("-no-reboot");
        c.args(["-drive", &drive("root", &self.rootfs), "-device", "virtio-blk-device,drive=root"]);
        c.args(["-drive", &drive("program", &self.program), "-device", "virtio-blk-device,drive=program"]);
        c.arg("-kernel").arg(&self.kernel).arg("-append").arg(cfg.full_cmdline());
        c
    }
}

/// Runs `qemu` (a command whose serial console is its stdout) until a
/// `marker` line (up to `timeout`) and returns the JSON after the marker;
/// `None` after printing why.
pub fn qemu_marker_result(qemu: Command, marker: &str, timeout: Duration) -> Option<serde_json::Value> {
    match line_with_marker(qemu, marker, timeout) {
        Ok(line) => marker_json(&line, marker).map_err(|e| println!("qemu: {e}")).ok(),
        Err(tail_text) => {
            println!("qemu: no result within {} s; console tail:\n{}", timeout.as_secs(), console_tail(&tail_text));
            None
        }
    }
}

/// The JSON after `marker` on the first line of `text` that has it.
pub fn marker_json(text: &str, marker: &str) -> Result<serde_json::Value, String> {
    let line = text
        .lines()
        .find_map(|l| l.split_once(marker).map(|(_, json)| json.trim().to_string()))
        .ok_or_else(|| format!("no {marker:?} line"))?;
    serde_json::from_str(&line).map_err(|e| format!("unreadable result line {line:?}: {e}"))
}
