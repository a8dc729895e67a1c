//! The per-VM device thread sleeps unless there is device work: for an
//! idle guest, for a guest that never activates its vsock device while host
//! clients knock on the vsock socket, and for a guest whose vsock RX ring is
//! broken. Its CPU time (utime + stime of the `devices-<name>` thread, from
//! /proc/self/task/<tid>/stat) over a few seconds must stay a small fraction
//! of wall time: a generous bound, not a timing target (a spinning thread
//! takes ~100%). And a guest flooding its serial console leaves the console
//! log under its cap. The real guests need /dev/kvm (skip loudly without).

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::driver::{Driver, DATA_BASE, WRITE};
use common::vsock::GUEST_CID;
use tine_protocol::{Command, Exec, ExitStatus, Op, Reply};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm::devices::virtio::mmio::{reg, status, MmioTransport};
use vmm::devices::virtio::vsock::Vsock;
use vmm::devices::virtio::Interrupt;
use vmm::event_loop::EventLoop;
use vmm::VsockConfig;
use vmm_sys_util::eventfd::EventFd;

/// Longest share of wall time the device thread may spend on the CPU
/// while it has nothing to do.
const MAX_SHARE: f64 = 0.05;
/// How long each measurement runs.
const WINDOW: Duration = Duration::from_secs(4);

