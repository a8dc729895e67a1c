//! The UDP NAT (everything but DNS to the resolver): one connected host UDP
//! socket per guest flow (a guest address and port to a destination),
//! admitted like a TCP connection, closed after [`UDP_IDLE_TIMEOUT`] with
//! no datagram either way. A refused flow is remembered for
//! [`REFUSED_FLOW_MEMORY`], so its further datagrams are dropped without a
//! log record each.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress, IpProtocol, Ipv4Packet, Ipv4Repr, UdpPacket, UdpRepr,
};
use vmm_sys_util::epoll::EventSet;

use super::admit::{admit, Ask, Meter};
use super::interest::Interest;
use super::link::Link;
use super::{Shared, Tuple};
use crate::dns::NameMap;
use crate::log::{Direction, Protocol};
use crate::{GATEWAY_MAC, MTU};

/// How long a UDP flow lives without a datagram either way.
pub const UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Refused UDP flows remembered, at most.
const MAX_REFUSED_FLOWS: usize = 1024;
/// How long a refused UDP flow is remembered (then judged again: the
/// policy may have changed).
const REFUSED_FLOW_MEMORY: Duration = Duration::from_secs(10);
/// The largest UDP payload in one frame to the guest (no fragmentation).
const MAX_UDP_PAYLOAD: usize = MTU - 20 - 8;
/// The scratch buffer of [`Udp`]: one datagram from a host socket (bytes).
pub(super) const SCRATCH_BYTES: usize = 65536;

/// One UDP flow and its connected host socket.
struct Flow {
    tuple: Tuple,
    guest_mac: [u8; 6],
    host: UdpSocket,
    interest: Interest,
    /// The host socket was reported readable and not yet read empty.
    readable: bool,
    meter: Meter,
    last_active: Instant,
}

/// The UDP flows of one stack.
pub(super) struct Udp {
    /// Flows by epoll token, and their tokens by addresses.
    flows: HashMap<u64, Flow>,
    by_tuple: HashMap<Tuple, u64>,
    /// Refused flows and when.
    refused: HashMap<Tuple, Instant>,
    /// One datagram from a host socket.
    buf: Vec<u8>,
    /// `SO_RCVBUF`/`SO_SNDBUF` asked for each host socket (bytes).
    host_buffer_bytes: usize,
}

impl Udp {
    /// No flows; host sockets asked for `host_buffer_bytes` of kernel
    /// buffer each way.
    pub(super) fn new(host_buffer_bytes: usize) -> Self {
        Self {
            flows: HashMap::new(),
            by_tuple: HashMap::new(),
            refused: HashMap::new(),
            buf: vec![0; SCRATCH_BYTES],
            host_buffer_bytes,
        }
    }

    /// Flows open now.
    pub(super) fn len(&self) -> usize {
        self.flows.len()
    }

    /// A datagram from the guest: into its flow, or a new flow if the
    /// policy and the cap allow it (`open`: connections and flows open now).
    pub(super) fn out(
        &mut self,
        tuple: Tuple,
        guest_mac: [u8; 6],
        payload: &[u8],
        shared: &mut Shared,
        names: &NameMap,
        open: usize,
    ) {
        if let Some(flow) = self.by_tuple.get(&tuple).and_then(|t| self.flows.get_mut(t)) {
            flow.last_active = Instant::now();
            if flow.host.send(payload).is_ok() {
                flow.meter.bytes_out += payload.len() as u64;
            }
            return;
        }
        if self.refused.contains_key(&tuple) {
            return;
        }
        let ask = Ask { protocol: Protocol::Udp, direction: Direction::Outbound, dst: tuple.dst, fixed: None };
        let control = shared.control.clone();
        let Some(admitted) = admit(ask, &control, names, shared.cap(open)) else {
            if self.refused.len() >= MAX_REFUSED_FLOWS {
                self.refused.clear();
            }
            self.refused.insert(tuple, Instant::now());
            return;
        };
        let target = SocketAddr::V4(SocketAddrV4::new(admitted.host_ip, tuple.dst.port()));
        let Some((host, mut meter)) = admitted.open(&shared.control, || connect(target, self.host_buffer_bytes)) else {
            return;
        };
        meter.bytes_out = host.send(payload).map(|n| n as u64).unwrap_or(0);
        let token = shared.token();
        let flow = Flow {
            tuple,
            guest_mac,
            host,
            interest: Interest::default(),
            readable: false,
            meter,
            last_active: Instant::now(),
        };
        self.flows.insert(token, flow);
        self.by_tuple.insert(tuple, token);
    }

