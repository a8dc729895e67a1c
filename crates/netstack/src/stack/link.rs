//! The guest's side of the NAT: the Ethernet link between the guest's
//! virtio-net device and the smoltcp interface.
//!
//! [`Link`] is the smoltcp [`Device`]: it queues the guest's frames until
//! the stack looks at them, hands the interface one frame at a time (the
//! stack admits a new connection just before its SYN goes in), and queues
//! the interface's frames toward the guest up to a bound, remembering when
//! the interface wanted to send more ([`Link::is_starved`]). [`peek`] is
//! the look the stack takes at a guest frame before the interface sees it.

use std::collections::VecDeque;
use std::net::SocketAddrV4;

use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::wire::{
    ArpOperation, ArpPacket, EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress, IpProtocol, Ipv4Packet,
    TcpPacket, UdpPacket,
};

use super::Tuple;
use crate::{DNS_ADDR, GATEWAY_ADDR, GATEWAY_MAC, MTU};

/// Bytes of frames queued each way, at most (besides the frame counts):
/// with a 64 KiB MTU, 256 full frames would be 16 MiB per sandbox.
pub(super) const MAX_QUEUED_BYTES: usize = 1 << 20;

/// Bytes of frame buffers kept for reuse, at most.
const MAX_SPARE_BYTES: usize = 256 * 1024;

/// The bytes a [`Link`] holds at most: each queue may pass
/// [`MAX_QUEUED_BYTES`] by one frame (the bound is checked before a
/// push), one frame waits in the slot, and the spare buffers.
pub(super) const BYTES_MAX: usize = 2 * (MAX_QUEUED_BYTES + super::MAX_FRAME) + super::MAX_FRAME + MAX_SPARE_BYTES;

/// Frames one way, with their total length in bytes.
#[derive(Default)]
struct Frames {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl Frames {
    fn push(&mut self, frame: Vec<u8>) {
        self.bytes += frame.len();
        self.frames.push_back(frame);
    }

    fn pop(&mut self) -> Option<Vec<u8>> {
        let frame = self.frames.pop_front()?;
        self.bytes -= frame.len();
        Some(frame)
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.bytes = 0;
    }

    /// Whether `frames` frames or [`MAX_QUEUED_BYTES`] bytes are queued.
    fn is_full(&self, frames: usize) -> bool {
        self.frames.len() >= frames || self.bytes >= MAX_QUEUED_BYTES
    }
}

/// Frame buffers kept for reuse, their capacity at most
/// [`MAX_SPARE_BYTES`] together.
#[derive(Default)]
struct Spare {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
}

impl Spare {
    /// A cleared buffer, reused when one is kept.
    fn take(&mut self) -> Vec<u8> {
        let Some(mut buf) = self.bufs.pop() else {
            return Vec::new();
        };
        self.bytes -= buf.capacity();
        buf.clear();
        buf
    }

    fn keep(&mut self, buf: Vec<u8>) {
        if self.bytes + buf.capacity() <= MAX_SPARE_BYTES {
            self.bytes += buf.capacity();
            self.bufs.push(buf);
        }
    }
}

/// Frames both ways between the guest and the interface.
pub(super) struct Link {
    /// Frames from the guest not yet looked at.
    from_guest: Frames,
    /// The one frame handed to the interface next.
    slot: Option<Vec<u8>>,
    /// Frames toward the guest.
    to_guest: Frames,
    max_to_guest: usize,
    max_from_guest: usize,
    /// Something wanted to send while `to_guest` was full.
    starved: bool,
    /// Frame buffers to reuse.
    spare: Spare,
}

impl Link {
    /// A link queueing at most `max_guest_frames` frames toward the guest
    /// (at least 1) and `max(max_guest_frames, 64)` from it, and at most
    /// [`MAX_QUEUED_BYTES`] each way.
    pub(super) fn new(max_guest_frames: usize) -> Self {
        Self {
            from_guest: Frames::default(),
            slot: None,
            to_guest: Frames::default(),
            max_to_guest: max_guest_frames.max(1),
            max_from_guest: max_guest_frames.max(64),
            starved: false,
            spare: Spare::default(),
        }
    }

