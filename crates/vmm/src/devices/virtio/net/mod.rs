//! virtio-net (virtio 1.2, section 5.1): the guest's Ethernet NIC, backed by
//! a [`NetBackend`] (in a VM: [`netstack::stack::NetStack`], the
//! user-space NAT).
//!
//! Queues: 0 receive (RX, frames for the guest), 1 transmit (TX); no
//! control queue, one queue pair. Every buffer starts with the 12-byte
//! `virtio_net_hdr` ([`NetHdr`], section 5.1.6; `num_buffers` is always
//! there with `VIRTIO_F_VERSION_1`). Features offered: the MAC address
//! ([`netstack::GUEST_MAC`]) and MTU ([`netstack::MTU`]) in the config
//! space, mergeable RX buffers (a frame spread over several RX chains when
//! one is too small), checksum offload both ways (the device completes
//! partial TX checksums, RFC 1071, and marks RX frames whose TCP/UDP
//! checksum it verified), and event index suppression. No segmentation
//! offload: the guest sends and receives frames of at most
//! [`MAX_FRAME_LEN`] bytes.
//!
//! A hostile guest: a TX frame that is too short, too long, segmented
//! (GSO), has device-writable buffers, a bad chain or a checksum field
//! outside the frame is dropped and counted ([`NetStats`]); an RX chain
//! that cannot hold a frame (read-only buffers, shorter than the header,
//! a bad chain) is returned empty and counted. Only a corrupt ring (an
//! available index more than a queue ahead, rings outside guest memory, a
//! head index past the table) marks the device broken.
//!
//! Flow: a TX notification drains the TX queue into
//! [`NetBackend::send_frame`] (a full backend leaves the rest in the ring,
//! retried on the backend's next readiness), runs [`NetBackend::poll`] and
//! delivers the backend's frames to the RX queue; an RX notification (new
//! buffers) delivers frames; the backend's fd ([`NetBackend::epoll_fd`])
//! readable runs poll, delivery and the pending TX.

pub mod csum;

use std::num::Wrapping;
use std::os::fd::RawFd;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::chain::{parse_chain, Segment};
use super::{
    Activation, Interrupt, VirtioDevice, VirtioError, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING,
    VIRTIO_RING_F_EVENT_IDX,
};
use crate::devices::persist::Persist;
use crate::guest_warn;
use crate::log_limit::LogLimiter;

/// virtio device ID of a network device.
pub const VIRTIO_ID_NET: u32 = 1;
/// Queue size offered (both queues).
pub const QUEUE_SIZE: u16 = 256;
/// Most descriptors in one chain.
pub const MAX_SEGMENTS: usize = 64;
/// Bytes of `struct virtio_net_hdr` (with `num_buffers`, section 5.1.6).
pub const HDR_LEN: usize = 12;
/// Bytes of an Ethernet II header: the shortest frame taken.
pub const ETH_HDR_LEN: usize = 14;
/// The longest frame (bytes, without the virtio header): the MTU plus
/// the Ethernet header.
pub const MAX_FRAME_LEN: usize = netstack::MTU + ETH_HDR_LEN;
/// The longest TX chain read (bytes, all descriptors together).
pub const MAX_CHAIN_BYTES: u64 = 64 * 1024;
/// The receive queue's index.
pub const RXQ: usize = 0;
/// The transmit queue's index.
pub const TXQ: usize = 1;
/// Rounds of TX drain + poll + RX delivery per event while the backend
/// keeps taking frames after a poll (bounds one event's work).
const MAX_TX_ROUNDS: usize = 16;

