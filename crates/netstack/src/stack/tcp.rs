//! Guest TCP connections, each ended in a smoltcp socket and spliced to a
//! non-blocking host socket.
//!
//! A guest SYN (RFC 9293 §3.5) for a 4-tuple with no connection yet goes
//! through [`super::admit`]; a refused one gets no listener, so smoltcp
//! answers with a RST. An admitted one starts the host connect and is
//! held, frame and all, with no smoltcp socket and no buffer yet
//! ([`State::Connecting`]; the guest's retransmitted SYNs are dropped
//! meanwhile). When the host connect finishes, a smoltcp socket listening
//! on exactly that destination is made and the SYN handed to the
//! interface, which answers with the SYN-ACK; a host connect that fails or
//! takes longer than [`StackConfig::connect_timeout`](super::StackConfig::connect_timeout)
//! hands the SYN over with no listener, so the guest gets a RST. Then
//! bytes flow both ways through the smoltcp socket buffers (no copy in
//! between; a full buffer stops the reads of the other side, by host
//! socket interest or TCP window), FIN and RST pass both ways. A
//! connection ends (its socket and buffers go) when both sides are closed:
//! the smoltcp socket does not linger in TIME-WAIT (RFC 9293 §3.6.1 keeps
//! it to answer a retransmitted FIN and to keep old segments out of a new
//! connection; on this lossless virtual link a late FIN gets a RST, which
//! the guest takes as the end it was waiting for anyway).
//!
//! A connection into the guest (an inbound one, [`Tcp::dial`]) is the
//! other way round: the host's end is a Unix stream the daemon holds
//! ([`NetControl::connect_inbound`](crate::control::NetControl::connect_inbound)),
//! the smoltcp socket connects from the gateway to the guest's port
//! ([`State::Dialing`]), and once the guest accepts, bytes flow as above. A
//! guest that refuses closes the host's end before any byte.
//!
//! What the guest's bytes wait for before they reach the host is the
//! connection's [`Gate`] (see `gate`): nothing, the names it must show
//! (TLS SNI, every HTTP request's `Host`) when the policy's
//! [`NameCheck`](crate::policy::NameCheck) for its address asks for them,
//! or, for DNS over TCP to the resolver, each whole query judged by its
//! name.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use smoltcp::iface::{Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp;
use smoltcp::wire::IpListenEndpoint;
use socket2::{Domain, SockAddr, Socket, Type};
use vmm_sys_util::epoll::{Epoll, EventSet};

use super::admit::{admit, Ask, Meter};
use super::gate::{Gate, Refusal, Secrets, RULE_SECRET_LEAK};
use super::interest::Interest;
use super::{Shared, StackConfig, Tuple};
use crate::control::{Handoff, InboundRequest, NetControl};
use crate::dns::NameMap;
use crate::log::{Direction, Protocol};
use crate::policy::Verdict;
use crate::{DNS_ADDR, GATEWAY_ADDR, GUEST_ADDR};

/// The rule of a log record for DNS over TCP to the resolver (refused
/// when there is no upstream; each query is judged by name).
pub const RULE_DNS_TCP: &str = "dns:tcp";

/// The rule of a log record for an inbound connection (the host's own,
/// not judged by the egress policy; the cap applies).
pub const RULE_INBOUND: &str = "inbound";

/// The gateway's ports for inbound connections (RFC 6335 §6: the dynamic
/// range).
const INBOUND_PORTS: std::ops::RangeInclusive<u16> = 49152..=65535;

/// smoltcp aborts a connection whose guest does not acknowledge data for
/// this long.
const GUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a connection whose both sides closed keeps its smoltcp socket:
/// long enough for smoltcp to send its ACK of the guest's FIN (it delays
/// ACKs by 10 ms), then its buffers go (instead of the 10 s smoltcp's
/// TIME-WAIT would keep them).
const FINAL_ACK_GRACE: Duration = Duration::from_millis(50);

/// A SYN frame held while its host connect runs, at most (bytes): an
/// Ethernet, an IPv4 and a TCP header with all their options (14 + 60 +
/// 60) and room to spare. A longer SYN carries data (TCP Fast Open, which
/// smoltcp never offers) and is dropped.
pub(super) const MAX_SYN_FRAME: usize = 256;

/// The scratch buffer of [`Tcp`] (bytes): what a [`Gate`] looks at, at
/// most one DNS-over-TCP message.
pub(super) const SCRATCH_BYTES: usize = 2 + 65535;

/// The smoltcp buffer per direction for
/// [`StackConfig::tcp_buffer_bytes`](super::StackConfig::tcp_buffer_bytes)
/// (bytes).
pub(super) fn buffer_bytes(configured: usize) -> usize {
    configured.max(4096)
}

/// The sandbox's secrets as a connection's gate asks about them: its
/// [`Handoff`], and where a leak is logged.
struct SandboxSecrets<'a> {
    handoff: Option<std::sync::Arc<dyn Handoff>>,
    control: &'a NetControl,
    dst: SocketAddrV4,
}

impl Secrets for SandboxSecrets<'_> {
    fn wants(&mut self, name: &str) -> bool {
        self.handoff.as_ref().is_some_and(|h| h.wants(name))
    }

    fn leak(&mut self, host: &str, head: &[u8]) -> bool {
        let Some(h) = &self.handoff else { return false };
        let found = h.leaked(host, head);
        if found.is_empty() {
            return false;
        }
        let refuse = h.refuse_leaks();
        let verdict = Verdict { allowed: !refuse, rule: RULE_SECRET_LEAK.to_owned() };
        let mut record = crate::log::NetRecord::starting(
            Protocol::Tcp,
            std::net::IpAddr::V4(super::admit::host_ip(*self.dst.ip())),
            self.dst.port(),
            Some(host.to_owned()).filter(|h| !h.is_empty()),
            verdict,
        );
        record.secrets = found;
        record.duration_ms = Some(0);
        self.control.record(record);
        refuse
    }
}

