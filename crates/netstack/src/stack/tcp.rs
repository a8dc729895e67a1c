//! Guest TCP connections, each ended in a smoltcp socket and spliced to a
//! non-blocking host socket.
//!
//! A guest SYN (RFC 9293 §3.5) for a 4-tuple with no connection yet goes
//! through [`super::admit`]; a refused one gets no listener, so smoltcp
//! answers with a RST. An admitted one gets a smoltcp socket listening on
//! exactly that destination, its SYN-ACK held back until the host connect
//! finishes ([`State::Connecting`]); a refused host connect resets the
//! guest. Then bytes flow both ways through the smoltcp socket buffers
//! (no copy in between; a full buffer stops the reads of the other side,
//! by host socket interest or TCP window), FIN and RST pass both ways, and
//! a connection closed cleanly lingers in [`State::TimeWait`] until smoltcp
//! lets it go.
//!
//! A connection into the guest (an inbound one, [`Tcp::dial`]) is the
//! other way round: the host's end is a Unix stream the daemon holds
//! ([`NetControl::connect_inbound`](crate::control::NetControl::connect_inbound)),
//! the smoltcp socket connects from the gateway to the guest's port
//! ([`State::Dialing`]), and once the guest accepts, bytes flow as above. A
//! guest that refuses closes the host's end before any byte.
//!
//! What the guest's bytes wait for before they reach the host is the
//! connection's [`Gate`]: nothing, a name in the first bytes (TLS SNI or
//! HTTP `Host`, [`crate::sniff`]) when the policy has domain rules, or,
//! for DNS over TCP to the resolver, each whole query judged by its name.

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

use super::admit::{admit, Ask, Cap, Meter};
use super::interest::Interest;
use super::{Shared, Tuple};
use crate::control::InboundRequest;
use crate::dns::NameMap;
use crate::log::{Direction, Protocol};
use crate::policy::Verdict;
use crate::sniff::{sniff, Sniffed, MAX_SNIFF_BYTES};
use crate::{DNS_ADDR, GATEWAY_ADDR, GUEST_ADDR};

/// The rule of a log record for DNS over TCP to the resolver (refused
/// when there is no upstream; each query is judged by name).
pub const RULE_DNS_TCP: &str = "dns:tcp";

/// How long the first bytes of a connection are held for sniffing at most
/// (a protocol that is neither TLS nor HTTP may send a few bytes and wait
/// for an answer); then they go on as if no name were in them.
pub const SNIFF_WAIT: Duration = Duration::from_secs(1);

/// The rule of a log record for an inbound connection (the host's own,
/// not judged by the egress policy; the cap applies).
pub const RULE_INBOUND: &str = "inbound";

/// The gateway's ports for inbound connections (RFC 6335 §6: the dynamic
/// range).
const INBOUND_PORTS: std::ops::RangeInclusive<u16> = 49152..=65535;

/// smoltcp aborts a connection whose guest does not acknowledge data for
/// this long.
const GUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// What the guest's bytes wait for before they go on to the host.
#[derive(Debug, PartialEq, Eq)]
enum Gate {
    /// Nothing.
    Open,
    /// A name (TLS SNI, HTTP `Host`) in the first bytes, or none, or
    /// [`SNIFF_WAIT`] after the first bytes came (`since`).
    Sniff { since: Option<Instant> },
    /// DNS over TCP to the resolver: whole messages (RFC 7766 §8: a 2-byte
    /// length, then the message), each judged by its name; `cleared`:
    /// bytes judged and not yet passed on.
    Dns { cleared: usize },
}

/// Where a connection is.
#[derive(Debug)]
enum State {
    /// The host connect is under way; the guest's SYN-ACK is held back.
    /// `writable`: the host socket was reported writable (connect done or
    /// failed) and not looked at yet.
    Connecting { host: Socket, writable: bool },
    /// Inbound: the smoltcp socket's SYN is on its way to the guest; the
    /// host's end waits (its bytes stay in its buffer).
    Dialing { host: Socket },
    /// The host connect finished: bytes flow.
    Open(Open),
    /// The host side is gone and the log record final; the smoltcp socket
    /// stays in TIME-WAIT (to acknowledge the guest's FIN again if needed)
    /// until smoltcp closes it.
    TimeWait,
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
}

