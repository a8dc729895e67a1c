//! Layered disk tests against a flat in-memory model.

use std::path::{Path, PathBuf};

use super::*;

/// xorshift64*: a fixed-seed generator, so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        // Some writes are all zeros: a zero cluster in the top must still
        // shadow data below.
        if self.below(8) == 0 {
            return vec![0; n];
        }
        let seed = self.next();
        (0..n).map(|i| (seed >> ((i % 8) * 8)) as u8 ^ (i / 8) as u8).collect()
    }
}

fn write_base(dir: &Path, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let mut rng = Rng(seed);
    let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let path = dir.join("base.raw");
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

fn read_all(d: &LayeredDisk) -> Vec<u8> {
    let mut buf = vec![0u8; d.size() as usize];
    d.read_at(&mut buf, 0).unwrap();
    buf
}

/// Random writes, reads, discards, write-zeroes, flushes, freezes and
/// reopenings, every read compared with a flat model of the disk.
fn model_run(cluster_bits: u32, seed: u64, steps: usize) {
    let dir = tempfile::tempdir().unwrap();
    let size: u64 = 1 << 20;
    // A base shorter than the disk: the rest reads as zeros.
    let (base, base_bytes) = write_base(dir.path(), 300 * 1024 + 512, seed ^ 0xabc);
    let mut model = vec![0u8; size as usize];
    model[..base_bytes.len()].copy_from_slice(&base_bytes);
    let mut n_top = 0;
    let mut next_top = |dir: &Path| {
        n_top += 1;
        dir.join(format!("delta-{n_top}"))
    };
    let mut disk = LayeredDisk::create(Some(&base), size, cluster_bits, &next_top(dir.path())).unwrap();
    let cs = disk.cluster_size();
    let mut rng = Rng(seed);
    for step in 0..steps {
        let off = rng.below(size);
        let len = rng.below((3 * cs).min(size - off)) + 1;
        match rng.below(100) {
            0..=39 => {
                let data = rng.bytes(len as usize);
                disk.write_at(&data, off).unwrap();
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            40..=69 => {
                let mut buf = vec![0xeeu8; len as usize];
                disk.read_at(&mut buf, off).unwrap();
                assert!(buf == model[off as usize..(off + len) as usize], "step {step}: read {off}+{len}");
            }
            70..=77 => {
                // Cluster-aligned discard: reads as zeros afterwards.
                let c0 = off / cs;
                let c1 = (c0 + rng.below(4) + 1).min(size.div_ceil(cs));
                let (s, e) = (c0 * cs, (c1 * cs).min(size));
                disk.discard(s, e - s).unwrap();
                model[s as usize..e as usize].fill(0);
            }
            78..=83 => {
                disk.write_zeroes(off, len).unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            }
            84..=87 => {
                // Unaligned discard: each byte keeps its value or reads 0;
                // outside the range nothing changes.
                disk.discard(off, len).unwrap();
                let all = read_all(&disk);
                for (i, (&got, want)) in all.iter().zip(model.iter_mut()).enumerate() {
                    let inside = (i as u64) >= off && (i as u64) < off + len;
                    assert!(got == *want || (inside && got == 0), "step {step}: byte {i} after discard");
                    *want = got;
                }
            }
            88..=91 => disk.flush().unwrap(),
            92..=95 => {
                disk.freeze_top(&next_top(dir.path())).unwrap();
            }
            _ => {
                // Flush, drop, reopen from the spec.
                disk.flush().unwrap();
                let spec = disk.spec();
                drop(disk);
                disk = LayeredDisk::open(&spec).unwrap();
            }
        }
    }
    assert!(read_all(&disk) == model, "whole disk at the end");
    disk.flush().unwrap();
    let spec = disk.spec();
    drop(disk);
    assert!(read_all(&LayeredDisk::open(&spec).unwrap()) == model, "whole disk reopened");
}

#[test]
fn random_operations_match_a_flat_model_4k_clusters() {
    model_run(12, 0x1234_5678_9abc_def1, 4000);
}

#[test]
fn random_operations_match_a_flat_model_64k_clusters() {
    model_run(16, 0x0fed_cba9_8765_4321, 3000);
}

#[test]
fn a_disk_without_base_reads_zeros_and_its_last_cluster_may_be_short() {
    let dir = tempfile::tempdir().unwrap();
    // 100 KiB + 512: the second 64 KiB cluster is short.
    let size = 100 * 1024 + 512;
    let mut d = LayeredDisk::create(None, size, 16, &dir.path().join("top")).unwrap();
    assert_eq!(read_all(&d), vec![0; size as usize]);
    d.write_at(&[7; 512], size - 512).unwrap();
    let mut b = [0u8; 1024];
    d.read_at(&mut b, size - 1024).unwrap();
    assert_eq!(&b[..512], &[0; 512]);
    assert_eq!(&b[512..], &[7; 512]);
    d.discard(65536, size - 65536).unwrap();
    d.read_at(&mut b, size - 1024).unwrap();
    assert_eq!(b, [0; 1024]);
}

#[test]
fn out_of_range_requests_fail_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = LayeredDisk::create(None, 1 << 20, 16, &dir.path().join("top")).unwrap();
    let mut b = [0u8; 512];
    for off in [1 << 20, (1 << 20) - 511, u64::MAX, u64::MAX - 100] {
        assert!(matches!(d.read_at(&mut b, off), Err(DiskError::OutOfRange { .. })));
        assert!(matches!(d.write_at(&b, off), Err(DiskError::OutOfRange { .. })));
        assert!(matches!(d.discard(off, 512), Err(DiskError::OutOfRange { .. })));
        assert!(matches!(d.write_zeroes(off, u64::MAX), Err(DiskError::OutOfRange { .. })));
    }
    assert!(matches!(LayeredDisk::create(None, 1000, 16, &dir.path().join("x")), Err(DiskError::Size { .. })));
    assert!(matches!(LayeredDisk::create(None, 4096, 30, &dir.path().join("y")), Err(DiskError::Size { .. })));
}

#[test]
fn flushed_writes_survive_a_crash_and_unflushed_new_clusters_read_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let (base, base_bytes) = write_base(dir.path(), 256 * 1024, 7);
    let top = dir.path().join("top");
    let mut d = LayeredDisk::create(Some(&base), 1 << 20, 16, &top).unwrap();
    d.write_at(&[0x11; 4096], 0).unwrap();
    d.flush().unwrap();
    // Written after the flush, into a cluster not yet in the top: the map
    // entry stays in memory. Dropping the disk is the crash (no flush in
    // Drop); the bytes themselves did reach the data region.
    d.write_at(&[0x22; 4096], 65536).unwrap();
    let spec = d.spec();
    drop(d);
    let mut d = LayeredDisk::open(&spec).unwrap();
    let mut b = vec![0u8; 65536];
    d.read_at(&mut b, 0).unwrap();
    assert_eq!(&b[..4096], &[0x11; 4096]);
    assert_eq!(&b[4096..], &base_bytes[4096..65536], "the rest of the first cluster was copied up");
    d.read_at(&mut b, 65536).unwrap();
    assert_eq!(b, base_bytes[65536..131072], "the unflushed cluster reads from the base");
    // A partial write into that cluster must not expose the stale bytes
    // left in the data region by the lost write.
    d.write_at(&[0x33; 512], 65536 + 8192).unwrap();
    d.read_at(&mut b, 65536).unwrap();
    let mut want = base_bytes[65536..131072].to_vec();
    want[8192..8704].fill(0x33);
    assert_eq!(b, want);
    // Same for a cluster above the base's end (zeros below: punched).
    d.write_at(&[0x44; 4096], 512 * 1024).unwrap();
    drop(d);
    let mut d = LayeredDisk::open(&spec).unwrap();
    d.write_at(&[0x55; 512], 512 * 1024 + 4096).unwrap();
    d.read_at(&mut b, 512 * 1024).unwrap();
    let mut want = vec![0u8; 65536];
    want[4096..4608].fill(0x55);
    assert_eq!(b, want);
    // A discard that was flushed stays a discard.
    d.discard(0, 65536).unwrap();
    d.flush().unwrap();
    drop(d);
    let d = LayeredDisk::open(&spec).unwrap();
    d.read_at(&mut b, 0).unwrap();
    assert_eq!(b, vec![0; 65536], "a discarded cluster shadows the base");
}