/// Hands an open connection whose ClientHello names `name` to the secret
/// broker: its host socket is given to the broker as the upstream, and a
/// stream pair's end takes its place in the splice (the ClientHello, still
/// in the smoltcp socket's buffer, goes on to the broker through it).
///
/// Errors: the pair cannot be made (the caller resets the connection).
fn hand_to_broker(
    record: u64,
    open: &mut Open,
    interest: &mut Interest,
    shared: &Shared,
    name: String,
) -> io::Result<()> {
    let Some(handoff) = shared.control.handoff() else {
        return Err(io::Error::other("the sandbox's secrets went away"));
    };
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    interest.clear(&shared.epoll, open.host.as_raw_fd());
    let upstream = std::mem::replace(&mut open.host, Socket::from(ours));
    open.readable = true;
    open.writable = true;
    shared.control.update(record, |r| {
        if r.domain.is_none() {
            r.domain = Some(name.clone());
        }
    });
    handoff.take(name, theirs, std::net::TcpStream::from(upstream), record);
    Ok(())
}

/// The `SO_RCVBUF`/`SO_SNDBUF` asked for
/// [`StackConfig::host_buffer_bytes`](super::StackConfig::host_buffer_bytes)
/// (bytes; Linux doubles it).
pub(super) fn host_buffer_bytes(configured: usize) -> usize {
    configured.max(4096)
}

/// Where a connection is.
#[derive(Debug)]
enum State {
    /// The host connect is under way; the guest's SYN waits here (`syn`:
    /// the whole frame) and the connection has no smoltcp socket yet.
    /// `writable`: the host socket was reported writable (connect done or
    /// failed) and not looked at yet; `deadline`: when the connect is given
    /// up.
    Connecting { host: Socket, writable: bool, syn: Vec<u8>, deadline: Instant },
    /// Inbound: the smoltcp socket's SYN is on its way to the guest; the
    /// host's end waits (its bytes stay in its buffer).
    Dialing { host: Socket },
    /// The host connect finished: bytes flow.
    Open(Open),
    /// Reset both ways: waiting for smoltcp to send the guest its RST.
    Aborted,
}

/// A connection whose host connect finished.
#[derive(Debug)]
struct Open {
    host: Socket,
    /// The host socket was reported readable and not yet read empty.
    readable: bool,
    /// The host socket was not found full since it was reported writable.
    writable: bool,
    /// The host sent its FIN (read returned 0); the guest's side is closing.
    host_eof: bool,
    /// The guest's FIN was passed on (`shutdown(Write)` on the host).
    guest_eof: bool,
    /// When both sides were found closed (the smoltcp socket in
    /// TIME-WAIT); it goes [`FINAL_ACK_GRACE`] later.
    finished: Option<Instant>,
}

impl State {
    /// The host socket, if the state has one.
    fn into_host(self) -> Option<Socket> {
        match self {
            State::Connecting { host, .. } | State::Dialing { host } => Some(host),
            State::Open(o) => Some(o.host),
            State::Aborted => None,
        }
    }
}

/// One guest TCP connection.
#[derive(Debug)]
struct Conn {
    tuple: Tuple,
    /// Its smoltcp socket (`None` while [`State::Connecting`]).
    handle: Option<SocketHandle>,
    state: State,
    gate: Gate,
    interest: Interest,
    meter: Meter,
}

impl Conn {
    /// The host connect (outbound) or the guest's accept (inbound)
    /// finished: bytes may flow. Returns the SYN held while connecting.
    fn establish(&mut self) -> Option<Vec<u8>> {
        let (host, syn) = match std::mem::replace(&mut self.state, State::Aborted) {
            State::Connecting { host, syn, .. } => (host, Some(syn)),
            State::Dialing { host } => (host, None),
            other => {
                self.state = other;
                return None;
            }
        };
        self.state = State::Open(Open {
            host,
            readable: true,
            writable: true,
            host_eof: false,
            guest_eof: false,
            finished: None,
        });
        syn
    }

    /// Resets both sides: RST to the guest (smoltcp sends it; then the
    /// connection is removed) and to the host.
    fn abort(&mut self, socket: &mut tcp::Socket, epoll: &Epoll) {
        socket.abort();
        if let Some(host) = std::mem::replace(&mut self.state, State::Aborted).into_host() {
            self.interest.clear(epoll, host.as_raw_fd());
            let _ = host.set_linger(Some(Duration::ZERO));
        }
    }

    /// Registers exactly the host events the connection waits for
    /// (`socket`: its smoltcp socket, once it has one).
    fn update_interest(&mut self, socket: Option<&tcp::Socket>, epoll: &Epoll, token: u64) {
        let (fd, want) = match (&self.state, socket) {
            (State::Connecting { host, .. }, _) => (host.as_raw_fd(), EventSet::OUT),
            (State::Open(o), Some(socket)) => {
                let mut want = EventSet::empty();
                if !o.host_eof && !o.readable && socket.may_send() && socket.send_queue() < socket.send_capacity() {
                    want |= EventSet::IN;
                }
                if !o.writable && self.gate.cleared() > 0 && socket.recv_queue() > 0 {
                    want |= EventSet::OUT;
                }
                (o.host.as_raw_fd(), want)
            }
            (State::Open(_) | State::Dialing { .. } | State::Aborted, _) => return,
        };
        self.interest.set(epoll, fd, token, want);
    }

