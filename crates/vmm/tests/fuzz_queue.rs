//! Property-based fuzzing of virtqueue processing (stable toolchain:
//! proptest in place of cargo-fuzz, a bounded number of cases per
//! `cargo test`): a hostile driver writes arbitrary descriptor tables
//! (addresses inside, at the edge of and outside guest memory, any length,
//! any flags including INDIRECT, any `next`), arbitrary available rings and
//! indexes, and arbitrary bytes where the buffers point, then notifies the
//! queue. The real devices (virtio-blk over a real file, virtio-vsock over
//! real Unix sockets) behind the real virtio-mmio transport must not panic,
//! must return (every chain walk is bounded), must not use more chains than
//! were made available, and must serve a well-formed request after the
//! driver resets them (virtio 1.2, sections 2.7 and 3.1). No KVM needed.

mod common;

use common::driver::{Driver, DATA_BASE, INDIRECT, MEM_SIZE, NEXT, QUEUE_BASE, WRITE};
use common::vsock::GUEST_CID;
use proptest::prelude::*;
use vmm::devices::virtio::block::{req, status, Block, VIRTIO_BLK_F_FLUSH};
use vmm::devices::virtio::vsock::Vsock;

const QSIZE: u16 = 16;
const DISK_BYTES: u64 = 1 << 20;

/// One descriptor as a hostile driver may write it.
#[derive(Clone, Debug)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn arb_addr() -> impl Strategy<Value = u64> {
    let mem = MEM_SIZE as u64;
    prop_oneof![
        4 => (0u64..0x4000).prop_map(|o| DATA_BASE + o),
        1 => (0u64..0x100).prop_map(move |o| mem - o),
        1 => Just(QUEUE_BASE),
        1 => any::<u64>(),
        1 => (0u64..0x100).prop_map(|o| u64::MAX - o),
    ]
}

fn arb_len() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => 0u32..64,
        2 => prop_oneof![Just(1u32), Just(16), Just(44), Just(512), Just(4096), Just(65536)],
        1 => any::<u32>(),
    ]
}

fn arb_flags() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => prop_oneof![Just(0u16), Just(NEXT), Just(WRITE), Just(NEXT | WRITE)],
        1 => prop_oneof![Just(INDIRECT), Just(INDIRECT | NEXT), Just(INDIRECT | WRITE)],
        1 => any::<u16>(),
    ]
}

fn arb_index() -> impl Strategy<Value = u16> {
    prop_oneof![4 => 0u16..QSIZE, 1 => any::<u16>()]
}

fn arb_desc() -> impl Strategy<Value = Desc> {
    (arb_addr(), arb_len(), arb_flags(), arb_index()).prop_map(|(addr, len, flags, next)| Desc {
        addr,
        len,
        flags,
        next,
    })
}

/// A hostile queue: its descriptor table, available ring, available index
/// and the bytes at `DATA_BASE` (request headers, packet headers and
/// indirect tables alike).
#[derive(Clone, Debug)]
struct HostileQueue {
    descs: Vec<Desc>,
    ring: Vec<u16>,
    avail_idx: u16,
    data: Vec<u8>,
}

fn arb_queue() -> impl Strategy<Value = HostileQueue> {
    (
        proptest::collection::vec(arb_desc(), QSIZE as usize),
        proptest::collection::vec(arb_index(), QSIZE as usize),
        prop_oneof![4 => 0u16..=QSIZE, 1 => any::<u16>()],
        proptest::collection::vec(any::<u8>(), 0..0x400),
    )
        .prop_map(|(descs, ring, avail_idx, data)| HostileQueue { descs, ring, avail_idx, data })
}

/// Writes `h` into queue `q` and notifies it (twice: a second notification
/// must not redo or break anything). Returns the used entries.
fn submit(d: &mut Driver, q: usize, h: &HostileQueue) -> Vec<(u32, u32)> {
    d.write_bytes(DATA_BASE, &h.data);
    for (i, desc) in h.descs.iter().enumerate() {
        d.set_desc(q, i as u16, desc.addr, desc.len, desc.flags, desc.next);
    }
    let avail = d.queues[q].avail;
    for (i, &head) in h.ring.iter().enumerate() {
        d.write_bytes(avail + 4 + i as u64 * 2, &head.to_le_bytes());
    }
    d.set_avail_idx(q, h.avail_idx);
    d.kick(q);
    d.kick(q);
    d.used(q)
}

