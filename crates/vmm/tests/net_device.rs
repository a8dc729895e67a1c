//! The virtio-net device (virtio 1.2, section 5.1) driven through its
//! queues in guest memory as a hostile driver would: frames that are too
//! short or too long, segmented (GSO) frames, checksum requests pointing
//! outside the frame, device-writable TX buffers, read-only or too small
//! RX buffers, zero-length and looping chains, a frame spread over many
//! tiny RX buffers (mergeable RX buffers), a backend that is full, a
//! corrupt ring. The device must count what it drops, never panic, mark
//! itself broken only for a corrupt ring, and go on serving a good frame.
//! A proptest throws random descriptor tables and rings at both queues.
//!
//! The backend is a loopback defined here (every frame the guest sends
//! comes back to it): this is a test of the device; the real NAT
//! (netstack) has its own tests. No KVM needed.

mod common;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::driver::{Driver, DATA_BASE, INDIRECT, MEM_SIZE, NEXT, QUEUE_BASE, WRITE};
use proptest::prelude::*;
use vmm::devices::virtio::mmio::reg;
use vmm::devices::virtio::net::{
    csum, Net, NetBackend, NetCounters, NetHdr, NetStats, HDR_LEN, MAX_FRAME_LEN, QUEUE_SIZE, RXQ, TXQ, VIRTIO_ID_NET,
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_HDR_F_DATA_VALID,
    VIRTIO_NET_HDR_F_NEEDS_CSUM,
};
use vmm::devices::virtio::VIRTIO_RING_F_EVENT_IDX;
use vmm::event_loop::EventLoop;
use vmm::seccomp::ThreadKind;
use vmm_sys_util::eventfd::EventFd;

/// What the test sees of the loopback backend.
#[derive(Default)]
struct Observed {
    /// Every frame the device handed to the backend.
    sent: Vec<Vec<u8>>,
    /// Frames waiting for `poll` to queue them for the guest.
    inject: VecDeque<Vec<u8>>,
    /// While false, `poll` leaves the sent frames where they are (the
    /// backend stays full).
    drain: bool,
    /// How many times the backend was reset.
    resets: usize,
}

/// A backend that gives each frame the guest sends back to the guest (at
/// the next `poll`), holding at most `cap` frames not yet polled.
struct Loopback {
    seen: Arc<Mutex<Observed>>,
    pending: VecDeque<Vec<u8>>,
    to_guest: VecDeque<Vec<u8>>,
    cap: usize,
    /// The backend's fd, if the test wakes the device through it (read,
    /// to clear it, by `poll`).
    wake: Option<EventFd>,
}

impl NetBackend for Loopback {
    fn send_frame(&mut self, frame: &[u8]) -> bool {
        if self.pending.len() >= self.cap {
            return false;
        }
        self.pending.push_back(frame.to_vec());
        self.seen.lock().unwrap().sent.push(frame.to_vec());
        true
    }

    fn peek_frame(&self) -> Option<&[u8]> {
        self.to_guest.front().map(|f| f.as_slice())
    }

    fn pop_frame(&mut self) {
        self.to_guest.pop_front();
    }

    fn poll(&mut self) {
        if let Some(w) = &self.wake {
            let _ = w.read();
        }
        let mut seen = self.seen.lock().unwrap();
        if seen.drain {
            self.to_guest.extend(self.pending.drain(..));
        }
        self.to_guest.extend(seen.inject.drain(..));
    }

    fn epoll_fd(&self) -> Option<RawFd> {
        self.wake.as_ref().map(|w| w.as_raw_fd())
    }

    fn reset(&mut self) {
        self.pending.clear();
        self.to_guest.clear();
        self.seen.lock().unwrap().resets += 1;
    }
}

/// Features a Linux guest takes.
const FEATURES: u64 =
    VIRTIO_NET_F_MRG_RXBUF | VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_MAC | VIRTIO_RING_F_EVENT_IDX;
/// RX buffers: descriptor `i` at `RX_BASE + i * RX_STRIDE`.
const RX_BASE: u64 = DATA_BASE;
const RX_STRIDE: u64 = 0x1000;
/// TX data area.
const TX_BASE: u64 = DATA_BASE + 0x20_0000;

struct Harness {
    d: Driver,
    seen: Arc<Mutex<Observed>>,
    counters: Arc<NetCounters>,
    /// The RX descriptors' buffers: (addr, len) by descriptor index.
    rx_bufs: Vec<(u64, u32)>,
    /// Next TX descriptor index to use.
    tx_next: u16,
    /// The RX descriptors the last [`Harness::received`] took back.
    last_ids: Vec<u16>,
}