    /// Notes what epoll reported for the host socket.
    fn ready(&mut self, set: EventSet) {
        let readable = set.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR | EventSet::READ_HANG_UP);
        let writable = set.intersects(EventSet::OUT | EventSet::HANG_UP | EventSet::ERROR);
        match &mut self.state {
            State::Connecting { writable: w, .. } => *w |= writable,
            State::Open(o) => {
                o.readable |= readable;
                o.writable |= writable;
            }
            State::Dialing { .. } | State::Aborted => {}
        }
    }
}

/// The TCP connections of one stack.
pub(super) struct Tcp {
    /// Connections by epoll token, and their tokens by 4-tuple.
    conns: HashMap<u64, Conn>,
    by_tuple: HashMap<Tuple, u64>,
    /// SYNs whose host connect finished or failed, for the interface now.
    released: Vec<(Tuple, Vec<u8>)>,
    /// smoltcp buffer per direction per connection (bytes).
    buffer_bytes: usize,
    /// `SO_RCVBUF`/`SO_SNDBUF` asked for each host socket (bytes).
    host_buffer_bytes: usize,
    /// [`StackConfig::connect_timeout`](super::StackConfig::connect_timeout).
    connect_timeout: Duration,
    /// Where DNS over TCP to the resolver goes (`None`: refused).
    dns_upstream: Option<SocketAddr>,
    /// The guest's bytes a gate looks at: up to one DNS-over-TCP message
    /// (2-byte length + up to 64 KiB), or the first bytes of a connection.
    scratch: Vec<u8>,
    /// The gateway port the next inbound connection tries first.
    next_inbound_port: u16,
}

impl Tcp {
    /// No connections; buffers, the connect timeout and DNS over TCP
    /// (to the first upstream) as `config` says.
    pub(super) fn new(config: &StackConfig) -> Self {
        Self {
            conns: HashMap::new(),
            by_tuple: HashMap::new(),
            released: Vec::new(),
            buffer_bytes: buffer_bytes(config.tcp_buffer_bytes),
            host_buffer_bytes: host_buffer_bytes(config.host_buffer_bytes),
            connect_timeout: config.connect_timeout,
            dns_upstream: config.dns_upstreams.first().copied(),
            scratch: vec![0; SCRATCH_BYTES],
            next_inbound_port: *INBOUND_PORTS.start(),
        }
    }

    /// Connections open now.
    pub(super) fn open_count(&self) -> usize {
        self.conns.len()
    }

    /// A guest TCP segment of `tuple` (`syn`: a SYN without ACK, checksums
    /// verified; `frame`: the whole frame), before the interface sees it;
    /// `true`: give it to the interface. A segment of a connection whose
    /// host connect runs is dropped (the guest retransmits its SYN); a SYN
    /// for a 4-tuple with no connection is admitted ([`Tcp::on_syn`]):
    /// held if admitted, given to the interface (which answers with a
    /// RST) if not. `open`: connections and flows open now.
    pub(super) fn segment(
        &mut self,
        tuple: Tuple,
        syn: bool,
        frame: &[u8],
        shared: &mut Shared,
        names: &NameMap,
        open: usize,
    ) -> bool {
        if let Some(conn) = self.by_tuple.get(&tuple).and_then(|t| self.conns.get(t)) {
            return !matches!(conn.state, State::Connecting { .. });
        }
        if !syn {
            return true;
        }
        if frame.len() > MAX_SYN_FRAME {
            shared.stats.frames_dropped += 1;
            return false;
        }
        !self.on_syn(tuple, frame, shared, names, open)
    }

    /// Admits a new connection for the guest SYN `frame` of `tuple`;
    /// `true`: admitted, the host connect started and the frame held.
    fn on_syn(&mut self, tuple: Tuple, frame: &[u8], shared: &mut Shared, names: &NameMap, open: usize) -> bool {
        let dst = tuple.dst;
        // DNS over TCP to the resolver (RFC 7766: a client retries there
        // after a truncated answer) goes to the first upstream.
        let dns = *dst.ip() == DNS_ADDR && dst.port() == 53;
        let (protocol, fixed) = if dns {
            let verdict = Verdict { allowed: self.dns_upstream.is_some(), rule: RULE_DNS_TCP.to_owned() };
            (Protocol::Dns, Some(verdict))
        } else {
            (Protocol::Tcp, None)
        };
        let ask = Ask { protocol, direction: Direction::Outbound, dst, fixed };
        let Some(admitted) = admit(ask, &shared.control.clone(), names, shared.cap(open)) else {
            return false;
        };
        let inspect = shared.control.handoff().is_some_and(|h| h.active());
        let gate = match (dns, inspect) {
            (true, _) => Gate::dns(),
            (false, true) => Gate::inspecting(admitted.names),
            (false, false) => Gate::new(admitted.names),
        };
        let target = match self.dns_upstream.filter(|_| dns) {
            Some(upstream) => upstream,
            None => SocketAddr::V4(SocketAddrV4::new(admitted.host_ip, dst.port())),
        };
        let Some((host, meter)) = admitted.open(&shared.control, || connect(target, self.host_buffer_bytes)) else {
            return false;
        };
        let deadline = Instant::now() + self.connect_timeout;
        let state = State::Connecting { host, writable: true, syn: frame.to_vec(), deadline };
        self.add(Conn { tuple, handle: None, state, gate, interest: Interest::default(), meter }, shared);
        true
    }