#[test]
fn branch_children_share_the_frozen_layer_and_keep_their_own_writes() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let mut parent = LayeredDisk::create(None, 4 << 20, 16, &p("t0")).unwrap();
    let big: Vec<u8> = (0..(2 << 20)).map(|i| (i % 251) as u8).collect();
    parent.write_at(&big, 0).unwrap();
    let (frozen, mut kids) = parent.branch(&p("t1"), &[p("a"), p("b")]).unwrap();
    assert_eq!(frozen, p("t0"));
    // O(1): the new tops hold no data, whatever the parent wrote.
    for k in &kids {
        let top = k.layers().unwrap().pop().unwrap();
        assert_eq!(top.data_clusters, 0);
        assert!(top.allocated_bytes <= 64 * 1024, "a new top allocates {} bytes", top.allocated_bytes);
    }
    assert!(parent.layers().unwrap()[0].data_clusters >= 32);
    kids[0].write_at(&[0xaa; 1000 * 512][..512 * 3], 4096).unwrap();
    kids[1].write_at(&[0xbb; 512 * 3], 4096).unwrap();
    parent.write_at(&[0xcc; 512 * 3], 4096).unwrap();
    let mut b = vec![0u8; 8192];
    for (d, v) in [(&kids[0], 0xaa), (&kids[1], 0xbb), (&parent, 0xcc)] {
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(&b[..4096], &big[..4096]);
        assert_eq!(&b[4096..4096 + 1536], &vec![v; 1536][..]);
        assert_eq!(&b[4096 + 1536..], &big[4096 + 1536..8192]);
    }
    // Reopen a child from its spec.
    kids[1].flush().unwrap();
    let spec_b = kids[1].spec();
    assert_eq!(spec_b, ChainSpec { base: None, frozen: vec![p("t0")], top: Some(p("b")) });
    drop(kids);
    let b_again = LayeredDisk::open(&spec_b).unwrap();
    b_again.read_at(&mut b, 0).unwrap();
    assert_eq!(&b[4096..4096 + 1536], &[0xbb; 1536][..]);
    // The frozen layer cannot be a writable top again.
    let bad = ChainSpec { base: None, frozen: vec![], top: Some(p("t0")) };
    assert!(matches!(LayeredDisk::open(&bad), Err(DiskError::Frozen { .. })));
    // A top that is not the child of the layer below is refused.
    let mut other = LayeredDisk::create(None, 4 << 20, 16, &p("o0")).unwrap();
    other.freeze_top(&p("o1")).unwrap();
    let bad = ChainSpec { base: None, frozen: vec![p("t0")], top: Some(p("o1")) };
    assert!(matches!(LayeredDisk::open(&bad), Err(DiskError::Chain { .. })));
}

