//! The disk's share of a branch's pause, against the data a sandbox wrote
//! to its disk: a `LayeredDisk` (a blank base, a top) has `GiB` written to
//! its top in 1 MiB writes (on the host, through the `Disk` trait, as the
//! virtio-blk device writes a guest's data), then
//!
//! - `checkpoint`: freezes the top and goes on on a new empty top, what
//!   every capture (branch, snapshot, hibernation) does with the VM
//!   paused (`vmm`'s `capture_state`): the target is that this is
//!   flat in the data written;
//! - `child top`: a new top over the frozen chain, what each branch child
//!   gets before it restores (`tine_storage::LayeredDisk::create_top`);
//! - `sync`: `tine_storage::sync` of the frozen chain, which a snapshot or
//!   a hibernation (not a branch) does before it names the layers, after
//!   the VM goes on: it grows with the dirty data the host's page cache
//!   still holds, and is shown for the record.
//!
//! `cargo bench -p tine-benches --bench disk_checkpoint`;
//! `DISK_CHECKPOINT_GIB` (default `0,1,4`) lists the amounts written (GiB,
//! comma-separated; the files live in `$TMPDIR` and take that much space
//! while a case runs).

use std::time::Instant;

use tine_benches::{env_list, record};
use tine_storage::{Disk, LayeredDisk};

/// The disk's size: room for the largest amount written.
const DISK_BYTES: u64 = 16 << 30;

/// Writes `bytes` to `disk` from offset 0 in 1 MiB writes of non-zero data.
fn fill(disk: &mut LayeredDisk, bytes: u64) {
    let block = vec![0x5au8; 1 << 20];
    for i in 0..bytes >> 20 {
        disk.write_at(&block, i << 20).expect("write");
    }
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("disk_checkpoint");
    let amounts: Vec<u64> = env_list("DISK_CHECKPOINT_GIB", "0,1,4");
    println!("{:>10} {:>16} {:>16} {:>16} {:>12}", "written", "checkpoint µs", "child top µs", "sync ms", "write s");
    for gib in amounts {
        let dir = tempfile::tempdir().expect("temp dir");
        let base = dir.path().join("base.raw");
        std::fs::File::create(&base).and_then(|f| f.set_len(DISK_BYTES)).expect("base");
        let mut disk = LayeredDisk::create(Some(&base), DISK_BYTES, 16, &dir.path().join("top.delta")).expect("disk");
        let t = Instant::now();
        fill(&mut disk, gib << 30);
        let write_s = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let frozen = Disk::checkpoint(&mut disk).expect("checkpoint").expect("a chain checkpoints");
        let checkpoint_us = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        LayeredDisk::create_top(&frozen, &dir.path().join("child.delta")).expect("child top");
        let child_us = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        tine_storage::sync(&frozen).expect("sync");
        let sync_ms = t.elapsed().as_secs_f64() * 1e3;

        println!("{:>7} GiB {checkpoint_us:>16.0} {child_us:>16.0} {sync_ms:>16.1} {write_s:>12.1}", gib);
        record("disk_checkpoint", &format!("checkpoint_{gib}gib_us"), checkpoint_us, "us");
        record("disk_checkpoint", &format!("child_top_{gib}gib_us"), child_us, "us");
        record("disk_checkpoint", &format!("sync_{gib}gib_ms"), sync_ms, "ms");
    }
}
