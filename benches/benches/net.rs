//! Network benchmark: guest-to-host TCP throughput (both directions) and
//! connection set-up latency through Tine's user-space NAT (virtio-net +
//! `crates/netstack`), beside QEMU's user-mode network (`-netdev user`,
//! libslirp) on `-M microvm`, with the same kernel, root filesystem, guest
//! program and command line, in the same run.
//!
//! Both guests boot with `init=/usr/bin/python3 /dev/vdb`: the guest
//! program (`netbench_guest.py`, on a raw second disk) sets up the fixed
//! addressing both networks share (10.0.2.15/24 via 10.0.2.2), reaches
//! this process's server on 127.0.0.1 as 10.0.2.2 and prints one
//! `NETBENCH {json}` line on the serial console. Tine's NAT gets the
//! loopback range permitted for this run, as the network test's server
//! config does; QEMU's slirp maps 10.0.2.2 to loopback by itself.
//!
//! Run: `cargo bench -p tine-benches --bench net` (env NET_BENCH_MIB per
//! transfer, default 64; NET_BENCH_ROUNDS, default 3; NET_BENCH_CONNECTS,
//! default 200). Needs /dev/kvm, and qemu-system-x86 for the comparison.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// The guest program, run as init.
const GUEST_PROGRAM: &str = include_str!("netbench_guest.py");
/// Its result line's prefix on the console.
const MARKER: &str = "NETBENCH ";
/// Boot plus measurements, at most (this host's nested guests are slow).
const TIMEOUT: Duration = Duration::from_secs(900);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("net");
    if !testkit::kvm_available("network benchmark") {
        return;
    }
    let (mib, rounds, connects) =
        (env_u64("NET_BENCH_MIB", 64), env_u64("NET_BENCH_ROUNDS", 3), env_u64("NET_BENCH_CONNECTS", 200));
    let port = serve();
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("netbench.disk");
    std::fs::write(&program, tine_benches::sector_padded(GUEST_PROGRAM)).unwrap();
    let (kernel, rootfs) = (testkit::kernel(), testkit::rootfs());
    let cmdline = format!(
        "root=/dev/vda ro rootfstype=ext4 init=/usr/bin/python3 /dev/vdb netbench_port={port} \
         netbench_mib={mib} netbench_rounds={rounds} netbench_connects={connects}"
    );
    let profile = vmm::HostProfile::detect();
    println!(
        "network benchmark: {mib} MiB x {rounds} each way, {connects} connects; kernel {}, rootfs {}, host profile {profile}",
        kernel.display(),
        rootfs.display()
    );

    let guest = tine_benches::ProgramGuest { kernel, rootfs, program, cmdline };
    let tine = run_tine(&guest);
    report("tine", "tine (virtio-net + netstack NAT)", &tine);
    let qemu = match tine_benches::which("qemu-system-x86_64") {
        Some(q) => {
            let r = run_qemu(&q, &guest, profile);
            report("qemu", "qemu -M microvm -netdev user (libslirp)", &r);
            r
        }
        None => {
            println!("qemu-system-x86_64 not found: install qemu-system-x86 for the comparison");
            None
        }
    };
    if let (Some(t), Some(q)) = (&tine, &qemu) {
        println!("ratios tine/qemu (throughput: higher is better for tine; latency: lower is):");
        for (what, key) in [("upload", "upload_mb_s"), ("download", "download_mb_s")] {
            let ratio = median_of(t, key) / median_of(q, key);
            println!("  {what:<22} {ratio:.2}");
            record(&format!("ratio.{what}.p50.tine_over_qemu"), ratio, "x");
        }
        for (key, what) in [("connect_ms_median", "connect"), ("first_byte_ms_median", "first_byte")] {
            let ratio = num(t, key) / num(q, key);
            println!("  {key:<22} {ratio:.2}");
            record(&format!("ratio.{what}.p50.tine_over_qemu"), ratio, "x");
        }
    }
}

