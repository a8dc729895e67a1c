//! vsock benchmark: throughput both ways and 1-byte round-trip latency
//! between the host and a guest process over Tine's virtio-vsock (hybrid
//! Unix socket on the host side), beside the same exchange over a Unix
//! socket pair on the host, in the same run.
//!
//! Run: `cargo bench -p tine-benches --bench vsock` (env VSOCK_BYTES,
//! default 64 MiB; VSOCK_PINGS, default 200). Needs /dev/kvm.

use std::os::unix::net::UnixStream;
use std::time::Duration;

fn report(what: &str, s: &testkit::ExchangeStats) {
    println!(
        "{what:<24} host->peer {:>9.1} MB/s   peer->host {:>9.1} MB/s   1-byte RTT median {:>8} us   ({} bytes each way, {} pings)",
        s.to_peer_mbps(),
        s.from_peer_mbps(),
        s.rtt_median().as_micros(),
        s.bytes,
        s.rtts.len()
    );
}

fn main() {
    let bytes: u64 = std::env::var("VSOCK_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(64 << 20);
    let pings: u64 = std::env::var("VSOCK_PINGS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);

    // Baseline: a Unix socket pair on the host, the peer on a thread.
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let peer = std::thread::spawn(move || testkit::exchange_peer(&mut b));
    let base = testkit::exchange(&mut a, bytes, pings);
    peer.join().unwrap();
    report("unix socket pair (host)", &base);

    if !testkit::kvm_available("vsock benchmark") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (config, uds) = testkit::vsock_exchange_guest(dir.path(), "vsock-bench", 5000);
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    assert!(vm.console().wait_for("TINE-INIT-VSOCK listening", Duration::from_secs(600)), "guest never listened");
    let (mut s, _) = testkit::vsock_connect(&uds, 5000).expect("vsock handshake");
    let guest = testkit::exchange(&mut s, bytes, pings);
    report("virtio-vsock (guest)", &guest);
    println!(
        "ratio vsock/unix:        throughput host->peer {:.4}, peer->host {:.4}; RTT {:.0}x",
        guest.to_peer_mbps() / base.to_peer_mbps(),
        guest.from_peer_mbps() / base.from_peer_mbps(),
        guest.rtt_median().as_secs_f64() / base.rtt_median().as_secs_f64()
    );
    drop(s);
    let _ = vm.wait_timeout(Duration::from_secs(120));
}
