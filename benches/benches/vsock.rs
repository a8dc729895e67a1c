//! vsock benchmark: throughput both ways and 1-byte round-trip latency
//! between the host and a guest process over Tine's virtio-vsock (hybrid
//! Unix socket on the host side), beside the same exchange over a Unix
//! socket pair on the host, in the same run.
//!
//! Run: `cargo bench -p tine-benches --bench vsock` (env VSOCK_BYTES,
//! default 64 MiB; VSOCK_PINGS, default 200). Needs /dev/kvm.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use tine_benches::record;

/// Prints `s` under `what` and records its figures under `<key>.`
/// (`unix_pair`, `vsock`). Throughputs are in MB/s (10^6 bytes).
fn report(key: &str, what: &str, s: &testkit::ExchangeStats) {
    println!(
        "{what:<24} host->peer {:>9.1} MB/s   peer->host {:>9.1} MB/s   1-byte RTT median {:>8} us   ({} bytes each way, {} pings)",
        s.to_peer_mbps(),
        s.from_peer_mbps(),
        s.rtt_median().as_micros(),
        s.bytes,
        s.rtts.len()
    );
    record("vsock", &format!("{key}.host_to_peer"), s.to_peer_mbps(), "MB/s");
    record("vsock", &format!("{key}.peer_to_host"), s.from_peer_mbps(), "MB/s");
    record("vsock", &format!("{key}.rtt.p50"), s.rtt_median().as_micros() as f64, "us");
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("vsock");
    let bytes: u64 = std::env::var("VSOCK_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(64 << 20);
    let pings: u64 = std::env::var("VSOCK_PINGS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);

    // Baseline: a Unix socket pair on the host, the peer on a thread.
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let peer = std::thread::spawn(move || testkit::exchange_peer(&mut b));
    let base = testkit::exchange(&mut a, bytes, pings);
    peer.join().unwrap();
    report("unix_pair", "unix socket pair (host)", &base);

    if !testkit::kvm_available("vsock benchmark") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (config, uds) = testkit::vsock_exchange_guest(dir.path(), "vsock-bench", 5000);
    let mut vm = vmm::build_for_boot(&config).expect("VM starts");
    assert!(vm.console().wait_for("TINE-INIT-VSOCK listening", Duration::from_secs(600)), "guest never listened");
    let (mut s, _) = testkit::vsock_connect(&uds, 5000).expect("vsock handshake");
    let guest = testkit::exchange(&mut s, bytes, pings);
    report("vsock", "virtio-vsock (guest)", &guest);
    let to_peer = guest.to_peer_mbps() / base.to_peer_mbps();
    let from_peer = guest.from_peer_mbps() / base.from_peer_mbps();
    let rtt = guest.rtt_median().as_secs_f64() / base.rtt_median().as_secs_f64();
    println!("ratio vsock/unix:        throughput host->peer {to_peer:.4}, peer->host {from_peer:.4}; RTT {rtt:.0}x");
    record("vsock", "ratio.host_to_peer.vsock_over_unix", to_peer, "x");
    record("vsock", "ratio.peer_to_host.vsock_over_unix", from_peer, "x");
    record("vsock", "ratio.rtt.p50.vsock_over_unix", rtt, "x");
    drop(s);
    let _ = vm.wait_timeout(Duration::from_secs(120));
}
