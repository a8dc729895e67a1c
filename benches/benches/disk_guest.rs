//! In-guest disk benchmark: what a guest sees of its data disk through
//! Tine's virtio-blk device on a raw file and on a fresh copy-on-write
//! delta over a raw base (`tine_storage::LayeredDisk`, a sandbox's disk
//! right after its create or branch), beside QEMU's virtio-blk
//! (`-M microvm`) on a raw file and on a qcow2 overlay over the same kind
//! of base (`snapshot=on`: QEMU's own temporary qcow2 file over the raw
//! image, so no `qemu-img` is needed), with the same kernel, root filesystem, guest program and
//! command line, in the same run. The device's own cost without a guest
//! is `disk.rs`; here the guest kernel's block layer runs too (emulated on
//! a nested host, where it dominates: compare the ratios).
//!
//! Every guest boots with `init=/usr/bin/python3 /dev/vdb`: the guest
//! program (`diskbench_guest.py`, on a raw second disk) measures /dev/vdc
//! with O_DIRECT (sequential 1 MiB writes, an fsync, 1 MiB reads, then
//! random 4 KiB writes, an fsync, 4 KiB reads) and prints one
//! `DISKBENCH {json}` line on the serial console. The host files live in
//! `$TMPDIR`.
//!
//! Run: `cargo bench -p tine-benches --bench disk_guest` (env
//! DISK_GUEST_MIB, sequential MiB each way, default 32; DISK_GUEST_OPS,
//! random requests each way, default 200). Needs /dev/kvm, and
//! qemu-system-x86 for the comparison.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tine_benches::env_or;
use tine_storage::{Disk, LayeredDisk};

/// The guest program, run as init.
const GUEST_PROGRAM: &str = include_str!("diskbench_guest.py");
/// Its result line's prefix on the console.
const MARKER: &str = "DISKBENCH ";
/// Boot plus measurements, at most (this host's nested guests are slow).
const TIMEOUT: Duration = Duration::from_secs(1200);

/// The figures the guest reports, with their units.
const FIGURES: [(&str, &str); 4] =
    [("seq_write_mb_s", "MB/s"), ("seq_read_mb_s", "MB/s"), ("rand_write_us", "us"), ("rand_read_us", "us")];

/// One data disk as each VMM gets it.
enum DataDisk {
    /// A raw image file.
    Raw(PathBuf),
    /// Tine: a copy-on-write chain; QEMU: a qcow2 overlay (`snapshot=on`)
    /// over this raw base.
    Layered(vmm::DiskImage, PathBuf),
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("disk_guest");
    if !testkit::kvm_available("in-guest disk benchmark") {
        return;
    }
    let (mib, ops) = (env_or("DISK_GUEST_MIB", 32), env_or("DISK_GUEST_OPS", 200));
    let size = (mib + 16) << 20;
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("diskbench.disk");
    std::fs::write(&program, tine_benches::sector_padded(GUEST_PROGRAM)).unwrap();
    let (kernel, rootfs) = (testkit::kernel(), testkit::rootfs());
    let cmdline = format!(
        "root=/dev/vda ro rootfstype=ext4 init=/usr/bin/python3 /dev/vdb diskbench_mib={mib} diskbench_ops={ops}"
    );
    let guest = tine_benches::ProgramGuest { kernel, rootfs, program, cmdline };
    let profile = vmm::HostProfile::detect();
    println!("in-guest disk benchmark: {mib} MiB sequential and {ops} x 4 KiB random each way, O_DIRECT; host profile {profile}");