    /// Queues a copy of a guest frame; `false`: the queue is full.
    pub(super) fn push_from_guest(&mut self, frame: &[u8]) -> bool {
        if self.from_guest.is_full(self.max_from_guest) {
            return false;
        }
        let mut buf = self.spare.take();
        buf.extend_from_slice(frame);
        self.from_guest.push(buf);
        true
    }

    /// The oldest guest frame not yet looked at, unless the queue toward
    /// the guest is full (a frame in may produce one out: an ACK, a RST,
    /// an ARP reply); then the link is starved if frames wait.
    pub(super) fn next_from_guest(&mut self) -> Option<Vec<u8>> {
        if self.to_guest_full() {
            if !self.from_guest.frames.is_empty() {
                self.starved = true;
            }
            return None;
        }
        self.from_guest.pop()
    }

    /// Puts `frame` where the interface's next receive takes it.
    pub(super) fn load(&mut self, frame: Vec<u8>) {
        if let Some(old) = self.slot.replace(frame) {
            self.recycle(old);
        }
    }

    /// Recycles the loaded frame if the interface did not take it.
    pub(super) fn unload(&mut self) {
        if let Some(buf) = self.slot.take() {
            self.recycle(buf);
        }
    }

    /// The next frame for the guest (not removed).
    pub(super) fn front_to_guest(&self) -> Option<&[u8]> {
        self.to_guest.frames.front().map(Vec::as_slice)
    }

    /// Removes the frame [`Link::front_to_guest`] returned; `true` when the
    /// link was starved and the queue is now at most half full (the stack
    /// has work again).
    pub(super) fn pop_to_guest(&mut self) -> bool {
        if let Some(buf) = self.to_guest.pop() {
            self.recycle(buf);
        }
        if self.starved
            && self.to_guest.frames.len() <= self.max_to_guest / 2
            && self.to_guest.bytes <= MAX_QUEUED_BYTES / 2
        {
            self.starved = false;
            return true;
        }
        false
    }

    /// Whether the queue toward the guest is full.
    pub(super) fn to_guest_full(&self) -> bool {
        self.to_guest.is_full(self.max_to_guest)
    }

    /// Queues a frame toward the guest built by `build` into a cleared
    /// buffer; `false` (and starved) if the queue is full.
    pub(super) fn push_to_guest(&mut self, build: impl FnOnce(&mut Vec<u8>)) -> bool {
        if self.to_guest_full() {
            self.starved = true;
            return false;
        }
        let mut buf = self.spare.take();
        build(&mut buf);
        self.to_guest.push(buf);
        true
    }

    /// Notes that something waits for room toward the guest.
    pub(super) fn starve(&mut self) {
        self.starved = true;
    }

    /// Whether something waits for room toward the guest.
    pub(super) fn is_starved(&self) -> bool {
        self.starved
    }

    /// Keeps a frame buffer for reuse (up to [`MAX_SPARE_BYTES`] of them).
    pub(super) fn recycle(&mut self, buf: Vec<u8>) {
        self.spare.keep(buf);
    }

    /// The bytes of the frames queued both ways now.
    pub(super) fn queued_bytes(&self) -> usize {
        self.from_guest.bytes + self.to_guest.bytes + self.slot.as_ref().map_or(0, Vec::len)
    }

    /// Drops every queued frame both ways.
    pub(super) fn clear(&mut self) {
        self.from_guest.clear();
        self.to_guest.clear();
        self.slot = None;
        self.starved = false;
    }
}

pub(super) struct RxTok(Vec<u8>);

pub(super) struct TxTok<'a> {
    queue: &'a mut Frames,
    spare: &'a mut Spare,
}