    /// Marks flow `token`'s host socket readable; `false` if it is no flow.
    pub(super) fn ready(&mut self, token: u64) -> bool {
        match self.flows.get_mut(&token) {
            Some(flow) => {
                flow.readable = true;
                true
            }
            None => false,
        }
    }

    /// Datagrams from the host to the guest (while the guest's queue has
    /// room), interest, idle timeouts.
    pub(super) fn poll(&mut self, link: &mut Link, shared: &Shared) {
        let now = Instant::now();
        self.refused.retain(|_, t| now.saturating_duration_since(*t) < REFUSED_FLOW_MEMORY);
        let tokens: Vec<u64> = self.flows.keys().copied().collect();
        for token in tokens {
            let Some(flow) = self.flows.get_mut(&token) else {
                continue;
            };
            while flow.readable && !link.to_guest_full() {
                match flow.host.recv(&mut self.buf) {
                    Ok(n) => {
                        flow.last_active = now;
                        let Some(payload) = self.buf.get(..n).filter(|p| p.len() <= MAX_UDP_PAYLOAD) else {
                            continue;
                        };
                        flow.meter.bytes_in += n as u64;
                        let (mac, from, to) = (flow.guest_mac, flow.tuple.dst, flow.tuple.guest);
                        link.push_to_guest(|buf| frame(buf, mac, from, to, payload));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => flow.readable = false,
                    // An ICMP error for an earlier datagram, EINTR: go on.
                    Err(_) => {}
                }
            }
            if now.saturating_duration_since(flow.last_active) >= UDP_IDLE_TIMEOUT {
                self.close(token, shared);
                continue;
            }
            let want = if link.to_guest_full() {
                // Read again once the guest took frames (the eventfd).
                link.starve();
                EventSet::empty()
            } else if flow.readable {
                EventSet::empty()
            } else {
                EventSet::IN
            };
            flow.interest.set(&shared.epoll, flow.host.as_raw_fd(), token, want);
        }
    }

    /// When the flow idle longest times out.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.flows.values().map(|f| f.last_active).min().map(|t| t + UDP_IDLE_TIMEOUT)
    }

    /// Closes every flow and forgets refused ones.
    pub(super) fn reset(&mut self, shared: &Shared) {
        let tokens: Vec<u64> = self.flows.keys().copied().collect();
        for token in tokens {
            self.close(token, shared);
        }
        self.refused.clear();
    }

    fn close(&mut self, token: u64, shared: &Shared) {
        let Some(mut flow) = self.flows.remove(&token) else {
            return;
        };
        self.by_tuple.remove(&flow.tuple);
        flow.interest.clear(&shared.epoll, flow.host.as_raw_fd());
        flow.meter.close(&shared.control);
    }
}

/// A non-blocking host UDP socket connected to `target`, its kernel
/// buffers asked to be `buffer_bytes` each way.
fn connect(target: SocketAddr, buffer_bytes: usize) -> io::Result<UdpSocket> {
    let bind: SocketAddr =
        if target.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let socket = socket2::Socket::new(socket2::Domain::for_address(target), socket2::Type::DGRAM, None)?;
    socket.set_recv_buffer_size(buffer_bytes)?;
    socket.set_send_buffer_size(buffer_bytes)?;
    socket.bind(&bind.into())?;
    let socket = UdpSocket::from(socket);
    socket.set_nonblocking(true)?;
    socket.connect(target)?;
    Ok(socket)
}

