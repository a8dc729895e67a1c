//! The resolver at [`crate::DNS_ADDR`] (UDP port 53).
//!
//! A query (RFC 1035 §4.1) from the guest is judged by the policy's
//! [`crate::policy::CompiledPolicy::check_name`]: a denied name gets
//! `REFUSED` (RFC 1035 §4.1.1, RCODE 5), and so does a query past
//! [`crate::stack::StackConfig::dns_rate`]. A name of
//! [`crate::stack::StackConfig::static_hosts`] is answered here; any other
//! query is forwarded as it is, only its ID changed, to an upstream
//! resolver. Against off-path spoofing (RFC 5452 §9.2) each forwarded
//! query gets a random ID and a host UDP socket of its own, bound to a
//! port the kernel picks at random and connected to the upstream queried,
//! so only that server's datagrams reach it; an answer counts only if it
//! is a response with that ID and the same question (name, type, class).
//! The answer goes back to the guest with the guest's ID. No answer
//! within [`QUERY_TIMEOUT`] gives `SERVFAIL`, and so does a query past
//! [`MAX_PENDING`] outstanding ones. The A/AAAA records of answers fill a
//! bounded address-to-names map ([`NameMap`]) that domain rules and the
//! network log use, each entry kept for its record's TTL, clamped to
//! [[`MIN_NAME_TTL`], [`MAX_NAME_TTL`]]. Every query gets one
//! [`crate::log::NetRecord`] of protocol [`crate::log::Protocol::Dns`]
//! (a rate refusal only the first of each second, see [`crate::rate`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};
use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::udp;
use smoltcp::wire::{IpEndpoint, IpListenEndpoint};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::control::NetControl;
use crate::host_name;
use crate::log::{NetRecord, Protocol};
use crate::rate::{Limiter, RateLimit, Take, RULE_LIMIT_RATE};
use crate::DNS_ADDR;

/// How long a forwarded query waits for its upstream answer before the
/// guest gets `SERVFAIL`.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Forwarded queries waiting for an answer, at most (each holds a host
/// socket); more get `SERVFAIL`.
pub const MAX_PENDING: usize = 64;
/// Addresses the [`NameMap`] remembers, at most (oldest out).
pub const MAX_MAPPED_ADDRS: usize = 4096;
/// Names remembered per address, at most (oldest out).
pub const MAX_NAMES_PER_ADDR: usize = 4;
/// The shortest time a name is remembered for an address, whatever its
/// record's TTL (0 included: the guest's connection follows its answer).
pub const MIN_NAME_TTL: Duration = Duration::from_secs(5);
/// The longest time a name is remembered for an address; a guest that
/// caches an answer longer must ask again before its address is admitted
/// by the name.
pub const MAX_NAME_TTL: Duration = Duration::from_secs(3600);
/// The largest DNS message over UDP to the guest: Ethernet's 1500-byte
/// MTU less the IPv4 and UDP headers, so an answer fits a guest whose
/// interface kept that MTU (an agent older than the 64 KiB link). Larger
/// answers are truncated (TC bit, RFC 1035 §4.1.1).
pub const MAX_GUEST_MESSAGE: usize = 1500 - 20 - 8;
/// `SO_RCVBUF`/`SO_SNDBUF` asked for each forwarded query's socket
/// (bytes; Linux doubles it): room for an answer of up to about 24 KiB.
const QUERY_SOCKET_BUFFER: usize = 16 * 1024;
/// The resolver's smoltcp socket: bytes of datagrams from the guest and
/// to it, and datagrams each way.
const GUEST_RX_BYTES: usize = 16 * 1024;
const GUEST_TX_BYTES: usize = 64 * 1024;
const GUEST_RX_PACKETS: usize = 32;
const GUEST_TX_PACKETS: usize = 64;
/// The scratch buffer for one upstream datagram (bytes).
const SCRATCH_BYTES: usize = 65536;

/// The bytes a [`Resolver`] holds in buffers at most: its smoltcp
/// socket's (with their packet metadata), each outstanding query's host
/// socket's kernel buffers (as capped, doubled by Linux, both ways), and
/// its scratch buffer.
pub const BYTES_MAX: usize = GUEST_RX_BYTES
    + GUEST_TX_BYTES
    + (GUEST_RX_PACKETS + GUEST_TX_PACKETS) * std::mem::size_of::<udp::PacketMetadata>()
    + MAX_PENDING * 2 * 2 * QUERY_SOCKET_BUFFER
    + SCRATCH_BYTES;