#[test]
fn discard_gives_blocks_back_and_shadows_lower_data() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _) = write_base(dir.path(), 1 << 20, 3);
    let mut d = LayeredDisk::create(Some(&base), 8 << 20, 16, &dir.path().join("top")).unwrap();
    d.write_at(&vec![0x5a; 4 << 20], 0).unwrap();
    d.flush().unwrap();
    let before = d.layers().unwrap()[1].allocated_bytes;
    assert!(before >= 4 << 20, "{before}");
    d.discard(0, 4 << 20).unwrap();
    let after = d.layers().unwrap()[1].allocated_bytes;
    assert!(after < 256 * 1024, "after discard the top still holds {after} bytes");
    let mut b = vec![1u8; 1 << 20];
    d.read_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0), "discarded clusters read as zeros over the base");
}

#[test]
fn corrupt_headers_and_maps_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top");
    let mut d = LayeredDisk::create(None, 1 << 20, 16, &top).unwrap();
    d.write_at(&[1; 512], 0).unwrap();
    d.flush().unwrap();
    drop(d);
    let spec = ChainSpec { base: None, frozen: vec![], top: Some(top.clone()) };
    let orig = std::fs::read(&top).unwrap();
    let mut bytes = orig.clone();
    bytes[20] ^= 1; // the virtual size
    std::fs::write(&top, &bytes).unwrap();
    assert!(matches!(LayeredDisk::open(&spec), Err(DiskError::Corrupt { .. })));
    let mut bytes = orig.clone();
    bytes[0] = b'X';
    std::fs::write(&top, &bytes).unwrap();
    assert!(matches!(LayeredDisk::open(&spec), Err(DiskError::NotADelta { .. })));
    let mut bytes = orig.clone();
    bytes[4096] = 0b11; // an invalid map entry
    std::fs::write(&top, &bytes).unwrap();
    assert!(matches!(LayeredDisk::open(&spec), Err(DiskError::Corrupt { .. })));
    std::fs::write(&top, &orig[..100]).unwrap();
    assert!(LayeredDisk::open(&spec).is_err());
}

