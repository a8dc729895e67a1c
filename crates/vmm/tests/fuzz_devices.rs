//! Property tests standing in for fuzzing (cargo-fuzz needs a nightly
//! toolchain; this project builds with stable only): arbitrary descriptor
//! tables, available rings and vsock packets in front of the real
//! virtio-blk and virtio-vsock devices behind the real virtio-mmio
//! transport, driven by the test driver (tests/common/driver.rs). A device
//! must never panic, must only put heads the driver offered in the used
//! ring, and must keep serving a well-formed request afterwards (or mark
//! itself broken, per virtio 1.2 section 2.1.2, DEVICE_NEEDS_RESET).
//!
//! The number of cases is bounded for CI (`PROPTEST_CASES` raises it for
//! a longer run on demand). No KVM needed.

mod common;

use common::driver::{Driver, DATA_BASE, WRITE};
use common::vsock::{guest_header, GUEST_CID};
use proptest::prelude::*;
use vmm::devices::virtio::block::{req, status, Block};
use vmm::devices::virtio::vsock::packet::{op, Header, HDR_LEN};
use vmm::devices::virtio::vsock::Vsock;

const QSIZE: u16 = 16;
/// Guest memory the harness has (bytes): descriptors pointing past it are
/// part of what is generated.
const MEM: u64 = common::driver::MEM_SIZE as u64;

/// One descriptor as a hostile driver may write it: any address (mostly
/// inside guest memory, sometimes past it), any length, any flags, any
/// next index.
fn descriptor() -> impl Strategy<Value = Desc> {
    (
        prop_oneof![4 => DATA_BASE..MEM, 1 => any::<u64>()],
        prop_oneof![4 => 0u32..8192, 1 => any::<u32>()],
        any::<u16>(),
        prop_oneof![4 => 0u16..QSIZE, 1 => any::<u16>()],
    )
}

/// `(addr, len, flags, next)` of one descriptor.
type Desc = (u64, u32, u16, u16);
/// A generated ring: descriptor table, heads to offer, avail index to
/// publish, bytes for the data area.
type Ring = (Vec<Desc>, Vec<u16>, Option<u16>, Vec<u8>);

/// A descriptor table, the heads to offer, the avail index to publish
/// (sometimes far past the heads offered) and bytes to fill the data area.
fn ring() -> impl Strategy<Value = Ring> {
    (
        prop::collection::vec(descriptor(), QSIZE as usize),
        prop::collection::vec(prop_oneof![4 => 0u16..QSIZE, 1 => any::<u16>()], 1..8),
        prop::option::weighted(0.2, any::<u16>()),
        prop::collection::vec(any::<u8>(), 0..512),
    )
}

/// Writes the generated ring into the driver's queue `q`, kicks it, and
/// checks the used ring: only offered heads, at most as many entries as
/// offered.
fn drive(d: &mut Driver, q: usize, (descs, heads, avail_idx, data): &Ring) {
    d.write_bytes(DATA_BASE, data);
    for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
        d.set_desc(q, i as u16, addr, len, flags, next);
    }
    for &h in heads {
        d.publish(q, h);
    }
    if let Some(idx) = avail_idx {
        d.set_avail_idx(q, *idx);
    }
    d.kick(q);
    if d.needs_reset() {
        return;
    }
    let used = d.used(q);
    assert!(used.len() <= QSIZE as usize, "{} used entries for a {QSIZE}-entry queue", used.len());
    for (id, _) in used {
        assert!(id < u32::from(QSIZE), "used head {id} is not a descriptor index");
    }
}

/// Cases per property: 2000 (about a second each in release), or
/// `PROPTEST_CASES`.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)
}

fn block_device() -> (tempfile::NamedTempFile, Driver) {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(1 << 20).unwrap();
    let block = Block::open(f.path(), false, "fuzz-serial").unwrap();
    let d = Driver::new(Box::new(block), 0, QSIZE);
    (f, d)
}