/// `VIRTIO_NET_F_CSUM` (bit 0): the device completes partial TX checksums.
pub const VIRTIO_NET_F_CSUM: u64 = 1 << 0;
/// `VIRTIO_NET_F_GUEST_CSUM` (bit 1): RX frames may carry `DATA_VALID`.
pub const VIRTIO_NET_F_GUEST_CSUM: u64 = 1 << 1;
/// `VIRTIO_NET_F_MTU` (bit 3): the config space's `mtu` is valid.
pub const VIRTIO_NET_F_MTU: u64 = 1 << 3;
/// `VIRTIO_NET_F_MAC` (bit 5): the config space's `mac` is valid.
pub const VIRTIO_NET_F_MAC: u64 = 1 << 5;
/// `VIRTIO_NET_F_MRG_RXBUF` (bit 15): a frame may span RX buffers.
pub const VIRTIO_NET_F_MRG_RXBUF: u64 = 1 << 15;
/// `VIRTIO_NET_HDR_F_NEEDS_CSUM`: the checksum at `csum_start +
/// csum_offset` holds only the pseudo-header's sum.
pub const VIRTIO_NET_HDR_F_NEEDS_CSUM: u8 = 1;
/// `VIRTIO_NET_HDR_F_DATA_VALID`: the device verified the checksum.
pub const VIRTIO_NET_HDR_F_DATA_VALID: u8 = 2;
/// `VIRTIO_NET_HDR_GSO_NONE`: not a segmentation offload frame.
pub const VIRTIO_NET_HDR_GSO_NONE: u8 = 0;
/// `VIRTIO_NET_S_LINK_UP`, the config space's `status`.
const VIRTIO_NET_S_LINK_UP: u16 = 1;

/// A network backend: where the guest's frames go and where its frames
/// come from. Frames are whole Ethernet II frames without the virtio
/// header. Runs on the VM's net thread (seccomp [`crate::seccomp::ThreadKind::Net`]).
pub trait NetBackend: Send {
    /// Takes one Ethernet frame the guest sent (no virtio_net_hdr). false = backend full, retry later
    /// (the device leaves the TX chain in the queue and retries after the
    /// next [`NetBackend::poll`] or when [`NetBackend::epoll_fd`] is
    /// readable; a backend that refuses a frame must make one of those
    /// free room).
    fn send_frame(&mut self, frame: &[u8]) -> bool;
    /// The next Ethernet frame for the guest, if any (not removed).
    fn peek_frame(&self) -> Option<&[u8]>;
    /// Removes the frame peek_frame returned.
    fn pop_frame(&mut self);
    /// Runs the stack: frames in, host sockets, timers. Called after a TX batch and on epoll_fd readiness.
    fn poll(&mut self);
    /// Readable when poll() has work (host sockets, timers). Level-triggered.
    /// The same fd for the backend's whole life (the event loop registers
    /// it once, when the VM starts; [`NetBackend::reset`] keeps it).
    fn epoll_fd(&self) -> Option<RawFd>;
    /// Drops every connection (after restore: nothing host-side survived).
    fn reset(&mut self);
}

impl NetBackend for netstack::stack::NetStack {
    fn send_frame(&mut self, frame: &[u8]) -> bool {
        netstack::stack::NetStack::send_frame(self, frame)
    }

    fn peek_frame(&self) -> Option<&[u8]> {
        netstack::stack::NetStack::peek_frame(self)
    }

    fn pop_frame(&mut self) {
        netstack::stack::NetStack::pop_frame(self)
    }

    fn poll(&mut self) {
        netstack::stack::NetStack::poll(self)
    }

    fn epoll_fd(&self) -> Option<RawFd> {
        Some(netstack::stack::NetStack::epoll_fd(self))
    }

    fn reset(&mut self) {
        netstack::stack::NetStack::reset(self)
    }
}

