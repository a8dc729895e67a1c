//! The NAT on smoltcp: guest Ethernet frames in and out, host sockets
//! behind.
//!
//! One smoltcp [`Interface`] (Medium::Ethernet, [`GATEWAY_MAC`], addresses
//! [`GATEWAY_ADDR`]/24 and [`DNS_ADDR`]/24, "any IP" with a default route
//! via [`GATEWAY_ADDR`]) takes every frame the guest sends, whatever the
//! destination address. Each guest frame is looked at before the interface
//! sees it: a TCP SYN (RFC 9293 §3.5) for a 4-tuple that has no connection
//! yet is judged by the policy; a refused one gets no listener, so smoltcp
//! answers with a RST. An allowed one gets a smoltcp TCP socket listening
//! on exactly that destination (its SYN-ACK held back until the host
//! connection is up) and a non-blocking host TCP socket connecting to the
//! destination (to 127.0.0.1 for [`GATEWAY_ADDR`]). The two are spliced
//! both ways through the smoltcp socket buffers
//! ([`StackConfig::tcp_buffer_bytes`] each way): no copy in between, a full
//! buffer stops the reads of the other side (host socket interest or TCP
//! window). FIN and RST pass both ways.
//!
//! With domain rules in the policy, a connection's first guest bytes are
//! held until [`crate::sniff::sniff`] finds the TLS SNI or HTTP `Host` (or
//! none, or [`SNIFF_WAIT`] passed); a denied name resets both sides.
//!
//! UDP (other than DNS) gets one connected host UDP socket per flow, judged
//! like a TCP connection, closed after [`UDP_IDLE_TIMEOUT`]. UDP and TCP to
//! [`DNS_ADDR`]:53 go to the resolver ([`crate::dns`]; TCP is passed to the
//! first upstream, query by query). ICMP echo is answered for
//! [`GATEWAY_ADDR`] and [`DNS_ADDR`] only (not forwarded). TCP connections
//! and UDP flows count against [`StackConfig::max_connections`].
//!
//! Frames toward the guest are bounded by
//! [`StackConfig::max_guest_frames`]; when that queue is full nothing more
//! is read from host sockets or from the guest until the device takes
//! frames ([`NetStack::pop_frame`] wakes the epoll set through an eventfd).
//! Guest frames must carry complete checksums (no offload).
//!
//! Everything host-side (the host sockets, a timerfd for smoltcp's timers,
//! an eventfd for "the guest took frames") is in one epoll set,
//! [`NetStack::epoll_fd`]; interest in a host socket is only registered
//! while it is wanted, so a level-triggered fd never spins.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::socket::tcp;
use smoltcp::wire::{
    ArpOperation, ArpPacket, EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress, IpCidr, IpListenEndpoint,
    IpProtocol, Ipv4Packet, Ipv4Repr, TcpPacket, UdpPacket, UdpRepr,
};
use socket2::{Domain, SockAddr, Socket, Type};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

use crate::control::NetControl;
pub use crate::dns::resolv_conf_upstreams;
use crate::dns::Resolver;
use crate::log::{NetRecord, Protocol};
use crate::policy::Verdict;
use crate::sniff::{sniff, Sniffed, MAX_SNIFF_BYTES};
use crate::{DNS_ADDR, GATEWAY_ADDR, GATEWAY_MAC, MTU, PREFIX_LEN};

/// Server-level settings of every sandbox's stack.
#[derive(Clone, Debug)]
pub struct StackConfig {
    /// Where DNS queries are forwarded (default: the `nameserver` lines of
    /// `/etc/resolv.conf`, port 53).
    pub dns_upstreams: Vec<SocketAddr>,
    /// Names the gateway's DNS answers itself (A records), before asking
    /// upstream: for operators and tests.
    pub static_hosts: BTreeMap<String, IpAddr>,
    /// Open TCP connections plus UDP flows per sandbox, at most.
    pub max_connections: usize,
    /// Buffer per direction per connection (bytes).
    pub tcp_buffer_bytes: usize,
    /// Frames queued toward the guest, at most.
    pub max_guest_frames: usize,
}

impl Default for StackConfig {
    /// Upstreams from `/etc/resolv.conf`, no static hosts, 256 connections,
    /// 256 KiB per direction, 256 frames toward the guest.
    fn default() -> Self {
        Self {
            dns_upstreams: resolv_conf_upstreams(),
            static_hosts: BTreeMap::new(),
            max_connections: 256,
            tcp_buffer_bytes: 256 * 1024,
            max_guest_frames: 256,
        }
    }
}

/// Errors of the stack's set-up.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// epoll, timerfd or a socket could not be created.
    #[error("network stack set-up failed: {0}")]
    Setup(#[source] std::io::Error),
    /// The resolver could not be set up.
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsError),
}

/// Counters of one stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackStats {
    /// TCP connections plus UDP flows open now.
    pub open_connections: usize,
    /// Connections refused because of `max_connections`.
    pub refused_by_cap: u64,
    /// Guest frames dropped (malformed or over a limit).
    pub frames_dropped: u64,
}

