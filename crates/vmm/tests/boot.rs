//! Boots the real guest kernel under KVM with the test rootfs: its /init
//! prints a marker, counts the processors in /proc/cpuinfo, and ends the
//! way `tine_init_action=` says. One boot, of the bzImage (the boot
//! protocol's setup header, an LZ4-compressed kernel; every other guest
//! of the tests boots the vmlinux ELF, as Tine does by default), with 2
//! vCPUs from a virtio-blk root: it writes a data disk, exchanges bytes
//! over vsock with its threads found filtered, and resets through the
//! i8042. Power off from inside is `agent.rs`'s busybox guest; a guest
//! kernel panic ending the VM with an error is crate tine's
//! `processes.rs` (a sandbox crashed through sysrq: failed, the panic in
//! its error). Needs /dev/kvm (skips loudly without it).

mod common;

use std::time::Duration;

use vmm::VmOutcome;

/// Generous: a boot takes ~22 s where the host emulates kernel mode.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// The vsock exchange's port in the guest.
const PORT: u32 = 5000;
/// The 1-byte round trips of the vsock exchange.
const PINGS: u64 = 200;

/// One guest (the bzImage, the test rootfs on a read-only virtio-blk
/// root, a data disk, vsock, 2 vCPUs, the console also in a log file) for
/// what were five tests that each booted one (the bzImage's boot and a
/// guest panic were `boots_a_bzimage_to_init_reads_cpuinfo_and_a_guest_kernel_panic_ends_the_vm_with_an_error`):
///
/// - `boots_from_a_virtio_blk_root_and_writes_a_data_disk` (this file):
///   the root mounts from virtio-blk, init writes a 4 KiB pattern to the
///   data disk and reads its serial, and the pattern reaches the image file.
/// - `guest_listener_exchanges_bytes_both_ways_over_vsock` (was vsock.rs):
///   init listens on an AF_VSOCK port; the host connects through the VM's
///   Unix socket (hybrid vsock handshake), sends N bytes, receives N bytes,
///   checks every byte, and times a 1-byte ping-pong. N is 16 MiB, 64
///   times the 256 KiB receive buffer each end advertises (credit flow and
///   ring wrap many times over); 64 MiB with `TINE_TEST_FULL` (about a
///   minute more here: 1.1 MB/s host to guest, docs/hosts.md);
///   `TINE_VSOCK_BYTES` sets any size. 4 MiB in CI: 16 times the buffer.
/// - `a_real_vms_threads_run_filtered` (was seccomp.rs, which keeps its
///   userfaultfd part): every vCPU thread and the device thread of a
///   running guest run with a seccomp filter.
///
/// Then init resets the VM through the i8042 (what was
/// `boots_two_vcpus_and_resets_through_the_i8042`, a boot of its own).
#[test]
fn a_virtio_blk_root_guest_writes_a_disk_exchanges_vsock_bytes_runs_filtered_and_resets() {
    use std::os::unix::fs::FileExt;
    if !testkit::kvm_available("boot-virtio-blk-vsock") {
        return;
    }
    let n: u64 = std::env::var("TINE_VSOCK_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if testkit::full_size() { 64 << 20 } else { 4 << 20 });
    let dir = tempfile::tempdir().unwrap();
    // A short name: the threads' names (`vcpu0-<name>`, `devices-<name>`)
    // must fit Linux's 15 bytes.
    let name = "blk-vs";
    let (mut config, uds) = testkit::vsock_exchange_guest(dir.path(), name, PORT);
    let data = dir.path().join("data.img");
    std::fs::File::create(&data).unwrap().set_len(1 << 20).unwrap();
    config.disks.push(vmm::DiskConfig::raw(data.clone(), false, "tine-data-serial"));
    config.cmdline.push_str(" tine_init_disk=/dev/vdb tine_init_action=reset");
    config.vcpus = 2;
    config.kernel = testkit::bzimage();
    config.console_log = Some(dir.path().join("console.log"));
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(
        console.wait_for("TINE-INIT-VSOCK listening", BOOT_TIMEOUT),
        "the guest never listened:\n{}",
        console.text()
    );

    // The running VM's threads are filtered.
    for thread in [format!("vcpu0-{name}"), format!("vcpu1-{name}"), format!("devices-{name}")] {
        assert_eq!(common::threads::wait_filtered(&thread), vec![2], "{thread}");
    }

    let (mut s, host_port) = testkit::vsock_connect(&uds, PORT).expect("hybrid vsock handshake");
    assert!(host_port >= 1 << 30, "host port {host_port}");
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let stats = testkit::with_console_on_panic(&console, || testkit::exchange(&mut s, n, PINGS));
    eprintln!(
        "vsock: host->guest {:.1} MB/s, guest->host {:.1} MB/s ({n} bytes each way), 1-byte round trip median {} us",
        stats.to_peer_mbps(),
        stats.from_peer_mbps(),
        stats.rtt_median().as_micros()
    );
    drop(s);

    let exit = vm.wait_timeout(Duration::from_secs(300));
    let text = console.text();
    assert!(matches!(exit, Ok(VmOutcome::Reset)), "the guest must reset itself: {exit:?}; console:\n{text}");
    assert!(text.contains("EXT4-fs (vda): mounted filesystem"), "root not mounted from virtio-blk:\n{text}");
    assert!(text.contains(testkit::INIT_MARKER), "{text}");
    assert!(text.contains(&format!("{}2 ", testkit::INIT_CPUINFO)), "two processors:\n{text}");
    assert!(text.contains(&format!("{}tine-data-serial", testkit::INIT_DISK_OK)), "disk check failed:\n{text}");
    assert!(text.contains(&format!("TINE-INIT-VSOCK ok bytes={n} pings={PINGS}")), "{text}");
    assert!(!text.contains("TINE-INIT-ERROR"), "init reported an error:\n{text}");
    // The log file got the same output.
    let log = std::fs::read_to_string(dir.path().join("console.log")).unwrap();
    assert!(log.contains(testkit::INIT_MARKER), "{log}");
    // The guest's write reached the image file.
    let mut got = vec![0u8; 4096];
    std::fs::File::open(&data).unwrap().read_exact_at(&mut got, 4096).unwrap();
    let want: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 7) as u8).collect();
    assert_eq!(got, want, "the data disk does not hold the guest's pattern");
}
