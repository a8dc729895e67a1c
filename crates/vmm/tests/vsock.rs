//! virtio-vsock with a real guest: the test init listens on an AF_VSOCK
//! port; the host connects through the VM's Unix socket (hybrid vsock
//! handshake), sends N bytes, receives N bytes, checks every byte, and
//! times a 1-byte ping-pong. Needs /dev/kvm (skips loudly without it).
//! N is 64 MiB (env TINE_VSOCK_BYTES overrides).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use vmm::{Vm, VmConfig, VmExit, VsockConfig};

const PORT: u32 = 5000;
const PINGS: u64 = 200;

#[test]
fn guest_listener_exchanges_bytes_both_ways_over_vsock() {
    if !testkit::kvm_available("vsock-exchange") {
        return;
    }
    let n: u64 = std::env::var("TINE_VSOCK_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(64 << 20);
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let mut config = VmConfig::new("vsock-test", testkit::kernel());
    config.initrd = Some(testkit::build_test_initramfs(dir.path()));
    config.vsock = Some(VsockConfig { cid: 3, uds_path: uds.clone() });
    config.cmdline = format!("tine_init_vsock={PORT}");
    let mut vm = Vm::start(&config).expect("VM starts");
    let console = vm.console().clone();
    assert!(
        console.wait_for("TINE-INIT-VSOCK listening", Duration::from_secs(600)),
        "the guest never listened:\n{}",
        console.text()
    );

    let (mut s, host_port) = testkit::vsock_connect(&uds, PORT).expect("hybrid vsock handshake");
    assert!(host_port >= 1 << 30, "host port {host_port}");
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();

    // Host -> guest: N bytes; the guest checks each one.
    let t0 = Instant::now();
    s.write_all(&n.to_le_bytes()).unwrap();
    let mut chunk = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < n {
        let len = (n - off).min(chunk.len() as u64) as usize;
        for (i, b) in chunk[..len].iter_mut().enumerate() {
            *b = testkit::host_pattern(off + i as u64);
        }
        s.write_all(&chunk[..len]).unwrap();
        off += len as u64;
    }
    // Guest -> host: N bytes, checked here.
    let t1 = Instant::now();
    let mut off = 0u64;
    while off < n {
        let want = (n - off).min(chunk.len() as u64) as usize;
        let got = s.read(&mut chunk[..want]).unwrap();
        assert!(got > 0, "the guest closed after {off} of {n} bytes:\n{}", console.last_lines(20));
        for (i, b) in chunk[..got].iter().enumerate() {
            assert_eq!(*b, testkit::guest_pattern(off + i as u64), "byte {} from the guest", off + i as u64);
        }
        off += got as u64;
    }
    let t2 = Instant::now();
    // Ping-pong.
    s.write_all(&PINGS.to_le_bytes()).unwrap();
    let mut rtts = Vec::new();
    for i in 0..PINGS {
        let b = [i as u8];
        let t = Instant::now();
        s.write_all(&b).unwrap();
        let mut r = [0u8; 1];
        s.read_exact(&mut r).unwrap();
        rtts.push(t.elapsed());
        assert_eq!(r, b);
    }
    rtts.sort();
    let mb = n as f64 / 1e6;
    eprintln!(
        "vsock: host->guest {:.1} MB/s, guest->host {:.1} MB/s ({} bytes each way), 1-byte round trip median {} us",
        mb / (t1 - t0).as_secs_f64(),
        mb / (t2 - t1).as_secs_f64(),
        n,
        rtts[rtts.len() / 2].as_micros()
    );
    drop(s);
    let exit = vm.wait_timeout(Duration::from_secs(300));
    let text = console.text();
    assert!(text.contains(&format!("TINE-INIT-VSOCK ok bytes={n} pings={PINGS}")), "{text}");
    assert!(matches!(exit, Ok(VmExit::PowerOff)), "{exit:?}\n{text}");
}
