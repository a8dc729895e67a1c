//! The NAT on smoltcp: guest Ethernet frames in and out, host sockets
//! behind. This module is the map; each part has a room of its own:
//!
//! - `link`: the Ethernet link to the guest (the smoltcp device and its
//!   bounded queues) and the look taken at each guest frame before the
//!   interface sees it;
//! - `admit`: one admission path for every new connection and flow
//!   (policy verdict, connection cap, host socket, log record);
//! - `tcp`: guest TCP connections spliced to host sockets, and inbound
//!   connections from the host into a guest port
//!   ([`NetControl::connect_inbound`]);
//! - `gate`: what a connection's bytes wait for before they reach the host:
//!   the name checks of the egress policy (TLS SNI, every HTTP request's
//!   `Host`; what a domain rule guarantees and what it does not is in its
//!   doc), or whole DNS queries over TCP;
//! - `udp`: the UDP NAT (every UDP flow but DNS);
//! - [`crate::dns`]: the resolver at [`DNS_ADDR`], a smoltcp UDP socket.
//!
//! One smoltcp [`Interface`] (Medium::Ethernet, [`GATEWAY_MAC`], addresses
//! [`GATEWAY_ADDR`]/24 and [`DNS_ADDR`]/24, "any IP" with a default route
//! via [`GATEWAY_ADDR`]) takes every frame the guest sends, whatever the
//! destination address, one at a time: a TCP SYN is admitted before it
//! goes in and held there until its host connect finishes, a UDP datagram
//! for the NAT never goes in. ICMP echo is
//! answered for [`GATEWAY_ADDR`] and [`DNS_ADDR`] only (not forwarded).
//! TCP connections and UDP flows count against
//! [`StackConfig::max_connections`] and [`StackConfig::connection_rate`];
//! what the stack may hold in buffers is bounded by
//! [`StackConfig::buffer_bytes_max`].
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

mod admit;
mod gate;
mod interest;
mod link;
mod tcp;
mod udp;

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, PollResult, SocketSet};
use smoltcp::wire::{EthernetAddress, IpCidr};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

use self::admit::Cap;
pub use self::admit::{RULE_LIMIT_CONNECTIONS, RULE_UDP_DOMAIN_ONLY};
pub use self::gate::{
    NAME_WAIT, RULE_DNS_MALFORMED, RULE_HOST_MALFORMED, RULE_HOST_MISSING, RULE_HOST_TIMEOUT, RULE_SNI_MALFORMED,
    RULE_SNI_MISSING, RULE_SNI_TIMEOUT, RULE_UNKNOWN_PROTOCOL, SNIFF_WAIT,
};
use self::link::{Link, Peek};
use self::tcp::Tcp;
pub use self::tcp::{RULE_DNS_TCP, RULE_INBOUND};
use self::udp::Udp;
pub use self::udp::UDP_IDLE_TIMEOUT;
use crate::control::{NetControl, INBOUND_MAX_WAIT};
pub use crate::dns::resolv_conf_upstreams;
use crate::dns::Resolver;
use crate::rate::Limiter;
pub use crate::rate::{RateLimit, RULE_LIMIT_RATE};
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
    /// smoltcp buffer per direction per TCP connection (bytes; at least
    /// 4096 is used). Allocated when the host connect succeeds, freed when
    /// the connection ends (no buffer lingers in TIME-WAIT).
    pub tcp_buffer_bytes: usize,
    /// `SO_RCVBUF` and `SO_SNDBUF` asked for on each host socket (bytes; at
    /// least 4096 is used). Linux doubles the value for its bookkeeping
    /// and caps it at `net.core.rmem_max` / `wmem_max` (socket(7)); asking
    /// also turns the kernel's autotuning off for the socket, so this is
    /// what a host socket holds at most, and its TCP window: 128 KiB
    /// (256 KiB as Linux counts it) carries about 5 MB/s at 50 ms of round
    /// trip, 25 MB/s at 10 ms, per connection.
    pub host_buffer_bytes: usize,
    /// Frames queued toward the guest, at most.
    pub max_guest_frames: usize,
    /// How long a host TCP connect may take; then the guest's SYN gets a
    /// RST and the slot is free.
    pub connect_timeout: Duration,
    /// New TCP connections and UDP flows the guest may open (`None`: no
    /// limit); over it a SYN gets a RST, a datagram is dropped, logged
    /// with [`RULE_LIMIT_RATE`] (the first refusal of each second).
    pub connection_rate: Option<RateLimit>,
    /// DNS queries the guest may send to the resolver over UDP (`None`: no
    /// limit); over it a query gets `REFUSED`, logged as above.
    pub dns_rate: Option<RateLimit>,
}