fn new_backend(cap: usize) -> (Loopback, Arc<Mutex<Observed>>) {
    let seen = Arc::new(Mutex::new(Observed { drain: true, ..Observed::default() }));
    (Loopback { seen: seen.clone(), pending: VecDeque::new(), to_guest: VecDeque::new(), cap, wake: None }, seen)
}

impl Harness {
    fn new(features: u64, qsize: u16) -> Self {
        let (lb, seen) = new_backend(64);
        let net = Net::new(Box::new(lb));
        let counters = net.counters();
        let d = Driver::new(Box::new(net), features, qsize);
        Harness { d, seen, counters, rx_bufs: vec![(0, 0); usize::from(qsize)], tx_next: 0, last_ids: Vec::new() }
    }

    fn stats(&self) -> NetStats {
        self.counters.stats()
    }

    /// Posts RX buffers of `len` bytes at descriptors `first..first + n`.
    fn post_rx(&mut self, first: u16, n: u16, len: u32) {
        for i in first..first + n {
            let addr = RX_BASE + u64::from(i) * RX_STRIDE;
            self.d.set_desc(RXQ, i, addr, len, WRITE, 0);
            self.rx_bufs[usize::from(i)] = (addr, len);
            self.d.publish(RXQ, i);
        }
    }

    /// Sends `hdr` + `frame` as one TX chain of `split` descriptors (the
    /// bytes cut evenly), and kicks the TX queue.
    fn send(&mut self, hdr: NetHdr, frame: &[u8], split: usize) {
        let mut bytes = hdr.to_bytes().to_vec();
        bytes.extend_from_slice(frame);
        self.send_raw(&bytes, split, 0);
    }

    /// Sends `bytes` as one TX chain of `split` descriptors with `flags`.
    fn send_raw(&mut self, bytes: &[u8], split: usize, flags: u16) {
        self.d.write_bytes(TX_BASE, bytes);
        let per = bytes.len().div_ceil(split.max(1)).max(1);
        let mut bufs = Vec::new();
        let mut off = 0;
        while off < bytes.len() || bufs.is_empty() {
            let n = per.min(bytes.len() - off);
            bufs.push((TX_BASE + off as u64, n as u32, flags));
            off += n;
            if n == 0 {
                break;
            }
        }
        let first = self.take_tx_descs(bufs.len());
        self.d.add_chain(TXQ, first, &bufs);
        self.d.kick(TXQ);
    }

    /// Gives the RX buffers the last [`Harness::received`] took back to
    /// the device again.
    fn recycle(&mut self) {
        for id in std::mem::take(&mut self.last_ids) {
            self.d.publish(RXQ, id);
        }
    }

    /// Reserves `n` consecutive TX descriptors (wrapping to 0).
    fn take_tx_descs(&mut self, n: usize) -> u16 {
        let size = self.d.queues[TXQ].size;
        if usize::from(self.tx_next) + n > usize::from(size) {
            self.tx_next = 0;
        }
        let first = self.tx_next;
        self.tx_next += n as u16;
        first
    }

    /// Frames delivered into the RX ring since the last call: (header of
    /// the first buffer, frame bytes), after checking that each spans
    /// `num_buffers` used entries.
    fn received(&mut self) -> Vec<(NetHdr, Vec<u8>)> {
        let used = self.d.used(RXQ);
        self.last_ids = used.iter().map(|&(id, _)| id as u16).collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < used.len() {
            let (id, len) = used[i];
            let (addr, _) = self.rx_bufs[id as usize];
            if (len as usize) < HDR_LEN {
                // A buffer returned empty.
                assert_eq!(len, 0, "RX entry {i}: {len} bytes, less than a header");
                i += 1;
                continue;
            }
            let raw: [u8; HDR_LEN] = self.d.read_bytes(addr, HDR_LEN).try_into().unwrap();
            let hdr = NetHdr::from_bytes(&raw);
            assert!(hdr.num_buffers >= 1, "num_buffers 0");
            let n = usize::from(hdr.num_buffers);
            assert!(i + n <= used.len(), "frame of {n} buffers, {} published", used.len() - i);
            let mut frame = self.d.read_bytes(addr + HDR_LEN as u64, len as usize - HDR_LEN);
            for &(id, len) in &used[i + 1..i + n] {
                assert!(len > 0, "an empty buffer inside a frame");
                let (addr, blen) = self.rx_bufs[id as usize];
                assert!(len <= blen);
                frame.extend(self.d.read_bytes(addr, len as usize));
            }
            out.push((hdr, frame));
            i += n;
        }
        out
    }
}