/// A device may use at most what was made available, each entry naming a
/// descriptor of the table.
fn check_used(used: &[(u32, u32)], h: &HostileQueue) -> Result<(), TestCaseError> {
    prop_assert!(used.len() <= usize::from(h.avail_idx), "{} used of {} available", used.len(), h.avail_idx);
    for &(id, _) in used {
        prop_assert!(id < u32::from(QSIZE), "used id {id} is not a descriptor");
    }
    Ok(())
}

fn block() -> (tempfile::NamedTempFile, Driver) {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(DISK_BYTES).unwrap();
    let block = Block::open(f.path(), false, "fuzz").unwrap();
    (f, Driver::new(Box::new(block), VIRTIO_BLK_F_FLUSH, QSIZE))
}

/// A well-formed read of sector 1: header, 512-byte buffer, status.
fn block_read_works(d: &mut Driver) -> Result<(), TestCaseError> {
    let hdr = DATA_BASE + 0x8000;
    let data = hdr + 0x1000;
    let st = hdr + 0x2000;
    let mut h = req::IN.to_le_bytes().to_vec();
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&1u64.to_le_bytes());
    d.write_bytes(hdr, &h);
    d.write_bytes(st, &[0xee]);
    d.add_chain(0, 0, &[(hdr, 16, 0), (data, 512, WRITE), (st, 1, WRITE)]);
    d.kick(0);
    prop_assert_eq!(d.read_u8(st), status::OK);
    prop_assert_eq!(d.used(0), vec![(0, 513)]);
    Ok(())
}

/// Block request headers worth steering towards: real types, sectors at
/// the disk's edges.
fn arb_block_header() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![Just(req::IN), Just(req::OUT), Just(req::FLUSH), Just(req::GET_ID), any::<u32>()],
        prop_oneof![Just(0u64), Just(DISK_BYTES / 512 - 1), Just(DISK_BYTES / 512), any::<u64>()],
    )
        .prop_map(|(t, s)| {
            let mut h = t.to_le_bytes().to_vec();
            h.extend_from_slice(&0u32.to_le_bytes());
            h.extend_from_slice(&s.to_le_bytes());
            h
        })
}

/// Runs `cases` cases of `strategy` through `case`, which returns how
/// many chains the device used; fails on the first failing case (shrunk),
/// and if the device used no chain in any case (the generator would then
/// miss the parsing code it is for).
fn fuzz<S: Strategy>(cases: u32, strategy: S, case: impl Fn(S::Value) -> Result<usize, TestCaseError>) {
    let used = std::cell::Cell::new(0usize);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases, ..ProptestConfig::default() });
    runner
        .run(&strategy, |v| {
            used.set(used.get() + case(v)?);
            Ok(())
        })
        .unwrap();
    eprintln!("{cases} cases, {} chains used", used.get());
    assert!(used.get() > 0, "no case got a chain used");
}

/// virtio-blk: hostile queue, then a reset and a good request.
#[test]
fn block_survives_hostile_queues() {
    fuzz(6000, (arb_queue(), arb_block_header()), |(mut h, hdr)| {
        let (file, mut d) = block();
        // Half the cases: a plausible request header where most buffers
        // point, so requests get past the header check.
        if h.data.len() % 2 == 0 {
            let n = hdr.len().min(h.data.len());
            h.data[..n].copy_from_slice(&hdr[..n]);
        }
        let used = submit(&mut d, 0, &h);
        check_used(&used, &h)?;
        prop_assert_eq!(file.as_file().metadata().unwrap().len(), DISK_BYTES, "the disk changed size");
        d.init(1, VIRTIO_BLK_F_FLUSH, QSIZE);
        block_read_works(&mut d)?;
        Ok(used.len())
    });
}

/// virtio-vsock: hostile RX, TX and event queues, then a reset.
#[test]
fn vsock_survives_hostile_queues() {
    fuzz(3000, (arb_queue(), arb_queue(), arb_queue()), |(rx, tx, ev)| {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        // A host service on port 1024, for packets that connect to it.
        let _listener = std::os::unix::net::UnixListener::bind(format!("{}_1024", uds.display())).unwrap();
        let vsock = Vsock::new(GUEST_CID, &uds).unwrap();
        let mut d = Driver::new(Box::new(vsock), 0, QSIZE);
        let used_rx = submit(&mut d, 0, &rx);
        let used_tx = submit(&mut d, 1, &tx);
        let used_ev = submit(&mut d, 2, &ev);
        d.transport.process_events();
        d.kick(0);
        check_used(&used_rx, &rx)?;
        check_used(&used_tx, &tx)?;
        check_used(&used_ev, &ev)?;
        d.init(3, 0, QSIZE);
        prop_assert!(d.transport.is_active());
        prop_assert!(!d.needs_reset());
        Ok(used_rx.len() + used_tx.len() + used_ev.len())
    });
}