/// A well-formed read of sector 0 on a fresh ring: status OK.
fn block_still_serves(d: &mut Driver) {
    d.init(1, 0, QSIZE);
    let hdr = DATA_BASE;
    let data = DATA_BASE + 0x1000;
    let st = DATA_BASE + 0x3000;
    let mut h = Vec::new();
    h.extend_from_slice(&req::IN.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    d.write_bytes(hdr, &h);
    d.write_bytes(st, &[0xee]);
    d.add_chain(0, 0, &[(hdr, 16, 0), (data, 512, WRITE), (st, 1, WRITE)]);
    d.kick(0);
    assert_eq!(d.used(0).len(), 1, "the well-formed read after the garbage was not served");
    assert_eq!(d.read_u8(st), status::OK);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// virtio-blk: arbitrary descriptor chains (loops, out-of-memory
    /// addresses, huge lengths, indirect flags, wrong directions).
    #[test]
    fn block_takes_any_ring(r in ring()) {
        let (_f, mut d) = block_device();
        drive(&mut d, 0, &r);
        block_still_serves(&mut d);
    }

    /// virtio-vsock TX: arbitrary descriptor chains.
    #[test]
    fn vsock_tx_takes_any_ring(r in ring()) {
        let dir = tempfile::tempdir().unwrap();
        let vsock = Vsock::new(GUEST_CID, &dir.path().join("v.sock")).unwrap();
        let mut d = Driver::new(Box::new(vsock), 0, QSIZE);
        drive(&mut d, 1, &r);
        d.transport.process_events();
    }

    /// virtio-vsock RX: arbitrary buffers offered while the device has
    /// something to send (an RST for a request to a port nobody listens on).
    #[test]
    fn vsock_rx_takes_any_ring(r in ring()) {
        let dir = tempfile::tempdir().unwrap();
        let vsock = Vsock::new(GUEST_CID, &dir.path().join("v.sock")).unwrap();
        let mut d = Driver::new(Box::new(vsock), 0, QSIZE);
        let tx = DATA_BASE + 0x20_0000;
        d.write_bytes(tx, &guest_header(op::REQUEST, 1000, 4321, 0).to_bytes());
        d.add_chain(1, 0, &[(tx, HDR_LEN as u32, 0)]);
        d.kick(1);
        drive(&mut d, 0, &r);
        d.transport.process_events();
    }

    /// virtio-vsock packets: any header fields and payload in a well-formed
    /// chain. The device drops or answers them; it never panics.
    #[test]
    fn vsock_takes_any_packet(
        hdr in prop::array::uniform32(any::<u8>()).prop_flat_map(|a| (Just(a), prop::collection::vec(any::<u8>(), 12..=12))),
        payload in prop::collection::vec(any::<u8>(), 0..256),
        real_cids in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let vsock = Vsock::new(GUEST_CID, &dir.path().join("v.sock")).unwrap();
        let mut d = Driver::new(Box::new(vsock), 0, QSIZE);
        let mut raw = [0u8; HDR_LEN];
        raw[..32].copy_from_slice(&hdr.0);
        raw[32..].copy_from_slice(&hdr.1);
        let mut h = Header::from_bytes(&raw);
        if real_cids {
            // Past the CID checks, into the connection state machine.
            let g = guest_header(h.op, h.src_port, h.dst_port, h.len);
            h.src_cid = g.src_cid;
            h.dst_cid = g.dst_cid;
            h.type_ = g.type_;
        }
        let mut bytes = h.to_bytes().to_vec();
        bytes.extend_from_slice(&payload);
        let rx = DATA_BASE;
        for i in 0..4u16 {
            d.set_desc(0, i, rx + u64::from(i) * 4096, 4096, WRITE, 0);
            d.publish(0, i);
        }
        let tx = DATA_BASE + 0x20_0000;
        d.write_bytes(tx, &bytes);
        d.add_chain(1, 0, &[(tx, bytes.len() as u32, 0)]);
        d.kick(1);
        d.transport.process_events();
        prop_assert!(d.needs_reset() || d.used(1).len() == 1, "the TX chain was neither used nor the device reset");
    }
}
