//! The per-VM device thread sleeps unless there is device work: for a
//! guest that never activates its vsock device while host clients knock on
//! the vsock socket, and for a guest whose vsock RX ring is broken. Its CPU
//! time (utime + stime of the `devices-<name>` thread, from
//! /proc/self/task/<tid>/stat) over a few seconds must stay a small fraction
//! of wall time: a generous bound, not a timing target (a spinning thread
//! takes ~100%). The real guest here (a halt loop, no kernel) needs
//! /dev/kvm (skips loudly without). An idle booted guest, and a guest
//! flooding its serial console past the console log's cap, are checked on
//! the busybox guest `agent.rs` boots anyway
//! (`idle_guest_sleeps_and_a_console_flood_stays_under_the_cap` there).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::driver::{Driver, DATA_BASE, WRITE};
use common::threads::{assert_sleeps, knock};
use common::vsock::GUEST_CID;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm::devices::virtio::mmio::{reg, status, MmioTransport};
use vmm::devices::virtio::vsock::Vsock;
use vmm::devices::virtio::Interrupt;
use vmm::event_loop::EventLoop;
use vmm::VsockConfig;
use vmm_sys_util::eventfd::EventFd;

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