/// An Ethernet frame of `len` bytes (IPv4 ethertype, a byte pattern).
fn frame(len: usize) -> Vec<u8> {
    let mut f: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    if len >= 14 {
        f[..6].copy_from_slice(&netstack::GATEWAY_MAC);
        f[6..12].copy_from_slice(&netstack::GUEST_MAC);
        f[12..14].copy_from_slice(&[0x08, 0x00]);
    }
    f
}

/// An Ethernet + IPv4 + UDP frame 10.0.2.15:1000 -> 10.0.2.3:53 with
/// `payload` and the pseudo-header's sum in the checksum field, as a
/// guest with checksum offload sends it.
fn udp_partial(payload: &[u8]) -> Vec<u8> {
    let mut f = frame(14);
    let total = (20 + 8 + payload.len()) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 2, 15, 10, 0, 2, 3];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    let hc = !csum::fold(csum::sum(&ip, 0));
    ip[10..12].copy_from_slice(&hc.to_be_bytes());
    let ulen = (8 + payload.len()) as u16;
    let pseudo = csum::fold(csum::sum(&ip[12..20], 17 + u64::from(ulen)));
    f.extend_from_slice(&ip);
    for v in [1000u16, 53, ulen, pseudo] {
        f.extend_from_slice(&v.to_be_bytes());
    }
    f.extend_from_slice(payload);
    f
}

/// A good frame goes out and comes back (the device still works) in
/// 2048-byte receive buffers (4, or as many as it needs).
fn good_frame_round_trips(h: &mut Harness, len: usize) {
    let before = h.stats();
    let buffers = (HDR_LEN + len).div_ceil(2048).max(4) as u16;
    h.post_rx(0, buffers, 2048);
    let f = frame(len);
    h.send(NetHdr::default(), &f, 1);
    assert!(!h.d.needs_reset(), "the device is broken");
    // Frames the backend still held for the guest come first.
    let got = h.received();
    let (hdr, last) = got.last().expect("a frame came back");
    assert_eq!(*last, f);
    assert_eq!(usize::from(hdr.num_buffers), (HDR_LEN + len).div_ceil(2048));
    let after = h.stats();
    assert_eq!(after.tx_frames, before.tx_frames + 1);
    assert_eq!(after.rx_frames, before.rx_frames + got.len() as u64);
}

#[test]
fn identity_config_and_a_good_frame() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    assert_eq!(h.d.r(reg::DEVICE_ID), VIRTIO_ID_NET);
    let mut mac = [0u8; 6];
    h.d.transport.read(reg::CONFIG, &mut mac);
    assert_eq!(mac, netstack::GUEST_MAC);
    let mut mtu = [0u8; 2];
    h.d.transport.read(reg::CONFIG + 10, &mut mtu);
    assert_eq!(u16::from_le_bytes(mtu) as usize, netstack::MTU);
    for len in [14, 60, 1000, 1514] {
        good_frame_round_trips(&mut h, len);
    }
    let s = h.stats();
    assert_eq!((s.tx_frames, s.rx_frames, s.tx_dropped, s.rx_bad_buffers), (4, 4, 0, 0));
    assert_eq!(s.tx_bytes, (14 + 60 + 1000 + 1514) as u64);
    assert_eq!(s.rx_bytes, s.tx_bytes);
    // Every TX chain came back, with nothing written.
    let used = h.d.used(TXQ);
    assert_eq!(used.len(), 4);
    assert!(used.iter().all(|&(_, len)| len == 0));
}

#[test]
fn runt_oversized_and_zero_length_frames_are_dropped_and_counted() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    // Zero-length chain; shorter than the header; header + 13 bytes.
    h.send_raw(&[], 1, 0);
    h.send_raw(&[0u8; 5], 1, 0);
    h.send(NetHdr::default(), &frame(13), 2);
    assert_eq!(h.stats().tx_runt, 3);
    // One byte over the longest frame; a 64 KiB + 1 chain over 64 descriptors.
    h.send(NetHdr::default(), &frame(MAX_FRAME_LEN + 1), 3);
    h.send_raw(&vec![0u8; 64 * 1024 + 1], 64, 0);
    // A chain of 2 x 4 GiB - 1 claimed lengths (outside memory too).
    let first = h.take_tx_descs(2);
    h.d.add_chain(TXQ, first, &[(TX_BASE, u32::MAX, 0), (TX_BASE, u32::MAX, 0)]);
    h.d.kick(TXQ);
    let s = h.stats();
    assert_eq!(s.tx_oversized, 2, "{s:?}");
    assert_eq!(s.tx_bad_chain, 1, "{s:?}");
    assert_eq!(s.tx_dropped, 6);
    assert_eq!(s.tx_frames, 0);
    assert!(h.seen.lock().unwrap().sent.is_empty());
    assert_eq!(h.d.used(TXQ).len(), 6, "every dropped chain is returned");
    good_frame_round_trips(&mut h, 100);
}