    /// Dials the inbound connection `request` asked for: a smoltcp socket
    /// connecting from a free gateway port to the guest's port (its SYN
    /// goes out at the next egress poll), spliced to the request's stream
    /// once the guest accepts. Refused by the cap (`open`: connections and
    /// flows open now) or with no free gateway port, it is logged and the
    /// stream closed.
    pub(super) fn dial(
        &mut self,
        request: InboundRequest,
        iface: &mut Interface,
        sockets: &mut SocketSet<'static>,
        shared: &mut Shared,
        open: usize,
    ) {
        let dst = SocketAddrV4::new(GUEST_ADDR, request.port);
        let Some(local) = self.free_inbound_port(dst) else {
            tracing::warn!("inbound connection to guest port {}: no free gateway port", request.port);
            return;
        };
        let tuple = Tuple { guest: dst, dst: SocketAddrV4::new(GATEWAY_ADDR, local) };
        let fixed = Some(Verdict { allowed: true, rule: RULE_INBOUND.to_owned() });
        let ask = Ask { protocol: Protocol::Tcp, direction: Direction::Inbound, dst, fixed };
        let control = shared.control.clone();
        let Some(admitted) = admit(ask, &control, &NameMap::default(), shared.cap_inbound(open)) else {
            return;
        };
        let opened = admitted.open(&shared.control, || {
            let host = Socket::from(std::os::fd::OwnedFd::from(request.stream));
            host.set_nonblocking(true)?;
            let mut socket = new_socket(self.buffer_bytes);
            socket
                .connect(iface.context(), (GUEST_ADDR, request.port), (GATEWAY_ADDR, local))
                .map_err(|e| io::Error::other(format!("connect: {e}")))?;
            Ok((host, socket))
        });
        if let Some(((host, socket), meter)) = opened {
            let (handle, state) = (Some(sockets.add(socket)), State::Dialing { host });
            self.add(Conn { tuple, handle, state, gate: Gate::Open, interest: Interest::default(), meter }, shared);
        }
    }

    /// The SYNs to hand to the interface now, with their 4-tuples (see
    /// [`State::Connecting`]).
    pub(super) fn take_released(&mut self) -> Vec<(Tuple, Vec<u8>)> {
        std::mem::take(&mut self.released)
    }

    /// The data the connections hold now (bytes): queued in their smoltcp
    /// sockets and in their host sockets' kernel buffers.
    pub(super) fn buffered_bytes(&self, sockets: &SocketSet<'static>) -> u64 {
        self.conns
            .values()
            .map(|c| {
                let smoltcp = c.handle.map_or(0, |h| {
                    let s = sockets.get::<tcp::Socket>(h);
                    s.recv_queue() + s.send_queue()
                });
                let host = match &c.state {
                    State::Connecting { host, .. } | State::Dialing { host } => kernel_queued(host),
                    State::Open(o) => kernel_queued(&o.host),
                    State::Aborted => 0,
                };
                smoltcp as u64 + host
            })
            .sum()
    }

    /// Registers `conn` under a new token.
    fn add(&mut self, conn: Conn, shared: &mut Shared) {
        let token = shared.token();
        self.by_tuple.insert(conn.tuple, token);
        self.conns.insert(token, conn);
    }

    /// A gateway port no connection to `guest` uses, from
    /// [`INBOUND_PORTS`] in turn.
    fn free_inbound_port(&mut self, guest: SocketAddrV4) -> Option<u16> {
        let span = usize::from(INBOUND_PORTS.end() - INBOUND_PORTS.start()) + 1;
        for _ in 0..span {
            let port = self.next_inbound_port;
            self.next_inbound_port = if port == *INBOUND_PORTS.end() { *INBOUND_PORTS.start() } else { port + 1 };
            let tuple = Tuple { guest, dst: SocketAddrV4::new(GATEWAY_ADDR, port) };
            if !self.by_tuple.contains_key(&tuple) {
                return Some(port);
            }
        }
        None
    }

    /// After the interface took a frame of `tuple`: a connection whose
    /// socket still (or again) listens did not get (or lost) its SYN, and
    /// is forgotten, so no other SYN can land on its listener.
    pub(super) fn after_frame(&mut self, tuple: Tuple, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let Some(&token) = self.by_tuple.get(&tuple) else {
            return;
        };
        let listening = self
            .conns
            .get(&token)
            .and_then(|c| c.handle)
            .is_some_and(|h| sockets.get::<tcp::Socket>(h).state() == tcp::State::Listen);
        if listening {
            self.close(token, true, sockets, shared);
        }
    }

    /// Notes epoll's `set` for connection `token`; `false` if it is none.
    pub(super) fn ready(&mut self, token: u64, set: EventSet) -> bool {
        match self.conns.get_mut(&token) {
            Some(conn) => {
                conn.ready(set);
                true
            }
            None => false,
        }
    }