/// TTL of the answers for static hosts (seconds).
pub const STATIC_TTL: u32 = 60;

/// Errors of the resolver's set-up.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The smoltcp socket could not be bound to the resolver's address.
    #[error("DNS resolver could not bind {DNS_ADDR}:53")]
    Bind,
}

/// A bounded map from an address to the names whose DNS answers gave it
/// (lower-case, no trailing dot), each until its answer's TTL (clamped to
/// [[`MIN_NAME_TTL`], [`MAX_NAME_TTL`]]) runs out. Oldest addresses fall
/// out first.
#[derive(Debug, Default)]
pub struct NameMap {
    map: HashMap<IpAddr, Vec<(String, Instant)>>,
    order: VecDeque<IpAddr>,
}

impl NameMap {
    /// Remembers that `name` resolved to `ip` at `now`, for `ttl` seconds
    /// (clamped); a name already there is kept until the later expiry.
    pub fn insert(&mut self, ip: IpAddr, name: &str, ttl: u32, now: Instant) {
        let ttl = Duration::from_secs(u64::from(ttl)).clamp(MIN_NAME_TTL, MAX_NAME_TTL);
        let until = now + ttl;
        if let Some(names) = self.map.get_mut(&ip) {
            names.retain(|(_, t)| *t > now);
            if let Some(entry) = names.iter_mut().find(|(n, _)| n == name) {
                entry.1 = entry.1.max(until);
                return;
            }
            if names.len() >= MAX_NAMES_PER_ADDR {
                names.remove(0);
            }
            names.push((name.to_owned(), until));
            return;
        }
        while self.map.len() >= MAX_MAPPED_ADDRS {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        self.map.insert(ip, vec![(name.to_owned(), until)]);
        self.order.push_back(ip);
    }

    /// The names `ip` was resolved from that have not expired at `now`
    /// (empty if none).
    pub fn names_at(&self, ip: IpAddr, now: Instant) -> Vec<String> {
        self.map
            .get(&ip)
            .map(|names| names.iter().filter(|(_, t)| *t > now).map(|(n, _)| n.clone()).collect())
            .unwrap_or_default()
    }

    /// [`NameMap::names_at`] now.
    pub fn names(&self, ip: IpAddr) -> Vec<String> {
        self.names_at(ip, Instant::now())
    }

    /// Addresses remembered (expired names included until they are
    /// replaced or fall out).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no address is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// A forwarded query waiting for its answer.
#[derive(Debug)]
struct Pending {
    guest: IpEndpoint,
    guest_id: u16,
    /// The ID it was sent upstream with.
    id: u16,
    query: Query,
    qname: String,
    /// Its own socket, connected to the upstream queried.
    socket: UdpSocket,
    deadline: Instant,
    started: Instant,
    record: u64,
}

/// The gateway's resolver: the smoltcp UDP socket on `DNS_ADDR:53` and a
/// host socket per forwarded query.
#[derive(Debug)]
pub struct Resolver {
    handle: SocketHandle,
    upstreams: Vec<SocketAddr>,
    next_upstream: usize,
    static_hosts: BTreeMap<String, IpAddr>,
    pending: Vec<Pending>,
    names: NameMap,
    rate: Limiter,
    /// The epoll token its host sockets are registered with.
    token: u64,
    scratch: Vec<u8>,
}

/// A name in the form names are compared in ([`host_name::fold`]); the
/// root name is the empty string.
fn normal_name(name: &str) -> String {
    host_name::fold(name).unwrap_or_default()
}

/// A random query ID (RFC 5452 §9.2); 0 if the kernel has no randomness
/// to give (it always has, after boot).
fn random_id() -> u16 {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    u16::from_ne_bytes(b)
}

/// A non-blocking host UDP socket on a port the kernel picks (at random,
/// on Linux) connected to `upstream`, its buffers capped.
fn query_socket(upstream: SocketAddr) -> io::Result<UdpSocket> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(upstream), socket2::Type::DGRAM, None)?;
    socket.set_recv_buffer_size(QUERY_SOCKET_BUFFER)?;
    socket.set_send_buffer_size(QUERY_SOCKET_BUFFER)?;
    let any: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    socket.bind(&any.into())?;
    socket.set_nonblocking(true)?;
    socket.connect(&upstream.into())?;
    Ok(socket.into())
}

