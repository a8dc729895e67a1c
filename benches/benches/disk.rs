//! The disk backends' own cost, on the host, without a guest: time per
//! request through the `tine_storage::Disk` trait (what the virtio-blk
//! device calls for each request's data) for 4 KiB random and 1 MiB
//! sequential reads and writes on a raw file, a fresh delta (writes copy
//! clusters up; reads of what it holds) and a 3-deep chain (a raw base
//! and two frozen deltas under the top), against a plain `pread`/`pwrite`
//! loop on a raw file of the same size. Files live in `$TMPDIR` (the page
//! cache: this measures the backends' work, not the host's disk).
//!
//! `cargo bench -p tine-benches --bench disk`; `DISK_BENCH_MIB` (default
//! 256) sets the disk's size, `DISK_BENCH_OPS` (default 20000) the random
//! requests per case.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use tine_benches::{env_or, record};
use tine_storage::{ChainSpec, Disk, LayeredDisk, RawDisk};

/// xorshift64*: fixed seed, same offsets for every case.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// One case's four figures (µs per request).
struct Figures {
    read_4k: f64,
    write_4k: f64,
    read_1m: f64,
    write_1m: f64,
}

fn time_per(n: u64, t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// Runs the four workloads with `read(buf, offset)` and `write(buf,
/// offset)` on a disk of `size` bytes; random writes go first (on a fresh
/// delta they are the copy-up case), then the sequential ones.
fn run(
    size: u64,
    ops: u64,
    mut read: impl FnMut(&mut [u8], u64),
    mut write: impl FnMut(&[u8], u64),
    flush: impl FnOnce(),
) -> Figures {
    let mut small = vec![0x5au8; 4096];
    let mut big = vec![0xa5u8; 1 << 20];
    let mut rng = Rng(33);
    let t = Instant::now();
    for _ in 0..ops {
        write(&small, rng.below(size / 4096) * 4096);
    }
    let write_4k = time_per(ops, t);
    let mut rng = Rng(34);
    let t = Instant::now();
    for _ in 0..ops {
        read(&mut small, rng.below(size / 4096) * 4096);
    }
    let read_4k = time_per(ops, t);
    let n = size >> 20;
    let t = Instant::now();
    for i in 0..n {
        write(&big, i << 20);
    }
    flush();
    let write_1m = time_per(n, t);
    let t = Instant::now();
    for i in 0..n {
        read(&mut big, i << 20);
    }
    let read_1m = time_per(n, t);
    Figures { read_4k, write_4k, read_1m, write_1m }
}

fn raw_file(path: &Path, size: u64, fill: u8) {
    let f = std::fs::File::create(path).unwrap();
    let chunk = vec![fill; 1 << 20];
    for i in 0..size >> 20 {
        f.write_all_at(&chunk, i << 20).unwrap();
    }
}

fn disk_case(d: &mut dyn Disk, size: u64, ops: u64) -> Figures {
    let d = std::cell::RefCell::new(d);
    run(
        size,
        ops,
        |b, o| d.borrow().read_at(b, o).unwrap(),
        |b, o| d.borrow_mut().write_at(b, o).unwrap(),
        || d.borrow_mut().flush().unwrap(),
    )
}

fn main() {
    let _changes = tine_benches::report_changes_at_end("disk");
    let size: u64 = env_or::<u64>("DISK_BENCH_MIB", 256) << 20;
    let ops: u64 = env_or("DISK_BENCH_OPS", 20_000);
    let dir = tempfile::tempdir().unwrap();
    let mut cases: Vec<(&str, Figures)> = Vec::new();

    // Plain pread/pwrite on a raw file.
    let plain = dir.path().join("plain.raw");
    raw_file(&plain, size, 1);
    let f = OpenOptions::new().read(true).write(true).open(&plain).unwrap();
    cases.push((
        "pread/pwrite",
        run(
            size,
            ops,
            |b, o| f.read_exact_at(b, o).unwrap(),
            |b, o| f.write_all_at(b, o).unwrap(),
            || f.sync_data().unwrap(),
        ),
    ));

    // RawDisk.
    let raw = dir.path().join("raw.raw");
    raw_file(&raw, size, 1);
    cases.push(("raw", disk_case(&mut RawDisk::open(&raw, true).unwrap(), size, ops)));

    // A fresh delta over a raw base of the same data.
    let base = dir.path().join("base.raw");
    raw_file(&base, size, 1);
    let mut fresh = LayeredDisk::create(Some(&base), size, 16, &dir.path().join("fresh.delta")).unwrap();
    cases.push(("fresh delta", disk_case(&mut fresh, size, ops)));

    // A 3-deep chain: the base, two frozen deltas holding some of the
    // data, then the top.
    let mut chain = LayeredDisk::create(Some(&base), size, 16, &dir.path().join("l1.delta")).unwrap();
    let mut rng = Rng(7);
    for _ in 0..2 {
        for _ in 0..(size >> 16) / 4 {
            chain.write_at(&[2u8; 65536], rng.below(size >> 16) << 16).unwrap();
        }
        Disk::checkpoint(&mut chain).unwrap();
    }
    let spec: ChainSpec = Disk::spec(&chain);
    eprintln!("chain: base + {} frozen + top", spec.frozen.len());
    cases.push(("3-deep chain", disk_case(&mut chain, size, ops)));

    let bench = "disk";
    println!("{:<14} {:>12} {:>12} {:>12} {:>12}", "µs/request", "read 4K", "write 4K", "read 1M", "write 1M");
    for (name, f) in &cases {
        println!("{name:<14} {:>12.2} {:>12.2} {:>12.1} {:>12.1}", f.read_4k, f.write_4k, f.read_1m, f.write_1m);
        let key = name.replace([' ', '/'], "_");
        record(bench, &format!("{key}_read_4k_us"), f.read_4k, "us");
        record(bench, &format!("{key}_write_4k_us"), f.write_4k, "us");
        record(bench, &format!("{key}_read_1m_us"), f.read_1m, "us");
        record(bench, &format!("{key}_write_1m_us"), f.write_1m, "us");
    }
    let raw = &cases[1].1;
    for (name, f) in &cases[2..] {
        println!(
            "{name} / raw: read 4K {:.2}x, write 4K {:.2}x, read 1M {:.2}x, write 1M {:.2}x (target: within 1.2x)",
            f.read_4k / raw.read_4k,
            f.write_4k / raw.write_4k,
            f.read_1m / raw.read_1m,
            f.write_1m / raw.write_1m
        );
    }
}