impl Default for StackConfig {
    /// Upstreams from `/etc/resolv.conf`, no static hosts, 256
    /// connections, 64 KiB per direction in smoltcp, 128 KiB asked for each
    /// host socket buffer, 256 frames toward the guest, a 20 s connect
    /// timeout, 100 new connections a second (bursts of 200) and 100 DNS
    /// queries a second (bursts of 200).
    fn default() -> Self {
        Self {
            dns_upstreams: resolv_conf_upstreams(),
            static_hosts: BTreeMap::new(),
            max_connections: 256,
            tcp_buffer_bytes: 64 * 1024,
            host_buffer_bytes: 128 * 1024,
            max_guest_frames: 256,
            connect_timeout: Duration::from_secs(20),
            connection_rate: Some(RateLimit { per_second: 100, burst: 200 }),
            dns_rate: Some(RateLimit { per_second: 100, burst: 200 }),
        }
    }
}

impl StackConfig {
    /// The bytes a stack with this config may hold in buffers at most (the
    /// sandbox manager charges what they hold,
    /// [`crate::control::NetControl::buffered_bytes`], to the memory
    /// budget; this is its bound). The sum of
    ///
    /// - per connection or flow ([`StackConfig::max_connections`]): the
    ///   smoltcp buffers (2 x [`StackConfig::tcp_buffer_bytes`]), the host
    ///   socket's kernel buffers as capped (2 x 2 x
    ///   [`StackConfig::host_buffer_bytes`]: receive and send, each doubled
    ///   by Linux) and a held SYN frame;
    /// - the frame queues both ways (1 MiB each, plus one frame over) and
    ///   the spare frame buffers;
    /// - the resolver: its smoltcp socket, one host socket per outstanding
    ///   query (as capped), its scratch buffer;
    /// - the stack's scratch buffers (a datagram, a DNS-over-TCP message).
    ///
    /// Not counted: the bookkeeping of each connection (a few hundred
    /// bytes), the network log (in the control, bounded by its own
    /// capacity) and the name map (bounded by [`crate::dns::MAX_MAPPED_ADDRS`]).
    pub fn buffer_bytes_max(&self) -> u64 {
        let tcp = tcp::buffer_bytes(self.tcp_buffer_bytes) as u64;
        let host = 4 * tcp::host_buffer_bytes(self.host_buffer_bytes) as u64;
        let per_conn = 2 * tcp + host + tcp::MAX_SYN_FRAME as u64;
        let conns = per_conn.saturating_mul(self.max_connections as u64);
        conns
            .saturating_add(link::BYTES_MAX as u64)
            .saturating_add(crate::dns::BYTES_MAX as u64)
            .saturating_add(udp::SCRATCH_BYTES as u64)
            .saturating_add(tcp::SCRATCH_BYTES as u64)
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
    /// Connections and flows refused by [`StackConfig::connection_rate`],
    /// logged or not.
    pub refused_by_rate: u64,
    /// DNS queries refused by [`StackConfig::dns_rate`], logged or not.
    pub dns_refused_by_rate: u64,
    /// Guest frames dropped (malformed or over a limit).
    pub frames_dropped: u64,
}

/// The largest Ethernet frame taken from the guest: MTU + 14-byte header
/// + a 4-byte 802.1Q tag.
pub const MAX_FRAME: usize = MTU + 14 + 4;
/// The smallest: an Ethernet header.
pub const MIN_FRAME: usize = 14;

/// epoll tokens: the timerfd, the eventfd, the resolver's host sockets
/// (one per forwarded query, all under one token),
/// then one per TCP connection or UDP flow.
const TOKEN_TIMER: u64 = 0;
const TOKEN_WAKE: u64 = 1;
const TOKEN_DNS: u64 = 2;
const TOKEN_CONN_BASE: u64 = 16;

/// A guest connection's or flow's addresses (IPv4 only, like the guest
/// link).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Tuple {
    guest: SocketAddrV4,
    dst: SocketAddrV4,
}