/// The CPU time (user + system) of this process's thread named `comm`,
/// waiting up to 10 s for it to exist (a new thread names itself once it
/// runs).
fn thread_cpu(comm: &str) -> Duration {
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
fn device_thread(vm: &str) -> String {
    format!("devices-{vm}").chars().take(15).collect()
}

/// Measures the device thread of VM `vm` over [`WINDOW`]; asserts it
/// stayed under [`MAX_SHARE`] of the wall time. `what` names the case.
fn assert_sleeps(vm: &str, what: &str) {
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
fn knock(uds: &std::path::Path, n: usize) -> Vec<UnixStream> {
    (0..n)
        .map(|i| {
            let mut s = UnixStream::connect(uds).expect("connect to the vsock socket");
            s.write_all(format!("CONNECT {}\n", 5000 + i).as_bytes()).unwrap();
            s
        })
        .collect()
}

#[test]
fn device_thread_sleeps_while_vsock_is_never_activated() {
    // Device model only: a vsock device the driver never touches, behind
    // the real event loop thread.
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let t =
        MmioTransport::new(Box::new(Vsock::new(GUEST_CID, &uds).unwrap()), mem, Arc::new(Interrupt::new(irq))).unwrap();
    let t = Arc::new(Mutex::new(t));
    let _loop = EventLoop::spawn("dt-inact", vec![t.clone()], vmm::seccomp::ThreadKind::Devices).unwrap();
    let _clients = knock(&uds, 4);
    assert_sleeps("dt-inact", "vsock never activated, host clients waiting");
    assert!(!t.lock().unwrap().is_active());
}

#[test]
fn device_thread_sleeps_after_the_guest_breaks_its_rx_ring() {
    // Device model only: an activated vsock device whose RX ring the
    // "guest" corrupts (an available index far past the queue), behind the
    // real event loop thread.
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut d = Driver::new(Box::new(Vsock::new(GUEST_CID, &uds).unwrap()), 0, 16);
    d.set_desc(0, 0, DATA_BASE, 4096, WRITE, 0);
    d.publish(0, 0);
    d.set_avail_idx(0, 1000);
    let Driver { transport, .. } = d;
    let t = Arc::new(Mutex::new(transport));
    let _loop = EventLoop::spawn("dt-broken", vec![t.clone()], vmm::seccomp::ThreadKind::Devices).unwrap();
    // A host connection makes the device write to the RX ring: it finds
    // the ring broken.
    let first = knock(&uds, 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let needs_reset = || {
        let mut b = [0u8; 4];
        t.lock().unwrap().read(reg::STATUS, &mut b);
        u32::from_le_bytes(b) & status::DEVICE_NEEDS_RESET != 0
    };
    while !needs_reset() {
        assert!(Instant::now() < deadline, "the device never noticed the broken RX ring");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Its host clients were let go; new ones wait in the listener's backlog.
    let _more = knock(&uds, 4);
    drop(first);
    assert_sleeps("dt-broken", "vsock RX ring broken, host clients waiting");
}

#[test]
fn device_thread_sleeps_while_a_real_guest_never_activates_vsock() {
    if !testkit::kvm_available("device-thread-no-vsock-driver") {
        return;
    }
    // A guest that halts at its first instruction (hlt; jmp back): the
    // vsock device is configured but never activated.
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("halt.elf");
    std::fs::write(&kernel, testkit::raw_code_elf(&[0xf4, 0xeb, 0xfd], 0x100_0000)).unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut config = vmm::VmConfig::new("dt-halt", &kernel);
    config.memory_mib = 64;
    config.vsock = Some(VsockConfig { cid: 3, uds_path: uds.clone() });
    let vm = vmm::build_for_boot(&config).expect("VM starts");
    let _clients = knock(&uds, 4);
    assert_sleeps("dt-halt", "real guest without a vsock driver, host clients waiting");
    drop(vm);
}

fn exec(agent: &mut testkit::BlockingAgent, script: &str) -> tine_protocol::ExecReply {
    let op = Op::Exec(Exec {
        command: Command::Shell(script.into()),
        cwd: None,
        env: Vec::new(),
        stdin: Vec::new(),
        timeout_ms: 600_000,
        output_limit: 0,
    });
    match agent.call(op) {
        Ok(Reply::Exec(e)) => e,
        other => panic!("expected an exec reply, got {other:?}"),
    }
}

#[test]
fn idle_guest_sleeps_and_a_console_flood_stays_under_the_cap() {
    if !testkit::kvm_available("device-thread-idle-and-console-flood") {
        return;
    }
    // Five times the cap: rotated at each cap's worth, the old log
    // replaced each time. Each byte is a UART write through the emulated
    // guest kernel (a VM exit and an interrupt), so the flood is small.
    const CAP: u64 = 16 << 10;
    const FLOOD: u64 = 80 << 10;
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let log = dir.path().join("console.log");
    let mut config = vmm::VmConfig::new("dt-idle", testkit::kernel());
    config.disks = vec![vmm::DiskConfig::raw(testkit::oci::busybox_image_rootfs(dir.path()), true, "root")];
    config.vsock = Some(VsockConfig { cid: 3, uds_path: uds.clone() });
    config.cmdline = testkit::oci::IMAGE_CMDLINE.into();
    config.console_log = Some(log.clone());
    config.console_log_max_bytes = CAP;
    let vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(
        console.wait_for("listening on vsock port 1024", Duration::from_secs(600)),
        "agent never started:\n{}",
        console.text()
    );
    let mut agent = testkit::BlockingAgent::connect(&uds).expect("connect to the agent");
    assert!(matches!(agent.call(Op::Ping), Ok(Reply::Pong { .. })));

    // Idle, with the agent's connection open.
    testkit::with_console_on_panic(&console, || assert_sleeps("dt-idle", "idle guest, agent connected"));

    // The guest writes several times the cap to its serial port.
    let r = exec(&mut agent, &format!("head -c {FLOOD} /dev/zero | tr '\\0' x > /dev/ttyS0"));
    assert_eq!(r.status, ExitStatus::Code(0), "{}", String::from_utf8_lossy(&r.stderr.data));
    let cur = std::fs::metadata(&log).unwrap().len();
    let old = std::fs::metadata(dir.path().join("console.log.1")).map(|m| m.len()).unwrap_or(0);
    eprintln!("console.log {cur} bytes, console.log.1 {old} bytes, cap {CAP}, flood {FLOOD}");
    assert!(cur <= CAP && old <= CAP, "console logs past the cap: {cur} and {old} bytes");
    assert_eq!(old, CAP, "the log was not rotated");
    assert!(console.text().contains(&"x".repeat(1000)), "the flood did not reach the console");
    drop(vm);
}