/// `struct virtio_net_hdr` (section 5.1.6), little-endian on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetHdr {
    /// `VIRTIO_NET_HDR_F_*`.
    pub flags: u8,
    /// `VIRTIO_NET_HDR_GSO_*`.
    pub gso_type: u8,
    /// Length of the headers (GSO; ignored here).
    pub hdr_len: u16,
    /// Segment size (GSO; ignored here).
    pub gso_size: u16,
    /// With `NEEDS_CSUM`: where checksumming starts (bytes from the
    /// frame's start).
    pub csum_start: u16,
    /// With `NEEDS_CSUM`: where the checksum goes (bytes from `csum_start`).
    pub csum_offset: u16,
    /// RX: how many buffers the frame spans.
    pub num_buffers: u16,
}

impl NetHdr {
    /// Decodes the 12 header bytes.
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        NetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
            num_buffers: u16_at(10),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        for (i, v) in
            [(2, self.hdr_len), (4, self.gso_size), (6, self.csum_start), (8, self.csum_offset), (10, self.num_buffers)]
        {
            b[i..i + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// Live counters of a virtio-net device (shared; see [`Net::counters`]).
#[derive(Debug, Default)]
pub struct NetCounters {
    tx_frames: AtomicU64,
    tx_bytes: AtomicU64,
    rx_frames: AtomicU64,
    rx_bytes: AtomicU64,
    tx_runt: AtomicU64,
    tx_oversized: AtomicU64,
    tx_gso: AtomicU64,
    tx_bad_csum: AtomicU64,
    tx_bad_chain: AtomicU64,
    rx_dropped: AtomicU64,
    rx_bad_buffers: AtomicU64,
}

/// A reading of [`NetCounters`]. Frames and bytes count Ethernet frames
/// without the virtio header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames the guest sent that the backend took.
    pub tx_frames: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// TX frames dropped, all reasons ([`NetStats::tx_runt`] ..
    /// [`NetStats::tx_bad_chain`] together).
    pub tx_dropped: u64,
    /// TX frames shorter than the virtio header plus an Ethernet header.
    pub tx_runt: u64,
    /// TX frames longer than [`MAX_FRAME_LEN`] (or chains longer than
    /// [`MAX_CHAIN_BYTES`]).
    pub tx_oversized: u64,
    /// TX frames with a `gso_type` other than `GSO_NONE`.
    pub tx_gso: u64,
    /// TX frames with `NEEDS_CSUM` and a checksum field outside the frame.
    pub tx_bad_csum: u64,
    /// TX chains that are malformed (a loop, outside guest memory, too
    /// many descriptors, device-writable buffers).
    pub tx_bad_chain: u64,
    /// Frames from the backend dropped (not an Ethernet frame of at most
    /// [`MAX_FRAME_LEN`] bytes).
    pub rx_dropped: u64,
    /// RX chains returned empty (malformed, read-only buffers, too small).
    pub rx_bad_buffers: u64,
}

impl NetCounters {
    /// The counters now.
    pub fn stats(&self) -> NetStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (runt, over, gso, csum, chain) =
            (g(&self.tx_runt), g(&self.tx_oversized), g(&self.tx_gso), g(&self.tx_bad_csum), g(&self.tx_bad_chain));
        NetStats {
            tx_frames: g(&self.tx_frames),
            tx_bytes: g(&self.tx_bytes),
            rx_frames: g(&self.rx_frames),
            rx_bytes: g(&self.rx_bytes),
            tx_dropped: runt + over + gso + csum + chain,
            tx_runt: runt,
            tx_oversized: over,
            tx_gso: gso,
            tx_bad_csum: csum,
            tx_bad_chain: chain,
            rx_dropped: g(&self.rx_dropped),
            rx_bad_buffers: g(&self.rx_bad_buffers),
        }
    }
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A virtio-net device.
pub struct Net {
    backend: Box<dyn NetBackend>,
    config: [u8; 12],
    queue_sizes: [u16; 2],
    running: Option<Running>,
    /// One TX chain's bytes (header + frame), reused.
    tx_buf: Vec<u8>,
    /// The backend refused a frame: TX is retried on its next readiness.
    tx_blocked: bool,
    counters: Arc<NetCounters>,
    /// Guest-triggered log lines (shared per VM).
    log: Arc<LogLimiter>,
}

struct Running {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    interrupt: Arc<Interrupt>,
    features: u64,
}

impl Net {
    /// A device whose frames go to and come from `backend`, with MAC
    /// address [`netstack::GUEST_MAC`] and MTU [`netstack::MTU`].
    pub fn new(backend: Box<dyn NetBackend>) -> Self {
        let mut config = [0u8; 12];
        config[..6].copy_from_slice(&netstack::GUEST_MAC);
        config[6..8].copy_from_slice(&VIRTIO_NET_S_LINK_UP.to_le_bytes());
        config[8..10].copy_from_slice(&1u16.to_le_bytes());
        config[10..12].copy_from_slice(&(netstack::MTU as u16).to_le_bytes());
        Net {
            backend,
            config,
            queue_sizes: [QUEUE_SIZE; 2],
            running: None,
            tx_buf: vec![0; HDR_LEN + MAX_FRAME_LEN],
            tx_blocked: false,
            counters: Arc::new(NetCounters::default()),
            log: Arc::new(LogLimiter::default()),
        }
    }

    /// The device's counters (shared, live).
    pub fn counters(&self) -> Arc<NetCounters> {
        self.counters.clone()
    }

    /// TX, then the backend, then RX, while the backend keeps taking
    /// frames it refused before the poll.
    fn process_tx(&mut self) -> Result<(), VirtioError> {
        for round in 0..MAX_TX_ROUNDS {
            let (sent, blocked) = self.drain_tx()?;
            self.backend.poll();
            self.deliver_rx()?;
            self.tx_blocked = blocked;
            // Blocked: the poll may have made room; try again, unless the
            // last try after a poll took nothing.
            if !blocked || (sent == 0 && round > 0) {
                break;
            }
        }
        Ok(())
    }

    /// Hands the TX queue's frames to the backend until it is empty or the
    /// backend is full (that chain stays in the ring). Returns (frames
    /// sent, backend full).
    fn drain_tx(&mut self) -> Result<(u64, bool), VirtioError> {
        let Net { backend, running, tx_buf, counters, log, .. } = self;
        let Some(Running { mem, queues, interrupt, .. }) = running.as_mut() else { return Ok((0, false)) };
        let mem = &*mem;
        let q = &mut queues[TXQ];
        let broken = |reason: String| VirtioError::Broken { device: "virtio-net", reason };
        let (mut sent, mut blocked, mut used_any) = (0u64, false, false);
        'ring: loop {
            q.disable_notification(mem).map_err(|e| broken(format!("TX available ring: {e}")))?;
            loop {
                let mut iter = q.iter(mem).map_err(|e| broken(format!("TX available ring: {e}")))?;
                let Some(chain) = iter.next() else { break };
                let head = chain.head_index();
                if let Some(len) = read_tx_frame(mem, chain, tx_buf, counters, log) {
                    if !backend.send_frame(&tx_buf[HDR_LEN..HDR_LEN + len]) {
                        q.go_to_previous_position();
                        blocked = true;
                        break 'ring;
                    }
                    sent += 1;
                    bump(&counters.tx_frames, 1);
                    bump(&counters.tx_bytes, len as u64);
                }
                q.add_used(mem, head, 0).map_err(|e| broken(format!("TX used ring: {e}")))?;
                used_any = true;
            }
            if !q.enable_notification(mem).map_err(|e| broken(format!("TX available ring: {e}")))? {
                break;
            }
        }
        if used_any && q.needs_notification(mem).map_err(|e| broken(format!("TX used event: {e}")))? {
            interrupt.trigger(VIRTIO_MMIO_INT_VRING);
        }
        Ok((sent, blocked))
    }

    /// Delivers the backend's frames into the RX queue while it has
    /// buffers for them.
    fn deliver_rx(&mut self) -> Result<(), VirtioError> {
        let Net { backend, running, counters, log, .. } = self;
        let Some(Running { mem, queues, interrupt, features }) = running.as_mut() else { return Ok(()) };
        let mut rx = RxRing::new(&mut queues[RXQ], mem);
        let mergeable = *features & VIRTIO_NET_F_MRG_RXBUF != 0;
        let guest_csum = *features & VIRTIO_NET_F_GUEST_CSUM != 0;
        let mut chains: Vec<(u16, Vec<Segment>, usize)> = Vec::new();
        'frames: while let Some(frame) = backend.peek_frame() {
            if !(ETH_HDR_LEN..=MAX_FRAME_LEN).contains(&frame.len()) {
                tracing::debug!("virtio-net: the backend gave a {}-byte frame; dropped", frame.len());
                bump(&counters.rx_dropped, 1);
                backend.pop_frame();
                continue;
            }
            let need = HDR_LEN + frame.len();
            chains.clear();
            let mut room = 0usize;
            while room < need {
                let Some((head, parsed)) = rx.pop()? else {
                    // Out of buffers: give back what was taken for this
                    // frame and wait for the guest to add more.
                    let seen = Wrapping(rx.q.next_avail());
                    rx.give_back(chains.len());
                    if rx.wait_for_buffers(seen)? {
                        continue 'frames;
                    }
                    break 'frames;
                };
                let usable = parsed.and_then(|segs| {
                    let r: usize = segs.iter().map(|s| s.len as usize).sum();
                    let fits = if mergeable { r >= HDR_LEN } else { r >= need };
                    (fits && segs.iter().all(|s| s.writable)).then_some((segs, r))
                });
                match usable {
                    Some((segs, r)) => {
                        chains.push((head, segs, r));
                        room += r;
                    }
                    None => {
                        guest_warn!(
                            log,
                            "virtio-net: RX buffer {head} is malformed, read-only or too small; returned empty"
                        );
                        bump(&counters.rx_bad_buffers, 1);
                        // The frame starts over in the following buffers;
                        // the ones taken for it go back empty.
                        let mut empty: Vec<(u16, u32)> = chains.drain(..).map(|(h, _, _)| (h, 0)).collect();
                        empty.push((head, 0));
                        rx.put_used(&empty)?;
                        room = 0;
                    }
                }
            }
            let verified = guest_csum && csum::l4_checksum_valid(frame);
            let hdr = NetHdr {
                flags: if verified { VIRTIO_NET_HDR_F_DATA_VALID } else { 0 },
                num_buffers: chains.len() as u16,
                ..NetHdr::default()
            }
            .to_bytes();
            let mut used = Vec::with_capacity(chains.len());
            let mut pos = 0usize; // bytes of header + frame written so far
            for (head, segs, r) in &chains {
                let take = (*r).min(need - pos);
                let mut w = 0;
                if pos == 0 {
                    w += scatter(mem, segs, 0, &hdr);
                    w += scatter(mem, segs, HDR_LEN, &frame[..take - HDR_LEN]);
                } else {
                    let from = pos - HDR_LEN;
                    w += scatter(mem, segs, 0, &frame[from..from + take]);
                }
                used.push((*head, w as u32));
                pos += take;
            }
            rx.put_used(&used)?;
            bump(&counters.rx_frames, 1);
            bump(&counters.rx_bytes, frame.len() as u64);
            backend.pop_frame();
        }
        if rx.needs_notification()? {
            interrupt.trigger(VIRTIO_MMIO_INT_VRING);
        }
        Ok(())
    }
}