/// What the parts of the stack share: the sandbox's policy and log, the
/// epoll set their host sockets are in, the counters and the cap.
struct Shared {
    control: Arc<NetControl>,
    epoll: Epoll,
    stats: StackStats,
    /// [`StackConfig::max_connections`].
    max_connections: usize,
    /// [`StackConfig::connection_rate`].
    rate: Limiter,
    next_token: u64,
}

impl Shared {
    fn new(control: Arc<NetControl>, max_connections: usize, rate: Option<RateLimit>) -> Result<Self, StackError> {
        let epoll = Epoll::new().map_err(StackError::Setup)?;
        Ok(Self {
            control,
            epoll,
            stats: StackStats::default(),
            max_connections,
            rate: Limiter::new(rate, Instant::now()),
            next_token: TOKEN_CONN_BASE,
        })
    }

    /// Where a new outbound connection or flow stands (`open`: connections
    /// and flows open now): the cap and the rate.
    fn cap(&mut self, open: usize) -> Cap<'_> {
        Cap { open, max: self.max_connections, refused: &mut self.stats.refused_by_cap, rate: Some(&mut self.rate) }
    }

    /// The same for an inbound connection: the cap only (the host's own).
    fn cap_inbound(&mut self, open: usize) -> Cap<'_> {
        Cap { open, max: self.max_connections, refused: &mut self.stats.refused_by_cap, rate: None }
    }

    /// A new epoll token for a connection or flow.
    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn watch(&self, fd: RawFd, token: u64) -> Result<(), StackError> {
        self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token)).map_err(StackError::Setup)
    }
}

/// One sandbox's NAT. It is `Send` (it runs on the VM's network thread).
pub struct NetStack {
    iface: Interface,
    link: Link,
    sockets: SocketSet<'static>,
    shared: Shared,
    tcp: Tcp,
    udp: Udp,
    dns: Resolver,
    timer: TimerFd,
    wake: EventFd,
    epoch: Instant,
    events: Vec<EpollEvent>,
    /// The resolver's host sockets were reported readable.
    dns_ready: bool,
    /// The eventfd was written: the guest took frames, or inbound
    /// connections wait in the control.
    woken: bool,
    /// When the timerfd fires (`None`: not armed).
    armed: Option<Instant>,
    /// [`StackConfig::buffer_bytes_max`].
    buffer_bytes_max: u64,
    /// When [`NetStack::buffered_bytes`] was last told to the control.
    reported: Instant,
}

/// How often a stack tells its control the bytes its buffers hold
/// ([`NetControl::buffered_bytes`]).
pub const BUFFERED_REPORT_EVERY: Duration = Duration::from_secs(1);

impl std::fmt::Debug for NetStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetStack").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

impl NetStack {
    /// A stack with no connections.
    ///
    /// Errors: [`StackError::Setup`], [`StackError::Dns`].
    pub fn new(config: StackConfig, control: Arc<NetControl>) -> Result<Self, StackError> {
        let mut link = Link::new(config.max_guest_frames);
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
        let dns = Resolver::new(&config.dns_upstreams, &config.static_hosts, config.dns_rate, &mut sockets, TOKEN_DNS)?;
        let shared = Shared::new(control, config.max_connections, config.connection_rate)?;
        let timer = TimerFd::new().map_err(|e| StackError::Setup(io::Error::from_raw_os_error(e.errno())))?;
        let wake = EventFd::new(EFD_NONBLOCK).map_err(StackError::Setup)?;
        shared.watch(timer.as_raw_fd(), TOKEN_TIMER)?;
        shared.watch(wake.as_raw_fd(), TOKEN_WAKE)?;
        shared.control.set_inbound_waker(wake.try_clone().map_err(StackError::Setup)?);
        Ok(Self {
            iface,
            link,
            sockets,
            shared,
            tcp: Tcp::new(&config),
            udp: Udp::new(tcp::host_buffer_bytes(config.host_buffer_bytes)),
            dns,
            timer,
            wake,
            epoch,
            events: vec![EpollEvent::default(); 256],
            dns_ready: false,
            woken: false,
            armed: None,
            buffer_bytes_max: config.buffer_bytes_max(),
            reported: Instant::now(),
        })
    }