/// Whether `answer` answers the question `question` sent with `id`: a
/// response with that ID and exactly that question (name compared without
/// case, RFC 4343; type; class).
fn answers(answer: &Message, id: u16, question: &Query) -> bool {
    let [q] = answer.queries.as_slice() else {
        return false;
    };
    answer.metadata.id == id
        && answer.metadata.message_type == MessageType::Response
        && q.query_type() == question.query_type()
        && q.query_class() == question.query_class()
        && normal_name(&q.name().to_ascii()) == normal_name(&question.name().to_ascii())
}

impl Resolver {
    /// A resolver forwarding to `upstreams`, answering `static_hosts`
    /// itself, taking queries at `rate`; its UDP socket is added to
    /// `sockets`, and its host sockets will be registered in the stack's
    /// epoll set under `token`.
    ///
    /// Errors: [`DnsError`].
    pub fn new(
        upstreams: &[SocketAddr],
        static_hosts: &BTreeMap<String, IpAddr>,
        rate: Option<RateLimit>,
        sockets: &mut SocketSet<'static>,
        token: u64,
    ) -> Result<Self, DnsError> {
        let mut socket = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; GUEST_RX_PACKETS], vec![0; GUEST_RX_BYTES]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; GUEST_TX_PACKETS], vec![0; GUEST_TX_BYTES]),
        );
        socket.bind(IpListenEndpoint { addr: Some(DNS_ADDR.into()), port: 53 }).map_err(|_| DnsError::Bind)?;
        let handle = sockets.add(socket);
        Ok(Self {
            handle,
            upstreams: upstreams.to_vec(),
            next_upstream: 0,
            static_hosts: static_hosts.iter().map(|(k, v)| (normal_name(k), *v)).collect(),
            pending: Vec::new(),
            names: NameMap::default(),
            rate: Limiter::new(rate, Instant::now()),
            token,
            scratch: vec![0; SCRATCH_BYTES],
        })
    }

    /// The address-to-names map of the answers so far.
    pub fn names(&self) -> &NameMap {
        &self.names
    }

    /// Forwarded queries waiting for an answer.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Queries refused by the rate limit so far.
    pub fn refused_by_rate(&self) -> u64 {
        self.rate.refused()
    }

    /// When the oldest waiting query times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.iter().map(|p| p.deadline).min()
    }

    /// Forgets every waiting query (after a restore); their sockets close.
    pub fn reset(&mut self) {
        self.pending.clear();
    }

    /// Runs the resolver: the guest's queries, the upstreams' answers (read
    /// only when `host_ready`: a host socket registered in `epoll` was
    /// reported readable), timeouts.
    pub fn poll(
        &mut self,
        sockets: &mut SocketSet<'static>,
        control: &NetControl,
        epoll: &Epoll,
        now: Instant,
        host_ready: bool,
    ) {
        // Guest queries (bounded by the smoltcp socket's buffer).
        loop {
            let socket = sockets.get_mut::<udp::Socket>(self.handle);
            let (query, guest) = match socket.recv() {
                Ok((data, meta)) => (data.to_vec(), meta.endpoint),
                Err(_) => break,
            };
            self.query(sockets, control, epoll, &query, guest, now);
        }
        if host_ready {
            self.answers(sockets, control, now);
        }
        let mut i = 0;
        while let Some(p) = self.pending.get(i) {
            if p.deadline > now {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            let reply = error_reply(p.guest_id, Some(p.query), ResponseCode::ServFail);
            self.reply(sockets, p.guest, &reply);
            control.update(p.record, |r| {
                r.duration_ms = Some(duration_ms(p.started, now));
            });
        }
    }

    fn reply(&self, sockets: &mut SocketSet<'static>, guest: IpEndpoint, message: &[u8]) {
        let mut meta = udp::UdpMetadata::from(guest);
        meta.local_address = Some(DNS_ADDR.into());
        let socket = sockets.get_mut::<udp::Socket>(self.handle);
        if message.len() <= MAX_GUEST_MESSAGE {
            let _ = socket.send_slice(message, meta);
        } else if let Ok(msg) = Message::from_vec(message) {
            if let Ok(short) = msg.truncate().to_vec() {
                let _ = socket.send_slice(&short, meta);
            }
        }
    }

    fn query(
        &mut self,
        sockets: &mut SocketSet<'static>,
        control: &NetControl,
        epoll: &Epoll,
        raw: &[u8],
        guest: IpEndpoint,
        now: Instant,
    ) {
        let msg = match Message::from_vec(raw) {
            Ok(m) => m,
            Err(_) => {
                // FORMERR if there is a header to answer to (RFC 1035 §4.1.1).
                if let Some(id) = raw.get(..2) {
                    if raw.len() >= 12 && raw[2] & 0x80 == 0 {
                        let id = u16::from_be_bytes([id[0], id[1]]);
                        self.reply(sockets, guest, &error_reply(id, None, ResponseCode::FormErr));
                    }
                }
                return;
            }
        };
        let id = msg.metadata.id;
        if msg.metadata.message_type != MessageType::Query {
            return;
        }
        if msg.metadata.op_code != OpCode::Query || msg.queries.len() != 1 {
            let code = if msg.metadata.op_code != OpCode::Query { ResponseCode::NotImp } else { ResponseCode::FormErr };
            self.reply(sockets, guest, &error_reply(id, None, code));
            return;
        }
        let Some(question) = msg.queries.first().cloned() else {
            return;
        };
        let qname = normal_name(&question.name().to_ascii());
        let mut verdict = control.policy().check_name(&qname);
        if verdict.allowed {
            if let Take::Refused { log } = self.rate.take(now) {
                if !log {
                    self.reply(sockets, guest, &error_reply(id, Some(question), ResponseCode::Refused));
                    return;
                }
                verdict = crate::policy::Verdict { allowed: false, rule: RULE_LIMIT_RATE.to_owned() };
            }
        }
        let record = NetRecord {
            bytes_out: raw.len() as u64,
            ..NetRecord::starting(Protocol::Dns, IpAddr::V4(DNS_ADDR), 53, Some(qname.clone()), verdict)
        };
        // Answered here, at once: sent, then logged with the answer's size.
        let answer_locally = |this: &Self, sockets: &mut SocketSet<'static>, reply: Vec<u8>, record: NetRecord| {
            this.reply(sockets, guest, &reply);
            control.record(NetRecord { bytes_in: reply.len() as u64, duration_ms: Some(0), ..record });
        };
        if !record.allowed {
            answer_locally(self, sockets, error_reply(id, Some(question), ResponseCode::Refused), record);
            return;
        }
        if let Some(ip) = self.static_hosts.get(&qname).copied() {
            self.names.insert(ip, &qname, STATIC_TTL, now);
            answer_locally(self, sockets, static_reply(&msg, &question, ip), record);
            return;
        }
        let record_id = control.record(record);
        let servfail = |this: &Self, sockets: &mut SocketSet<'static>, q: Query| {
            let reply = error_reply(id, Some(q), ResponseCode::ServFail);
            this.reply(sockets, guest, &reply);
            control.update(record_id, |r| r.duration_ms = Some(0));
        };
        if self.pending.len() >= MAX_PENDING || self.upstreams.is_empty() {
            servfail(self, sockets, question);
            return;
        }
        let upstream = self.upstreams[self.next_upstream % self.upstreams.len()];
        self.next_upstream = self.next_upstream.wrapping_add(1);
        let new_id = random_id();
        let mut forward = raw.to_vec();
        forward[..2].copy_from_slice(&new_id.to_be_bytes());
        let sent = query_socket(upstream).and_then(|s| {
            s.send(&forward)?;
            epoll.ctl(ControlOperation::Add, s.as_raw_fd(), EpollEvent::new(EventSet::IN, self.token))?;
            Ok(s)
        });
        let Ok(socket) = sent else {
            servfail(self, sockets, question);
            return;
        };
        self.pending.push(Pending {
            guest,
            guest_id: id,
            id: new_id,
            query: question,
            qname,
            socket,
            deadline: now + QUERY_TIMEOUT,
            started: now,
            record: record_id,
        });
    }

    /// Reads every waiting query's socket; an answer to its question goes
    /// to the guest, anything else is dropped.
    fn answers(&mut self, sockets: &mut SocketSet<'static>, control: &NetControl, now: Instant) {
        let mut i = 0;
        while i < self.pending.len() {
            match self.read_answer(i) {
                Some(msg) => {
                    let p = self.pending.swap_remove(i);
                    self.deliver(sockets, control, p, msg, now);
                }
                None => i += 1,
            }
        }
    }

    /// The first datagram on pending query `i`'s socket that answers its
    /// question, parsed, with its raw length in `scratch`.
    fn read_answer(&mut self, i: usize) -> Option<(Message, usize)> {
        let p = self.pending.get(i)?;
        loop {
            let len = match p.socket.recv(&mut self.scratch) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // Empty, or an ICMP error for the query: wait on.
                Err(_) => return None,
            };
            let Some(bytes) = self.scratch.get(..len) else {
                continue;
            };
            if let Ok(msg) = Message::from_vec(bytes) {
                if answers(&msg, p.id, &p.query) {
                    return Some((msg, len));
                }
            }
        }
    }

    /// Sends the answer (`msg`, its bytes in `scratch`) of `p` to the
    /// guest, with the guest's ID, and maps its addresses to its names.
    fn deliver(
        &mut self,
        sockets: &mut SocketSet<'static>,
        control: &NetControl,
        p: Pending,
        answer: (Message, usize),
        now: Instant,
    ) {
        let (msg, len) = answer;
        for rec in &msg.answers {
            let ip = match rec.data {
                RData::A(a) => IpAddr::V4(a.0),
                RData::AAAA(a) => IpAddr::V6(a.0),
                _ => continue,
            };
            self.names.insert(ip, &p.qname, rec.ttl, now);
            let owner = normal_name(&rec.name.to_ascii());
            if owner != p.qname {
                self.names.insert(ip, &owner, rec.ttl, now);
            }
        }
        let Some(bytes) = self.scratch.get(..len) else {
            return;
        };
        let mut reply = bytes.to_vec();
        reply[..2].copy_from_slice(&p.guest_id.to_be_bytes());
        self.reply(sockets, p.guest, &reply);
        control.update(p.record, |r| {
            r.bytes_in = reply.len() as u64;
            r.duration_ms = Some(duration_ms(p.started, now));
        });
    }
}