/// Reads one TX chain (header + frame) into `buf` and checks it; returns
/// the frame's length (the frame is `buf[HDR_LEN..HDR_LEN + len]`, its
/// checksum completed), or `None` if it was dropped (counted).
fn read_tx_frame(
    mem: &GuestMemoryMmap,
    chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    buf: &mut [u8],
    counters: &NetCounters,
    log: &LogLimiter,
) -> Option<usize> {
    let drop = |counter: &AtomicU64, why: &str| {
        guest_warn!(log, "virtio-net: TX {why}; frame dropped");
        bump(counter, 1);
        None
    };
    let parsed = match parse_chain(mem, chain, MAX_SEGMENTS) {
        Ok(p) => p,
        Err(e) => return drop(&counters.tx_bad_chain, &e.to_string()),
    };
    if parsed.segments.iter().any(|s| s.writable) {
        return drop(&counters.tx_bad_chain, "chain has device-writable buffers");
    }
    let total: u64 = parsed.segments.iter().map(|s| u64::from(s.len)).sum();
    if total > MAX_CHAIN_BYTES || total > (HDR_LEN + MAX_FRAME_LEN) as u64 {
        return drop(&counters.tx_oversized, &format!("chain of {total} bytes is longer than a frame"));
    }
    let total = total as usize;
    if total < HDR_LEN + ETH_HDR_LEN {
        return drop(&counters.tx_runt, &format!("chain of {total} bytes is shorter than a frame"));
    }
    let Some(buf) = buf.get_mut(..total) else { return drop(&counters.tx_oversized, "frame too long") };
    if gather(mem, &parsed.segments, buf) != total {
        return drop(&counters.tx_bad_chain, "chain could not be read");
    }
    let (hdr, frame) = buf.split_at_mut(HDR_LEN);
    let mut raw = [0u8; HDR_LEN];
    raw.copy_from_slice(hdr);
    let hdr = NetHdr::from_bytes(&raw);
    if hdr.gso_type != VIRTIO_NET_HDR_GSO_NONE {
        return drop(&counters.tx_gso, &format!("gso_type {} (no segmentation offload was offered)", hdr.gso_type));
    }
    if hdr.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 {
        if let Err(e) = csum::complete_partial(frame, hdr.csum_start, hdr.csum_offset) {
            return drop(&counters.tx_bad_csum, &e.to_string());
        }
    }
    Some(frame.len())
}