/// Writes into `buf` a frame to the guest at `guest_mac` carrying a UDP
/// datagram from `src` to `dst` (RFC 768; checksums complete).
fn frame(buf: &mut Vec<u8>, guest_mac: [u8; 6], src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) {
    let caps = ChecksumCapabilities::default();
    let udp = UdpRepr { src_port: src.port(), dst_port: dst.port() };
    let ip = Ipv4Repr {
        src_addr: *src.ip(),
        dst_addr: *dst.ip(),
        next_header: IpProtocol::Udp,
        payload_len: 8 + payload.len(),
        hop_limit: 64,
    };
    buf.clear();
    buf.resize(14 + ip.buffer_len() + 8 + payload.len(), 0);
    let mut eth = EthernetFrame::new_unchecked(&mut buf[..]);
    eth.set_src_addr(EthernetAddress(GATEWAY_MAC));
    eth.set_dst_addr(EthernetAddress(guest_mac));
    eth.set_ethertype(EthernetProtocol::Ipv4);
    let mut ipp = Ipv4Packet::new_unchecked(eth.payload_mut());
    ip.emit(&mut ipp, &caps);
    let mut udpp = UdpPacket::new_unchecked(ipp.payload_mut());
    udp.emit(
        &mut udpp,
        &IpAddress::Ipv4(*src.ip()),
        &IpAddress::Ipv4(*dst.ip()),
        payload.len(),
        |b| b.copy_from_slice(payload),
        &caps,
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::control::NetControl;
    use crate::policy::{Egress, NetworkPolicy, ServerNetPolicy};
    use crate::{GATEWAY_ADDR, GUEST_ADDR, GUEST_MAC};

    fn shared(egress: Egress, max_connections: usize) -> Shared {
        let policy = NetworkPolicy { egress, allow: vec!["127.0.0.1/32".into()], deny: Vec::new() };
        let server =
            ServerNetPolicy { permit_ranges: vec!["127.0.0.0/8".parse().unwrap()], host_addrs: Default::default() };
        let control = NetControl::new(&policy, None, Arc::new(server), 64).unwrap();
        Shared::new(control, max_connections, None).unwrap()
    }

    fn tuple(dst: SocketAddrV4) -> Tuple {
        Tuple { guest: SocketAddrV4::new(GUEST_ADDR, 5000), dst }
    }

    /// A frame toward the guest as (source, destination, payload), its
    /// checksums verified.
    fn parse(frame: &[u8]) -> (SocketAddrV4, SocketAddrV4, Vec<u8>) {
        let eth = EthernetFrame::new_checked(frame).unwrap();
        assert_eq!(eth.dst_addr(), EthernetAddress(GUEST_MAC));
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        assert!(ip.verify_checksum());
        let udp = UdpPacket::new_checked(ip.payload()).unwrap();
        assert!(udp.verify_checksum(&IpAddress::Ipv4(ip.src_addr()), &IpAddress::Ipv4(ip.dst_addr())));
        (
            SocketAddrV4::new(ip.src_addr(), udp.src_port()),
            SocketAddrV4::new(ip.dst_addr(), udp.dst_port()),
            udp.payload().to_vec(),
        )
    }

    /// Polls until the guest's queue has a frame (at most 5 s).
    fn poll_for_frame(udp: &mut Udp, link: &mut Link, shared: &Shared) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            udp.poll(link, shared);
            if let Some(f) = link.front_to_guest() {
                return f.to_vec();
            }
            assert!(Instant::now() < deadline, "no datagram back");
            let mut events = vec![vmm_sys_util::epoll::EpollEvent::default(); 4];
            if let Ok(n) = shared.epoll.wait(100, &mut events) {
                for e in &events[..n] {
                    udp.ready(e.data());
                }
            }
        }
    }

    #[test]
    fn a_flow_carries_datagrams_both_ways_and_is_logged_once() {
        let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = echo.local_addr().unwrap().port();
        let mut shared = shared(Egress::Deny, 8);
        let mut udp = Udp::new(4096);
        let mut link = Link::new(8);
        let t = tuple(SocketAddrV4::new(GATEWAY_ADDR, port));
        udp.out(t, GUEST_MAC, b"ping", &mut shared, &NameMap::default(), 0);
        udp.out(t, GUEST_MAC, b"again", &mut shared, &NameMap::default(), 1);
        assert_eq!(udp.len(), 1);
        let mut buf = [0u8; 16];
        let (n, from) = echo.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"ping");
        let (n, _) = echo.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"again");
        echo.send_to(b"pong", from).unwrap();
        let f = poll_for_frame(&mut udp, &mut link, &shared);
        // The answer comes from the gateway's address and port, checksummed.
        assert_eq!(parse(&f), (t.dst, t.guest, b"pong".to_vec()));
        udp.reset(&shared);
        assert_eq!(udp.len(), 0);
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 1);
        assert_eq!((log[0].bytes_out, log[0].bytes_in), (9, 4));
        assert!(log[0].duration_ms.is_some());
    }

    #[test]
    fn a_refused_flow_is_logged_once_and_remembered() {
        let mut shared = shared(Egress::Deny, 8);
        let mut udp = Udp::new(4096);
        let t = tuple(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 9), 443));
        for _ in 0..3 {
            udp.out(t, GUEST_MAC, b"quic", &mut shared, &NameMap::default(), 0);
        }
        assert_eq!(udp.len(), 0);
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 1);
        assert!(!log[0].allowed);
    }

    #[test]
    fn the_cap_counts_tcp_and_udp_together() {
        let mut shared = shared(Egress::Allow, 2);
        let mut udp = Udp::new(4096);
        let t = tuple(SocketAddrV4::new(GATEWAY_ADDR, 9));
        udp.out(t, GUEST_MAC, b"x", &mut shared, &NameMap::default(), 2);
        assert_eq!(udp.len(), 0);
        assert_eq!(shared.stats.refused_by_cap, 1);
    }
}