    /// Services every connection (`starved`: the queue toward the guest
    /// was full, so a finished connection's last ACK may still wait).
    pub(super) fn service_all(&mut self, sockets: &mut SocketSet<'static>, shared: &mut Shared, starved: bool) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.service(token, sockets, shared, starved);
        }
    }

    /// When the first connect is given up, a finished connection goes or
    /// the first sniffing connection stops waiting for a name.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.conns
            .values()
            .filter_map(|c| match (&c.state, &c.gate) {
                (State::Connecting { deadline, .. }, _) => Some(*deadline),
                (State::Open(Open { finished: Some(t), .. }), _) => Some(*t + FINAL_ACK_GRACE),
                (_, gate) => gate.deadline(),
            })
            .min()
    }

    /// Drops every connection, resetting the host sides; the guest's next
    /// segment on one gets a RST (no socket matches it).
    pub(super) fn reset(&mut self, sockets: &mut SocketSet<'static>, shared: &Shared) {
        self.released.clear();
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.close(token, true, sockets, shared);
        }
    }

    /// A connection whose host connect runs: once it is known, the held
    /// SYN goes to the interface, to a new listener (connected) or to none
    /// (refused, failed or past its deadline: the guest gets a RST).
    fn service_connecting(&mut self, token: u64, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let State::Connecting { host, writable, deadline, .. } = &mut conn.state else {
            return;
        };
        let connected = if *writable {
            match host.take_error() {
                Ok(None) if host.peer_addr().is_ok() => Some(true),
                Ok(None) => {
                    // Not yet (a spurious wake-up).
                    *writable = false;
                    None
                }
                _ => Some(false),
            }
        } else {
            None
        };
        let connected = match connected {
            None if Instant::now() < *deadline => {
                conn.update_interest(None, &shared.epoll, token);
                return;
            }
            None => false,
            Some(c) => c,
        };
        let listener = connected.then(|| listening_socket(self.buffer_bytes, conn.tuple.dst)).and_then(Result::ok);
        let tuple = conn.tuple;
        match listener {
            Some(socket) => {
                conn.handle = Some(sockets.add(socket));
                if let Some(syn) = conn.establish() {
                    self.released.push((tuple, syn));
                }
            }
            None => {
                if let State::Connecting { syn, .. } = &mut conn.state {
                    self.released.push((tuple, std::mem::take(syn)));
                }
                self.close(token, true, sockets, shared);
            }
        }
    }

    /// Moves data of one connection, passes FIN/RST on, updates interest,
    /// and removes it when both sides are done.
    fn service(&mut self, token: u64, sockets: &mut SocketSet<'static>, shared: &Shared, starved: bool) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let Some(handle) = conn.handle else {
            self.service_connecting(token, sockets, shared);
            return;
        };
        let socket = sockets.get_mut::<tcp::Socket>(handle);
        match &mut conn.state {
            State::Aborted => {
                if socket.remote_endpoint().is_none() {
                    self.close(token, false, sockets, shared);
                }
                return;
            }
            State::Connecting { .. } => return,
            State::Dialing { .. } => match socket.state() {
                tcp::State::SynSent => return,
                tcp::State::Closed | tcp::State::Listen => {
                    // Refused (RST) or timed out: the host's end closes.
                    self.close(token, false, sockets, shared);
                    return;
                }
                _ => {
                    conn.establish();
                }
            },
            State::Open(_) => {}
        }
        let State::Open(open) = &mut conn.state else {
            return;
        };
        let state = socket.state();
        match state {
            tcp::State::Listen => {
                self.close(token, true, sockets, shared);
                return;
            }
            tcp::State::Closed => {
                // The guest reset it (or it timed out): reset the host side.
                let clean = open.host_eof && open.guest_eof;
                self.close(token, !clean, sockets, shared);
                return;
            }
            tcp::State::SynReceived => {
                conn.update_interest(Some(socket), &shared.epoll, token);
                return;
            }
            _ => {}
        }
        // Both ways; once more when the host's answer released guest bytes
        // the gate held (Gate::host_sent).
        let mut released = true;
        while std::mem::take(&mut released) {
            // Guest -> host: what the gate clears, looked at first when it
            // clears nothing.
            loop {
                if conn.gate.cleared() == 0 {
                    let window = conn.gate.window();
                    let queued = socket.recv_queue().min(window);
                    let n = socket.peek_slice(&mut self.scratch[..queued]).unwrap_or(0);
                    let more = socket.may_recv() && n < window.min(socket.recv_capacity());
                    let (control, meter) = (&shared.control, &conn.meter);
                    let looked = self.scratch.get(..n).unwrap_or(&[]);
                    let mut secrets = SandboxSecrets { handoff: control.handoff(), control, dst: conn.tuple.dst };
                    let verdict = conn.gate.advance_with(
                        looked,
                        more,
                        Instant::now(),
                        &mut |name| meter.judge_name(control, name),
                        &mut secrets,
                    );
                    match verdict {
                        Err(refusal) => {
                            if let Refusal::Rule(rule) = refusal {
                                conn.meter.refuse(&shared.control, rule);
                            }
                            conn.abort(socket, &shared.epoll);
                            return;
                        }
                        Ok(Some(name)) => {
                            if let Err(e) = hand_to_broker(conn.meter.record(), open, &mut conn.interest, shared, name)
                            {
                                tracing::warn!("secret broker hand-over: {e}");
                                conn.abort(socket, &shared.epoll);
                                return;
                            }
                        }
                        Ok(None) => {}
                    }
                    if conn.gate.cleared() == 0 {
                        break;
                    }
                }
                if !open.writable || !socket.can_recv() {
                    break;
                }
                let limit = usize::try_from(conn.gate.cleared()).unwrap_or(usize::MAX);
                let host = &open.host;
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
                        conn.meter.bytes_out += n as u64;
                        conn.gate.passed(n);
                    }
                    Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => open.writable = false,
                    Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                    Ok(Err(_)) => {
                        conn.abort(socket, &shared.epoll);
                        return;
                    }
                }
            }
            if !open.guest_eof && !socket.may_recv() && socket.recv_queue() == 0 {
                open.guest_eof = true;
                let _ = open.host.shutdown(Shutdown::Write);
            }
            // Host -> guest, every byte shown to the gate.
            while open.readable && !open.host_eof && socket.may_send() && socket.send_queue() < socket.send_capacity() {
                let (host, gate) = (&open.host, &mut conn.gate);
                let r = socket.send(|buf| match (&*host).read(buf) {
                    Ok(n) => {
                        released |= gate.host_sent(buf.get(..n).unwrap_or(&[]));
                        (n, Ok(n))
                    }
                    Err(e) => (0, Err(e)),
                });
                match r {
                    Ok(Ok(0)) => {
                        open.host_eof = true;
                        socket.close();
                    }
                    Ok(Ok(n)) => conn.meter.bytes_in += n as u64,
                    Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => open.readable = false,
                    Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                    Ok(Err(_)) => {
                        conn.abort(socket, &shared.epoll);
                        return;
                    }
                    Err(_) => break,
                }
            }
        }
        if open.host_eof && open.guest_eof && state == tcp::State::TimeWait {
            // Both sides are done: the socket and its buffers go once its
            // last ACK is out.
            let now = Instant::now();
            let since = *open.finished.get_or_insert(now);
            if now >= since + FINAL_ACK_GRACE && !starved {
                self.close(token, false, sockets, shared);
                return;
            }
        }
        conn.update_interest(Some(socket), &shared.epoll, token);
    }

    /// Removes a connection and its smoltcp socket, and completes its log
    /// record; `reset_host`: the host side gets a RST instead of a FIN.
    fn close(&mut self, token: u64, reset_host: bool, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let Some(mut conn) = self.conns.remove(&token) else {
            return;
        };
        self.by_tuple.remove(&conn.tuple);
        if let Some(host) = std::mem::replace(&mut conn.state, State::Aborted).into_host() {
            conn.interest.clear(&shared.epoll, host.as_raw_fd());
            if reset_host {
                let _ = host.set_linger(Some(Duration::ZERO));
            }
        }
        conn.meter.close(&shared.control);
        if let Some(handle) = conn.handle {
            sockets.remove(handle);
        }
    }
}