/// Copies the chain's (readable) segments into `out`; returns how many
/// bytes were read.
fn gather(mem: &GuestMemoryMmap, segs: &[Segment], out: &mut [u8]) -> usize {
    let mut done = 0;
    for s in segs {
        let n = (s.len as usize).min(out.len() - done);
        if n > 0 && mem.read_slice(&mut out[done..done + n], s.addr).is_err() {
            return done;
        }
        done += n;
    }
    done
}

/// Writes `data` across the chain's segments from byte `skip`; returns
/// how many bytes fit.
fn scatter(mem: &GuestMemoryMmap, segs: &[Segment], mut skip: usize, data: &[u8]) -> usize {
    let mut done = 0;
    for s in segs {
        if done == data.len() {
            break;
        }
        let len = s.len as usize;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(data.len() - done);
        if mem.write_slice(&data[done..done + n], GuestAddress(s.addr.0 + skip as u64)).is_err() {
            return done;
        }
        done += n;
        skip = 0;
    }
    done
}

/// An RX chain taken: its head and its segments (`None`: malformed, to be
/// returned empty).
type RxChain = (u16, Option<Vec<Segment>>);

/// The RX queue during one delivery: chains are taken one by one, and the
/// used entries of one frame are published together (a driver that
/// polls the used ring must never see part of a multi-buffer frame,
/// section 5.1.6.4), so this keeps its own used index and interrupt
/// suppression (section 2.7.10) rather than virtio-queue's per-entry
/// `add_used`.
struct RxRing<'a> {
    q: &'a mut Queue,
    mem: &'a GuestMemoryMmap,
    /// The used index when the delivery started.
    old_used: Wrapping<u16>,
}