/// The name asked by a DNS query message (lower-case, no trailing dot);
/// `None` unless it is a standard query with exactly one question.
pub fn query_name(message: &[u8]) -> Option<String> {
    let msg = Message::from_vec(message).ok()?;
    if msg.metadata.message_type != MessageType::Query || msg.metadata.op_code != OpCode::Query {
        return None;
    }
    match msg.queries.as_slice() {
        [q] => Some(normal_name(&q.name().to_ascii())),
        _ => None,
    }
}

fn duration_ms(start: Instant, now: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(start).as_millis()).unwrap_or(u64::MAX)
}

/// A reply with `code` and no answers, echoing `query` if given.
fn error_reply(id: u16, query: Option<Query>, code: ResponseCode) -> Vec<u8> {
    let mut msg = Message::error_msg(id, OpCode::Query, code);
    msg.metadata.recursion_desired = true;
    msg.metadata.recursion_available = true;
    if let Some(q) = query {
        msg.add_query(q);
    }
    msg.to_vec().unwrap_or_default()
}

/// The answer for a static host: A for an IPv4 address asked as A, AAAA
/// for IPv6 asked as AAAA, else NOERROR with no answers.
fn static_reply(request: &Message, question: &Query, ip: IpAddr) -> Vec<u8> {
    let mut msg = Message::response(request.metadata.id, OpCode::Query);
    msg.metadata.recursion_desired = request.metadata.recursion_desired;
    msg.metadata.recursion_available = true;
    msg.metadata.authoritative = true;
    msg.add_query(question.clone());
    let rdata = match (question.query_type(), ip) {
        (RecordType::A, IpAddr::V4(v4)) => Some(RData::A(A(v4))),
        (RecordType::AAAA, IpAddr::V6(v6)) => Some(RData::AAAA(AAAA(v6))),
        _ => None,
    };
    if let Some(rdata) = rdata {
        msg.add_answer(Record::from_rdata(question.name().clone(), STATIC_TTL, rdata));
    }
    msg.to_vec().unwrap_or_default()
}

