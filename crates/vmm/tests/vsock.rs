//! virtio-vsock with a real guest booted from an ext4 root filesystem on
//! virtio-blk (built by the test with `mkfs.ext4 -d`): the test program
//! on it (/sbin/init) listens on an AF_VSOCK port; the host connects through the VM's Unix socket (hybrid vsock
//! handshake), sends N bytes, receives N bytes, checks every byte, and
//! times a 1-byte ping-pong. Needs /dev/kvm (skips loudly without it).
//! N is 16 MiB, 64 times the 256 KiB receive buffer each end advertises (credit flow
//! and ring wrap many times over); 64 MiB with `TINE_TEST_FULL` (about a
//! minute more here: 1.1 MB/s host to guest, docs/hosts.md);
//! `TINE_VSOCK_BYTES` sets any size.

use std::time::Duration;

use vmm::VmOutcome;

const PORT: u32 = 5000;
const PINGS: u64 = 200;

#[test]
fn guest_listener_exchanges_bytes_both_ways_over_vsock() {
    if !testkit::kvm_available("vsock-exchange") {
        return;
    }
    let n: u64 = std::env::var("TINE_VSOCK_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if testkit::full_size() { 64 << 20 } else { 16 << 20 });
    let dir = tempfile::tempdir().unwrap();
    let (config, uds) = testkit::vsock_exchange_guest(dir.path(), "vsock-test", PORT);
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(
        console.wait_for("TINE-INIT-VSOCK listening", Duration::from_secs(600)),
        "the guest never listened:\n{}",
        console.text()
    );

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
    assert!(text.contains("EXT4-fs (vda): mounted filesystem"), "root not on virtio-blk:\n{text}");
    assert!(text.contains(&format!("TINE-INIT-VSOCK ok bytes={n} pings={PINGS}")), "{text}");
    assert!(matches!(exit, Ok(VmOutcome::PowerOff)), "{exit:?}\n{text}");
}