impl<'a> RxRing<'a> {
    fn new(q: &'a mut Queue, mem: &'a GuestMemoryMmap) -> Self {
        let old_used = Wrapping(q.next_used());
        RxRing { q, mem, old_used }
    }

    fn broken(reason: String) -> VirtioError {
        VirtioError::Broken { device: "virtio-net", reason }
    }

    /// The next available chain, parsed (see [`RxChain`]); `None` if the
    /// guest has no buffer.
    fn pop(&mut self) -> Result<Option<RxChain>, VirtioError> {
        let mem = self.mem;
        let mut iter = self.q.iter(mem).map_err(|e| Self::broken(format!("RX available ring: {e}")))?;
        let Some(chain) = iter.next() else { return Ok(None) };
        let head = chain.head_index();
        if head >= self.q.size() {
            return Err(Self::broken(format!("RX available ring names descriptor {head} of {}", self.q.size())));
        }
        Ok(Some((head, parse_chain(mem, chain, MAX_SEGMENTS).ok().map(|p| p.segments))))
    }

    /// Puts the last `n` chains taken back in the available ring.
    fn give_back(&mut self, n: usize) {
        for _ in 0..n {
            self.q.go_to_previous_position();
        }
    }

    /// Asks the driver to notify when it adds a buffer past `seen` (the
    /// available index when the buffers ran out), then re-checks: true if
    /// one raced in. With `VIRTIO_RING_F_EVENT_IDX`, `avail_event` is set
    /// to `seen`, not to the next chain to take: chains given back are
    /// still available, and it is the next one added that is waited for.
    fn wait_for_buffers(&mut self, seen: Wrapping<u16>) -> Result<bool, VirtioError> {
        let (q, mem) = (&mut *self.q, self.mem);
        q.enable_notification(mem).map_err(|e| Self::broken(format!("RX available ring: {e}")))?;
        if q.event_idx_enabled() {
            let at = q
                .used_ring()
                .checked_add(4 + 8 * u64::from(q.size()))
                .ok_or_else(|| Self::broken("RX used ring address overflows".into()))?;
            mem.write_obj(seen.0, GuestAddress(at)).map_err(|e| Self::broken(format!("RX avail_event: {e}")))?;
        }
        fence(Ordering::SeqCst);
        let now = q.avail_idx(mem, Ordering::Acquire).map_err(|e| Self::broken(format!("RX available ring: {e}")))?;
        Ok(now != seen)
    }

