//! Property-based fuzzing of the virtio-vsock packet path (stable
//! toolchain: proptest in place of cargo-fuzz, a bounded number of cases
//! per `cargo test`): the 44-byte header codec, and sequences of packets a
//! hostile guest sends (any op, CID, port, flags, credit; payload lengths
//! that lie; header and payload split over descriptors) interleaved with a
//! host side that connects, writes and closes over real Unix sockets. The
//! device must not panic, must return every TX chain it takes, and every
//! packet it puts in the guest's RX ring must be well-formed (virtio 1.2,
//! section 5.10.6). No KVM needed.

mod common;

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};

use common::driver::{Driver, DATA_BASE, WRITE};
use common::vsock::GUEST_CID;
use proptest::prelude::*;
use vmm::devices::virtio::vsock::muxer::HOST_CID;
use vmm::devices::virtio::vsock::packet::{op, Header, HDR_LEN, MAX_PAYLOAD, TYPE_STREAM};
use vmm::devices::virtio::vsock::Vsock;

const RXQ: usize = 0;
const TXQ: usize = 1;
const QSIZE: u16 = 16;
const RX_BASE: u64 = DATA_BASE;
const RX_BUF: u32 = 4096;
const TX_BASE: u64 = DATA_BASE + 0x10_0000;
/// The host service the guest may connect to.
const HOST_PORT: u32 = 1024;

fn arb_header() -> impl Strategy<Value = Header> {
    (
        prop_oneof![4 => Just(GUEST_CID), 1 => any::<u64>()],
        prop_oneof![4 => Just(HOST_CID), 1 => any::<u64>()],
        prop_oneof![Just(1000u32), Just(1001), any::<u32>()],
        prop_oneof![3 => Just(HOST_PORT), 1 => Just(1025), 1 => any::<u32>()],
        prop_oneof![4 => Just(TYPE_STREAM), 1 => any::<u16>()],
        prop_oneof![8 => 1u16..=7, 1 => any::<u16>()],
        prop_oneof![3 => 0u32..4, 1 => any::<u32>()],
        prop_oneof![3 => Just(256u32 * 1024), 1 => any::<u32>()],
        any::<u32>(),
    )
        .prop_map(|(src_cid, dst_cid, src_port, dst_port, type_, op, flags, buf_alloc, fwd_cnt)| Header {
            src_cid,
            dst_cid,
            src_port,
            dst_port,
            len: 0,
            type_,
            op,
            flags,
            buf_alloc,
            fwd_cnt,
        })
}

/// What happens next: the guest sends a packet, or the host side acts.
#[derive(Clone, Debug)]
enum Action {
    /// A TX packet: header, payload, a `len` field that may lie, and
    /// whether header and payload sit in separate descriptors.
    Tx { header: Header, payload: Vec<u8>, len: Option<u32>, split: bool },
    /// The guest opens a well-formed connection to the host service.
    GuestConnect { src_port: u32 },
    /// The guest accepts the last connection the host asked for.
    GuestAccept,
    /// A host client connects to the VM's socket and asks for `port`.
    HostConnect { port: u32 },
    /// The host service accepts what the guest connected.
    HostAccept,
    /// Host stream `i` writes `bytes`.
    HostWrite { i: usize, bytes: Vec<u8> },
    /// Host stream `i` closes.
    HostClose { i: usize },
}

fn arb_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (
            arb_header(),
            proptest::collection::vec(any::<u8>(), 0..128),
            prop_oneof![4 => Just(None), 1 => any::<u32>().prop_map(Some), 1 => Just(Some(MAX_PAYLOAD + 1))],
            any::<bool>(),
        )
            .prop_map(|(header, payload, len, split)| Action::Tx { header, payload, len, split }),
        1 => prop_oneof![Just(1000u32), Just(1001), Just(HOST_PORT), any::<u32>()].prop_map(|port| Action::HostConnect { port }),
        2 => prop_oneof![Just(1000u32), Just(1001)].prop_map(|src_port| Action::GuestConnect { src_port }),
        2 => Just(Action::GuestAccept),
        2 => Just(Action::HostAccept),
        4 => (0usize..4, proptest::collection::vec(any::<u8>(), 1..256)).prop_map(|(i, bytes)| Action::HostWrite { i, bytes }),
        1 => (0usize..4).prop_map(|i| Action::HostClose { i }),
    ]
}

/// A header a well-behaved guest would send.
fn well_formed(op: u16, src_port: u32, dst_port: u32) -> Header {
    Header {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 1 << 18,
        fwd_cnt: 0,
    }
}

struct Harness {
    _dir: tempfile::TempDir,
    uds: std::path::PathBuf,
    listener: UnixListener,
    d: Driver,
    host: Vec<UnixStream>,
    /// Packets the device put in the RX ring, and how many were RW.
    rx_packets: usize,
    rx_data: usize,
    /// The last REQUEST the host side sent: (host port, guest port).
    last_request: Option<(u32, u32)>,
}

