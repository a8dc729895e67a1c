//! What keeping a disk chain short costs (`tine_storage::compact`): a
//! `LayeredDisk` over a blank base gets `GiB` written in 1 MiB writes,
//! spread over 9 checkpoints (one more than
//! `tine_storage::MAX_FROZEN_LAYERS`, the default `[limits]
//! max_disk_layers`, past which a resume, a template's making or a branch
//! merges the chain), then
//!
//! - `flatten`: the 9 frozen layers merged into one new synced layer
//!   (`tine_storage::flatten`): a resume of such a hibernation waits this
//!   long; after a branch it runs in the background;
//! - `swap`: the merged layer put under the running disk's top in place
//!   of the 9 (`Disk::replace_lower`), what the VMM does with the disk's
//!   transport locked: the guest's I/O waits this long;
//! - `read 4 KiB`: one random 4 KiB read that finds nothing above the
//!   base, before and after (the lookup walks every layer).
//!
//! `cargo bench -p tine-benches --bench disk_flatten`; `DISK_FLATTEN_GIB`
//! (default `0,1,4`) lists the amounts written (GiB, comma-separated; at
//! least 1 MiB per layer, so 0 is 9 MiB; the
//! files live in `$TMPDIR` and take twice that much while a case runs).

use std::time::Instant;

use tine_benches::{env_list, record};
use tine_storage::{Disk, LayeredDisk};

/// The disk's size: room for the largest amount written.
const DISK_BYTES: u64 = 16 << 30;
/// Checkpoints the amount is spread over.
const LAYERS: u64 = 9;

/// Microseconds per 4 KiB read at offsets past what was written (each
/// read walks the chain down to the base).
fn read_us(disk: &LayeredDisk, from: u64) -> f64 {
    let mut buf = vec![0u8; 4096];
    let n = 2000u64;
    let t = Instant::now();
    for i in 0..n {
        let at = from + (i * 7_919 % 100_000) * 4096;
        disk.read_at(&mut buf, at.min(DISK_BYTES - 4096)).expect("read");
    }
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("disk_flatten");
    let amounts: Vec<u64> = env_list("DISK_FLATTEN_GIB", "0,1,4");
    println!(
        "{:>10} {:>12} {:>10} {:>16} {:>16}",
        "written", "flatten ms", "swap µs", "read before µs", "read after µs"
    );
    let block = vec![0x5au8; 1 << 20];
    for gib in amounts {
        let dir = tempfile::tempdir().expect("temp dir");
        let base = dir.path().join("base.raw");
        std::fs::File::create(&base).and_then(|f| f.set_len(DISK_BYTES)).expect("base");
        let mut disk = LayeredDisk::create(Some(&base), DISK_BYTES, 16, &dir.path().join("top.delta")).expect("disk");
        // MiB per layer; at least 1 (so "0" is 9 MiB).
        let per_layer = ((gib << 10) / LAYERS).max(1);
        let mut below = None;
        for layer in 0..LAYERS {
            for i in 0..per_layer {
                disk.write_at(&block, (layer * per_layer + i) << 20).expect("write");
            }
            below = Disk::checkpoint(&mut disk).expect("checkpoint");
        }
        let below = below.expect("a chain checkpoints");
        let unwritten = (LAYERS * per_layer + 1) << 20;
        let before = read_us(&disk, unwritten);

        let t = Instant::now();
        let flat = tine_storage::flatten(&below, &dir.path().join("flat.delta")).expect("flatten");
        let flatten_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        assert!(Disk::replace_lower(&mut disk, &below, &flat).expect("swap"));
        let swap_us = t.elapsed().as_secs_f64() * 1e6;
        let after = read_us(&disk, unwritten);

        println!("{:>6} MiB {flatten_ms:>12.1} {swap_us:>10.0} {before:>16.2} {after:>16.2}", LAYERS * per_layer);
        record("disk_flatten", &format!("flatten_{gib}gib_ms"), flatten_ms, "ms");
        record("disk_flatten", &format!("swap_{gib}gib_us"), swap_us, "us");
        record("disk_flatten", &format!("read_before_{gib}gib_us"), before, "us");
        record("disk_flatten", &format!("read_after_{gib}gib_us"), after, "us");
    }
}