    /// Publishes used entries `(head, len)` at once.
    fn put_used(&mut self, entries: &[(u16, u32)]) -> Result<(), VirtioError> {
        let (q, mem) = (&mut *self.q, self.mem);
        let size = q.size();
        let used = q.used_ring();
        let start = Wrapping(q.next_used());
        for (i, &(head, len)) in entries.iter().enumerate() {
            let slot = (start + Wrapping(i as u16)).0 % size;
            let at = used
                .checked_add(4 + 8 * u64::from(slot))
                .ok_or_else(|| Self::broken("RX used ring address overflows".into()))?;
            mem.write_obj(u32::from(head), GuestAddress(at))
                .and_then(|()| mem.write_obj(len, GuestAddress(at + 4)))
                .map_err(|e| Self::broken(format!("RX used ring: {e}")))?;
        }
        let new = start + Wrapping(entries.len() as u16);
        fence(Ordering::Release);
        mem.store(new.0.to_le(), GuestAddress(used + 2), Ordering::Release)
            .map_err(|e| Self::broken(format!("RX used ring: {e}")))?;
        q.set_next_used(new.0);
        Ok(())
    }

    /// Whether the driver wants an interrupt for the entries published
    /// since [`RxRing::new`] (section 2.7.10: with event index, when
    /// `used_event` lies among them).
    fn needs_notification(&mut self) -> Result<bool, VirtioError> {
        let new = Wrapping(self.q.next_used());
        if new == self.old_used {
            return Ok(false);
        }
        if !self.q.event_idx_enabled() {
            return Ok(true);
        }
        fence(Ordering::SeqCst);
        let at = self
            .q
            .avail_ring()
            .checked_add(4 + 2 * u64::from(self.q.size()))
            .ok_or_else(|| Self::broken("RX available ring address overflows".into()))?;
        let used_event: u16 =
            self.mem.read_obj(GuestAddress(at)).map_err(|e| Self::broken(format!("RX used_event: {e}")))?;
        Ok(new - Wrapping(used_event) - Wrapping(1) < new - self.old_used)
    }
}