    // Sparse files: what a sandbox's new disk is.
    let sparse = |name: &str| {
        let p = dir.path().join(name);
        std::fs::File::create(&p).and_then(|f| f.set_len(size)).unwrap();
        p
    };
    let base = sparse("base.raw");
    let top = dir.path().join("top.delta");
    let chain = LayeredDisk::create(Some(&base), size, tine_storage::DEFAULT_CLUSTER_BITS, &top).unwrap();
    let spec = Disk::spec(&chain);
    drop(chain);
    let mut results: Vec<(&str, Option<Value>)> = vec![
        ("tine.raw", run_tine(&guest, &DataDisk::Raw(sparse("tine.raw")))),
        ("tine.delta", run_tine(&guest, &DataDisk::Layered(vmm::DiskImage::Chain(spec), top))),
    ];
    match tine_benches::which("qemu-system-x86_64") {
        Some(q) => {
            let raw = DataDisk::Raw(sparse("qemu.raw"));
            results.push(("qemu.raw", run_qemu(&q, &guest, profile, &raw)));
            let qcow2 = DataDisk::Layered(vmm::DiskImage::Empty, base.clone());
            results.push(("qemu.qcow2", run_qemu(&q, &guest, profile, &qcow2)));
        }
        None => println!("qemu-system-x86_64 not found: install qemu-system-x86 for the comparison"),
    }

    println!("{:<12} {:>16} {:>16} {:>16} {:>16}", "", FIGURES[0].0, FIGURES[1].0, FIGURES[2].0, FIGURES[3].0);
    for (key, r) in &results {
        let Some(r) = r else {
            println!("{key:<12} no result");
            continue;
        };
        print!("{key:<12}");
        for (figure, unit) in FIGURES {
            let v = r[figure].as_f64().unwrap_or(f64::NAN);
            print!(" {v:>16.3}");
            tine_benches::record("disk_guest", &format!("{key}.{figure}"), v, unit);
        }
        println!();
    }
    let get = |key: &str| results.iter().find(|(k, _)| *k == key).and_then(|(_, r)| r.clone());
    for (tine, qemu) in [("tine.raw", "qemu.raw"), ("tine.delta", "qemu.qcow2")] {
        let (Some(t), Some(q)) = (get(tine), get(qemu)) else { continue };
        // Throughputs: above 1 is Tine faster; latencies: below 1 is.
        print!("{tine}/{qemu}:");
        for (figure, _) in FIGURES {
            let ratio = t[figure].as_f64().unwrap_or(f64::NAN) / q[figure].as_f64().unwrap_or(f64::NAN);
            print!(" {figure} {ratio:.2}");
            tine_benches::record("disk_guest", &format!("ratio.{tine}.{figure}.over_qemu"), ratio, "x");
        }
        println!();
    }
}

/// Tine's VMM in this process: the root filesystem and the program as
/// read-only disks, the data disk writable, one vCPU, 512 MiB.
fn run_tine(guest: &tine_benches::ProgramGuest, data: &DataDisk) -> Option<Value> {
    let mut config = guest.tine("diskbench");
    let data = match data {
        DataDisk::Raw(p) => vmm::DiskConfig::raw(p, false, "data"),
        DataDisk::Layered(image, _) => vmm::DiskConfig::fixed(image.clone(), "data"),
    };
    config.disks.push(data);
    tine_benches::tine_marker_result(&config, MARKER, TIMEOUT)
}

/// QEMU's `-M microvm` as [`tine_benches::qemu_microvm`] sets it up, with
/// the same disks in the same order (the data disk's cache mode QEMU's
/// default, writeback, as Tine's files are written through the host's
/// page cache too).
fn run_qemu(
    qemu: &Path,
    guest: &tine_benches::ProgramGuest,
    profile: vmm::HostProfile,
    data: &DataDisk,
) -> Option<Value> {
    let data = match data {
        DataDisk::Raw(p) => format!("id=data,file={},format=raw,if=none", p.display()),
        DataDisk::Layered(_, base) => format!("id=data,file={},format=raw,if=none,snapshot=on", base.display()),
    };
    let mut c = guest.qemu(qemu, profile);
    c.args(["-drive", &data, "-device", "virtio-blk-device,drive=data"]);
    tine_benches::qemu_marker_result(c, MARKER, TIMEOUT)
}