impl State {
    /// The host socket, if the state has one.
    fn into_host(self) -> Option<Socket> {
        match self {
            State::Connecting { host, .. } | State::Dialing { host } => Some(host),
            State::Open(o) => Some(o.host),
            State::TimeWait | State::Aborted => None,
        }
    }
}

/// One guest TCP connection.
#[derive(Debug)]
struct Conn {
    tuple: Tuple,
    handle: SocketHandle,
    state: State,
    gate: Gate,
    interest: Interest,
    meter: Meter,
}

impl Conn {
    /// The host connect (outbound) or the guest's accept (inbound)
    /// finished: bytes may flow.
    fn establish(&mut self) {
        if let State::Connecting { host, .. } | State::Dialing { host } =
            std::mem::replace(&mut self.state, State::Aborted)
        {
            self.state = State::Open(Open { host, readable: true, writable: true, host_eof: false, guest_eof: false });
        }
    }

    /// Resets both sides: RST to the guest (smoltcp sends it; then the
    /// connection is removed) and to the host. Nothing for a connection in
    /// TIME-WAIT.
    fn abort(&mut self, socket: &mut tcp::Socket, epoll: &Epoll) {
        if matches!(self.state, State::TimeWait) {
            return;
        }
        socket.abort();
        if let Some(host) = std::mem::replace(&mut self.state, State::Aborted).into_host() {
            self.interest.clear(epoll, host.as_raw_fd());
            let _ = host.set_linger(Some(Duration::ZERO));
        }
    }

    /// Registers exactly the host events the connection waits for.
    fn update_interest(&mut self, socket: &tcp::Socket, epoll: &Epoll, token: u64) {
        let (fd, want) = match &self.state {
            State::Connecting { host, .. } => (host.as_raw_fd(), EventSet::OUT),
            State::Open(o) => {
                let mut want = EventSet::empty();
                if !o.host_eof && !o.readable && socket.may_send() && socket.send_queue() < socket.send_capacity() {
                    want |= EventSet::IN;
                }
                let sniffing = matches!(self.gate, Gate::Sniff { .. });
                if !o.writable && !sniffing && socket.recv_queue() > 0 {
                    want |= EventSet::OUT;
                }
                (o.host.as_raw_fd(), want)
            }
            State::Dialing { .. } | State::TimeWait | State::Aborted => return,
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
            State::Dialing { .. } | State::TimeWait | State::Aborted => {}
        }
    }
}

/// The TCP connections of one stack.
pub(super) struct Tcp {
    /// Connections by epoll token, and their tokens by 4-tuple.
    conns: HashMap<u64, Conn>,
    by_tuple: HashMap<Tuple, u64>,
    /// Connections in `conns` in [`State::TimeWait`].
    lingering: usize,
    /// Buffer per direction per connection (bytes).
    buffer_bytes: usize,
    /// Where DNS over TCP to the resolver goes (`None`: refused).
    dns_upstream: Option<SocketAddr>,
    sniff_buf: Vec<u8>,
    /// One DNS-over-TCP message (2-byte length + up to 64 KiB).
    dns_buf: Vec<u8>,
    /// The gateway port the next inbound connection tries first.
    next_inbound_port: u16,
}

impl Tcp {
    /// No connections; `buffer_bytes` per direction per connection (at
    /// least 4096), DNS over TCP to `dns_upstream`.
    pub(super) fn new(buffer_bytes: usize, dns_upstream: Option<SocketAddr>) -> Self {
        Self {
            conns: HashMap::new(),
            by_tuple: HashMap::new(),
            lingering: 0,
            buffer_bytes: buffer_bytes.max(4096),
            dns_upstream,
            sniff_buf: vec![0; MAX_SNIFF_BYTES],
            dns_buf: vec![0; 2 + 65535],
            next_inbound_port: *INBOUND_PORTS.start(),
        }
    }

    /// Connections open now (not lingering in TIME-WAIT).
    pub(super) fn open_count(&self) -> usize {
        self.conns.len() - self.lingering
    }