    /// [`StackConfig::buffer_bytes_max`] of the config this stack was
    /// made with (bytes).
    pub fn buffer_bytes_max(&self) -> u64 {
        self.buffer_bytes_max
    }

    /// The bytes the stack's buffers hold now: the data queued in the
    /// smoltcp sockets, the frames queued both ways, and the data the host
    /// sockets' kernel buffers hold (`SIOCINQ`/`SIOCOUTQ`, tcp(7)). For
    /// tests and statistics; one system call per host socket.
    pub fn buffered_bytes(&self) -> u64 {
        self.tcp.buffered_bytes(&self.sockets) + self.link.queued_bytes() as u64
    }

    /// Takes one Ethernet frame from the guest; `false`: queue full, retry later.
    ///
    /// A frame shorter than an Ethernet header or longer than [`MAX_FRAME`]
    /// is dropped (counted in [`StackStats::frames_dropped`]) and `true`
    /// returned. The frame must carry complete checksums.
    pub fn send_frame(&mut self, frame: &[u8]) -> bool {
        if !(MIN_FRAME..=MAX_FRAME).contains(&frame.len()) {
            self.shared.stats.frames_dropped += 1;
            return true;
        }
        self.link.push_from_guest(frame)
    }

    /// The next frame for the guest (not removed).
    pub fn peek_frame(&self) -> Option<&[u8]> {
        self.link.front_to_guest()
    }

    /// Removes the frame [`NetStack::peek_frame`] returned.
    pub fn pop_frame(&mut self) {
        if self.link.pop_to_guest() {
            let _ = self.wake.write(1);
        }
    }

    /// Runs the stack: guest frames, host sockets, timers.
    pub fn poll(&mut self) {
        self.collect_events();
        if std::mem::take(&mut self.woken) {
            self.dial_inbound();
        }
        let now = self.now();
        self.iface.poll_maintenance(now);
        self.ingest(now);
        self.service_tcp(now);
        let dns_ready = std::mem::take(&mut self.dns_ready);
        self.dns.poll(&mut self.sockets, &self.shared.control, &self.shared.epoll, Instant::now(), dns_ready);
        self.udp.poll(&mut self.link, &self.shared);
        while self.iface.poll_egress(now, &mut self.link, &mut self.sockets) == PollResult::SocketStateChanged {}
        self.service_tcp(now);
        if self.reported.elapsed() >= BUFFERED_REPORT_EVERY {
            self.reported = Instant::now();
            self.shared.control.set_buffered_bytes(self.buffered_bytes());
        }
        self.arm_timer();
    }

    /// Readable (level-triggered) when [`NetStack::poll`] has work.
    pub fn epoll_fd(&self) -> RawFd {
        self.shared.epoll.as_raw_fd()
    }

    /// Drops every connection and flow (after a restore): no RST is sent
    /// now, the guest's next segment on an old connection gets one (no
    /// socket matches it); host connections are reset. The log stays.
    pub fn reset(&mut self) {
        self.tcp.reset(&mut self.sockets, &self.shared);
        self.udp.reset(&self.shared);
        self.link.clear();
        self.dns.reset();
    }

    /// Counters.
    pub fn stats(&self) -> StackStats {
        StackStats {
            open_connections: self.open_count(),
            refused_by_rate: self.shared.rate.refused(),
            dns_refused_by_rate: self.dns.refused_by_rate(),
            ..self.shared.stats
        }
    }

    /// Services the TCP connections, then hands the interface the SYNs
    /// whose host connect finished (a listener waits for each) or failed
    /// (none: smoltcp answers with a RST).
    fn service_tcp(&mut self, now: smoltcp::time::Instant) {
        self.tcp.service_all(&mut self.sockets, &mut self.shared, self.link.is_starved());
        for (tuple, frame) in self.tcp.take_released() {
            self.link.load(frame);
            let _ = self.iface.poll_ingress_single(now, &mut self.link, &mut self.sockets);
            self.link.unload();
            self.tcp.after_frame(tuple, &mut self.sockets, &self.shared);
        }
    }