#[test]
fn gso_frames_are_dropped() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    for gso_type in [1u8, 3, 4, 0x81, 0x80, 0xff] {
        h.send(NetHdr { gso_type, gso_size: 1448, hdr_len: 54, ..NetHdr::default() }, &frame(200), 1);
    }
    assert_eq!(h.stats().tx_gso, 6);
    good_frame_round_trips(&mut h, 1514);
}

#[test]
fn partial_checksums_are_completed_and_bad_offsets_dropped() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    h.post_rx(0, 8, 2048);
    for payload in [&b""[..], b"x", b"a query of odd length", &[0xffu8; 1000]] {
        let f = udp_partial(payload);
        assert!(!csum::l4_checksum_valid(&f));
        let hdr = NetHdr { flags: VIRTIO_NET_HDR_F_NEEDS_CSUM, csum_start: 34, csum_offset: 6, ..NetHdr::default() };
        h.send(hdr, &f, 2);
        let got = h.received();
        assert_eq!(got.len(), 1);
        let (rh, rf) = &got[0];
        assert!(csum::l4_checksum_valid(rf), "the checksum was not completed");
        assert_eq!(rh.flags, VIRTIO_NET_HDR_F_DATA_VALID, "a verified frame is marked DATA_VALID");
        assert_eq!(rf[..40], f[..40]);
        assert_eq!(rf[42..], f[42..]);
    }
    // A frame without a valid checksum comes back without DATA_VALID.
    h.send(NetHdr::default(), &udp_partial(b"no offload"), 1);
    let got = h.received();
    assert_eq!(got[0].0.flags, 0);

    let len = udp_partial(b"abc").len() as u16;
    for (start, offset) in [(len, 0), (len - 1, 0), (34, len), (u16::MAX, u16::MAX), (0, u16::MAX), (len - 2, 1)] {
        let hdr =
            NetHdr { flags: VIRTIO_NET_HDR_F_NEEDS_CSUM, csum_start: start, csum_offset: offset, ..NetHdr::default() };
        h.send(hdr, &udp_partial(b"abc"), 1);
    }
    let s = h.stats();
    assert_eq!(s.tx_bad_csum, 6, "{s:?}");
    assert_eq!(s.tx_frames, 5);
    assert!(h.received().is_empty());
    good_frame_round_trips(&mut h, 60);
}

#[test]
fn device_writable_tx_buffers_and_loops_are_dropped() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    let mut bytes = NetHdr::default().to_bytes().to_vec();
    bytes.extend(frame(100));
    // All writable; readable then writable.
    h.send_raw(&bytes, 2, WRITE);
    h.d.write_bytes(TX_BASE, &bytes);
    let first = h.take_tx_descs(2);
    h.d.add_chain(TXQ, first, &[(TX_BASE, 50, 0), (TX_BASE + 50, 62, WRITE)]);
    h.d.kick(TXQ);
    // A loop: a -> b -> a.
    let a = h.take_tx_descs(2);
    h.d.set_desc(TXQ, a, TX_BASE, 56, NEXT, a + 1);
    h.d.set_desc(TXQ, a + 1, TX_BASE + 56, 56, NEXT, a);
    h.d.publish(TXQ, a);
    h.d.kick(TXQ);
    // A next index past the table.
    let b = h.take_tx_descs(1);
    h.d.set_desc(TXQ, b, TX_BASE, 112, NEXT, 60_000);
    h.d.publish(TXQ, b);
    // An indirect table that points outside guest memory.
    let c = h.take_tx_descs(1);
    h.d.set_desc(TXQ, c, MEM_SIZE as u64 - 8, 64, INDIRECT, 0);
    h.d.publish(TXQ, c);
    h.d.kick(TXQ);
    let s = h.stats();
    assert_eq!(s.tx_bad_chain, 5, "{s:?}");
    assert_eq!(s.tx_frames, 0);
    assert_eq!(h.d.used(TXQ).len(), 5);
    good_frame_round_trips(&mut h, 100);
}

/// The largest frame the link carries (64 KiB MTU) goes out and comes
/// back over 2048-byte mergeable buffers.
#[test]
fn the_largest_frame_round_trips() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    good_frame_round_trips(&mut h, MAX_FRAME_LEN);
    let s = h.stats();
    assert_eq!((s.tx_frames, s.rx_frames, s.tx_bytes), (1, 1, MAX_FRAME_LEN as u64));
}