#[test]
fn a_raw_disk_is_a_one_layer_chain() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_base(dir.path(), 128 * 1024, 9);
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut d = LayeredDisk::from_raw(f, &path, true).unwrap();
    assert_eq!(read_all(&d), data);
    d.write_at(&[9; 512], 512).unwrap();
    d.flush().unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[512..1024], &[9; 512]);
    // Freezing a raw top makes it the base of a new delta.
    d.freeze_top(&dir.path().join("top")).unwrap();
    d.write_at(&[8; 512], 0).unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[..512], &data[..512], "the raw base is no longer written");
    let ro = LayeredDisk::from_raw(std::fs::File::open(&path).unwrap(), &path, false).unwrap();
    assert!(ro.is_read_only());
    let mut ro = ro;
    assert!(matches!(ro.write_at(&[0; 512], 0), Err(DiskError::ReadOnly)));
}

/// Throughput of the layered path against the raw path on this machine:
/// `cargo test --release -p vmm --lib disk::tests::throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn throughput() {
    let dir = tempfile::tempdir().unwrap();
    let size: u64 = 256 << 20;
    let chunk = vec![0x5au8; 128 * 1024];
    let raw_path = dir.path().join("raw");
    std::fs::File::create(&raw_path).unwrap().set_len(size).unwrap();
    let raw_file = std::fs::OpenOptions::new().read(true).write(true).open(&raw_path).unwrap();
    let raw = LayeredDisk::from_raw(raw_file, &raw_path, true).unwrap();
    let (base, _) = write_base(dir.path(), 64 << 20, 1);
    let layered = LayeredDisk::create(Some(&base), size, 16, &dir.path().join("top")).unwrap();
    for (name, mut d) in [("raw", raw), ("layered", layered)] {
        let t = std::time::Instant::now();
        for off in (0..size).step_by(chunk.len()) {
            d.write_at(&chunk, off).unwrap();
        }
        d.flush().unwrap();
        let w = t.elapsed();
        // 4 KiB overwrites at random offsets (clusters already data in the
        // top: no copy-up; the copy-up cost is not measured here).
        let mut rng = Rng(5);
        let t = std::time::Instant::now();
        for _ in 0..4096 {
            let off = rng.below(size / 4096) * 4096;
            d.write_at(&chunk[..4096], off).unwrap();
        }
        let rw = t.elapsed();
        let mut buf = vec![0u8; chunk.len()];
        let t = std::time::Instant::now();
        for off in (0..size).step_by(chunk.len()) {
            d.read_at(&mut buf, off).unwrap();
        }
        let r = t.elapsed();
        let mib = (size >> 20) as f64;
        println!(
            "{name}: sequential write+flush {:.0} MiB/s, sequential read {:.0} MiB/s, 4096 random 4 KiB writes {:.1} ms",
            mib / w.as_secs_f64(),
            mib / r.as_secs_f64(),
            rw.as_secs_f64() * 1000.0
        );
    }
}

/// `Disk::checkpoint`: the returned chain is the disk as of the call and
/// stays so while the disk goes on writing on a new top beside the old.
#[test]
fn a_checkpoint_is_the_disk_at_that_instant_and_the_disk_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _) = write_base(dir.path(), 1 << 20, 3);
    let mut d = LayeredDisk::create(Some(&base), 4 << 20, 16, &dir.path().join("first.delta")).unwrap();
    d.write_at(&[1; 4096], 8192).unwrap();
    let before = read_all(&d);
    let frozen = Disk::checkpoint(&mut d).unwrap().expect("a chain checkpoints");
    assert_eq!(frozen.top, None);
    assert_eq!(frozen.frozen, vec![dir.path().join("first.delta")]);
    let top = d.spec().top.expect("a new top");
    assert_eq!(top.parent(), Some(dir.path()), "the new top sits beside the old one");
    assert!(top.file_name().unwrap().to_str().unwrap().ends_with(".delta"));
    d.write_at(&[2; 4096], 8192).unwrap();
    let mut after = before.clone();
    after[8192..12288].fill(2);
    assert_eq!(read_all(&d), after);
    let snap = LayeredDisk::open(&frozen).unwrap();
    assert!(snap.is_read_only());
    assert_eq!(read_all(&snap), before, "the checkpoint does not see later writes");
    // A child over the checkpoint: its own top, the checkpoint's bytes.
    let child_spec = ChainSpec { top: Some(dir.path().join("child.delta")), ..frozen.clone() };
    assert!(LayeredDisk::open(&child_spec).is_err(), "a top must exist to be opened");
}