/// A smoltcp socket for a new connection: `buffer_bytes` each way, no
/// Nagle, the guest's acknowledgement timeout.
fn new_socket(buffer_bytes: usize) -> tcp::Socket<'static> {
    let mut socket =
        tcp::Socket::new(tcp::SocketBuffer::new(vec![0; buffer_bytes]), tcp::SocketBuffer::new(vec![0; buffer_bytes]));
    socket.set_nagle_enabled(false);
    socket.set_timeout(Some(GUEST_TIMEOUT.into()));
    socket
}

/// A smoltcp socket listening on exactly `dst` (for the held SYN).
fn listening_socket(buffer_bytes: usize, dst: SocketAddrV4) -> io::Result<tcp::Socket<'static>> {
    let mut socket = new_socket(buffer_bytes);
    socket
        .listen(IpListenEndpoint { addr: Some((*dst.ip()).into()), port: dst.port() })
        .map_err(|e| io::Error::other(format!("listen: {e}")))?;
    Ok(socket)
}

/// The data bytes a host socket's kernel buffers hold now: unread
/// (`SIOCINQ`) plus unsent or unacknowledged (`SIOCOUTQ`), tcp(7) and
/// unix(7); 0 where the ioctl fails.
fn kernel_queued(socket: &Socket) -> u64 {
    let fd = socket.as_raw_fd();
    [libc::FIONREAD, libc::TIOCOUTQ]
        .into_iter()
        .map(|request| {
            let mut n: libc::c_int = 0;
            // SAFETY: `fd` is a socket this stack owns and keeps open for
            // the call; both requests write one c_int to the pointer given,
            // which points at `n`, alive for the call.
            let r = unsafe { libc::ioctl(fd, request, &mut n as *mut libc::c_int) };
            if r == 0 {
                u64::try_from(n).unwrap_or(0)
            } else {
                0
            }
        })
        .sum()
}