#[test]
fn bad_rx_buffers_are_returned_empty_and_the_frame_goes_to_the_next() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    let f = frame(300);
    // Read-only; shorter than the header; a loop; outside memory.
    h.d.set_desc(RXQ, 0, RX_BASE, 2048, 0, 0);
    h.rx_bufs[0] = (RX_BASE, 2048);
    h.d.publish(RXQ, 0);
    h.post_rx(1, 1, 8);
    h.d.set_desc(RXQ, 2, RX_BASE + 2 * RX_STRIDE, 64, WRITE | NEXT, 3);
    h.d.set_desc(RXQ, 3, RX_BASE + 3 * RX_STRIDE, 64, WRITE | NEXT, 2);
    h.d.publish(RXQ, 2);
    h.d.set_desc(RXQ, 4, MEM_SIZE as u64 - 100, 2048, WRITE, 0);
    h.d.publish(RXQ, 4);
    h.post_rx(5, 1, 2048);
    h.seen.lock().unwrap().inject.push_back(f.clone());
    h.d.transport.process_events();
    let used = h.d.used(RXQ);
    assert_eq!(used[..4], [(0, 0), (1, 0), (2, 0), (4, 0)]);
    assert_eq!(used[4], (5, (HDR_LEN + 300) as u32));
    let (addr, _) = h.rx_bufs[5];
    assert_eq!(h.d.read_bytes(addr + HDR_LEN as u64, 300), f);
    let s = h.stats();
    assert_eq!((s.rx_bad_buffers, s.rx_frames), (4, 1));
    assert!(!h.d.needs_reset());
    good_frame_round_trips(&mut h, 1514);
}

#[test]
fn a_frame_spreads_over_many_tiny_buffers() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    // An Ethernet-sized frame, 1514 bytes (1526 with the header), in
    // 16-byte buffers: 96 of them.
    h.post_rx(0, 100, 16);
    let f = frame(1514);
    h.send(NetHdr::default(), &f, 1);
    let got = h.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.num_buffers, 96);
    assert_eq!(got[0].1, f);
    // A buffer holding a header only, then the frame in the next ones.
    h.d.init(2, FEATURES, QUEUE_SIZE);
    h.post_rx(0, 1, HDR_LEN as u32);
    h.post_rx(1, 1, 1000);
    h.post_rx(2, 1, 1000);
    h.send(NetHdr::default(), &f, 1);
    let used = h.d.used(RXQ);
    assert_eq!(used, vec![(0, 12), (1, 1000), (2, 514)]);
}

#[test]
fn without_mergeable_buffers_a_frame_needs_one_big_buffer() {
    let mut h = Harness::new(FEATURES & !VIRTIO_NET_F_MRG_RXBUF, QUEUE_SIZE);
    // The largest frame, in one buffer (it spans the harness's slots
    // after slot 1, which nothing else uses here).
    let whole = (HDR_LEN + MAX_FRAME_LEN) as u32;
    h.post_rx(0, 1, 1000);
    h.post_rx(1, 1, whole);
    let f = frame(MAX_FRAME_LEN);
    h.send(NetHdr::default(), &f, 1);
    let used = h.d.used(RXQ);
    assert_eq!(used, vec![(0, 0), (1, whole)]);
    let raw: [u8; HDR_LEN] = h.d.read_bytes(h.rx_bufs[1].0, HDR_LEN).try_into().unwrap();
    assert_eq!(NetHdr::from_bytes(&raw).num_buffers, 1);
    assert_eq!(h.stats().rx_bad_buffers, 1);
}

#[test]
fn a_frame_waits_for_enough_buffers() {
    for features in [FEATURES, FEATURES & !VIRTIO_RING_F_EVENT_IDX] {
        let mut h = Harness::new(features, QUEUE_SIZE);
        // 112 bytes needed, 32 posted: nothing is used.
        h.post_rx(0, 2, 16);
        let f = frame(100);
        h.send(NetHdr::default(), &f, 1);
        assert!(h.d.used(RXQ).is_empty());
        if features & VIRTIO_RING_F_EVENT_IDX != 0 {
            // avail_event asks for a notification at the next buffer added.
            let q = &h.d.queues[RXQ];
            let at = q.used + 4 + 8 * u64::from(q.size);
            let ev = u16::from_le_bytes(h.d.read_bytes(at, 2).try_into().unwrap());
            assert_eq!(ev, 2);
        }
        h.post_rx(2, 5, 16);
        h.d.kick(RXQ);
        let got = h.received();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0.num_buffers, 7);
        assert_eq!(got[0].1, f);
    }
}

