//! The resolver at [`crate::DNS_ADDR`] (UDP port 53).
//!
//! A query (RFC 1035 §4.1) from the guest is judged by the policy's
//! [`crate::policy::CompiledPolicy::check_name`]: a denied name gets
//! `REFUSED` (RFC 1035 §4.1.1, RCODE 5). A name of
//! [`crate::stack::StackConfig::static_hosts`] is answered here; any other
//! query is forwarded as it is (only its ID changed) to an upstream resolver
//! over a non-blocking host UDP socket, and the answer goes back to the
//! guest with the guest's ID. No answer within [`QUERY_TIMEOUT`] gives
//! `SERVFAIL`. The A/AAAA records of answers fill a bounded
//! address-to-names map ([`NameMap`]) that domain rules and the network log
//! use. Every query gets one [`crate::log::NetRecord`] of protocol
//! [`crate::log::Protocol::Dns`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};
use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::udp;
use smoltcp::wire::{IpEndpoint, IpListenEndpoint};

use crate::control::NetControl;
use crate::host_name;
use crate::log::{NetRecord, Protocol};
use crate::DNS_ADDR;

/// How long a forwarded query waits for its upstream answer before the
/// guest gets `SERVFAIL`.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Forwarded queries waiting for an answer, at most; more get `SERVFAIL`.
pub const MAX_PENDING: usize = 256;
/// Addresses the [`NameMap`] remembers, at most (oldest out).
pub const MAX_MAPPED_ADDRS: usize = 4096;
/// Names remembered per address, at most (oldest out).
pub const MAX_NAMES_PER_ADDR: usize = 4;
/// The largest DNS message over UDP to the guest: Ethernet's 1500-byte
/// MTU less the IPv4 and UDP headers, so an answer fits a guest whose
/// interface kept that MTU (an agent older than the 64 KiB link). Larger
/// answers are truncated (TC bit, RFC 1035 §4.1.1).
pub const MAX_GUEST_MESSAGE: usize = 1500 - 20 - 8;
/// The bytes a [`Resolver`] holds in buffers at most: its smoltcp
/// socket's (16 KiB in, 64 KiB out, with their packet metadata), its host
/// sockets' kernel buffers (two sockets, the default 208 KiB each way,
/// doubled) and its scratch buffer.
pub const BYTES_MAX: usize = 16 * 1024 + 64 * 1024 + 96 * 64 + 2 * 4 * 208 * 1024 + 65536;
/// TTL of the answers for static hosts (seconds).
pub const STATIC_TTL: u32 = 60;

/// Errors of the resolver's set-up.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The host UDP socket toward the upstream resolvers could not be made.
    #[error("DNS forwarder socket: {0}")]
    Socket(#[source] io::Error),
    /// The smoltcp socket could not be bound to the resolver's address.
    #[error("DNS resolver could not bind {DNS_ADDR}:53")]
    Bind,
}

/// A bounded map from an address to the names whose DNS answers gave it
/// (lower-case, no trailing dot). Oldest addresses fall out first.
#[derive(Debug, Default)]
pub struct NameMap {
    map: HashMap<IpAddr, Vec<String>>,
    order: VecDeque<IpAddr>,
}