impl Harness {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let listener = UnixListener::bind(format!("{}_{HOST_PORT}", uds.display())).unwrap();
        listener.set_nonblocking(true).unwrap();
        let vsock = Vsock::new(GUEST_CID, &uds).unwrap();
        let mut d = Driver::new(Box::new(vsock), 0, QSIZE);
        for i in 0..QSIZE {
            d.set_desc(RXQ, i, RX_BASE + u64::from(i) * u64::from(RX_BUF), RX_BUF, WRITE, 0);
            d.publish(RXQ, i);
        }
        Harness { _dir: dir, uds, listener, d, host: Vec::new(), rx_packets: 0, rx_data: 0, last_request: None }
    }

    /// Takes the packets the device put in the RX ring, checks each, and
    /// gives the buffers back.
    fn drain_rx(&mut self) -> Result<usize, TestCaseError> {
        let used = self.d.used(RXQ);
        for &(id, len) in &used {
            prop_assert!(id < u32::from(QSIZE), "RX used id {id}");
            prop_assert!(len as usize >= HDR_LEN && len <= RX_BUF, "RX used length {len}");
            let addr = RX_BASE + u64::from(id) * u64::from(RX_BUF);
            let raw: [u8; HDR_LEN] = self.d.read_bytes(addr, HDR_LEN).try_into().unwrap();
            let h = Header::from_bytes(&raw);
            prop_assert_eq!(h.len as usize, len as usize - HDR_LEN, "header len vs used len: {:?}", h);
            prop_assert_eq!((h.src_cid, h.dst_cid, h.type_), (HOST_CID, GUEST_CID, TYPE_STREAM), "{:?}", h);
            prop_assert!((op::REQUEST..=op::CREDIT_REQUEST).contains(&h.op), "op {}", h.op);
            prop_assert!(h.op == op::RW || h.len == 0, "payload on a control packet: {:?}", h);
            self.rx_packets += 1;
            if h.op == op::REQUEST {
                self.last_request = Some((h.src_port, h.dst_port));
            }
            self.rx_data += usize::from(h.op == op::RW);
            self.d.publish(RXQ, id as u16);
        }
        Ok(used.len())
    }

    fn act(&mut self, a: &Action) -> Result<(), TestCaseError> {
        match a {
            Action::Tx { header, payload, len, split } => {
                let mut h = *header;
                h.len = len.unwrap_or(payload.len() as u32);
                let hb = h.to_bytes();
                if *split && !payload.is_empty() {
                    self.d.write_bytes(TX_BASE, &hb);
                    self.d.write_bytes(TX_BASE + 0x1000, payload);
                    self.d.add_chain(
                        TXQ,
                        0,
                        &[(TX_BASE, HDR_LEN as u32, 0), (TX_BASE + 0x1000, payload.len() as u32, 0)],
                    );
                } else {
                    let mut b = hb.to_vec();
                    b.extend_from_slice(payload);
                    self.d.write_bytes(TX_BASE, &b);
                    self.d.add_chain(TXQ, 0, &[(TX_BASE, b.len() as u32, 0)]);
                }
                self.d.kick(TXQ);
                let used = self.d.used(TXQ);
                prop_assert!(used.len() <= 1, "TX used {used:?} for one chain");
                for &(id, _) in &used {
                    prop_assert_eq!(id, 0);
                }
            }
            Action::GuestConnect { src_port } => {
                let header = well_formed(op::REQUEST, *src_port, HOST_PORT);
                return self.act(&Action::Tx { header, payload: vec![], len: None, split: false });
            }
            Action::GuestAccept => {
                if let Some((host_port, guest_port)) = self.last_request {
                    let header = well_formed(op::RESPONSE, guest_port, host_port);
                    return self.act(&Action::Tx { header, payload: vec![], len: None, split: false });
                }
            }
            Action::HostConnect { port } => {
                if let Ok(mut s) = UnixStream::connect(&self.uds) {
                    let _ = s.write_all(format!("CONNECT {port}\n").as_bytes());
                    let _ = s.set_nonblocking(true);
                    self.host.push(s);
                }
            }
            Action::HostAccept => {
                while let Ok((s, _)) = self.listener.accept() {
                    let _ = s.set_nonblocking(true);
                    self.host.push(s);
                }
            }
            Action::HostWrite { i, bytes } => {
                if let Some(s) = self.host.get_mut(*i) {
                    let _ = s.write(bytes);
                }
            }
            Action::HostClose { i } => {
                if *i < self.host.len() {
                    drop(self.host.swap_remove(*i));
                }
            }
        }
        // What the event loop would do next: host-side events, RX.
        self.d.transport.process_events();
        self.d.kick(RXQ);
        self.drain_rx()?;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    /// The header codec is a bijection on 44-byte strings.
    #[test]
    fn header_bytes_round_trip(bytes in proptest::collection::vec(any::<u8>(), HDR_LEN)) {
        let raw: [u8; HDR_LEN] = bytes.try_into().unwrap();
        let h = Header::from_bytes(&raw);
        prop_assert_eq!(h.to_bytes(), raw);
        prop_assert_eq!(Header::from_bytes(&h.to_bytes()), h);
    }
}

/// Hostile packet sequences against a live host side. Fails on the first
/// failing case (shrunk), and if no case got a data packet (RW) to the
/// guest: the generator would then miss the connected states.
#[test]
fn packet_sequences_never_break_the_device() {
    let counts = std::cell::Cell::new((0usize, 0usize));
    let mut runner =
        proptest::test_runner::TestRunner::new(ProptestConfig { cases: 1500, ..ProptestConfig::default() });
    runner
        .run(&proptest::collection::vec(arb_action(), 1..24), |actions| {
            let mut h = Harness::new();
            for a in &actions {
                h.act(a)?;
            }
            // The device still takes and answers a well-formed REQUEST to
            // a port nobody listens on (RST), unless the guest broke it.
            if !h.d.needs_reset() {
                let req = well_formed(op::REQUEST, 4242, 7777);
                h.act(&Action::Tx { header: req, payload: vec![], len: None, split: false })?;
            }
            let (p, rw) = counts.get();
            counts.set((p + h.rx_packets, rw + h.rx_data));
            Ok(())
        })
        .unwrap();
    let (packets, data) = counts.get();
    eprintln!("{packets} packets to the guest, {data} of them data");
    assert!(data > 0, "no case moved data to the guest");
}