#[test]
fn a_full_backend_leaves_frames_in_the_ring_until_it_has_room() {
    let (lb, seen) = new_backend(1);
    seen.lock().unwrap().drain = false;
    let net = Net::new(Box::new(lb));
    let counters = net.counters();
    let mut h = Harness {
        d: Driver::new(Box::new(net), FEATURES, QUEUE_SIZE),
        seen: seen.clone(),
        counters,
        rx_bufs: vec![(0, 0); usize::from(QUEUE_SIZE)],
        tx_next: 0,
        last_ids: Vec::new(),
    };
    h.post_rx(0, 8, 2048);
    let frames: Vec<Vec<u8>> = (0..3).map(|i| frame(60 + i)).collect();
    for (i, f) in frames.iter().enumerate() {
        let mut bytes = NetHdr::default().to_bytes().to_vec();
        bytes.extend_from_slice(f);
        let at = TX_BASE + i as u64 * 0x1000;
        h.d.write_bytes(at, &bytes);
        h.d.add_chain(TXQ, i as u16, &[(at, bytes.len() as u32, 0)]);
    }
    h.d.kick(TXQ);
    assert_eq!(h.d.used(TXQ).len(), 1, "one frame taken, two left in the ring");
    assert_eq!(h.stats().tx_frames, 1);
    // Still full: nothing moves.
    h.d.transport.process_events();
    assert!(h.d.used(TXQ).is_empty());
    // The backend drains: the rest go, in order.
    seen.lock().unwrap().drain = true;
    h.d.transport.process_events();
    assert_eq!(h.d.used(TXQ).len(), 2);
    assert_eq!(seen.lock().unwrap().sent, frames);
    let got: Vec<Vec<u8>> = h.received().into_iter().map(|(_, f)| f).collect();
    assert_eq!(got, frames);
    assert_eq!(h.stats().tx_dropped, 0);
}

#[test]
fn a_corrupt_ring_breaks_the_device_until_reset() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    h.d.set_avail_idx(TXQ, QUEUE_SIZE + 5);
    h.d.kick(TXQ);
    assert!(h.d.needs_reset());
    // An RX head past the table.
    h.d.init(2, FEATURES, QUEUE_SIZE);
    h.tx_next = 0;
    let q = &h.d.queues[RXQ];
    h.d.write_bytes(q.avail + 4, &400u16.to_le_bytes());
    h.d.set_avail_idx(RXQ, 1);
    h.seen.lock().unwrap().inject.push_back(frame(61));
    h.d.transport.process_events();
    assert!(h.d.needs_reset());
    h.d.init(2, FEATURES, QUEUE_SIZE);
    good_frame_round_trips(&mut h, 60);
}

#[test]
fn a_restored_device_resets_its_backend_and_keeps_its_queues() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    good_frame_round_trips(&mut h, 80);
    let (lb, seen) = new_backend(64);
    let net = Net::new(Box::new(lb));
    h.counters = net.counters();
    h.d.save_and_restore(Box::new(net));
    h.seen = seen.clone();
    assert_eq!(seen.lock().unwrap().resets, 1, "after_restore resets the backend");
    assert!(h.d.transport.is_active());
    // The ring goes on where it was (used entries continue).
    let f = frame(90);
    h.post_rx(4, 1, 2048);
    h.send(NetHdr::default(), &f, 1);
    let got = h.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1, f);
}

#[test]
fn frames_from_the_backend_that_are_not_ethernet_frames_are_dropped() {
    let mut h = Harness::new(FEATURES, QUEUE_SIZE);
    h.post_rx(0, 4, 4096);
    h.seen.lock().unwrap().inject.extend([vec![], vec![1; 13], vec![2; MAX_FRAME_LEN + 1], frame(64)]);
    h.d.transport.process_events();
    let got = h.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1, frame(64));
    assert_eq!(h.stats().rx_dropped, 3);
}

/// Waits up to 30 s for `cond`.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The seccomp mode (`Seccomp:` of /proc, 2 = filter) of this process's
/// thread named `name`, if it exists.
fn seccomp_of_thread(name: &str) -> Option<u32> {
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            return status.lines().find_map(|l| l.strip_prefix("Seccomp:")).map(|m| m.trim().parse().unwrap());
        }
    }
    None
}