    /// A guest SYN (checksums verified) for `tuple`, about to go into the
    /// interface: admits a new connection unless one has the 4-tuple (one
    /// in TIME-WAIT goes: the guest reused its port). `open`: connections
    /// and flows open now.
    pub(super) fn on_syn(
        &mut self,
        tuple: Tuple,
        sockets: &mut SocketSet<'static>,
        shared: &mut Shared,
        names: &NameMap,
        open: usize,
    ) {
        if let Some(&old) = self.by_tuple.get(&tuple) {
            if self.conns.get(&old).is_some_and(|c| matches!(c.state, State::TimeWait)) {
                self.close(old, false, sockets, shared);
            }
        }
        if self.by_tuple.contains_key(&tuple) {
            return;
        }
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
        let cap = Cap { open, max: shared.max_connections, refused: &mut shared.stats.refused_by_cap };
        let Some(admitted) =
            admit(Ask { protocol, direction: Direction::Outbound, dst, fixed }, &shared.control, names, cap)
        else {
            return;
        };
        let gate = if dns {
            Gate::Dns { cleared: 0 }
        } else if admitted.policy.has_domain_rules() {
            Gate::Sniff { since: None }
        } else {
            Gate::Open
        };
        let target = match self.dns_upstream.filter(|_| dns) {
            Some(upstream) => upstream,
            None => SocketAddr::V4(SocketAddrV4::new(admitted.host_ip, dst.port())),
        };
        let opened = admitted.open(&shared.control, || {
            let host = connect(target)?;
            let mut socket = self.socket();
            socket.pause_synack(true);
            socket
                .listen(IpListenEndpoint { addr: Some((*dst.ip()).into()), port: dst.port() })
                .map_err(|e| io::Error::other(format!("listen: {e}")))?;
            Ok((host, socket))
        });
        if let Some(((host, socket), meter)) = opened {
            let (handle, state) = (sockets.add(socket), State::Connecting { host, writable: true });
            self.add(Conn { tuple, handle, state, gate, interest: Interest::default(), meter }, shared);
        }
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
        let cap = Cap { open, max: shared.max_connections, refused: &mut shared.stats.refused_by_cap };
        let Some(admitted) = admit(ask, &shared.control, &NameMap::default(), cap) else {
            return;
        };
        let opened = admitted.open(&shared.control, || {
            let host = Socket::from(std::os::fd::OwnedFd::from(request.stream));
            host.set_nonblocking(true)?;
            let mut socket = self.socket();
            socket
                .connect(iface.context(), (GUEST_ADDR, request.port), (GATEWAY_ADDR, local))
                .map_err(|e| io::Error::other(format!("connect: {e}")))?;
            Ok((host, socket))
        });
        if let Some(((host, socket), meter)) = opened {
            let (handle, state) = (sockets.add(socket), State::Dialing { host });
            self.add(Conn { tuple, handle, state, gate: Gate::Open, interest: Interest::default(), meter }, shared);
        }
    }