/// A raw disk: read-only refuses writes; writable writes in place and
/// punches holes; it cannot be checkpointed while writable.
#[test]
fn a_raw_disk_reads_writes_and_punches_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_base(dir.path(), 1 << 20, 4);
    let mut ro = crate::RawDisk::open(&path, false).unwrap();
    assert!(matches!(ro.write_at(&[0; 512], 0), Err(DiskError::ReadOnly)));
    assert_eq!(Disk::checkpoint(&mut ro).unwrap().and_then(|s| s.base), Some(path.clone()));
    let mut rw = crate::RawDisk::open(&path, true).unwrap();
    let mut buf = vec![0; 4096];
    rw.read_at(&mut buf, 4096).unwrap();
    assert_eq!(buf, data[4096..8192]);
    rw.write_at(&[9; 4096], 4096).unwrap();
    rw.write_zeroes(65536, 65536).unwrap();
    rw.flush().unwrap();
    rw.read_at(&mut buf, 4096).unwrap();
    assert_eq!(buf, vec![9; 4096]);
    rw.read_at(&mut buf, 65536).unwrap();
    assert_eq!(buf, vec![0; 4096]);
    assert!(matches!(rw.read_at(&mut buf, (1 << 20) - 100), Err(DiskError::OutOfRange { .. })));
    assert!(Disk::checkpoint(&mut rw).unwrap().is_none());
}

/// `create_top` over a checkpoint: a new writable disk that reads as the
/// checkpoint and keeps its writes to itself.
#[test]
fn a_top_created_over_a_checkpoint_reads_it_and_writes_apart() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _) = write_base(dir.path(), 1 << 20, 5);
    let mut d = LayeredDisk::create(Some(&base), 2 << 20, 16, &dir.path().join("a.delta")).unwrap();
    d.write_at(&[7; 512], 1 << 20).unwrap();
    let frozen = Disk::checkpoint(&mut d).unwrap().unwrap();
    let at = read_all(&d);
    let child = LayeredDisk::create_top(&frozen, &dir.path().join("child.delta")).unwrap();
    let mut c = LayeredDisk::open(&child).unwrap();
    assert_eq!(read_all(&c), at);
    c.write_at(&[8; 512], 0).unwrap();
    assert_eq!(read_all(&d), at, "the parent does not see the child's write");
    // A chain of only a raw base: the disk is the base's size.
    let only = ChainSpec { base: Some(base.clone()), frozen: vec![], top: None };
    let t = LayeredDisk::create_top(&only, &dir.path().join("t.delta")).unwrap();
    assert_eq!(LayeredDisk::open(&t).unwrap().size(), 1 << 20);
}

/// A checkpoint of a disk whose top holds nothing yet is the chain below
/// the top: no empty layer is frozen, the top stays; a write or a discard
/// since the last checkpoint makes the next one freeze the top as before.
#[test]
fn a_checkpoint_of_an_untouched_top_adds_no_layer() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _) = write_base(dir.path(), 1 << 20, 5);
    let mut d = LayeredDisk::create(Some(&base), 4 << 20, 16, &dir.path().join("first.delta")).unwrap();
    let first = Disk::checkpoint(&mut d).unwrap().expect("a chain checkpoints");
    assert_eq!(first, ChainSpec { base: Some(base.clone()), frozen: vec![], top: None });
    assert_eq!(d.spec().top, Some(dir.path().join("first.delta")), "the untouched top stays");

    d.write_at(&[1; 4096], 0).unwrap();
    let second = Disk::checkpoint(&mut d).unwrap().unwrap();
    assert_eq!(second.frozen, vec![dir.path().join("first.delta")]);
    let top = d.spec().top.unwrap();
    for _ in 0..3 {
        assert_eq!(Disk::checkpoint(&mut d).unwrap().unwrap(), second, "nothing written: the same chain");
        assert_eq!(d.spec().top.as_ref(), Some(&top));
    }
    let before = read_all(&d);
    assert_eq!(read_all(&LayeredDisk::open(&second).unwrap()), before);

    // A discard is a change of the disk like a write.
    Disk::discard(&mut d, 0, 64 << 10).unwrap();
    let third = Disk::checkpoint(&mut d).unwrap().unwrap();
    assert_eq!(third.frozen.len(), 2, "{third:?}");
    assert_eq!(read_all(&LayeredDisk::open(&third).unwrap())[..4096], [0; 4096]);
    assert_eq!(read_all(&LayeredDisk::open(&second).unwrap()), before, "the older checkpoint is unchanged");
}