/// The device behind the real event loop, on its `net-<vm>` thread under
/// the net seccomp filter: a TX notification sends a frame that comes
/// back into the RX ring, and the backend's fd becoming readable wakes the
/// thread to deliver a frame the backend got on its own.
#[test]
fn the_net_thread_moves_frames_under_its_filter() {
    let (mut lb, seen) = new_backend(64);
    let wake = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    lb.wake = Some(wake.try_clone().unwrap());
    let net = Net::new(Box::new(lb));
    let counters = net.counters();
    let mut d = Driver::new(Box::new(net), FEATURES, QUEUE_SIZE);
    for i in 0..8u16 {
        d.set_desc(RXQ, i, RX_BASE + u64::from(i) * RX_STRIDE, 2048, WRITE, 0);
        d.publish(RXQ, i);
    }
    let f = frame(200);
    let mut bytes = NetHdr::default().to_bytes().to_vec();
    bytes.extend_from_slice(&f);
    d.write_bytes(TX_BASE, &bytes);
    d.add_chain(TXQ, 0, &[(TX_BASE, bytes.len() as u32, 0)]);
    let Driver { transport, mem, .. } = d;
    let evts: Vec<EventFd> = transport.queue_evts().iter().map(|e| e.try_clone().unwrap()).collect();
    let t = Arc::new(Mutex::new(transport));
    let event_loop = EventLoop::spawn("nt-vm", vec![t.clone()], ThreadKind::Net).unwrap();
    assert_eq!(vmm::event_loop::thread_name(ThreadKind::Net, "nt-vm"), "net-nt-vm");
    wait_until("the net thread's filter", || seccomp_of_thread("net-nt-vm") == Some(2));

    evts[TXQ].write(1).unwrap();
    wait_until("the frame to come back", || counters.stats().rx_frames == 1);
    let read = |gpa: u64, len: usize| {
        let mut v = vec![0; len];
        vm_memory::Bytes::read_slice(&mem, &mut v, vm_memory::GuestAddress(gpa)).unwrap();
        v
    };
    assert_eq!(read(RX_BASE + HDR_LEN as u64, f.len()), f);

    let g = frame(300);
    seen.lock().unwrap().inject.push_back(g.clone());
    wake.write(1).unwrap();
    wait_until("the backend's frame", || counters.stats().rx_frames == 2);
    assert_eq!(read(RX_BASE + RX_STRIDE + HDR_LEN as u64, g.len()), g);
    assert!(t.lock().unwrap().is_active());
    drop(event_loop);
    // Joined, the thread may still be listed for a moment: a joiner wakes
    // when the exiting thread clears its tid (CLONE_CHILD_CLEARTID, in
    // the kernel's exit path), before the task is reaped from /proc.
    wait_until("the thread to end with its loop", || seccomp_of_thread("net-nt-vm").is_none());
}

// --- random rings ---

const QSIZE: u16 = 16;

/// `(addr, len, flags, next)` of one descriptor as a hostile driver may
/// write it.
type Desc = (u64, u32, u16, u16);

fn arb_desc() -> impl Strategy<Value = Desc> {
    let mem = MEM_SIZE as u64;
    (
        prop_oneof![
            4 => (0u64..0x4000).prop_map(|o| DATA_BASE + o),
            1 => (0u64..0x100).prop_map(move |o| mem - o),
            1 => Just(QUEUE_BASE),
            1 => any::<u64>(),
        ],
        prop_oneof![
            3 => 0u32..64,
            3 => prop_oneof![Just(12u32), Just(26), Just(100), Just(1526), Just(4096), Just(65536)],
            1 => any::<u32>(),
        ],
        prop_oneof![
            4 => prop_oneof![Just(0u16), Just(NEXT), Just(WRITE), Just(NEXT | WRITE)],
            1 => prop_oneof![Just(INDIRECT), Just(INDIRECT | NEXT)],
            1 => any::<u16>(),
        ],
        prop_oneof![4 => 0u16..QSIZE, 1 => any::<u16>()],
    )
}

/// A hostile queue: descriptor table, available ring and index, and
/// bytes at `DATA_BASE`.
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
        proptest::collection::vec(prop_oneof![4 => 0u16..QSIZE, 1 => any::<u16>()], QSIZE as usize),
        prop_oneof![4 => 0u16..=QSIZE, 1 => any::<u16>()],
        proptest::collection::vec(any::<u8>(), 0..0x400),
    )
        .prop_map(|(descs, ring, avail_idx, data)| HostileQueue { descs, ring, avail_idx, data })
}

/// A plausible virtio-net header (any flags, GSO types, checksum fields).
fn arb_hdr() -> impl Strategy<Value = [u8; HDR_LEN]> {
    (
        prop_oneof![Just(0u8), Just(VIRTIO_NET_HDR_F_NEEDS_CSUM), any::<u8>()],
        prop_oneof![4 => Just(0u8), 1 => any::<u8>()],
        prop_oneof![Just(0u16), Just(34), 0u16..2000, any::<u16>()],
        prop_oneof![Just(6u16), Just(16), 0u16..2000, any::<u16>()],
    )
        .prop_map(|(flags, gso_type, csum_start, csum_offset)| {
            NetHdr { flags, gso_type, csum_start, csum_offset, ..NetHdr::default() }.to_bytes()
        })
}