impl phy::RxToken for RxTok {
    fn consume<R, F>(self, f: F) -> R
    where
        F: FnOnce(&[u8]) -> R,
    {
        f(&self.0)
    }
}

impl phy::TxToken for TxTok<'_> {
    fn consume<R, F>(self, len: usize, f: F) -> R
    where
        F: FnOnce(&mut [u8]) -> R,
    {
        let mut buf = self.spare.take();
        buf.resize(len, 0);
        let r = f(&mut buf);
        self.queue.push(buf);
        r
    }
}

impl Device for Link {
    type RxToken<'a> = RxTok;
    type TxToken<'a> = TxTok<'a>;

    fn receive(&mut self, _timestamp: smoltcp::time::Instant) -> Option<(Self::RxToken<'_>, Self::TxToken<'_>)> {
        let frame = self.slot.take()?;
        Some((RxTok(frame), TxTok { queue: &mut self.to_guest, spare: &mut self.spare }))
    }

    fn transmit(&mut self, _timestamp: smoltcp::time::Instant) -> Option<Self::TxToken<'_>> {
        if self.to_guest_full() {
            self.starved = true;
            return None;
        }
        Some(TxTok { queue: &mut self.to_guest, spare: &mut self.spare })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MTU + 14;
        caps
    }
}

/// What a guest frame is, as far as the NAT cares.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Peek {
    /// A TCP segment of `Tuple`; `true` if it is a SYN without ACK whose
    /// checksums are right.
    Tcp(Tuple, bool),
    /// A UDP datagram (checksums verified) for the UDP NAT (not DNS):
    /// the guest's MAC, the payload's range in the frame.
    Udp(Tuple, [u8; 6], std::ops::Range<usize>),
    /// Not for anyone here: an ARP request for an address that is neither
    /// the gateway's nor the resolver's, a UDP datagram for another MAC,
    /// an ICMP echo request beyond the gateway.
    Ignore,
    /// Malformed: a UDP datagram with a bad checksum.
    Drop,
    /// For smoltcp as it is.
    Other,
}