/// The largest Ethernet frame taken from the guest: MTU + 14-byte header
/// + a 4-byte 802.1Q tag.
pub const MAX_FRAME: usize = MTU + 14 + 4;
/// The smallest: an Ethernet header.
pub const MIN_FRAME: usize = 14;
/// The rule of a log record for a connection refused by
/// [`StackConfig::max_connections`].
pub const RULE_LIMIT_CONNECTIONS: &str = "limit:connections";
/// The rule of a log record for DNS over TCP to the resolver (refused
/// when there is no upstream; each query is judged by name).
pub const RULE_DNS_TCP: &str = "dns:tcp";
/// smoltcp aborts a connection whose guest does not acknowledge data for
/// this long.
const GUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the first bytes of a connection are held for sniffing at most
/// (a protocol that is neither TLS nor HTTP may send a few bytes and wait
/// for an answer); then they go on as if no name were in them.
pub const SNIFF_WAIT: Duration = Duration::from_secs(1);

const TOKEN_TIMER: u64 = 0;
const TOKEN_WAKE: u64 = 1;
const TOKEN_DNS: u64 = 2;
const TOKEN_CONN_BASE: u64 = 16;

/// A guest TCP connection's addresses (IPv4 only, like the guest link).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Tuple {
    guest: SocketAddrV4,
    dst: SocketAddrV4,
}

/// The link between the guest and the interface: frames both ways.
struct Link {
    /// Frames from the guest not yet looked at.
    from_guest: VecDeque<Vec<u8>>,
    /// The one frame handed to the interface next.
    slot: Option<Vec<u8>>,
    /// Frames toward the guest.
    to_guest: VecDeque<Vec<u8>>,
    max_to_guest: usize,
    max_from_guest: usize,
    /// The interface wanted to send while `to_guest` was full.
    starved: bool,
    /// Frame buffers to reuse.
    spare: Vec<Vec<u8>>,
}

impl Link {
    /// Keeps a frame buffer for reuse (a few at most).
    fn recycle(&mut self, buf: Vec<u8>) {
        if self.spare.len() < 64 {
            self.spare.push(buf);
        }
    }
}

struct RxTok(Vec<u8>);
struct TxTok<'a> {
    queue: &'a mut VecDeque<Vec<u8>>,
    spare: &'a mut Vec<Vec<u8>>,
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
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(len, 0);
        let r = f(&mut buf);
        self.queue.push_back(buf);
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
        if self.to_guest.len() >= self.max_to_guest {
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

/// One guest TCP connection and its host socket.
struct Conn {
    tuple: Tuple,
    handle: SocketHandle,
    /// `None` once closed (after an abort).
    host: Option<Socket>,
    /// The host connect finished.
    connected: bool,
    /// The guest's first bytes must still be sniffed before forwarding.
    sniffing: bool,
    /// The host sent its FIN (read returned 0); the guest got `close()`.
    host_eof: bool,
    /// The guest's FIN was passed on (`shutdown(Write)` on the host).
    guest_eof: bool,
    /// DNS over TCP to the resolver: guest bytes go on only as whole
    /// messages (RFC 7766 §8: a 2-byte length, then the message), each
    /// query judged by its name.
    dns_tcp: bool,
    /// Guest bytes judged and not yet passed on (DNS over TCP).
    cleared: usize,
    /// When the first guest bytes were seen while sniffing.
    sniff_since: Option<Instant>,
    /// Both sides closed cleanly, the host socket is gone and the record
    /// final; the smoltcp socket stays in TIME-WAIT (to acknowledge the
    /// guest's FIN again if needed) until smoltcp closes it.
    finished: bool,
    /// Aborted: waiting for smoltcp to send the guest its RST.
    dead: bool,
    readable: bool,
    writable: bool,
    /// The events registered in the epoll set (empty: not registered).
    interest: u32,
    record: u64,
    bytes_out: u64,
    bytes_in: u64,
    started: Instant,
}

/// One sandbox's NAT. It is `Send` (it runs on the VM's network thread).
pub struct NetStack {
    config: StackConfig,
    control: Arc<NetControl>,
    iface: Interface,
    link: Link,
    sockets: SocketSet<'static>,
    epoll: Epoll,
    timer: TimerFd,
    wake: EventFd,
    conns: HashMap<u64, Conn>,
    by_tuple: HashMap<Tuple, u64>,
    next_token: u64,
    dns: Resolver,
    /// UDP flows (not DNS) by token, and their tokens by addresses.
    flows: HashMap<u64, UdpFlow>,
    udp_by_tuple: HashMap<Tuple, u64>,
    /// Refused UDP flows and when.
    refused_flows: HashMap<Tuple, Instant>,
    udp_buf: Vec<u8>,
    /// Connections in `conns` that are [`Conn::finished`].
    lingering: usize,
    stats: StackStats,
    epoch: Instant,
    events: Vec<EpollEvent>,
    sniff_buf: Vec<u8>,
    /// One DNS-over-TCP message (2-byte length + up to 64 KiB).
    dns_buf: Vec<u8>,
    /// The resolver's host sockets were reported readable.
    dns_ready: bool,
    /// When the timerfd fires (`None`: not armed).
    armed: Option<Instant>,
}

impl std::fmt::Debug for NetStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetStack").field("conns", &self.conns.len()).field("stats", &self.stats).finish_non_exhaustive()
    }
}

fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

fn duration_ms(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// What a guest frame is, as far as the NAT cares.
enum Peek {
    /// A TCP segment of `Tuple`; `true` if it is a SYN without ACK.
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
fn peek(frame: &[u8]) -> Peek {
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

/// Where a guest connection or flow goes on the host: 127.0.0.1 for the
/// gateway (and judged as that), else the address dialled.
fn host_ip(dst: Ipv4Addr) -> Ipv4Addr {
    if dst == GATEWAY_ADDR {
        Ipv4Addr::LOCALHOST
    } else {
        dst
    }
}

/// One UDP flow of the guest (a guest address and port to a destination)
/// and its connected host socket.
struct UdpFlow {
    tuple: Tuple,
    guest_mac: [u8; 6],
    host: std::net::UdpSocket,
    /// The events registered in the epoll set (empty: not registered).
    interest: u32,
    /// The host socket was reported readable and not yet read empty.
    readable: bool,
    record: u64,
    bytes_out: u64,
    bytes_in: u64,
    started: Instant,
    last_active: Instant,
}

/// How long a UDP flow lives without a datagram either way.
pub const UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Refused UDP flows remembered (so their further datagrams are dropped
/// without one log record each), at most.
const MAX_REFUSED_FLOWS: usize = 1024;
/// How long a refused UDP flow is remembered (then judged again: the
/// policy may have changed).
const REFUSED_FLOW_MEMORY: Duration = Duration::from_secs(10);
/// The largest UDP payload in one frame to the guest (no fragmentation).
const MAX_UDP_PAYLOAD: usize = MTU - 20 - 8;

impl NetStack {
    /// A stack with no connections.
    ///
    /// Errors: [`StackError::Setup`].
    pub fn new(config: StackConfig, control: Arc<NetControl>) -> Result<Self, StackError> {
        let mut link = Link {
            from_guest: VecDeque::new(),
            slot: None,
            to_guest: VecDeque::new(),
            max_to_guest: config.max_guest_frames.max(1),
            max_from_guest: config.max_guest_frames.max(64),
            starved: false,
            spare: Vec::new(),
        };
        let seed = random_seed();
        let mut iface_config = Config::new(EthernetAddress(GATEWAY_MAC).into());
        iface_config.random_seed = seed;
        let epoch = Instant::now();
        let mut iface = Interface::new(iface_config, &mut link, smoltcp::time::Instant::ZERO);
        iface.update_ip_addrs(|addrs| {
            let _ = addrs.push(IpCidr::new(GATEWAY_ADDR.into(), PREFIX_LEN));
            let _ = addrs.push(IpCidr::new(DNS_ADDR.into(), PREFIX_LEN));
        });
        iface.set_any_ip(true);
        iface
            .routes_mut()
            .add_default_ipv4_route(GATEWAY_ADDR)
            .map_err(|_| StackError::Setup(io::Error::other("route table full")))?;
        let mut sockets = SocketSet::new(Vec::new());
        let dns = Resolver::new(&config.dns_upstreams, &config.static_hosts, &mut sockets, seed >> 16)?;
        let epoll = Epoll::new().map_err(StackError::Setup)?;
        let timer = TimerFd::new().map_err(|e| StackError::Setup(io::Error::from_raw_os_error(e.errno())))?;
        let wake = EventFd::new(EFD_NONBLOCK).map_err(StackError::Setup)?;
        epoll
            .ctl(ControlOperation::Add, timer.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_TIMER))
            .map_err(StackError::Setup)?;
        epoll
            .ctl(ControlOperation::Add, wake.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_WAKE))
            .map_err(StackError::Setup)?;
        for fd in dns.host_fds() {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, TOKEN_DNS))
                .map_err(StackError::Setup)?;
        }
        Ok(Self {
            config,
            control,
            iface,
            link,
            sockets,
            epoll,
            timer,
            wake,
            conns: HashMap::new(),
            by_tuple: HashMap::new(),
            next_token: TOKEN_CONN_BASE,
            dns,
            lingering: 0,
            flows: HashMap::new(),
            udp_by_tuple: HashMap::new(),
            refused_flows: HashMap::new(),
            udp_buf: vec![0; 65536],
            stats: StackStats::default(),
            epoch,
            events: vec![EpollEvent::default(); 256],
            sniff_buf: vec![0; MAX_SNIFF_BYTES],
            dns_ready: false,
            dns_buf: vec![0; 2 + 65535],
            armed: None,
        })
    }

    /// Takes one Ethernet frame from the guest; `false`: queue full, retry later.
    ///
    /// A frame shorter than an Ethernet header or longer than [`MAX_FRAME`]
    /// is dropped (counted in [`StackStats::frames_dropped`]) and `true`
    /// returned. The frame must carry complete checksums.
    pub fn send_frame(&mut self, frame: &[u8]) -> bool {
        if !(MIN_FRAME..=MAX_FRAME).contains(&frame.len()) {
            self.stats.frames_dropped += 1;
            return true;
        }
        if self.link.from_guest.len() >= self.link.max_from_guest {
            return false;
        }
        let mut buf = self.link.spare.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(frame);
        self.link.from_guest.push_back(buf);
        true
    }

    /// The next frame for the guest (not removed).
    pub fn peek_frame(&self) -> Option<&[u8]> {
        self.link.to_guest.front().map(Vec::as_slice)
    }

    /// Removes the frame [`NetStack::peek_frame`] returned.
    pub fn pop_frame(&mut self) {
        if let Some(buf) = self.link.to_guest.pop_front() {
            self.link.recycle(buf);
        }
        if self.link.starved && self.link.to_guest.len() <= self.link.max_to_guest / 2 {
            self.link.starved = false;
            let _ = self.wake.write(1);
        }
    }

    fn now(&self) -> smoltcp::time::Instant {
        smoltcp::time::Instant::from_micros(i64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(i64::MAX))
    }

    /// Runs the stack: guest frames, host sockets, timers.
    pub fn poll(&mut self) {
        self.collect_events();
        let now = self.now();
        self.iface.poll_maintenance(now);
        self.ingest(now);
        self.service_all();
        let dns_ready = std::mem::take(&mut self.dns_ready);
        self.dns.poll(&mut self.sockets, &self.control, Instant::now(), dns_ready);
        self.udp_poll();
        while self.iface.poll_egress(now, &mut self.link, &mut self.sockets)
            == smoltcp::iface::PollResult::SocketStateChanged
        {}
        self.service_all();
        self.arm_timer();
    }

    /// Reads the epoll set (without waiting) and marks what is ready.
    fn collect_events(&mut self) {
        let n = match self.epoll.wait(0, &mut self.events) {
            Ok(n) => n,
            Err(_) => return,
        };
        for i in 0..n {
            let Some(ev) = self.events.get(i).copied() else {
                break;
            };
            let set = ev.event_set();
            match ev.data() {
                TOKEN_TIMER => {
                    self.armed = None;
                    let _ = self.timer.wait();
                }
                TOKEN_WAKE => {
                    let _ = self.wake.read();
                }
                TOKEN_DNS => self.dns_ready = true,
                token => {
                    if let Some(flow) = self.flows.get_mut(&token) {
                        flow.readable = true;
                    }
                    if let Some(conn) = self.conns.get_mut(&token) {
                        if set.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR | EventSet::READ_HANG_UP) {
                            conn.readable = true;
                        }
                        if set.intersects(EventSet::OUT | EventSet::HANG_UP | EventSet::ERROR) {
                            conn.writable = true;
                        }
                    }
                }
            }
        }
    }

    /// Hands the guest's frames to the interface one at a time, admitting
    /// new TCP connections just before their SYN goes in.
    fn ingest(&mut self, now: smoltcp::time::Instant) {
        loop {
            // A frame in may produce one frame out (ACK, RST, ARP reply).
            if self.link.to_guest.len() >= self.link.max_to_guest {
                if !self.link.from_guest.is_empty() {
                    self.link.starved = true;
                }
                break;
            }
            let Some(frame) = self.link.from_guest.pop_front() else {
                break;
            };
            let tuple = match peek(&frame) {
                Peek::Tcp(tuple, syn) => {
                    if syn {
                        // A new connection on the 4-tuple of one in
                        // TIME-WAIT (ports reused fast): the old one goes.
                        let old = self.by_tuple.get(&tuple).copied();
                        if let Some(old) = old.filter(|t| self.conns.get(t).is_some_and(|c| c.finished)) {
                            self.close_conn(old, false);
                        }
                        if !self.by_tuple.contains_key(&tuple) {
                            self.admit(tuple);
                        }
                    }
                    Some(tuple)
                }
                Peek::Udp(tuple, mac, range) => {
                    if let Some(payload) = frame.get(range) {
                        self.udp_out(tuple, mac, payload);
                    }
                    self.link.recycle(frame);
                    continue;
                }
                Peek::Drop => {
                    self.stats.frames_dropped += 1;
                    self.link.recycle(frame);
                    continue;
                }
                Peek::Ignore => {
                    self.link.recycle(frame);
                    continue;
                }
                Peek::Other => None,
            };
            self.link.slot = Some(frame);
            let _ = self.iface.poll_ingress_single(now, &mut self.link, &mut self.sockets);
            if let Some(buf) = self.link.slot.take() {
                self.link.recycle(buf);
            }
            // A connection whose socket still (or again) listens after a
            // frame of its own did not get (or lost) its SYN: forget it,
            // so no other SYN can land on its listener.
            if let Some(token) = tuple.and_then(|t| self.by_tuple.get(&t).copied()) {
                let listening = self
                    .conns
                    .get(&token)
                    .is_some_and(|c| self.sockets.get::<tcp::Socket>(c.handle).state() == tcp::State::Listen);
                if listening {
                    self.close_conn(token, false);
                }
            }
        }
    }

    /// The policy's verdict on a new connection; creates it if allowed.
    fn admit(&mut self, tuple: Tuple) {
        let dst_ip = *tuple.dst.ip();
        let judged = host_ip(dst_ip);
        let port = tuple.dst.port();
        let names = self.dns.names().names(IpAddr::V4(dst_ip)).to_vec();
        let policy = self.control.policy();
        // DNS over TCP to the resolver (RFC 7766: a client retries there
        // after a truncated answer) goes to the first upstream; each query
        // in it is judged by name (see `service`).
        let dns_tcp = dst_ip == DNS_ADDR && port == 53;
        let upstream = if dns_tcp { self.config.dns_upstreams.first().copied() } else { None };
        let verdict = if dns_tcp {
            match upstream {
                Some(_) => Verdict { allowed: true, rule: RULE_DNS_TCP.to_owned() },
                None => Verdict { allowed: false, rule: RULE_DNS_TCP.to_owned() },
            }
        } else {
            policy.check_addr(IpAddr::V4(judged), port, &names)
        };
        let mut record = NetRecord::starting(
            if dns_tcp { Protocol::Dns } else { Protocol::Tcp },
            IpAddr::V4(if dns_tcp { dst_ip } else { judged }),
            port,
            names.first().cloned(),
            verdict,
        );
        if !record.allowed {
            record.duration_ms = Some(0);
            self.control.record(record);
            return;
        }
        if self.open_count() >= self.config.max_connections {
            self.stats.refused_by_cap += 1;
            record.allowed = false;
            record.rule = RULE_LIMIT_CONNECTIONS.to_owned();
            record.duration_ms = Some(0);
            self.control.record(record);
            return;
        }
        let target = upstream.unwrap_or(SocketAddr::V4(SocketAddrV4::new(judged, port)));
        let host = match connect(target) {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!("host connect to {target}: {e}");
                record.duration_ms = Some(0);
                self.control.record(record);
                return;
            }
        };
        let buf = self.config.tcp_buffer_bytes.max(4096);
        let mut socket = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; buf]), tcp::SocketBuffer::new(vec![0; buf]));
        socket.pause_synack(true);
        socket.set_nagle_enabled(false);
        socket.set_timeout(Some(GUEST_TIMEOUT.into()));
        if socket.listen(IpListenEndpoint { addr: Some(dst_ip.into()), port }).is_err() {
            record.duration_ms = Some(0);
            self.control.record(record);
            return;
        }
        let handle = self.sockets.add(socket);
        let token = self.next_token;
        self.next_token += 1;
        let record = self.control.record(record);
        let conn = Conn {
            tuple,
            handle,
            host: Some(host),
            connected: false,
            sniffing: !dns_tcp && policy.has_domain_rules(),
            dns_tcp,
            cleared: 0,
            sniff_since: None,
            finished: false,
            host_eof: false,
            guest_eof: false,
            dead: false,
            readable: false,
            writable: true,
            interest: 0,
            record,
            bytes_out: 0,
            bytes_in: 0,
            started: Instant::now(),
        };
        self.conns.insert(token, conn);
        self.by_tuple.insert(tuple, token);
    }

    fn service_all(&mut self) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.service(token);
        }
    }

    /// Moves data of one connection, passes FIN/RST on, updates interest,
    /// and removes it when both sides are done.
    fn service(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let socket = self.sockets.get_mut::<tcp::Socket>(conn.handle);
        if conn.finished {
            if socket.state() != tcp::State::TimeWait {
                self.close_conn(token, false);
            }
            return;
        }
        if conn.dead {
            if socket.remote_endpoint().is_none() {
                self.close_conn(token, false);
            }
            return;
        }
        let Some(host) = conn.host.as_ref() else {
            self.close_conn(token, true);
            return;
        };
        // The host connect.
        if !conn.connected {
            if !conn.writable {
                self.update_interest(token);
                return;
            }
            match host.take_error() {
                Ok(None) if host.peer_addr().is_ok() => {
                    conn.connected = true;
                    conn.readable = true;
                    socket.pause_synack(false);
                }
                Ok(None) => {
                    // Not yet (spurious wake-up).
                    conn.writable = false;
                    self.update_interest(token);
                    return;
                }
                _ => {
                    // Refused: the guest gets a RST to its SYN.
                    self.abort(token);
                    return;
                }
            }
        }
        let state = socket.state();
        match state {
            tcp::State::Listen => {
                self.close_conn(token, true);
                return;
            }
            tcp::State::Closed => {
                // The guest reset it (or it timed out): reset the host side.
                let clean = conn.host_eof && conn.guest_eof;
                self.close_conn(token, !clean);
                return;
            }
            tcp::State::SynReceived => {
                self.update_interest(token);
                return;
            }
            _ => {}
        }
        // Sniff the first bytes for a name; until then guest bytes wait.
        if conn.sniffing {
            let queued = socket.recv_queue();
            let n = socket.peek_slice(&mut self.sniff_buf[..queued.min(MAX_SNIFF_BYTES)]).unwrap_or(0);
            if n > 0 && conn.sniff_since.is_none() {
                conn.sniff_since = Some(Instant::now());
            }
            let waited = conn.sniff_since.is_some_and(|t| t.elapsed() >= SNIFF_WAIT);
            let first = self.sniff_buf.get(..n).unwrap_or(&[]);
            match sniff(first) {
                Sniffed::NeedMore
                    if n < MAX_SNIFF_BYTES.min(socket.recv_capacity()) && socket.may_recv() && !waited => {}
                Sniffed::Name(name) => {
                    conn.sniffing = false;
                    if !judge_name(&self.control, conn.record, name) {
                        self.abort(token);
                        return;
                    }
                }
                _ => conn.sniffing = false,
            }
        }
        // Guest -> host.
        loop {
            if conn.dns_tcp && conn.cleared == 0 {
                // The next whole query, judged by its name.
                let mut head = [0u8; 2];
                if socket.peek_slice(&mut head) != Ok(2) {
                    break;
                }
                let len = 2 + usize::from(u16::from_be_bytes(head));
                if socket.recv_queue() < len {
                    if len > socket.recv_capacity() {
                        self.abort(token);
                        return;
                    }
                    break;
                }
                let n = socket.peek_slice(&mut self.dns_buf[..len]).unwrap_or(0);
                let Some(name) = self.dns_buf.get(2..n).and_then(crate::dns::query_name) else {
                    self.abort(token);
                    return;
                };
                if !judge_name(&self.control, conn.record, name) {
                    self.abort(token);
                    return;
                }
                conn.cleared = len;
            }
            if conn.sniffing || !conn.writable || !socket.can_recv() {
                break;
            }
            let limit = if conn.dns_tcp { conn.cleared } else { usize::MAX };
            let r = socket.recv(|buf| {
                let buf = buf.get(..limit.min(buf.len())).unwrap_or(buf);
                match (&*host).write(buf) {
                    Ok(n) => (n, Ok(n)),
                    Err(e) => (0, Err(e)),
                }
            });
            match r {
                Ok(Ok(0)) | Err(_) => break,
                Ok(Ok(n)) => {
                    conn.bytes_out += n as u64;
                    conn.cleared = conn.cleared.saturating_sub(n);
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => conn.writable = false,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(_)) => {
                    self.abort(token);
                    return;
                }
            }
        }
        if !conn.guest_eof && !conn.sniffing && !socket.may_recv() && socket.recv_queue() == 0 {
            conn.guest_eof = true;
            let _ = host.shutdown(Shutdown::Write);
        }
        // Host -> guest.
        while conn.readable && !conn.host_eof && socket.may_send() && socket.send_queue() < socket.send_capacity() {
            let r = socket.send(|buf| match (&*host).read(buf) {
                Ok(n) => (n, Ok(n)),
                Err(e) => (0, Err(e)),
            });
            match r {
                Ok(Ok(0)) => {
                    conn.host_eof = true;
                    socket.close();
                }
                Ok(Ok(n)) => conn.bytes_in += n as u64,
                Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => conn.readable = false,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(_)) => {
                    self.abort(token);
                    return;
                }
                Err(_) => break,
            }
        }
        if conn.host_eof && conn.guest_eof && state == tcp::State::TimeWait {
            self.finish(token, false);
            return;
        }
        self.update_interest(token);
    }

    /// Registers exactly the host events the connection waits for.
    fn update_interest(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let Some(host) = conn.host.as_ref() else {
            return;
        };
        let socket = self.sockets.get::<tcp::Socket>(conn.handle);
        let mut want = EventSet::empty();
        if !conn.connected {
            want |= EventSet::OUT;
        } else {
            if !conn.host_eof && !conn.readable && socket.may_send() && socket.send_queue() < socket.send_capacity() {
                want |= EventSet::IN;
            }
            if !conn.writable && !conn.sniffing && socket.recv_queue() > 0 {
                want |= EventSet::OUT;
            }
        }
        let bits = want.bits();
        if bits == conn.interest {
            return;
        }
        let fd = host.as_raw_fd();
        let op = if conn.interest == 0 {
            ControlOperation::Add
        } else if bits == 0 {
            ControlOperation::Delete
        } else {
            ControlOperation::Modify
        };
        if self.epoll.ctl(op, fd, EpollEvent::new(want, token)).is_ok() {
            conn.interest = bits;
        }
    }

    /// Resets both sides: RST to the guest (once smoltcp sent it the
    /// connection is removed) and to the host.
    fn abort(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let socket = self.sockets.get_mut::<tcp::Socket>(conn.handle);
        socket.abort();
        if let Some(host) = conn.host.take() {
            if conn.interest != 0 {
                let _ = self.epoll.ctl(ControlOperation::Delete, host.as_raw_fd(), EpollEvent::default());
                conn.interest = 0;
            }
            let _ = host.set_linger(Some(Duration::ZERO));
        }
        conn.dead = true;
    }

    /// Removes a connection; `reset_host`: the host side gets a RST
    /// instead of a FIN.
    fn close_conn(&mut self, token: u64, reset_host: bool) {
        self.finish(token, reset_host);
        let Some(conn) = self.conns.remove(&token) else {
            return;
        };
        self.lingering -= 1;
        self.by_tuple.remove(&conn.tuple);
        self.sockets.remove(conn.handle);
    }

    /// Closes the host side (`reset_host`: with a RST instead of a FIN)
    /// and completes the log record; the smoltcp socket stays (see
    /// [`Conn::finished`]). At most `max_connections` finished ones stay,
    /// the oldest go first.
    fn finish(&mut self, token: u64, reset_host: bool) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if conn.finished {
            return;
        }
        conn.finished = true;
        self.lingering += 1;
        if let Some(host) = conn.host.take() {
            if conn.interest != 0 {
                let _ = self.epoll.ctl(ControlOperation::Delete, host.as_raw_fd(), EpollEvent::default());
            }
            conn.interest = 0;
            if reset_host {
                let _ = host.set_linger(Some(Duration::ZERO));
            }
        }
        let (out, inn, ms) = (conn.bytes_out, conn.bytes_in, duration_ms(conn.started));
        self.control.update(conn.record, |r| {
            r.bytes_out = out;
            r.bytes_in = inn;
            r.duration_ms = Some(ms);
        });
        if self.lingering > self.config.max_connections {
            let oldest = self.conns.iter().filter(|(_, c)| c.finished).map(|(t, _)| *t).min();
            if let Some(oldest) = oldest {
                self.close_conn(oldest, false);
            }
        }
    }

    /// Arms the timerfd for smoltcp's next deadline or the resolver's.
    fn arm_timer(&mut self) {
        let now = self.now();
        let mut delay = self.iface.poll_delay(now, &self.sockets).map(Duration::from);
        if let Some(deadline) = self.dns.next_deadline() {
            let d = deadline.saturating_duration_since(Instant::now());
            delay = Some(delay.map_or(d, |x| x.min(d)));
        }
        if let Some(t) = self.conns.values().filter(|c| c.sniffing).filter_map(|c| c.sniff_since).min() {
            let d = (t + SNIFF_WAIT).saturating_duration_since(Instant::now());
            delay = Some(delay.map_or(d, |x| x.min(d)));
        }
        if let Some(t) = self.flows.values().map(|f| f.last_active).min() {
            let d = (t + UDP_IDLE_TIMEOUT).saturating_duration_since(Instant::now());
            delay = Some(delay.map_or(d, |x| x.min(d)));
        }
        let Some(mut delay) = delay else {
            if self.armed.take().is_some() {
                let _ = self.timer.clear();
            }
            return;
        };
        if delay.is_zero() {
            // Something wants out now: it waits for the guest to take
            // frames (the eventfd wakes us), or a moment.
            delay = if self.link.starved { Duration::from_millis(50) } else { Duration::from_millis(1) };
        }
        // Re-arm only when the deadline moved (by 1 ms or more).
        let deadline = Instant::now() + delay;
        let same = self.armed.is_some_and(|a| {
            let d = if a > deadline { a - deadline } else { deadline - a };
            d < Duration::from_millis(1)
        });
        if !same {
            self.armed = Some(deadline);
            let _ = self.timer.reset(delay, None);
        }
    }

    /// Readable (level-triggered) when [`NetStack::poll`] has work.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Drops every connection and flow (after a restore): no RST is sent
    /// now, the guest's next segment on an old connection gets one (no
    /// socket matches it); host connections are reset. The log stays.
    pub fn reset(&mut self) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.close_conn(token, true);
        }
        let flows: Vec<u64> = self.flows.keys().copied().collect();
        for token in flows {
            self.close_flow(token);
        }
        self.refused_flows.clear();
        self.link.from_guest.clear();
        self.link.to_guest.clear();
        self.link.slot = None;
        self.link.starved = false;
        self.dns.reset();
    }

    /// Counters.
    pub fn stats(&self) -> StackStats {
        StackStats { open_connections: self.open_count(), ..self.stats }
    }
}