/// The upstream resolvers of the host: the `nameserver` lines of
/// `/etc/resolv.conf` (resolv.conf(5)), port 53. Empty if the file is
/// missing or names none.
pub fn resolv_conf_upstreams() -> Vec<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf").map(|text| parse_resolv_conf(&text)).unwrap_or_default()
}

/// The `nameserver` addresses of a resolv.conf text, port 53 (an IPv6
/// zone suffix `%eth0` is dropped).
pub fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            if words.next()? != "nameserver" {
                return None;
            }
            let addr = words.next()?;
            let addr = addr.split('%').next()?;
            addr.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, 53))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_lines() {
        let text = "# x\nsearch a.b\nnameserver 127.0.0.53\nnameserver fe80::1%eth0\nnameserver bogus\noptions edns0\n";
        assert_eq!(
            parse_resolv_conf(text),
            vec![SocketAddr::from(([127, 0, 0, 53], 53)), SocketAddr::new("fe80::1".parse().unwrap(), 53)]
        );
    }

    #[test]
    fn names_expire_by_their_ttl_within_bounds() {
        let t0 = Instant::now();
        let mut m = NameMap::default();
        let (a, b, c) = (
            IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
            IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2)),
            IpAddr::V4(Ipv4Addr::new(192, 0, 2, 3)),
        );
        m.insert(a, "zero.test", 0, t0);
        m.insert(b, "minute.test", 60, t0);
        m.insert(c, "week.test", 7 * 86400, t0);
        let at = |m: &NameMap, ip, secs: u64| m.names_at(ip, t0 + Duration::from_secs(secs));
        assert_eq!(at(&m, a, 4), ["zero.test"], "a TTL of 0 still holds for MIN_NAME_TTL");
        assert!(at(&m, a, 5).is_empty());
        assert_eq!(at(&m, b, 59), ["minute.test"]);
        assert!(at(&m, b, 60).is_empty());
        assert_eq!(at(&m, c, 3599), ["week.test"]);
        assert!(at(&m, c, 3600).is_empty(), "at most MAX_NAME_TTL");
        // A new answer extends a name, never shortens it.
        m.insert(b, "minute.test", 1, t0 + Duration::from_secs(50));
        assert_eq!(at(&m, b, 59), ["minute.test"]);
        m.insert(b, "minute.test", 120, t0 + Duration::from_secs(50));
        assert_eq!(at(&m, b, 169), ["minute.test"]);
    }

    fn question(name: &str, t: RecordType) -> Query {
        Query::query(hickory_proto::rr::Name::from_ascii(name).unwrap(), t)
    }

    fn response(id: u16, q: Query, ip: Ipv4Addr, ttl: u32) -> Message {
        let mut r = Message::response(id, OpCode::Query);
        r.add_answer(Record::from_rdata(q.name().clone(), ttl, RData::A(A(ip))));
        r.add_query(q);
        r
    }

    #[test]
    fn an_answer_must_match_its_question() {
        let q = question("a.test.", RecordType::A);
        assert!(answers(&response(7, q.clone(), Ipv4Addr::LOCALHOST, 1), 7, &q));
        assert!(answers(&response(7, question("A.Test.", RecordType::A), Ipv4Addr::LOCALHOST, 1), 7, &q));
        assert!(!answers(&response(8, q.clone(), Ipv4Addr::LOCALHOST, 1), 7, &q), "another id");
        assert!(!answers(&response(7, question("b.test.", RecordType::A), Ipv4Addr::LOCALHOST, 1), 7, &q));
        assert!(!answers(&response(7, question("a.test.", RecordType::AAAA), Ipv4Addr::LOCALHOST, 1), 7, &q));
        let mut not_a_response = response(7, q.clone(), Ipv4Addr::LOCALHOST, 1);
        not_a_response.metadata.message_type = MessageType::Query;
        assert!(!answers(&not_a_response, 7, &q));
        let mut two = response(7, q.clone(), Ipv4Addr::LOCALHOST, 1);
        two.add_query(q.clone());
        assert!(!answers(&two, 7, &q));
    }

    #[test]
    fn each_query_goes_from_its_own_port_with_a_random_id_and_only_its_answer_counts() {
        use std::sync::Arc;

        let upstream = UdpSocket::bind("127.0.0.1:0").unwrap();
        upstream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let control = NetControl::new(&Default::default(), None, Arc::default(), 64).unwrap();
        let epoll = Epoll::new().unwrap();
        let mut sockets = SocketSet::new(Vec::new());
        let up = upstream.local_addr().unwrap();
        let mut r = Resolver::new(&[up], &BTreeMap::new(), None, &mut sockets, 9).unwrap();
        let guest = IpEndpoint::new(crate::GUEST_ADDR.into(), 5000);
        let now = Instant::now();
        let mut sent = Vec::new();
        for (i, name) in ["a.test.", "b.test."].into_iter().enumerate() {
            let mut q = Message::new(0x1000 + i as u16, MessageType::Query, OpCode::Query);
            q.add_query(question(name, RecordType::A));
            r.query(&mut sockets, &control, &epoll, &q.to_vec().unwrap(), guest, now);
            let mut buf = [0u8; 512];
            let (n, from) = upstream.recv_from(&mut buf).unwrap();
            sent.push((Message::from_vec(&buf[..n]).unwrap(), from));
        }
        assert_eq!(r.pending(), 2);
        assert_ne!(sent[0].1.port(), sent[1].1.port(), "a port of its own each");
        // 2^-16 odds of a false failure per run: the ids are not the guest's.
        assert!(sent.iter().any(|(m, _)| m.metadata.id != 0x1000 && m.metadata.id != 0x1001));
        let (asked, from) = &sent[0];
        let q = asked.queries[0].clone();
        let mut events = vec![EpollEvent::default(); 4];
        // From another socket (another port): the kernel drops it.
        let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
        stranger
            .send_to(&response(asked.metadata.id, q.clone(), Ipv4Addr::new(192, 0, 2, 66), 60).to_vec().unwrap(), from)
            .unwrap();
        // The wrong id and the wrong question, from the upstream: dropped.
        let wrong_id = asked.metadata.id.wrapping_add(1);
        upstream
            .send_to(&response(wrong_id, q.clone(), Ipv4Addr::new(192, 0, 2, 66), 60).to_vec().unwrap(), from)
            .unwrap();
        let other = question("b.test.", RecordType::A);
        upstream
            .send_to(&response(asked.metadata.id, other, Ipv4Addr::new(192, 0, 2, 66), 60).to_vec().unwrap(), from)
            .unwrap();
        assert!(epoll.wait(1000, &mut events).unwrap() > 0);
        r.poll(&mut sockets, &control, &epoll, Instant::now(), true);
        assert_eq!(r.pending(), 2);
        assert!(r.names().names(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 66))).is_empty());
        // The answer: delivered, its address named for its TTL.
        upstream
            .send_to(&response(asked.metadata.id, q, Ipv4Addr::new(192, 0, 2, 7), 30).to_vec().unwrap(), from)
            .unwrap();
        assert!(epoll.wait(1000, &mut events).unwrap() > 0);
        r.poll(&mut sockets, &control, &epoll, Instant::now(), true);
        assert_eq!(r.pending(), 1);
        let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));
        assert_eq!(r.names().names(ip), ["a.test"]);
        assert!(r.names().names_at(ip, Instant::now() + Duration::from_secs(31)).is_empty());
        let log = control.query(0, 10).0;
        assert!(log[0].bytes_in > 0 && log[0].duration_ms.is_some());
        assert_eq!(log[1].duration_ms, None, "still waiting");
        // The other times out: SERVFAIL, its socket gone.
        r.poll(&mut sockets, &control, &epoll, now + QUERY_TIMEOUT, false);
        assert_eq!(r.pending(), 0);
        assert!(control.query(0, 10).0[1].duration_ms.is_some());
    }

    #[test]
    fn name_map_is_bounded() {
        let mut m = NameMap::default();
        let now = Instant::now();
        for i in 0..(MAX_MAPPED_ADDRS as u32 + 10) {
            m.insert(IpAddr::V4(Ipv4Addr::from(i)), "a.test", 60, now);
        }
        assert_eq!(m.len(), MAX_MAPPED_ADDRS);
        assert!(m.names(IpAddr::V4(Ipv4Addr::from(0))).is_empty());
        let ip = IpAddr::V4(Ipv4Addr::new(1, 2, 3, 4));
        for i in 0..10 {
            m.insert(ip, &format!("n{i}.test"), 60, now);
        }
        assert_eq!(m.names(ip).len(), MAX_NAMES_PER_ADDR);
        assert_eq!(m.names(ip).last().map(String::as_str), Some("n9.test"));
    }
}