/// Tine's VMM in this process: the root filesystem and the program as
/// read-only disks, one vCPU, 512 MiB, a NIC on the NAT with loopback
/// permitted and no upstream DNS.
fn run_tine(guest: &tine_benches::ProgramGuest) -> Option<Value> {
    let server = Arc::new(netstack::policy::ServerNetPolicy {
        permit_ranges: vec!["127.0.0.0/8".parse().unwrap()],
        host_addrs: Default::default(),
    });
    let control = netstack::control::NetControl::new(&netstack::policy::NetworkPolicy::default(), None, server, 1024)
        .expect("the default policy compiles");
    let stack = netstack::stack::StackConfig {
        dns_upstreams: vec![],
        static_hosts: [("host.netbench.test".to_string(), IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2)))].into(),
        ..netstack::stack::StackConfig::default()
    };
    let mut config = guest.tine("netbench");
    config.net = Some(vmm::vm::config::NetConfig { stack, control });
    tine_benches::tine_marker_result(&config, MARKER, TIMEOUT)
}

/// QEMU's `-M microvm` as [`tine_benches::qemu_microvm`] sets it up (as
/// the boot benchmark does), with the same disks (read-only) and a
/// virtio-net device on `-netdev user`, with the same MAC as Tine's NIC.
fn run_qemu(qemu: &Path, guest: &tine_benches::ProgramGuest, profile: vmm::HostProfile) -> Option<Value> {
    let mut c = guest.qemu(qemu, profile);
    c.args(["-netdev", "user,id=n0", "-device", "virtio-net-device,netdev=n0,mac=02:54:00:12:34:56"]);
    tine_benches::qemu_marker_result(c, MARKER, TIMEOUT)
}

/// Prints `r` under `who` and records its figures under `<key>.` (`tine`,
/// `qemu`). Throughputs are in MB/s (10^6 bytes), as the guest measures.
fn report(key: &str, who: &str, r: &Option<Value>) {
    let Some(r) = r else {
        println!("{who}: no result");
        return;
    };
    println!("{who}:");
    println!("  upload   MB/s {:>8.3} (median of {})", median_of(r, "upload_mb_s"), r["upload_mb_s"]);
    println!("  download MB/s {:>8.3} (median of {})", median_of(r, "download_mb_s"), r["download_mb_s"]);
    for what in ["upload", "download"] {
        let v = median_of(r, &format!("{what}_mb_s"));
        record(&format!("{key}.{what}.p50"), v, "MB/s");
    }
    println!(
        "  connect        {:.3} ms median, {:.3} ms p90; with a 1-byte round trip {:.3} ms median, {:.3} ms p90 ({} connects)",
        num(r, "connect_ms_median"),
        num(r, "connect_ms_p90"),
        num(r, "first_byte_ms_median"),
        num(r, "first_byte_ms_p90"),
        r["connects"]
    );
    for (field, name) in [
        ("connect_ms_median", "connect.p50"),
        ("connect_ms_p90", "connect.p90"),
        ("first_byte_ms_median", "first_byte.p50"),
        ("first_byte_ms_p90", "first_byte.p90"),
    ] {
        record(&format!("{key}.{name}"), num(r, field), "ms");
    }
}

/// Records a figure of this bench (`tine_benches::record`); one that is
/// missing from a result (NaN) or divides by zero is not recorded.
fn record(name: &str, value: f64, unit: &str) {
    if value.is_finite() {
        tine_benches::record("net", name, value, unit);
    }
}

fn num(r: &Value, key: &str) -> f64 {
    r[key].as_f64().unwrap_or(f64::NAN)
}

fn median_of(r: &Value, key: &str) -> f64 {
    let mut xs: Vec<f64> = r[key].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The host end on 127.0.0.1 (a thread per connection). Requests, one per
/// connection: `U` + u64 LE n: read n bytes, answer their count (u64 LE);
/// `D` + u64 LE n: write n bytes; `P`: answer one byte.
fn serve() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = answer(conn);
            });
        }
    });
    port
}

fn answer(mut conn: TcpStream) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    let mut op = [0u8; 1];
    conn.read_exact(&mut op)?;
    let mut buf = vec![0u8; 256 << 10];
    match op[0] {
        b'P' => conn.write_all(b"p"),
        b'U' | b'D' => {
            let mut len = [0u8; 8];
            conn.read_exact(&mut len)?;
            let n = u64::from_le_bytes(len);
            let mut done = 0u64;
            while done < n {
                let k = (n - done).min(buf.len() as u64) as usize;
                if op[0] == b'U' {
                    let got = conn.read(&mut buf[..k])?;
                    if got == 0 {
                        break;
                    }
                    done += got as u64;
                } else {
                    conn.write_all(&buf[..k])?;
                    done += k as u64;
                }
            }
            if op[0] == b'U' {
                conn.write_all(&done.to_le_bytes())?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