/// A non-blocking host TCP socket connecting to `target`, its kernel
/// buffers asked to be `buffer_bytes` each way (see
/// [`StackConfig::host_buffer_bytes`](super::StackConfig::host_buffer_bytes)).
fn connect(target: SocketAddr, buffer_bytes: usize) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    socket.set_recv_buffer_size(buffer_bytes)?;
    socket.set_send_buffer_size(buffer_bytes)?;
    match socket.connect(&SockAddr::from(target)) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(socket)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, TcpListener};
    use std::sync::Arc;

    use vmm_sys_util::epoll::EpollEvent;

    use super::*;
    use crate::control::NetControl;
    use crate::policy::{Egress, NetworkPolicy, ServerNetPolicy};
    use crate::{GATEWAY_ADDR, GUEST_ADDR};

    /// The table, its socket set and what it shares, under a policy that
    /// allows the host's loopback (the gateway) and, with `domains`, has a
    /// domain rule.
    fn world(max_connections: usize, domains: bool) -> (Tcp, SocketSet<'static>, Shared) {
        let mut allow = vec!["127.0.0.1/32".to_string()];
        if domains {
            allow.push("example.com".into());
        }
        let policy = NetworkPolicy { egress: Egress::Deny, allow, deny: Vec::new() };
        let server =
            ServerNetPolicy { permit_ranges: vec!["127.0.0.0/8".parse().unwrap()], host_addrs: Default::default() };
        let control = NetControl::new(&policy, None, Arc::new(server), 64).unwrap();
        let config = StackConfig {
            dns_upstreams: Vec::new(),
            tcp_buffer_bytes: 4096,
            host_buffer_bytes: 4096,
            connect_timeout: Duration::from_secs(20),
            ..StackConfig::default()
        };
        (Tcp::new(&config), SocketSet::new(Vec::new()), Shared::new(control, max_connections, None).unwrap())
    }

    fn tuple(guest_port: u16, dst: SocketAddrV4) -> Tuple {
        Tuple { guest: SocketAddrV4::new(GUEST_ADDR, guest_port), dst }
    }

    fn gateway(l: &TcpListener) -> SocketAddrV4 {
        SocketAddrV4::new(GATEWAY_ADDR, l.local_addr().unwrap().port())
    }

    fn only(tcp: &Tcp) -> &Conn {
        assert_eq!(tcp.conns.len(), 1);
        tcp.conns.values().next().unwrap()
    }

    /// A stand-in for a SYN frame (the table does not parse it).
    const SYN: &[u8] = b"a SYN frame";

    /// Services and waits on the epoll set until `done` (at most 5 s).
    fn service_until(
        tcp: &mut Tcp,
        sockets: &mut SocketSet<'static>,
        shared: &mut Shared,
        done: impl Fn(&Tcp) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut events = vec![EpollEvent::default(); 4];
        loop {
            tcp.service_all(sockets, shared, false);
            if done(tcp) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out");
            let n = shared.epoll.wait(100, &mut events).unwrap();
            for e in &events[..n] {
                tcp.ready(e.data(), e.event_set());
            }
        }
    }

    #[test]
    fn an_admitted_syn_is_held_without_a_socket_until_the_host_connects() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        let t = tuple(40000, gateway(&l));
        assert!(!tcp.segment(t, true, SYN, &mut shared, &NameMap::default(), 0), "held, not for the interface");
        // The guest's retransmitted SYN is dropped while the connect runs.
        assert!(!tcp.segment(t, true, SYN, &mut shared, &NameMap::default(), 1));
        let conn = only(&tcp);
        assert!(matches!(conn.state, State::Connecting { writable: true, .. }));
        assert!(conn.handle.is_none() && sockets.iter().count() == 0, "no socket, no buffers yet");
        assert_eq!(conn.gate, Gate::Open);
        assert_eq!(tcp.open_count(), 1);
        // The host side reached the listener.
        l.set_nonblocking(false).unwrap();
        let (_peer, from) = l.accept().unwrap();
        assert!(from.ip().is_loopback());
        // Once the connect is done, the SYN is released to a listener.
        service_until(&mut tcp, &mut sockets, &mut shared, |tcp| !tcp.released.is_empty());
        assert_eq!(tcp.take_released(), vec![(t, SYN.to_vec())]);
        let conn = only(&tcp);
        assert!(matches!(conn.state, State::Open(_)));
        assert_eq!(sockets.get::<tcp::Socket>(conn.handle.unwrap()).state(), tcp::State::Listen);
        // The interface did not take it: the listener goes.
        tcp.after_frame(t, &mut sockets, &shared);
        assert!(tcp.conns.is_empty() && tcp.by_tuple.is_empty());
        assert_eq!(sockets.iter().count(), 0);
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 1);
        assert_eq!((log[0].addr, log[0].allowed), (Ipv4Addr::LOCALHOST.into(), true));
        assert!(log[0].duration_ms.is_some(), "the record is closed");
    }

    #[test]
    fn a_refused_or_timed_out_connect_releases_the_syn_to_no_listener() {
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let t = tuple(40001, gateway(&closed));
        drop(closed);
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        assert!(!tcp.segment(t, true, SYN, &mut shared, &NameMap::default(), 0));
        service_until(&mut tcp, &mut sockets, &mut shared, |tcp| tcp.conns.is_empty());
        assert_eq!(tcp.take_released(), vec![(t, SYN.to_vec())]);
        assert_eq!(sockets.iter().count(), 0);
        // A connect past its deadline: the same, without waiting for it.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let t = tuple(40002, gateway(&l));
        tcp.connect_timeout = Duration::ZERO;
        assert!(!tcp.segment(t, true, SYN, &mut shared, &NameMap::default(), 0));
        if let Some(State::Connecting { writable, .. }) = tcp.conns.values_mut().next().map(|c| &mut c.state) {
            *writable = false;
        }
        assert!(tcp.next_deadline().is_some_and(|d| d <= Instant::now()));
        tcp.service_all(&mut sockets, &mut shared, false);
        assert!(tcp.conns.is_empty());
        assert_eq!(tcp.take_released(), vec![(t, SYN.to_vec())]);
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 2);
        assert!(log.iter().all(|r| r.allowed && r.duration_ms.is_some()));
    }

    #[test]
    fn segments_of_unknown_connections_and_long_syns() {
        let (mut tcp, _sockets, mut shared) = world(8, false);
        let t = tuple(40003, SocketAddrV4::new(GATEWAY_ADDR, 9));
        // Not a SYN, no connection: the interface answers it (a RST).
        assert!(tcp.segment(t, false, SYN, &mut shared, &NameMap::default(), 0));
        // A SYN carrying data is dropped and counted.
        assert!(!tcp.segment(t, true, &[0; MAX_SYN_FRAME + 1], &mut shared, &NameMap::default(), 0));
        assert_eq!(shared.stats.frames_dropped, 1);
        assert!(tcp.conns.is_empty());
        assert!(shared.control.query(0, 10).0.is_empty());
    }

    #[test]
    fn refusals_log_and_open_nothing() {
        let (mut tcp, _sockets, mut shared) = world(1, false);
        let names = NameMap::default();
        // The policy: the interface gets the SYN (and answers with a RST).
        assert!(tcp.segment(
            tuple(1, SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 80)),
            true,
            SYN,
            &mut shared,
            &names,
            0
        ));
        // DNS over TCP with no upstream.
        assert!(tcp.segment(tuple(2, SocketAddrV4::new(DNS_ADDR, 53)), true, SYN, &mut shared, &names, 0));
        // The cap (one open elsewhere).
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(tcp.segment(tuple(3, gateway(&l)), true, SYN, &mut shared, &names, 1));
        assert!(tcp.conns.is_empty());
        assert_eq!(shared.stats.refused_by_cap, 1);
        let rules: Vec<String> = shared.control.query(0, 10).0.into_iter().map(|r| r.rule).collect();
        assert_eq!(rules[1..], [RULE_DNS_TCP.to_string(), crate::stack::RULE_LIMIT_CONNECTIONS.to_string()]);
    }

    #[test]
    fn the_connection_rate_refuses_past_its_burst_and_logs_once() {
        let (mut tcp, _sockets, mut shared) = world(8, false);
        shared.rate =
            crate::rate::Limiter::new(Some(crate::rate::RateLimit { per_second: 0, burst: 1 }), Instant::now());
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let names = NameMap::default();
        assert!(!tcp.segment(tuple(1, gateway(&l)), true, SYN, &mut shared, &names, 0), "the burst");
        for port in 2..5 {
            assert!(tcp.segment(tuple(port, gateway(&l)), true, SYN, &mut shared, &names, 1), "refused: a RST");
        }
        assert_eq!(shared.rate.refused(), 3);
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 2, "one refusal logged: {log:?}");
        assert_eq!((log[1].allowed, log[1].rule.as_str()), (false, crate::rate::RULE_LIMIT_RATE));
    }

    #[test]
    fn domain_rules_make_a_connection_wait_for_its_name() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, _sockets, mut shared) = world(8, true);
        tcp.segment(tuple(40003, gateway(&l)), true, SYN, &mut shared, &NameMap::default(), 0);
        // The gateway (127.0.0.1) is allowed by an address rule: no name
        // is looked at.
        assert_eq!(only(&tcp).gate, Gate::Open);
        // An address only the name example.com allowed must show it.
        let mut names = NameMap::default();
        names.insert(Ipv4Addr::new(127, 0, 0, 2).into(), "example.com", 60, Instant::now());
        let t = tuple(40004, SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 9));
        tcp.segment(t, true, SYN, &mut shared, &names, 1);
        let conn = tcp.conns.values().find(|c| c.tuple == t).unwrap();
        assert!(matches!(conn.gate, Gate::First { check: crate::policy::NameCheck::Required, since: None, .. }));
        let since = Instant::now();
        tcp.conns.values_mut().for_each(|c| {
            c.state = State::Aborted;
            if c.tuple == t {
                c.gate = Gate::First {
                    check: crate::policy::NameCheck::Required,
                    since: Some(since),
                    seen: 1,
                    host_spoke: false,
                };
            }
        });
        assert_eq!(tcp.next_deadline(), Some(since + crate::stack::NAME_WAIT));
    }

    #[test]
    fn interest_follows_the_state() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        tcp.segment(tuple(40004, gateway(&l)), true, SYN, &mut shared, &NameMap::default(), 0);
        let token = *tcp.conns.keys().next().unwrap();
        let conn = tcp.conns.get_mut(&token).unwrap();
        let mut events = vec![EpollEvent::default(); 4];
        // Connecting: waits for the connect (writable).
        conn.update_interest(None, &shared.epoll, token);
        let n = shared.epoll.wait(1000, &mut events).unwrap();
        assert_eq!((n, events[0].data()), (1, token));
        conn.ready(events[0].event_set());
        assert!(matches!(conn.state, State::Connecting { writable: true, .. }));
        // Open, readable and writable as far as it knows: waits for nothing.
        let socket = listening_socket(4096, conn.tuple.dst).unwrap();
        conn.handle = Some(sockets.add(socket));
        assert_eq!(conn.establish(), Some(SYN.to_vec()));
        let socket = sockets.get_mut::<tcp::Socket>(conn.handle.unwrap());
        conn.update_interest(Some(socket), &shared.epoll, token);
        assert_eq!(shared.epoll.wait(0, &mut events).unwrap(), 0);
        // Aborted: out of the set, the host side reset.
        conn.abort(socket, &shared.epoll);
        assert!(matches!(conn.state, State::Aborted));
        assert_eq!(shared.epoll.wait(0, &mut events).unwrap(), 0);
        tcp.reset(&mut sockets, &shared);
        assert!(tcp.conns.is_empty() && tcp.by_tuple.is_empty());
        assert_eq!(sockets.iter().count(), 0);
    }

    #[test]
    fn an_inbound_dial_uses_a_free_gateway_port_and_is_logged_inbound() {
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        let mut link = super::super::link::Link::new(8);
        let mut iface = smoltcp::iface::Interface::new(
            smoltcp::iface::Config::new(smoltcp::wire::EthernetAddress(crate::GATEWAY_MAC).into()),
            &mut link,
            smoltcp::time::Instant::ZERO,
        );
        iface.update_ip_addrs(|a| {
            let _ = a.push(smoltcp::wire::IpCidr::new(GATEWAY_ADDR.into(), crate::PREFIX_LEN));
        });
        // The first port is taken by a connection to the same guest port.
        let taken = Tuple { guest: SocketAddrV4::new(GUEST_ADDR, 8000), dst: SocketAddrV4::new(GATEWAY_ADDR, 49152) };
        tcp.by_tuple.insert(taken, 1);
        for _ in 0..2 {
            let (_ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            let request = InboundRequest { port: 8000, stream: theirs, asked: Instant::now() };
            tcp.dial(request, &mut iface, &mut sockets, &mut shared, 0);
        }
        let mut dialled: Vec<&Conn> = tcp.conns.values().collect();
        dialled.sort_by_key(|c| c.tuple.dst.port());
        let ports: Vec<u16> = dialled.iter().map(|c| c.tuple.dst.port()).collect();
        assert_eq!(ports, [49153, 49154]);
        for c in &dialled {
            assert!(matches!(c.state, State::Dialing { .. }));
            assert_eq!(sockets.get::<tcp::Socket>(c.handle.unwrap()).state(), tcp::State::SynSent);
        }
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 2);
        assert!(log.iter().all(|r| r.direction == Direction::Inbound && r.rule == RULE_INBOUND && r.port == 8000));
        // The range wraps around.
        tcp.next_inbound_port = *INBOUND_PORTS.end();
        assert_eq!(tcp.free_inbound_port(SocketAddrV4::new(GUEST_ADDR, 9)), Some(65535));
        assert_eq!(tcp.free_inbound_port(SocketAddrV4::new(GUEST_ADDR, 9)), Some(49152));
    }
}
