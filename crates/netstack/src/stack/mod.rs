//! The NAT on smoltcp: guest Ethernet frames in and out, host sockets
//! behind. This module is the map; each part has a room of its own:
//!
//! - `link`: the Ethernet link to the guest (the smoltcp device and its
//!   bounded queues) and the look taken at each guest frame before the
//!   interface sees it;
//! - `admit`: one admission path for every new connection and flow
//!   (policy verdict, connection cap, host socket, log record);
//! - `tcp`: guest TCP connections spliced to host sockets, with the
//!   name checks of the egress policy (TLS SNI, HTTP `Host`, DNS over TCP),
//!   and inbound connections from the host into a guest port
//!   ([`NetControl::connect_inbound`]);
//! - `udp`: the UDP NAT (every UDP flow but DNS);
//! - [`crate::dns`]: the resolver at [`DNS_ADDR`], a smoltcp UDP socket.
//!
//! One smoltcp [`Interface`] (Medium::Ethernet, [`GATEWAY_MAC`], addresses
//! [`GATEWAY_ADDR`]/24 and [`DNS_ADDR`]/24, "any IP" with a default route
//! via [`GATEWAY_ADDR`]) takes every frame the guest sends, whatever the
//! destination address, one at a time: a TCP SYN is admitted just before
//! it goes in, a UDP datagram for the NAT never goes in. ICMP echo is
//! answered for [`GATEWAY_ADDR`] and [`DNS_ADDR`] only (not forwarded).
//! TCP connections and UDP flows count against
//! [`StackConfig::max_connections`].
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

pub use self::admit::RULE_LIMIT_CONNECTIONS;
use self::link::{Link, Peek};
use self::tcp::Tcp;
pub use self::tcp::{RULE_DNS_TCP, RULE_INBOUND, SNIFF_WAIT};
use self::udp::Udp;
pub use self::udp::UDP_IDLE_TIMEOUT;
use crate::control::{NetControl, INBOUND_MAX_WAIT};
pub use crate::dns::resolv_conf_upstreams;
use crate::dns::Resolver;
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

/// epoll tokens: the timerfd, the eventfd, the resolver's host sockets,
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
    next_token: u64,
}

impl Shared {
    fn new(control: Arc<NetControl>, max_connections: usize) -> Result<Self, StackError> {
        let epoll = Epoll::new().map_err(StackError::Setup)?;
        Ok(Self { control, epoll, stats: StackStats::default(), max_connections, next_token: TOKEN_CONN_BASE })
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
}

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
        let dns = Resolver::new(&config.dns_upstreams, &config.static_hosts, &mut sockets, seed >> 16)?;
        let shared = Shared::new(control, config.max_connections)?;
        let timer = TimerFd::new().map_err(|e| StackError::Setup(io::Error::from_raw_os_error(e.errno())))?;
        let wake = EventFd::new(EFD_NONBLOCK).map_err(StackError::Setup)?;
        shared.watch(timer.as_raw_fd(), TOKEN_TIMER)?;
        shared.watch(wake.as_raw_fd(), TOKEN_WAKE)?;
        shared.control.set_inbound_waker(wake.try_clone().map_err(StackError::Setup)?);
        for fd in dns.host_fds() {
            shared.watch(fd, TOKEN_DNS)?;
        }
        Ok(Self {
            iface,
            link,
            sockets,
            shared,
            tcp: Tcp::new(config.tcp_buffer_bytes, config.dns_upstreams.first().copied()),
            udp: Udp::new(),
            dns,
            timer,
            wake,
            epoch,
            events: vec![EpollEvent::default(); 256],
            dns_ready: false,
            woken: false,
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
        self.tcp.service_all(&mut self.sockets, &self.shared);
        let dns_ready = std::mem::take(&mut self.dns_ready);
        self.dns.poll(&mut self.sockets, &self.shared.control, Instant::now(), dns_ready);
        self.udp.poll(&mut self.link, &self.shared);
        while self.iface.poll_egress(now, &mut self.link, &mut self.sockets) == PollResult::SocketStateChanged {}
        self.tcp.service_all(&mut self.sockets, &self.shared);
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
        StackStats { open_connections: self.open_count(), ..self.shared.stats }
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

    /// Hands the guest's frames to the interface one at a time, admitting
    /// new TCP connections just before their SYN goes in.
    fn ingest(&mut self, now: smoltcp::time::Instant) {
        while let Some(frame) = self.link.next_from_guest() {
            let tuple = match link::peek(&frame) {
                Peek::Tcp(tuple, syn) => {
                    if syn {
                        let open = self.open_count();
                        self.tcp.on_syn(tuple, &mut self.sockets, &mut self.shared, self.dns.names(), open);
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
    /// a sniffing connection's, an idle UDP flow's.
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