const _: () = {
    const fn send<T: Send>() {}
    send::<NetStack>();
};

/// A non-blocking host TCP socket connecting to `target`.
fn connect(target: SocketAddr) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    match socket.connect(&SockAddr::from(target)) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(socket)
}

/// A frame to the guest carrying a UDP datagram from `src` to `dst`.
fn udp_frame(buf: &mut Vec<u8>, guest_mac: [u8; 6], src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) {
    let caps = phy::ChecksumCapabilities::default();
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

impl NetStack {
    /// TCP connections and UDP flows open now.
    fn open_count(&self) -> usize {
        self.conns.len() - self.lingering + self.flows.len()
    }

    /// A datagram from the guest: into its flow, or a new flow if the
    /// policy and the cap allow it.
    fn udp_out(&mut self, tuple: Tuple, guest_mac: [u8; 6], payload: &[u8]) {
        if let Some(flow) = self.udp_by_tuple.get(&tuple).and_then(|t| self.flows.get_mut(t)) {
            flow.last_active = Instant::now();
            if flow.host.send(payload).is_ok() {
                flow.bytes_out += payload.len() as u64;
            }
            return;
        }
        if self.refused_flows.contains_key(&tuple) {
            return;
        }
        let judged = host_ip(*tuple.dst.ip());
        let port = tuple.dst.port();
        let names = self.dns.names().names(IpAddr::V4(*tuple.dst.ip())).to_vec();
        let verdict = self.control.policy().check_addr(IpAddr::V4(judged), port, &names);
        let mut record = NetRecord::starting(Protocol::Udp, IpAddr::V4(judged), port, names.first().cloned(), verdict);
        let mut refuse = !record.allowed;
        if !refuse && self.open_count() >= self.config.max_connections {
            self.stats.refused_by_cap += 1;
            record.allowed = false;
            record.rule = RULE_LIMIT_CONNECTIONS.to_owned();
            refuse = true;
        }
        if refuse {
            if self.refused_flows.len() >= MAX_REFUSED_FLOWS {
                self.refused_flows.clear();
            }
            self.refused_flows.insert(tuple, Instant::now());
            record.duration_ms = Some(0);
            self.control.record(record);
            return;
        }
        let target = SocketAddr::V4(SocketAddrV4::new(judged, port));
        let host = match udp_connect(target) {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!("host UDP socket to {target}: {e}");
                record.duration_ms = Some(0);
                self.control.record(record);
                return;
            }
        };
        let sent = host.send(payload).map(|n| n as u64).unwrap_or(0);
        let token = self.next_token;
        self.next_token += 1;
        let now = Instant::now();
        let flow = UdpFlow {
            tuple,
            guest_mac,
            host,
            interest: 0,
            readable: false,
            record: self.control.record(record),
            bytes_out: sent,
            bytes_in: 0,
            started: now,
            last_active: now,
        };
        self.flows.insert(token, flow);
        self.udp_by_tuple.insert(tuple, token);
    }

    /// Datagrams from the host to the guest (while the guest's queue has
    /// room), interest, idle timeouts.
    fn udp_poll(&mut self) {
        let now = Instant::now();
        self.refused_flows.retain(|_, t| now.saturating_duration_since(*t) < REFUSED_FLOW_MEMORY);
        let tokens: Vec<u64> = self.flows.keys().copied().collect();
        for token in tokens {
            let Some(flow) = self.flows.get_mut(&token) else {
                continue;
            };
            while flow.readable {
                if self.link.to_guest.len() >= self.link.max_to_guest {
                    self.link.starved = true;
                    break;
                }
                match flow.host.recv(&mut self.udp_buf) {
                    Ok(n) => {
                        flow.last_active = now;
                        let Some(payload) = self.udp_buf.get(..n) else {
                            continue;
                        };
                        if n > MAX_UDP_PAYLOAD {
                            continue;
                        }
                        flow.bytes_in += n as u64;
                        let mut buf = self.link.spare.pop().unwrap_or_default();
                        udp_frame(&mut buf, flow.guest_mac, flow.tuple.dst, flow.tuple.guest, payload);
                        self.link.to_guest.push_back(buf);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => flow.readable = false,
                    // An ICMP error for an earlier datagram, EINTR: go on.
                    Err(_) => {}
                }
            }
            if now.saturating_duration_since(flow.last_active) >= UDP_IDLE_TIMEOUT {
                self.close_flow(token);
                continue;
            }
            let want = if self.link.to_guest.len() >= self.link.max_to_guest {
                // Read again once the guest took frames (the eventfd).
                self.link.starved = true;
                EventSet::empty()
            } else if flow.readable {
                EventSet::empty()
            } else {
                EventSet::IN
            };
            let bits = want.bits();
            if bits != flow.interest {
                let op = if flow.interest == 0 {
                    ControlOperation::Add
                } else if bits == 0 {
                    ControlOperation::Delete
                } else {
                    ControlOperation::Modify
                };
                if self.epoll.ctl(op, flow.host.as_raw_fd(), EpollEvent::new(want, token)).is_ok() {
                    flow.interest = bits;
                }
            }
        }
    }

    fn close_flow(&mut self, token: u64) {
        let Some(flow) = self.flows.remove(&token) else {
            return;
        };
        self.udp_by_tuple.remove(&flow.tuple);
        if flow.interest != 0 {
            let _ = self.epoll.ctl(ControlOperation::Delete, flow.host.as_raw_fd(), EpollEvent::default());
        }
        let (out, inn, ms) = (flow.bytes_out, flow.bytes_in, duration_ms(flow.started));
        self.control.update(flow.record, |r| {
            r.bytes_out = out;
            r.bytes_in = inn;
            r.duration_ms = Some(ms);
        });
    }
}

/// A non-blocking host UDP socket connected to `target`.
fn udp_connect(target: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let bind: SocketAddr =
        if target.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let socket = std::net::UdpSocket::bind(bind)?;
    socket.set_nonblocking(true)?;
    socket.connect(target)?;
    Ok(socket)
}

/// Judges `name` (a connection's SNI or `Host`, or a DNS-over-TCP query's
/// name) by the current policy and records it in the connection's log
/// record `record` (with the deciding rule when denied); returns whether it
/// is allowed.
fn judge_name(control: &NetControl, record: u64, name: String) -> bool {
    let v = control.policy().check_name(&name);
    let allowed = v.allowed;
    control.update(record, |r| {
        if !allowed {
            r.allowed = false;
            r.rule = v.rule;
        }
        r.domain = Some(name);
    });
    allowed
}