/// The persisted state of a virtio-net device: empty. Its virtqueues are
/// saved by its transport ([`super::mmio::TransportState`], through
/// [`VirtioDevice::queue_states`]); its backend's connections are host
/// sockets, which do not survive a restore: a restored device gets a new
/// backend and resets it ([`VirtioDevice::after_restore`]), so the guest's
/// old TCP connections get resets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {}

/// What restoring a virtio-net device needs: its new backend.
pub struct NetArgs {
    /// The backend (a new one: nothing host-side is shared with the saved VM).
    pub backend: Box<dyn NetBackend>,
}

impl Persist<'_> for Net {
    type State = NetState;
    type ConstructorArgs = NetArgs;
    type Error = std::convert::Infallible;

    fn save(&self) -> NetState {
        NetState {}
    }

    /// A new device on `args.backend` ([`Net::new`]); the transport's
    /// restore then activates it on the saved virtqueues.
    fn restore(args: NetArgs, _state: &NetState) -> Result<Self, std::convert::Infallible> {
        Ok(Net::new(args.backend))
    }
}

impl VirtioDevice for Net {
    fn name(&self) -> &'static str {
        "virtio-net"
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_EVENT_IDX
            | VIRTIO_NET_F_CSUM
            | VIRTIO_NET_F_GUEST_CSUM
            | VIRTIO_NET_F_MTU
            | VIRTIO_NET_F_MAC
            | VIRTIO_NET_F_MRG_RXBUF
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!("virtio-net: config write at {offset:#x} ignored (read-only fields)");
    }

    fn activate(&mut self, activation: Activation, interrupt: Arc<Interrupt>) -> Result<(), VirtioError> {
        if activation.queues.len() != 2 || activation.queues.iter().any(|q| !q.ready()) {
            return Err(VirtioError::Activate {
                device: "virtio-net",
                reason: "the RX and TX queues must both be ready".into(),
            });
        }
        self.running = Some(Running {
            mem: activation.mem,
            queues: activation.queues,
            interrupt,
            features: activation.acked_features,
        });
        self.tx_blocked = false;
        Ok(())
    }

    /// Drops the queues. The backend keeps its connections (a driver reset
    /// is not a link loss: the guest's sockets outlive it); frames for the
    /// guest wait in the backend until the device runs again.
    fn reset(&mut self) {
        self.running = None;
        self.tx_blocked = false;
    }

    fn set_log_limiter(&mut self, log: Arc<LogLimiter>) {
        self.log = log;
    }

    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        self.running.as_ref().map(|r| r.queues.iter().map(|q| q.state()).collect())
    }

    fn process_queue(&mut self, index: usize) -> Result<(), VirtioError> {
        match index {
            TXQ => self.process_tx(),
            RXQ if self.tx_blocked => self.process_tx(),
            RXQ => self.deliver_rx(),
            _ => Ok(()),
        }
    }

    fn epoll_fd(&self) -> Option<RawFd> {
        self.backend.epoll_fd()
    }

    fn process_events(&mut self) -> Result<(), VirtioError> {
        if self.tx_blocked {
            return self.process_tx();
        }
        self.backend.poll();
        self.deliver_rx()
    }

    fn after_restore(&mut self) -> Result<(), VirtioError> {
        self.backend.reset();
        self.tx_blocked = false;
        Ok(())
    }
}