    /// A smoltcp socket for a new connection: [`Tcp::buffer_bytes`] each
    /// way, no Nagle, the guest's acknowledgement timeout.
    fn socket(&self) -> tcp::Socket<'static> {
        let buf = self.buffer_bytes;
        let mut socket = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; buf]), tcp::SocketBuffer::new(vec![0; buf]));
        socket.set_nagle_enabled(false);
        socket.set_timeout(Some(GUEST_TIMEOUT.into()));
        socket
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
        let listening =
            self.conns.get(&token).is_some_and(|c| sockets.get::<tcp::Socket>(c.handle).state() == tcp::State::Listen);
        if listening {
            self.close(token, false, sockets, shared);
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

    /// Services every connection.
    pub(super) fn service_all(&mut self, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.service(token, sockets, shared);
        }
    }

    /// When the first sniffing connection stops waiting for a name.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.conns
            .values()
            .filter_map(|c| match c.gate {
                Gate::Sniff { since: Some(t) } => Some(t + SNIFF_WAIT),
                _ => None,
            })
            .min()
    }

    /// Drops every connection, resetting the host sides; the guest's next
    /// segment on one gets a RST (no socket matches it).
    pub(super) fn reset(&mut self, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.close(token, true, sockets, shared);
        }
    }

    /// Moves data of one connection, passes FIN/RST on, updates interest,
    /// and removes it when both sides are done.
    fn service(&mut self, token: u64, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let socket = sockets.get_mut::<tcp::Socket>(conn.handle);
        match &mut conn.state {
            State::TimeWait => {
                if socket.state() != tcp::State::TimeWait {
                    self.close(token, false, sockets, shared);
                }
                return;
            }
            State::Aborted => {
                if socket.remote_endpoint().is_none() {
                    self.close(token, false, sockets, shared);
                }
                return;
            }
            State::Connecting { host, writable } => {
                if !*writable {
                    conn.update_interest(socket, &shared.epoll, token);
                    return;
                }
                match host.take_error() {
                    Ok(None) if host.peer_addr().is_ok() => {
                        conn.establish();
                        socket.pause_synack(false);
                    }
                    Ok(None) => {
                        // Not yet (a spurious wake-up).
                        *writable = false;
                        conn.update_interest(socket, &shared.epoll, token);
                        return;
                    }
                    _ => {
                        // Refused: the guest gets a RST to its SYN.
                        conn.abort(socket, &shared.epoll);
                        return;
                    }
                }
            }
            State::Dialing { .. } => match socket.state() {
                tcp::State::SynSent => return,
                tcp::State::Closed | tcp::State::Listen => {
                    // Refused (RST) or timed out: the host's end closes.
                    self.close(token, false, sockets, shared);
                    return;
                }
                _ => conn.establish(),
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
                conn.update_interest(socket, &shared.epoll, token);
                return;
            }
            _ => {}
        }
        // Sniff the first bytes for a name; until then guest bytes wait.
        if let Gate::Sniff { since } = &mut conn.gate {
            let queued = socket.recv_queue();
            let n = socket.peek_slice(&mut self.sniff_buf[..queued.min(MAX_SNIFF_BYTES)]).unwrap_or(0);
            if n > 0 && since.is_none() {
                *since = Some(Instant::now());
            }
            let waited = since.is_some_and(|t| t.elapsed() >= SNIFF_WAIT);
            match sniff(self.sniff_buf.get(..n).unwrap_or(&[])) {
                Sniffed::NeedMore
                    if n < MAX_SNIFF_BYTES.min(socket.recv_capacity()) && socket.may_recv() && !waited => {}
                Sniffed::Name(name) => {
                    conn.gate = Gate::Open;
                    if !conn.meter.judge_name(&shared.control, name) {
                        conn.abort(socket, &shared.epoll);
                        return;
                    }
                }
                _ => conn.gate = Gate::Open,
            }
        }
        // Guest -> host.
        loop {
            if let Gate::Dns { cleared: cleared @ 0 } = &mut conn.gate {
                // The next whole query, judged by its name.
                let mut head = [0u8; 2];
                if socket.peek_slice(&mut head) != Ok(2) {
                    break;
                }
                let len = 2 + usize::from(u16::from_be_bytes(head));
                if socket.recv_queue() < len {
                    if len > socket.recv_capacity() {
                        conn.abort(socket, &shared.epoll);
                        return;
                    }
                    break;
                }
                let n = socket.peek_slice(&mut self.dns_buf[..len]).unwrap_or(0);
                let Some(name) = self.dns_buf.get(2..n).and_then(crate::dns::query_name) else {
                    conn.abort(socket, &shared.epoll);
                    return;
                };
                if !conn.meter.judge_name(&shared.control, name) {
                    conn.abort(socket, &shared.epoll);
                    return;
                }
                *cleared = len;
            }
            if matches!(conn.gate, Gate::Sniff { .. }) || !open.writable || !socket.can_recv() {
                break;
            }
            let limit = match conn.gate {
                Gate::Dns { cleared } => cleared,
                _ => usize::MAX,
            };
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
                    if let Gate::Dns { cleared } = &mut conn.gate {
                        *cleared = cleared.saturating_sub(n);
                    }
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => open.writable = false,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(_)) => {
                    conn.abort(socket, &shared.epoll);
                    return;
                }
            }
        }
        let sniffing = matches!(conn.gate, Gate::Sniff { .. });
        if !open.guest_eof && !sniffing && !socket.may_recv() && socket.recv_queue() == 0 {
            open.guest_eof = true;
            let _ = open.host.shutdown(Shutdown::Write);
        }
        // Host -> guest.
        while open.readable && !open.host_eof && socket.may_send() && socket.send_queue() < socket.send_capacity() {
            let host = &open.host;
            let r = socket.send(|buf| match (&*host).read(buf) {
                Ok(n) => (n, Ok(n)),
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
        if open.host_eof && open.guest_eof && state == tcp::State::TimeWait {
            self.finish(token, false, sockets, shared);
            return;
        }
        conn.update_interest(socket, &shared.epoll, token);
    }

    /// Removes a connection; `reset_host`: the host side gets a RST
    /// instead of a FIN.
    fn close(&mut self, token: u64, reset_host: bool, sockets: &mut SocketSet<'static>, shared: &Shared) {
        self.finish(token, reset_host, sockets, shared);
        let Some(conn) = self.conns.remove(&token) else {
            return;
        };
        self.lingering -= 1;
        self.by_tuple.remove(&conn.tuple);
        sockets.remove(conn.handle);
    }

    /// Closes the host side (`reset_host`: with a RST instead of a FIN)
    /// and completes the log record; the smoltcp socket stays (see
    /// [`State::TimeWait`]). At most `max_connections` connections linger,
    /// the oldest go first.
    fn finish(&mut self, token: u64, reset_host: bool, sockets: &mut SocketSet<'static>, shared: &Shared) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if matches!(conn.state, State::TimeWait) {
            return;
        }
        if let Some(host) = std::mem::replace(&mut conn.state, State::TimeWait).into_host() {
            conn.interest.clear(&shared.epoll, host.as_raw_fd());
            if reset_host {
                let _ = host.set_linger(Some(Duration::ZERO));
            }
        }
        conn.meter.close(&shared.control);
        self.lingering += 1;
        if self.lingering > shared.max_connections {
            let oldest = self.conns.iter().filter(|(_, c)| matches!(c.state, State::TimeWait)).map(|(t, _)| *t).min();
            if let Some(oldest) = oldest {
                self.close(oldest, false, sockets, shared);
            }
        }
    }
}

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
        let server = ServerNetPolicy { permit_ranges: vec!["127.0.0.0/8".parse().unwrap()], host_addrs: Vec::new() };
        let control = NetControl::new(&policy, None, Arc::new(server), 64).unwrap();
        (Tcp::new(4096, None), SocketSet::new(Vec::new()), Shared::new(control, max_connections).unwrap())
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

    #[test]
    fn an_admitted_syn_listens_on_its_destination_while_the_host_connects() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        let t = tuple(40000, gateway(&l));
        tcp.on_syn(t, &mut sockets, &mut shared, &NameMap::default(), 0);
        tcp.on_syn(t, &mut sockets, &mut shared, &NameMap::default(), 1);
        let conn = only(&tcp);
        assert!(matches!(conn.state, State::Connecting { writable: true, .. }));
        assert_eq!(conn.gate, Gate::Open);
        let socket = sockets.get::<tcp::Socket>(conn.handle);
        assert_eq!(socket.state(), tcp::State::Listen);
        assert_eq!(tcp.open_count(), 1);
        // The host side reached the listener.
        l.set_nonblocking(false).unwrap();
        let (_peer, from) = l.accept().unwrap();
        assert!(from.ip().is_loopback());
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.len(), 1);
        assert_eq!((log[0].addr, log[0].allowed, log[0].duration_ms), (Ipv4Addr::LOCALHOST.into(), true, None));
    }

    #[test]
    fn a_syn_the_interface_did_not_take_leaves_nothing_behind() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        let t = tuple(40001, gateway(&l));
        tcp.on_syn(t, &mut sockets, &mut shared, &NameMap::default(), 0);
        // No SYN reached the listener: it still listens, so it goes.
        tcp.after_frame(t, &mut sockets, &shared);
        assert!(tcp.conns.is_empty() && tcp.by_tuple.is_empty());
        assert_eq!((tcp.open_count(), tcp.lingering), (0, 0));
        assert_eq!(sockets.iter().count(), 0);
        let log = shared.control.query(0, 10).0;
        assert!(log[0].duration_ms.is_some(), "the record is closed");
    }

    #[test]
    fn a_listener_service_finds_without_its_syn_is_closed() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        tcp.on_syn(tuple(40002, gateway(&l)), &mut sockets, &mut shared, &NameMap::default(), 0);
        // The loopback connect completes; service opens the connection and
        // then finds its socket still listening.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut events = vec![EpollEvent::default(); 4];
        loop {
            tcp.service_all(&mut sockets, &shared);
            if tcp.conns.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "still {:?}", only(&tcp).state);
            let n = shared.epoll.wait(100, &mut events).unwrap();
            for e in &events[..n] {
                tcp.ready(e.data(), e.event_set());
            }
        }
        assert_eq!(tcp.lingering, 0);
    }

    #[test]
    fn refusals_log_and_open_nothing() {
        let (mut tcp, mut sockets, mut shared) = world(1, false);
        // The policy.
        tcp.on_syn(
            tuple(1, SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 80)),
            &mut sockets,
            &mut shared,
            &NameMap::default(),
            0,
        );
        // DNS over TCP with no upstream.
        tcp.on_syn(tuple(2, SocketAddrV4::new(DNS_ADDR, 53)), &mut sockets, &mut shared, &NameMap::default(), 0);
        // The cap (one open elsewhere).
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        tcp.on_syn(tuple(3, gateway(&l)), &mut sockets, &mut shared, &NameMap::default(), 1);
        assert!(tcp.conns.is_empty());
        assert_eq!(sockets.iter().count(), 0);
        assert_eq!(shared.stats.refused_by_cap, 1);
        let rules: Vec<String> = shared.control.query(0, 10).0.into_iter().map(|r| r.rule).collect();
        assert_eq!(rules[1..], [RULE_DNS_TCP.to_string(), crate::stack::RULE_LIMIT_CONNECTIONS.to_string()]);
    }

    #[test]
    fn domain_rules_make_a_connection_wait_for_its_name() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, true);
        tcp.on_syn(tuple(40003, gateway(&l)), &mut sockets, &mut shared, &NameMap::default(), 0);
        assert_eq!(only(&tcp).gate, Gate::Sniff { since: None });
        assert_eq!(tcp.next_deadline(), None, "no deadline before the first bytes");
        let since = Instant::now();
        tcp.conns.values_mut().for_each(|c| c.gate = Gate::Sniff { since: Some(since) });
        assert_eq!(tcp.next_deadline(), Some(since + SNIFF_WAIT));
    }

    #[test]
    fn interest_follows_the_state() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(8, false);
        tcp.on_syn(tuple(40004, gateway(&l)), &mut sockets, &mut shared, &NameMap::default(), 0);
        let token = *tcp.conns.keys().next().unwrap();
        let conn = tcp.conns.get_mut(&token).unwrap();
        let socket = sockets.get_mut::<tcp::Socket>(conn.handle);
        let mut events = vec![EpollEvent::default(); 4];
        // Connecting: waits for the connect (writable).
        conn.update_interest(socket, &shared.epoll, token);
        let n = shared.epoll.wait(1000, &mut events).unwrap();
        assert_eq!((n, events[0].data()), (1, token));
        conn.ready(events[0].event_set());
        assert!(matches!(conn.state, State::Connecting { writable: true, .. }));
        // Open, readable and writable as far as it knows: waits for nothing.
        conn.establish();
        conn.update_interest(socket, &shared.epoll, token);
        assert_eq!(shared.epoll.wait(0, &mut events).unwrap(), 0);
        // Aborted: out of the set, the host side reset.
        conn.abort(socket, &shared.epoll);
        assert!(matches!(conn.state, State::Aborted));
        assert_eq!(shared.epoll.wait(0, &mut events).unwrap(), 0);
    }

    #[test]
    fn at_most_max_connections_linger_and_the_oldest_goes_first() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tcp, mut sockets, mut shared) = world(2, false);
        for port in 1..=3 {
            tcp.on_syn(tuple(port, gateway(&l)), &mut sockets, &mut shared, &NameMap::default(), 0);
        }
        let mut tokens: Vec<u64> = tcp.conns.keys().copied().collect();
        tokens.sort_unstable();
        for &t in &tokens {
            tcp.finish(t, false, &mut sockets, &shared);
        }
        assert_eq!((tcp.conns.len(), tcp.lingering, tcp.open_count()), (2, 2, 0));
        assert!(!tcp.conns.contains_key(&tokens[0]));
        // A new SYN on a lingering 4-tuple replaces the old connection.
        let reused = tcp.conns[&tokens[1]].tuple;
        tcp.on_syn(reused, &mut sockets, &mut shared, &NameMap::default(), 0);
        assert_eq!((tcp.conns.len(), tcp.lingering, tcp.open_count()), (2, 1, 1));
        assert!(!tcp.conns.contains_key(&tokens[1]));
        let log = shared.control.query(0, 10).0;
        assert_eq!(log.iter().filter(|r| r.duration_ms.is_some()).count(), 3);
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
            assert_eq!(sockets.get::<tcp::Socket>(c.handle).state(), tcp::State::SynSent);
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