impl NameMap {
    /// Remembers that `name` resolved to `ip`.
    pub fn insert(&mut self, ip: IpAddr, name: &str) {
        if let Some(names) = self.map.get_mut(&ip) {
            if !names.iter().any(|n| n == name) {
                if names.len() >= MAX_NAMES_PER_ADDR {
                    names.remove(0);
                }
                names.push(name.to_owned());
            }
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
        self.map.insert(ip, vec![name.to_owned()]);
        self.order.push_back(ip);
    }

    /// The names `ip` was resolved from (empty if none).
    pub fn names(&self, ip: IpAddr) -> &[String] {
        self.map.get(&ip).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Addresses remembered.
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
    query: Query,
    qname: String,
    upstream: SocketAddr,
    deadline: Instant,
    started: Instant,
    record: u64,
}

/// The gateway's resolver: the smoltcp UDP socket on `DNS_ADDR:53` and the
/// host sockets toward the upstreams.
#[derive(Debug)]
pub struct Resolver {
    handle: SocketHandle,
    upstreams: Vec<SocketAddr>,
    next_upstream: usize,
    host4: Option<UdpSocket>,
    host6: Option<UdpSocket>,
    static_hosts: BTreeMap<String, IpAddr>,
    pending: HashMap<u16, Pending>,
    next_id: u16,
    names: NameMap,
    scratch: Vec<u8>,
}

/// A name in the form names are compared in ([`host_name::fold`]); the
/// root name is the empty string.
fn normal_name(name: &str) -> String {
    host_name::fold(name).unwrap_or_default()
}

impl Resolver {
    /// A resolver forwarding to `upstreams`, answering `static_hosts`
    /// itself; its UDP socket is added to `sockets`.
    ///
    /// Errors: [`DnsError`].
    pub fn new(
        upstreams: &[SocketAddr],
        static_hosts: &BTreeMap<String, IpAddr>,
        sockets: &mut SocketSet<'static>,
        seed: u64,
    ) -> Result<Self, DnsError> {
        let mut socket = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 32], vec![0; 16 * 1024]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 64 * 1024]),
        );
        socket.bind(IpListenEndpoint { addr: Some(DNS_ADDR.into()), port: 53 }).map_err(|_| DnsError::Bind)?;
        let handle = sockets.add(socket);
        let bind = |addr: SocketAddr| -> Result<UdpSocket, DnsError> {
            let s = UdpSocket::bind(addr).map_err(DnsError::Socket)?;
            s.set_nonblocking(true).map_err(DnsError::Socket)?;
            Ok(s)
        };
        let host4 = if upstreams.iter().any(SocketAddr::is_ipv4) {
            Some(bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))?)
        } else {
            None
        };
        let host6 = if upstreams.iter().any(SocketAddr::is_ipv6) {
            Some(bind(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)))?)
        } else {
            None
        };
        Ok(Self {
            handle,
            upstreams: upstreams.to_vec(),
            next_upstream: 0,
            host4,
            host6,
            static_hosts: static_hosts.iter().map(|(k, v)| (normal_name(k), *v)).collect(),
            pending: HashMap::new(),
            next_id: (seed & 0xffff) as u16,
            names: NameMap::default(),
            scratch: vec![0; 65536],
        })
    }

    /// The host sockets toward the upstreams (to watch for readability).
    pub fn host_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.host4.iter().chain(self.host6.iter()).map(AsRawFd::as_raw_fd).collect()
    }

    /// The address-to-names map of the answers so far.
    pub fn names(&self) -> &NameMap {
        &self.names
    }

    /// Forwarded queries waiting for an answer.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// When the oldest waiting query times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.deadline).min()
    }

    /// Forgets every waiting query (after a restore).
    pub fn reset(&mut self) {
        self.pending.clear();
    }

    /// Runs the resolver: the guest's queries, the upstreams' answers (read
    /// only when `host_ready`: the host sockets were reported readable),
    /// timeouts.
    pub fn poll(&mut self, sockets: &mut SocketSet<'static>, control: &NetControl, now: Instant, host_ready: bool) {
        // Guest queries (bounded by the smoltcp socket's buffer).
        loop {
            let socket = sockets.get_mut::<udp::Socket>(self.handle);
            let (query, guest) = match socket.recv() {
                Ok((data, meta)) => (data.to_vec(), meta.endpoint),
                Err(_) => break,
            };
            self.query(sockets, control, &query, guest, now);
        }
        if host_ready {
            self.answers(sockets, control);
        }
        let expired: Vec<u16> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                let reply = error_reply(p.guest_id, Some(p.query), ResponseCode::ServFail);
                self.reply(sockets, p.guest, &reply);
                control.update(p.record, |r| {
                    r.duration_ms = Some(duration_ms(p.started, now));
                });
            }
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
        let verdict = control.policy().check_name(&qname);
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
            self.names.insert(ip, &qname);
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
        let mut new_id = self.next_id;
        while self.pending.contains_key(&new_id) {
            new_id = new_id.wrapping_add(1);
        }
        self.next_id = new_id.wrapping_add(1);
        let upstream = self.upstreams[self.next_upstream % self.upstreams.len()];
        self.next_upstream = self.next_upstream.wrapping_add(1);
        let mut forward = raw.to_vec();
        forward[..2].copy_from_slice(&new_id.to_be_bytes());
        let socket = if upstream.is_ipv4() { self.host4.as_ref() } else { self.host6.as_ref() };
        let sent = socket.map(|s| s.send_to(&forward, upstream));
        if !matches!(sent, Some(Ok(_))) {
            servfail(self, sockets, question);
            return;
        }
        self.pending.insert(
            new_id,
            Pending {
                guest,
                guest_id: id,
                query: question,
                qname,
                upstream,
                deadline: now + QUERY_TIMEOUT,
                started: now,
                record: record_id,
            },
        );
    }

    fn answers(&mut self, sockets: &mut SocketSet<'static>, control: &NetControl) {
        for v6 in [false, true] {
            loop {
                let socket = if v6 { &self.host6 } else { &self.host4 };
                let Some(socket) = socket else { break };
                let (len, from) = match socket.recv_from(&mut self.scratch) {
                    Ok(r) => r,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                };
                let Some(answer) = self.scratch.get(..len) else {
                    continue;
                };
                if len < 12 {
                    continue;
                }
                let id = u16::from_be_bytes([answer[0], answer[1]]);
                let matches = self.pending.get(&id).is_some_and(|p| p.upstream == from);
                if !matches {
                    continue;
                }
                let Some(p) = self.pending.remove(&id) else {
                    continue;
                };
                let mut reply = answer.to_vec();
                reply[..2].copy_from_slice(&p.guest_id.to_be_bytes());
                if let Ok(msg) = Message::from_vec(&reply) {
                    for rec in &msg.answers {
                        let ip = match rec.data {
                            RData::A(a) => IpAddr::V4(a.0),
                            RData::AAAA(a) => IpAddr::V6(a.0),
                            _ => continue,
                        };
                        self.names.insert(ip, &p.qname);
                        let owner = normal_name(&rec.name.to_ascii());
                        if owner != p.qname {
                            self.names.insert(ip, &owner);
                        }
                    }
                }
                self.reply(sockets, p.guest, &reply);
                let now = Instant::now();
                control.update(p.record, |r| {
                    r.bytes_in = reply.len() as u64;
                    r.duration_ms = Some(duration_ms(p.started, now));
                });
            }
        }
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
    fn name_map_is_bounded() {
        let mut m = NameMap::default();
        for i in 0..(MAX_MAPPED_ADDRS as u32 + 10) {
            m.insert(IpAddr::V4(Ipv4Addr::from(i)), "a.test");
        }
        assert_eq!(m.len(), MAX_MAPPED_ADDRS);
        assert!(m.names(IpAddr::V4(Ipv4Addr::from(0))).is_empty());
        let ip = IpAddr::V4(Ipv4Addr::new(1, 2, 3, 4));
        for i in 0..10 {
            m.insert(ip, &format!("n{i}.test"));
        }
        assert_eq!(m.names(ip).len(), MAX_NAMES_PER_ADDR);
        assert_eq!(m.names(ip).last().map(String::as_str), Some("n9.test"));
    }
}