fn submit(d: &mut Driver, q: usize, h: &HostileQueue) {
    for (i, &(addr, len, flags, next)) in h.descs.iter().enumerate() {
        d.set_desc(q, i as u16, addr, len, flags, next);
    }
    let avail = d.queues[q].avail;
    for (i, &head) in h.ring.iter().enumerate() {
        d.write_bytes(avail + 4 + i as u64 * 2, &head.to_le_bytes());
    }
    d.set_avail_idx(q, h.avail_idx);
    d.kick(q);
    d.kick(q);
}

fn check_used(used: &[(u32, u32)], h: &HostileQueue) -> Result<(), TestCaseError> {
    prop_assert!(used.len() <= usize::from(h.avail_idx), "{} used of {} available", used.len(), h.avail_idx);
    for &(id, _) in used {
        prop_assert!(id < u32::from(QSIZE), "used id {id} is not a descriptor");
    }
    Ok(())
}

/// Random RX and TX queues (with frames waiting for the guest), then a
/// reset and a good frame. Fails on the first failing case (shrunk), and
/// if no case got a TX chain used or a frame sent.
#[test]
fn hostile_rings_never_break_the_device() {
    let totals = std::cell::Cell::new((0usize, 0u64, 0u64, 0u64));
    let mut runner =
        proptest::test_runner::TestRunner::new(ProptestConfig { cases: 3000, ..ProptestConfig::default() });
    runner
        .run(
            &(arb_queue(), arb_queue(), arb_hdr(), proptest::collection::vec(0usize..1600, 0..4), any::<u8>()),
            |(rx, mut tx, hdr, inject, features_pick)| {
                let features = match features_pick % 4 {
                    0 => FEATURES & !VIRTIO_NET_F_MRG_RXBUF,
                    1 => FEATURES & !VIRTIO_RING_F_EVENT_IDX,
                    _ => FEATURES,
                };
                let mut h = Harness::new(features, QSIZE);
                h.seen.lock().unwrap().inject.extend(inject.iter().map(|&n| frame(n)));
                // Half the cases: a plausible header and frame where most
                // TX buffers point.
                if tx.data.len() % 2 == 0 {
                    let mut plausible = hdr.to_vec();
                    plausible.extend(frame(tx.data.len().max(HDR_LEN) - HDR_LEN));
                    let n = plausible.len().min(tx.data.len());
                    tx.data[..n].copy_from_slice(&plausible[..n]);
                }
                h.d.write_bytes(DATA_BASE, &tx.data);
                submit(&mut h.d, RXQ, &rx);
                submit(&mut h.d, TXQ, &tx);
                h.d.transport.process_events();
                let used_rx = h.d.used(RXQ);
                let used_tx = h.d.used(TXQ);
                check_used(&used_rx, &rx)?;
                check_used(&used_tx, &tx)?;
                let s = h.stats();
                // Every TX chain returned was sent or counted as dropped
                // (one more may have been counted before a corrupt ring
                // broke the device).
                let counted = (s.tx_frames + s.tx_dropped) as usize;
                prop_assert!(
                    counted == used_tx.len() || (counted == used_tx.len() + 1 && h.d.needs_reset()),
                    "{s:?} for {} used",
                    used_tx.len()
                );
                prop_assert!(s.rx_frames + s.rx_dropped <= (inject.len() as u64) + s.tx_frames);
                let (c, sent, dropped, rx_frames) = totals.get();
                totals.set((c + used_tx.len(), sent + s.tx_frames, dropped + s.tx_dropped, rx_frames + s.rx_frames));
                h.d.init(2, FEATURES, QSIZE);
                prop_assert!(h.d.transport.is_active() && !h.d.needs_reset());
                h.post_rx(0, QSIZE, 2048);
                let f = frame(64);
                h.send(NetHdr::default(), &f, 1);
                // Frames still queued in the backend come first.
                let mut found = false;
                for _ in 0..8 {
                    if h.received().iter().any(|(_, g)| *g == f) {
                        found = true;
                        break;
                    }
                    h.recycle();
                    h.d.kick(RXQ);
                }
                prop_assert!(found, "the good frame did not come back");
                Ok(())
            },
        )
        .unwrap();
    let (chains, sent, dropped, rx_frames) = totals.get();
    eprintln!(
        "{chains} TX chains used: {sent} frames sent, {dropped} dropped; {rx_frames} delivered into hostile RX rings"
    );
    assert!(chains > 0 && sent > 0 && dropped > 0 && rx_frames > 0, "the generator missed a path");
}