/// Looks at a guest frame (bounds-checked, checksums verified for a SYN
/// and a UDP datagram).
pub(super) fn peek(frame: &[u8]) -> Peek {
    let Ok(eth) = EthernetFrame::new_checked(frame) else {
        return Peek::Other;
    };
    if eth.ethertype() == EthernetProtocol::Arp {
        // "Any IP" would make smoltcp answer ARP for every address.
        return match ArpPacket::new_checked(eth.payload()) {
            Ok(arp) if arp.operation() == ArpOperation::Request => {
                let target = arp.target_protocol_addr();
                if target == GATEWAY_ADDR.octets() || target == DNS_ADDR.octets() {
                    Peek::Other
                } else {
                    Peek::Ignore
                }
            }
            _ => Peek::Other,
        };
    }
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return Peek::Other;
    }
    let Ok(ip) = Ipv4Packet::new_checked(eth.payload()) else {
        return Peek::Other;
    };
    if ip.more_frags() || ip.frag_offset() != 0 {
        return Peek::Other;
    }
    let (src, dst) = (ip.src_addr(), ip.dst_addr());
    match ip.next_header() {
        IpProtocol::Tcp => {
            let Ok(tcp) = TcpPacket::new_checked(ip.payload()) else {
                return Peek::Other;
            };
            let tuple =
                Tuple { guest: SocketAddrV4::new(src, tcp.src_port()), dst: SocketAddrV4::new(dst, tcp.dst_port()) };
            let syn = tcp.syn()
                && !tcp.ack()
                && !tcp.rst()
                && ip.verify_checksum()
                && tcp.verify_checksum(&IpAddress::Ipv4(src), &IpAddress::Ipv4(dst));
            Peek::Tcp(tuple, syn)
        }
        IpProtocol::Udp => {
            let Ok(udp) = UdpPacket::new_checked(ip.payload()) else {
                return Peek::Other;
            };
            if dst == DNS_ADDR && udp.dst_port() == 53 {
                return Peek::Other;
            }
            if eth.dst_addr() != EthernetAddress(GATEWAY_MAC) {
                return Peek::Ignore;
            }
            if !ip.verify_checksum() || !udp.verify_checksum(&IpAddress::Ipv4(src), &IpAddress::Ipv4(dst)) {
                return Peek::Drop;
            }
            let tuple =
                Tuple { guest: SocketAddrV4::new(src, udp.src_port()), dst: SocketAddrV4::new(dst, udp.dst_port()) };
            // Ethernet header + IPv4 header + UDP header.
            let start = 14 + usize::from(ip.header_len()) + 8;
            let end = start + udp.payload().len();
            Peek::Udp(tuple, eth.src_addr().0, start..end)
        }
        IpProtocol::Icmp => {
            // smoltcp answers echo requests for every address ("any IP");
            // only the gateway's own addresses answer (echo is not
            // forwarded to the host).
            let echo = ip.payload().first() == Some(&8);
            if echo && dst != GATEWAY_ADDR && dst != DNS_ADDR {
                Peek::Ignore
            } else {
                Peek::Other
            }
        }
        _ => Peek::Other,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use smoltcp::phy::{ChecksumCapabilities, RxToken, TxToken};
    use smoltcp::wire::{
        ArpRepr, EthernetRepr, Icmpv4Packet, Icmpv4Repr, Ipv4Repr, TcpControl, TcpRepr, TcpSeqNumber, UdpRepr,
    };

    use super::*;
    use crate::{GUEST_ADDR, GUEST_MAC};

    const T0: smoltcp::time::Instant = smoltcp::time::Instant::ZERO;

    /// A guest frame: Ethernet to `dst_mac`, IPv4 from the guest to `dst`,
    /// the transport header and payload written by `emit`.
    fn ip_frame(
        dst_mac: [u8; 6],
        dst: Ipv4Addr,
        proto: IpProtocol,
        len: usize,
        emit: impl FnOnce(&mut [u8]),
    ) -> Vec<u8> {
        let ip = Ipv4Repr { src_addr: GUEST_ADDR, dst_addr: dst, next_header: proto, payload_len: len, hop_limit: 64 };
        let eth = EthernetRepr {
            src_addr: EthernetAddress(GUEST_MAC),
            dst_addr: EthernetAddress(dst_mac),
            ethertype: EthernetProtocol::Ipv4,
        };
        let mut buf = vec![0u8; 14 + ip.buffer_len() + len];
        let mut f = EthernetFrame::new_unchecked(&mut buf[..]);
        eth.emit(&mut f);
        let mut p = Ipv4Packet::new_unchecked(f.payload_mut());
        ip.emit(&mut p, &ChecksumCapabilities::default());
        emit(p.payload_mut());
        buf
    }

    fn tcp_frame(dst: SocketAddrV4, control: TcpControl, ack: bool) -> Vec<u8> {
        let repr = TcpRepr {
            src_port: 40000,
            dst_port: dst.port(),
            control,
            seq_number: TcpSeqNumber(1),
            ack_number: ack.then_some(TcpSeqNumber(1)),
            window_len: 1024,
            window_scale: None,
            max_seg_size: None,
            sack_permitted: false,
            sack_ranges: [None; 3],
            timestamp: None,
            payload: &[],
        };
        ip_frame(GATEWAY_MAC, *dst.ip(), IpProtocol::Tcp, repr.buffer_len(), |b| {
            repr.emit(
                &mut TcpPacket::new_unchecked(b),
                &IpAddress::Ipv4(GUEST_ADDR),
                &IpAddress::Ipv4(*dst.ip()),
                &ChecksumCapabilities::default(),
            );
        })
    }

    fn udp_frame(dst_mac: [u8; 6], dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
        let repr = UdpRepr { src_port: 40000, dst_port: dst.port() };
        ip_frame(dst_mac, *dst.ip(), IpProtocol::Udp, 8 + payload.len(), |b| {
            repr.emit(
                &mut UdpPacket::new_unchecked(b),
                &IpAddress::Ipv4(GUEST_ADDR),
                &IpAddress::Ipv4(*dst.ip()),
                payload.len(),
                |p| p.copy_from_slice(payload),
                &ChecksumCapabilities::default(),
            );
        })
    }

    fn arp_request(target: Ipv4Addr) -> Vec<u8> {
        let arp = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Request,
            source_hardware_addr: EthernetAddress(GUEST_MAC),
            source_protocol_addr: GUEST_ADDR,
            target_hardware_addr: EthernetAddress([0; 6]),
            target_protocol_addr: target,
        };
        let eth = EthernetRepr {
            src_addr: EthernetAddress(GUEST_MAC),
            dst_addr: EthernetAddress::BROADCAST,
            ethertype: EthernetProtocol::Arp,
        };
        let mut buf = vec![0u8; 14 + arp.buffer_len()];
        let mut f = EthernetFrame::new_unchecked(&mut buf[..]);
        eth.emit(&mut f);
        arp.emit(&mut ArpPacket::new_unchecked(f.payload_mut()));
        buf
    }

    fn echo_request(dst: Ipv4Addr) -> Vec<u8> {
        let repr = Icmpv4Repr::EchoRequest { ident: 1, seq_no: 1, data: b"ping" };
        ip_frame(GATEWAY_MAC, dst, IpProtocol::Icmp, repr.buffer_len(), |b| {
            repr.emit(&mut Icmpv4Packet::new_unchecked(b), &ChecksumCapabilities::default());
        })
    }

    fn tuple(dst: SocketAddrV4) -> Tuple {
        Tuple { guest: SocketAddrV4::new(GUEST_ADDR, 40000), dst }
    }

    #[test]
    fn peek_tells_a_checked_syn_from_other_segments() {
        let dst = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 443);
        assert_eq!(peek(&tcp_frame(dst, TcpControl::Syn, false)), Peek::Tcp(tuple(dst), true));
        assert_eq!(peek(&tcp_frame(dst, TcpControl::Syn, true)), Peek::Tcp(tuple(dst), false));
        assert_eq!(peek(&tcp_frame(dst, TcpControl::None, true)), Peek::Tcp(tuple(dst), false));
        let mut bad = tcp_frame(dst, TcpControl::Syn, false);
        let last = bad.len() - 1;
        bad[last] ^= 0xff; // the urgent pointer: only the checksum notices
        assert_eq!(peek(&bad), Peek::Tcp(tuple(dst), false));
    }

    #[test]
    fn peek_sends_udp_to_the_nat_the_resolver_or_nowhere() {
        let dst = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 443);
        let frame = udp_frame(GATEWAY_MAC, dst, b"quic");
        match peek(&frame) {
            Peek::Udp(t, mac, range) => {
                assert_eq!((t, mac), (tuple(dst), GUEST_MAC));
                assert_eq!(&frame[range], b"quic");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(peek(&udp_frame(GATEWAY_MAC, SocketAddrV4::new(DNS_ADDR, 53), b"q")), Peek::Other);
        assert_eq!(peek(&udp_frame([2, 0, 0, 0, 0, 9], dst, b"quic")), Peek::Ignore);
        let mut bad = frame.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        assert_eq!(peek(&bad), Peek::Drop);
    }

    #[test]
    fn peek_answers_arp_and_echo_only_for_the_gateway_addresses() {
        assert_eq!(peek(&arp_request(GATEWAY_ADDR)), Peek::Other);
        assert_eq!(peek(&arp_request(DNS_ADDR)), Peek::Other);
        assert_eq!(peek(&arp_request(Ipv4Addr::new(10, 0, 2, 99))), Peek::Ignore);
        assert_eq!(peek(&echo_request(GATEWAY_ADDR)), Peek::Other);
        assert_eq!(peek(&echo_request(Ipv4Addr::new(192, 0, 2, 1))), Peek::Ignore);
        assert_eq!(peek(&[0u8; 5]), Peek::Other);
    }

    #[test]
    fn the_queue_toward_the_guest_is_bounded_and_wakes_at_half() {
        let mut link = Link::new(4);
        for i in 0..4u8 {
            assert!(link.push_to_guest(|b| b.push(i)));
        }
        assert!(link.to_guest_full());
        assert!(!link.push_to_guest(|b| b.push(9)));
        assert!(link.is_starved());
        assert!(link.transmit(T0).is_none());
        // Taking frames wakes the stack once the queue is half empty.
        assert_eq!(link.front_to_guest(), Some(&[0u8][..]));
        assert!(!link.pop_to_guest());
        assert!(link.pop_to_guest());
        assert!(!link.is_starved());
        assert_eq!(link.front_to_guest(), Some(&[2u8][..]));
        // The interface's frames land behind the others.
        link.transmit(T0).unwrap().consume(3, |b| b.copy_from_slice(b"abc"));
        assert!(!link.pop_to_guest());
        assert!(!link.pop_to_guest());
        assert_eq!(link.front_to_guest(), Some(&b"abc"[..]));
    }

    #[test]
    fn guest_frames_wait_while_the_guest_cannot_take_answers() {
        let mut link = Link::new(1);
        for i in 0..64u8 {
            assert!(link.push_from_guest(&[i]));
        }
        assert!(!link.push_from_guest(&[64]), "64 frames from the guest at most");
        assert_eq!(link.next_from_guest(), Some(vec![0]));
        assert!(link.push_to_guest(|b| b.push(1)));
        assert_eq!(link.next_from_guest(), None);
        assert!(link.is_starved());
        assert!(link.pop_to_guest());
        assert_eq!(link.next_from_guest(), Some(vec![1]));
    }

    #[test]
    fn the_queues_are_bounded_in_bytes_too() {
        let big = 60 * 1024;
        let mut link = Link::new(256);
        let mut queued = 0;
        while link.push_to_guest(|b| b.resize(big, 0)) {
            queued += 1;
        }
        assert_eq!(queued, MAX_QUEUED_BYTES.div_ceil(big), "full at the byte bound, not at 256 frames");
        assert!(link.is_starved());
        while !link.pop_to_guest() {}
        assert!(link.to_guest.bytes <= MAX_QUEUED_BYTES / 2, "wakes at half the bytes");
        let mut from = 0;
        while link.push_from_guest(&vec![0; big]) {
            from += 1;
        }
        assert_eq!(from, MAX_QUEUED_BYTES.div_ceil(big));
        while link.front_to_guest().is_some() {
            link.pop_to_guest();
        }
        while let Some(buf) = link.next_from_guest() {
            link.recycle(buf);
        }
        assert!(link.spare.bytes > 0 && link.spare.bytes <= MAX_SPARE_BYTES, "some buffers kept, within the bound");
    }

    #[test]
    fn the_interface_receives_the_loaded_frame_once() {
        let mut link = Link::new(8);
        link.load(vec![1, 2, 3]);
        let (rx, tx) = link.receive(T0).unwrap();
        assert_eq!(rx.consume(<[u8]>::to_vec), vec![1, 2, 3]);
        tx.consume(2, |b| b.copy_from_slice(&[7, 7]));
        assert!(link.receive(T0).is_none());
        assert_eq!(link.front_to_guest(), Some(&[7u8, 7][..]));
        link.load(vec![4]);
        link.unload();
        assert!(link.receive(T0).is_none());
        link.clear();
        assert_eq!(link.front_to_guest(), None);
    }
}