    /// TCP connections and UDP flows open now.
    fn open_count(&self) -> usize {
        self.tcp.open_count() + self.udp.len()
    }

    fn now(&self) -> smoltcp::time::Instant {
        smoltcp::time::Instant::from_micros(i64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(i64::MAX))
    }

    /// Reads the epoll set (without waiting) and marks what is ready.
    fn collect_events(&mut self) {
        let n = match self.shared.epoll.wait(0, &mut self.events) {
            Ok(n) => n,
            Err(_) => return,
        };
        for ev in self.events.iter().take(n) {
            match ev.data() {
                TOKEN_TIMER => {
                    self.armed = None;
                    let _ = self.timer.wait();
                }
                TOKEN_WAKE => {
                    let _ = self.wake.read();
                    self.woken = true;
                }
                TOKEN_DNS => self.dns_ready = true,
                token => {
                    if !self.udp.ready(token) {
                        self.tcp.ready(token, ev.event_set());
                    }
                }
            }
        }
    }

    /// Dials the inbound connections asked for (dropping any that waited
    /// longer than [`INBOUND_MAX_WAIT`]: its asker has given up).
    fn dial_inbound(&mut self) {
        for request in self.shared.control.take_inbound() {
            if request.asked.elapsed() > INBOUND_MAX_WAIT {
                continue;
            }
            let open = self.open_count();
            self.tcp.dial(request, &mut self.iface, &mut self.sockets, &mut self.shared, open);
        }
    }

    /// Hands the guest's frames to the interface one at a time; a SYN of a
    /// new TCP connection is admitted and held until its host connect
    /// finishes ([`Tcp::segment`]).
    fn ingest(&mut self, now: smoltcp::time::Instant) {
        while let Some(frame) = self.link.next_from_guest() {
            let tuple = match link::peek(&frame) {
                Peek::Tcp(tuple, syn) => {
                    let open = self.open_count();
                    if !self.tcp.segment(tuple, syn, &frame, &mut self.shared, self.dns.names(), open) {
                        self.link.recycle(frame);
                        continue;
                    }
                    Some(tuple)
                }
                Peek::Udp(tuple, mac, range) => {
                    if let Some(payload) = frame.get(range) {
                        let open = self.open_count();
                        self.udp.out(tuple, mac, payload, &mut self.shared, self.dns.names(), open);
                    }
                    self.link.recycle(frame);
                    continue;
                }
                Peek::Drop => {
                    self.shared.stats.frames_dropped += 1;
                    self.link.recycle(frame);
                    continue;
                }
                Peek::Ignore => {
                    self.link.recycle(frame);
                    continue;
                }
                Peek::Other => None,
            };
            self.link.load(frame);
            let _ = self.iface.poll_ingress_single(now, &mut self.link, &mut self.sockets);
            self.link.unload();
            if let Some(tuple) = tuple {
                self.tcp.after_frame(tuple, &mut self.sockets, &self.shared);
            }
        }
    }

    /// Arms the timerfd for the first deadline: smoltcp's, the resolver's,
    /// a connect's or a sniffing connection's, an idle UDP flow's. No
    /// smoltcp socket waits on a host connect (the SYN is held, not the
    /// socket), so smoltcp's delay is real: zero only while the queue
    /// toward the guest is full (then the eventfd wakes the stack).
    fn arm_timer(&mut self) {
        let now = Instant::now();
        let smoltcp = self.iface.poll_delay(self.now(), &self.sockets).map(Duration::from);
        let deadlines = [self.dns.next_deadline(), self.tcp.next_deadline(), self.udp.next_deadline()];
        let delay = deadlines.into_iter().flatten().map(|t| t.saturating_duration_since(now)).chain(smoltcp).min();
        let Some(mut delay) = delay else {
            if self.armed.take().is_some() {
                let _ = self.timer.clear();
            }
            return;
        };
        if delay.is_zero() {
            // Something wants out now: it waits for the guest to take
            // frames (the eventfd wakes us), or a moment.
            delay = if self.link.is_starved() { Duration::from_millis(50) } else { Duration::from_millis(1) };
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
}

const _: () = {
    const fn send<T: Send>() {}
    send::<NetStack>();
};
