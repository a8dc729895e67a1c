//! The NAT end to end on this machine's loopback: the "guest" is a second
//! smoltcp interface (a real TCP/IP stack with GUEST_ADDR/GUEST_MAC)
//! exchanging Ethernet frames with the NetStack; the far ends are real host
//! sockets on 127.0.0.1.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use netstack::control::InboundError;
use netstack::control::NetControl;
use netstack::log::{Direction, NetRecord, Protocol};
use netstack::policy::{Egress, NetworkPolicy, ServerNetPolicy};
use netstack::stack::{NetStack, StackConfig};
use netstack::{DNS_ADDR, GATEWAY_ADDR, GATEWAY_MAC, GUEST_ADDR, GUEST_MAC, PREFIX_LEN};
use sha2::{Digest, Sha256};
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{EthernetAddress, IpAddress, IpCidr, IpEndpoint};

// ---------------------------------------------------------------- the guest

struct GuestDev {
    rx: VecDeque<Vec<u8>>,
    tx: VecDeque<Vec<u8>>,
}

struct Rx(Vec<u8>);
struct Tx<'a>(&'a mut VecDeque<Vec<u8>>);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0; len];
        let r = f(&mut buf);
        self.0.push_back(buf);
        r
    }
}

impl Device for GuestDev {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;
    fn receive(&mut self, _: smoltcp::time::Instant) -> Option<(Rx, Tx<'_>)> {
        let f = self.rx.pop_front()?;
        Some((Rx(f), Tx(&mut self.tx)))
    }
    fn transmit(&mut self, _: smoltcp::time::Instant) -> Option<Tx<'_>> {
        Some(Tx(&mut self.tx))
    }
    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = 1514;
        caps
    }
}

/// A guest and the NAT, pumped by hand.
struct World {
    stack: NetStack,
    control: Arc<NetControl>,
    iface: Interface,
    dev: GuestDev,
    sockets: SocketSet<'static>,
    next_port: u16,
}

fn now() -> smoltcp::time::Instant {
    smoltcp::time::Instant::now()
}

fn policy(egress: Egress, allow: &[&str], deny: &[&str]) -> NetworkPolicy {
    NetworkPolicy {
        egress,
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
    }
}

/// The default config with no upstream, no static host and no rate limit.
fn config() -> StackConfig {
    StackConfig {
        dns_upstreams: Vec::new(),
        static_hosts: BTreeMap::new(),
        connection_rate: None,
        dns_rate: None,
        ..StackConfig::default()
    }
}

impl World {
    fn new(policy: NetworkPolicy, permit_loopback: bool, config: StackConfig) -> Self {
        Self::permitting(policy, if permit_loopback { &["127.0.0.0/8"] } else { &[] }, config)
    }

    /// A world whose server permits `permit_ranges` (entries as the
    /// configuration takes them).
    fn permitting(policy: NetworkPolicy, permit_ranges: &[&str], config: StackConfig) -> Self {
        let server = ServerNetPolicy {
            permit_ranges: permit_ranges.iter().map(|r| r.parse().unwrap()).collect(),
            host_addrs: Default::default(),
        };
        let control = NetControl::new(&policy, None, Arc::new(server), 1024).unwrap();
        let stack = NetStack::new(config, Arc::clone(&control)).unwrap();
        let mut dev = GuestDev { rx: VecDeque::new(), tx: VecDeque::new() };
        let mut cfg = Config::new(EthernetAddress(GUEST_MAC).into());
        cfg.random_seed = 0x1234_5678;
        let mut iface = Interface::new(cfg, &mut dev, now());
        iface.update_ip_addrs(|a| {
            a.push(IpCidr::new(GUEST_ADDR.into(), PREFIX_LEN)).unwrap();
        });
        iface.routes_mut().add_default_ipv4_route(GATEWAY_ADDR).unwrap();
        World { stack, control, iface, dev, sockets: SocketSet::new(Vec::new()), next_port: 40000 }
    }

    /// One round: guest out, NAT, guest in. Waits on the NAT's epoll fd
    /// (up to 1 ms) when nothing moved.
    fn pump(&mut self) {
        self.iface.poll(now(), &mut self.dev, &mut self.sockets);
        let mut moved = false;
        while let Some(f) = self.dev.tx.pop_front() {
            moved = true;
            if !self.stack.send_frame(&f) {
                self.dev.tx.push_front(f);
                break;
            }
        }
        self.stack.poll();
        while let Some(f) = self.stack.peek_frame() {
            self.dev.rx.push_back(f.to_vec());
            self.stack.pop_frame();
            moved = true;
        }
        self.iface.poll(now(), &mut self.dev, &mut self.sockets);
        if !moved && self.dev.tx.is_empty() {
            let mut pfd = libc::pollfd { fd: self.stack.epoll_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, count 1.
            unsafe { libc::poll(&mut pfd, 1, 1) };
        }
    }

    /// Pumps until `cond` holds; panics after 30 s.
    fn until(&mut self, what: &str, mut cond: impl FnMut(&mut World) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cond(self) {
            if Instant::now() >= deadline {
                let states: Vec<_> = self
                    .sockets
                    .iter()
                    .filter_map(|(_, s)| match s {
                        smoltcp::socket::Socket::Tcp(t) => Some((t.state(), t.send_queue(), t.recv_queue())),
                        _ => None,
                    })
                    .collect();
                eprintln!("DEBUG {:?} {:?} buffered {}", states, self.stack.stats(), self.stack.buffered_bytes());
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            self.pump();
        }
    }

    fn tcp(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// A guest TCP socket connecting to `dst:port`.
    fn connect(&mut self, dst: Ipv4Addr, port: u16) -> SocketHandle {
        let mut s =
            tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 256 * 1024]), tcp::SocketBuffer::new(vec![0; 256 * 1024]));
        self.next_port += 1;
        s.connect(self.iface.context(), (IpAddress::Ipv4(dst), port), self.next_port).unwrap();
        self.sockets.add(s)
    }

    /// Waits for the handshake's outcome: true = established, false = reset.
    fn connected(&mut self, h: SocketHandle) -> bool {
        self.until("a connect outcome", |w| {
            matches!(w.tcp(h).state(), tcp::State::Established | tcp::State::Closed | tcp::State::CloseWait)
        });
        self.tcp(h).state() != tcp::State::Closed
    }

    /// Sends all of `data` and reads `expect` bytes back (echo).
    fn echo(&mut self, h: SocketHandle, data: &[u8]) -> Vec<u8> {
        let mut sent = 0;
        let mut got = Vec::new();
        self.until("an echo", |w| {
            let s = w.tcp(h);
            if sent < data.len() && s.can_send() {
                sent += s.send_slice(&data[sent..]).unwrap();
            }
            while s.can_recv() {
                let mut buf = [0u8; 4096];
                let n = s.recv_slice(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            got.len() >= data.len() || !s.is_active()
        });
        got
    }

    /// Reads what guest socket `h` holds into `hasher`, adding the bytes
    /// to `got`.
    fn recv_hashed(&mut self, h: SocketHandle, hasher: &mut Sha256, got: &mut usize) {
        let s = self.tcp(h);
        while s.can_recv() {
            s.recv(|b| {
                hasher.update(&*b);
                *got += b.len();
                (b.len(), ())
            })
            .unwrap();
        }
    }

    /// A guest TCP socket listening on `port`.
    fn listen(&mut self, port: u16) -> SocketHandle {
        let mut s =
            tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 256 * 1024]), tcp::SocketBuffer::new(vec![0; 256 * 1024]));
        s.listen(port).unwrap();
        self.sockets.add(s)
    }

    fn log(&self) -> Vec<NetRecord> {
        self.control.query(0, 10_000).0
    }

    /// A DNS query from the guest to the gateway's resolver; the reply.
    fn dns(&mut self, name: &str, qtype: RecordType, id: u16) -> Message {
        let mut s = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 4], vec![0; 8192]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 4], vec![0; 8192]),
        );
        self.next_port += 1;
        s.bind(self.next_port).unwrap();
        let h = self.sockets.add(s);
        let mut q = Message::new(id, MessageType::Query, OpCode::Query);
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        let bytes = q.to_vec().unwrap();
        self.sockets.get_mut::<udp::Socket>(h).send_slice(&bytes, IpEndpoint::new(DNS_ADDR.into(), 53)).unwrap();
        let mut reply = None;
        self.until("a DNS reply", |w| {
            if let Ok((data, meta)) = w.sockets.get_mut::<udp::Socket>(h).recv() {
                assert_eq!(meta.endpoint, IpEndpoint::new(DNS_ADDR.into(), 53));
                reply = Some(Message::from_vec(data).unwrap());
            }
            reply.is_some()
        });
        self.sockets.remove(h);
        reply.unwrap()
    }
}

// ------------------------------------------------------------- host helpers

/// An echo server on 127.0.0.1 (each connection echoed until EOF).
fn echo_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { break };
            thread::spawn(move || {
                let mut buf = [0u8; 65536];
                loop {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if c.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
            });
        }
    });
    port
}

/// Deterministic pseudo-random bytes.
fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Reads `r` to its end: the byte count and the SHA-256 of the bytes.
fn read_hashed(r: &mut impl Read) -> (usize, sha2::digest::Output<Sha256>) {
    let mut h = Sha256::new();
    let mut n = 0usize;
    let mut buf = vec![0u8; 65536];
    loop {
        let k = r.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        n += k;
        h.update(&buf[..k]);
    }
    (n, h.finalize())
}

fn rec_for(log: &[NetRecord], protocol: Protocol, port: u16) -> Vec<NetRecord> {
    log.iter().filter(|r| r.protocol == protocol && r.port == port).cloned().collect()
}

// -------------------------------------------------------------------- tests

#[test]
fn transfers_16_mib_each_way_through_the_nat() {
    const LEN: usize = 16 << 20;
    let down = data(LEN, 7);
    let up = data(LEN, 11);
    let down_sum = Sha256::digest(&down);
    let up_sum = Sha256::digest(&up);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    let server = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        c.write_all(&down).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        tx.send(read_hashed(&mut c)).unwrap();
    });

    let mut w = World::new(NetworkPolicy::default(), true, config());
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    // Host -> guest.
    let start = Instant::now();
    let mut hasher = Sha256::new();
    let mut got = 0usize;
    w.until("the download", |w| {
        w.recv_hashed(h, &mut hasher, &mut got);
        !w.tcp(h).may_recv()
    });
    let secs = start.elapsed().as_secs_f64();
    println!("host->guest: {} MiB in {secs:.2} s = {:.1} MB/s", LEN >> 20, LEN as f64 / secs / 1e6);
    assert_eq!(got, LEN);
    assert_eq!(hasher.finalize(), down_sum);
    // Guest -> host.
    let start = Instant::now();
    let mut sent = 0usize;
    w.until("the upload", |w| {
        let s = w.tcp(h);
        while sent < LEN && s.can_send() {
            let n = s.send_slice(&up[sent..]).unwrap();
            if n == 0 {
                break;
            }
            sent += n;
        }
        if sent == LEN {
            s.close();
        }
        sent == LEN && s.send_queue() == 0
    });
    // The NAT may still hold the upload's tail for the host socket: keep
    // pumping until the host has read it all.
    let mut received = None;
    w.until("the host to read the upload", |_| {
        received = received.take().or_else(|| rx.try_recv().ok());
        received.is_some()
    });
    let (n, sum) = received.unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!("guest->host: {} MiB in {secs:.2} s = {:.1} MB/s", LEN >> 20, LEN as f64 / secs / 1e6);
    assert_eq!(n, LEN);
    assert_eq!(sum, up_sum);
    server.join().unwrap();
    // Both sides closed: the connection goes, its record gets the bytes.
    w.until("the connection's end", |w| w.stack.stats().open_connections == 0);
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 1, "{recs:?}");
    let r = &recs[0];
    assert!(r.allowed);
    assert_eq!(r.addr, IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_eq!(r.rule, "egress:allow");
    assert_eq!(r.bytes_in, LEN as u64);
    assert_eq!(r.bytes_out, LEN as u64);
    assert!(r.duration_ms.is_some());
}

#[test]
fn loopback_is_refused_by_default_with_a_rst_and_a_record() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let port = l.local_addr().unwrap().port();
    let mut w = World::new(NetworkPolicy::default(), false, config());
    let h = w.connect(GATEWAY_ADDR, port);
    // smoltcp's guest retries a SYN forever: Closed means it got a RST.
    assert!(!w.connected(h));
    assert!(l.accept().is_err(), "nothing reached the host");
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 1);
    assert!(!recs[0].allowed);
    assert_eq!(recs[0].rule, "blocked-range:127.0.0.0/8");
    assert_eq!(recs[0].addr, IpAddr::V4(Ipv4Addr::LOCALHOST));
    // Private and metadata addresses too (dialled by IP).
    for ip in [Ipv4Addr::new(169, 254, 169, 254), Ipv4Addr::new(192, 168, 1, 1)] {
        let h = w.connect(ip, 80);
        assert!(!w.connected(h));
    }
    let rules: Vec<String> = w.log().iter().map(|r| r.rule.clone()).collect();
    assert!(rules.contains(&"blocked-range:169.254.0.0/16".to_string()));
    assert!(rules.contains(&"blocked-range:192.168.0.0/16".to_string()));
    assert_eq!(w.stack.stats().open_connections, 0);
}

#[test]
fn a_permit_range_with_a_port_permits_that_port_only() {
    let permitted = echo_server();
    let other = echo_server();
    let range = format!("127.0.0.1/32:{permitted}");
    let mut w = World::permitting(NetworkPolicy::default(), &[&range], config());
    let h = w.connect(GATEWAY_ADDR, permitted);
    assert!(w.connected(h), "{range} permits port {permitted}");
    assert_eq!(w.echo(h, b"ping"), b"ping");
    let h = w.connect(GATEWAY_ADDR, other);
    assert!(!w.connected(h), "{range} does not permit port {other}");
    let recs = rec_for(&w.log(), Protocol::Tcp, other);
    assert_eq!((recs[0].allowed, recs[0].rule.as_str()), (false, "blocked-range:127.0.0.0/8"));
    // A range of ports.
    let (lo, hi) = (permitted.min(other), permitted.max(other));
    let range = format!("127.0.0.1/32:{lo}-{hi}");
    let mut w = World::permitting(NetworkPolicy::default(), &[&range], config());
    for port in [permitted, other] {
        let h = w.connect(GATEWAY_ADDR, port);
        assert!(w.connected(h), "{range} permits port {port}");
    }
}

#[test]
fn egress_deny_blocks_and_a_closed_host_port_gives_a_rst() {
    let port = echo_server();
    let mut w = World::new(policy(Egress::Deny, &[], &[]), true, config());
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(!w.connected(h));
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs[0].rule, "egress:deny");
    assert!(!recs[0].allowed);
    // Allowed by policy, but nothing listens on the host: RST to the SYN.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut w = World::new(NetworkPolicy::default(), true, config());
    let h = w.connect(GATEWAY_ADDR, closed);
    assert!(!w.connected(h));
    w.until("the conn's removal", |w| w.stack.stats().open_connections == 0);
    let recs = rec_for(&w.log(), Protocol::Tcp, closed);
    assert!(recs[0].duration_ms.is_some());
}

#[test]
fn the_connection_cap_refuses_the_fifth_and_keeps_the_four() {
    let port = echo_server();
    let mut cfg = config();
    cfg.max_connections = 4;
    let mut w = World::new(NetworkPolicy::default(), true, cfg);
    let hs: Vec<_> = (0..4).map(|_| w.connect(GATEWAY_ADDR, port)).collect();
    for &h in &hs {
        assert!(w.connected(h));
    }
    let fifth = w.connect(GATEWAY_ADDR, port);
    assert!(!w.connected(fifth));
    assert_eq!(w.stack.stats().refused_by_cap, 1);
    assert_eq!(w.stack.stats().open_connections, 4);
    for (i, &h) in hs.iter().enumerate() {
        let msg = data(100_000, i as u64 + 1);
        assert_eq!(w.echo(h, &msg), msg);
    }
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 5);
    assert_eq!(recs.iter().filter(|r| r.allowed).count(), 4);
    let refused: Vec<_> = recs.iter().filter(|r| !r.allowed).collect();
    assert_eq!(refused[0].rule, "limit:connections");
    // Closing one makes room again.
    w.tcp(hs[0]).close();
    w.until("a slot", |w| w.stack.stats().open_connections == 3);
    let again = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(again));
}

/// A DNS responder on 127.0.0.1 answering every A query with 127.0.0.1.
fn dns_responder() -> (SocketAddr, Arc<AtomicBool>) {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let addr = s.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while !stop2.load(Ordering::Relaxed) {
            let Ok((n, from)) = s.recv_from(&mut buf) else {
                continue;
            };
            let q = Message::from_vec(&buf[..n]).unwrap();
            let mut r = Message::response(q.metadata.id, OpCode::Query);
            r.metadata.recursion_available = true;
            let question = q.queries[0].clone();
            if question.query_type() == RecordType::A {
                r.add_answer(Record::from_rdata(question.name().clone(), 30, RData::A(A(Ipv4Addr::LOCALHOST))));
            }
            r.add_query(question);
            s.send_to(&r.to_vec().unwrap(), from).unwrap();
        }
    });
    (addr, stop)
}

fn answers(m: &Message) -> Vec<IpAddr> {
    m.answers
        .iter()
        .filter_map(|r| match r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            _ => None,
        })
        .collect()
}

#[test]
fn dns_static_forwarded_refused_and_names_feed_domain_rules() {
    let (upstream, stop) = dns_responder();
    let mut cfg = config();
    cfg.dns_upstreams = vec![upstream];
    cfg.static_hosts.insert("Static.Test".into(), IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7)));
    let port = echo_server();
    let mut w = World::new(policy(Egress::Deny, &["good.test", "static.test"], &["bad.test"]), true, cfg);
    // Static host: A answered here, AAAA empty NOERROR.
    let m = w.dns("static.test.", RecordType::A, 0x1111);
    assert_eq!(m.metadata.id, 0x1111);
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert_eq!(answers(&m), vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7))]);
    let m = w.dns("static.test.", RecordType::AAAA, 0x1112);
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert!(m.answers.is_empty());
    // Denied name: REFUSED and a record.
    let m = w.dns("bad.test.", RecordType::A, 0x2222);
    assert_eq!(m.metadata.response_code, ResponseCode::Refused);
    let log = w.log();
    let bad = log.iter().find(|r| r.domain.as_deref() == Some("bad.test")).unwrap();
    assert_eq!(bad.protocol, Protocol::Dns);
    assert!(!bad.allowed);
    assert_eq!(bad.rule, "deny:bad.test");
    // Before any answer named it, 127.0.0.1 is egress:deny.
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(!w.connected(h));
    // Forwarded to the test's upstream (its id remapped and restored).
    let m = w.dns("good.test.", RecordType::A, 0x3333);
    assert_eq!(m.metadata.id, 0x3333);
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert_eq!(answers(&m), vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    let good = w.log().into_iter().find(|r| r.domain.as_deref() == Some("good.test")).unwrap();
    assert!(good.allowed && good.rule == "allow:good.test");
    assert!(good.bytes_in > 0 && good.duration_ms.is_some());
    // Now 127.0.0.1 was named good.test: the domain rule lets it through
    // (with its name: see the name-check tests below).
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(w.connected(h));
    let req = b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n";
    assert_eq!(w.echo(h, req), req);
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[0].rule, "egress:deny");
    assert_eq!(recs[1].rule, "allow:good.test");
    assert_eq!(recs[1].domain.as_deref(), Some("good.test"));
    stop.store(true, Ordering::Relaxed);
}

#[test]
fn dns_without_an_answer_gives_servfail() {
    // An upstream that never answers.
    let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut cfg = config();
    cfg.dns_upstreams = vec![silent.local_addr().unwrap()];
    let mut w = World::new(NetworkPolicy::default(), true, cfg);
    let m = w.dns("slow.test.", RecordType::A, 0x4444);
    assert_eq!(m.metadata.id, 0x4444);
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
    // No upstream at all: SERVFAIL at once.
    let mut w = World::new(NetworkPolicy::default(), true, config());
    let m = w.dns("none.test.", RecordType::A, 0x5555);
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
}

#[test]
fn http_host_sniffing_denies_a_name_not_allowed() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for c in l.incoming() {
            let mut c = c.unwrap();
            let mut got = Vec::new();
            let _ = c.read_to_end(&mut got);
            tx.send(got).unwrap();
        }
    });
    let mut w = World::new(policy(Egress::Allow, &[], &["evil.test"]), true, config());
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n").unwrap();
    w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
    let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(got.is_empty(), "the request never reached the host");
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert!(!recs[0].allowed);
    assert_eq!(recs[0].rule, "deny:evil.test");
    assert_eq!(recs[0].domain.as_deref(), Some("evil.test"));
    // An allowed Host passes, bytes intact.
    let req = b"GET / HTTP/1.1\r\nHost: fine.test:8080\r\n\r\n";
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(req).unwrap();
    w.tcp(h).close();
    let got = loop {
        w.pump();
        if let Ok(g) = rx.try_recv() {
            break g;
        }
    };
    assert_eq!(got, req);
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert!(recs[1].allowed);
    assert_eq!(recs[1].domain.as_deref(), Some("fine.test"));
}

#[test]
fn reset_gives_the_old_connections_rsts_and_new_ones_work() {
    let port = echo_server();
    let mut w = World::new(NetworkPolicy::default(), true, config());
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    assert_eq!(w.echo(h, b"before"), b"before");
    w.stack.reset();
    assert_eq!(w.stack.stats().open_connections, 0);
    w.tcp(h).send_slice(b"after").unwrap();
    w.until("the old connection's reset", |w| w.tcp(h).state() == tcp::State::Closed);
    let h2 = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h2));
    assert_eq!(w.echo(h2, b"new"), b"new");
    // The log kept the first record and closed it.
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 2);
    assert!(recs[0].duration_ms.is_some());
}

/// A frame from the guest: Ethernet + IPv4 + UDP to `dst:port`.
fn udp_frame(dst: Ipv4Addr, port: u16, payload: &[u8]) -> Vec<u8> {
    use smoltcp::wire::*;
    let caps = smoltcp::phy::ChecksumCapabilities::default();
    let udp = UdpRepr { src_port: 5000, dst_port: port };
    let ip = Ipv4Repr {
        src_addr: GUEST_ADDR,
        dst_addr: dst,
        next_header: IpProtocol::Udp,
        payload_len: 8 + payload.len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; 14 + ip.buffer_len() + 8 + payload.len()];
    let mut eth = EthernetFrame::new_unchecked(&mut buf);
    eth.set_src_addr(EthernetAddress(GUEST_MAC));
    eth.set_dst_addr(EthernetAddress(GATEWAY_MAC));
    eth.set_ethertype(EthernetProtocol::Ipv4);
    let mut ipp = Ipv4Packet::new_unchecked(eth.payload_mut());
    ip.emit(&mut ipp, &caps);
    let mut up = UdpPacket::new_unchecked(ipp.payload_mut());
    udp.emit(
        &mut up,
        &IpAddress::Ipv4(GUEST_ADDR),
        &IpAddress::Ipv4(dst),
        payload.len(),
        |b| b.copy_from_slice(payload),
        &caps,
    );
    buf
}

/// A port on 127.0.0.1 nobody listens on (just freed).
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A frame from the guest: Ethernet + IPv4 + TCP SYN to `dst:port`.
fn syn_frame(dst: Ipv4Addr, sport: u16, port: u16) -> Vec<u8> {
    use smoltcp::wire::*;
    let tcp = TcpRepr {
        src_port: sport,
        dst_port: port,
        control: TcpControl::Syn,
        seq_number: TcpSeqNumber(1000),
        ack_number: None,
        window_len: 1000,
        window_scale: None,
        max_seg_size: Some(1460),
        sack_permitted: false,
        sack_ranges: [None; 3],
        timestamp: None,
        payload: &[],
    };
    let ip = Ipv4Repr {
        src_addr: GUEST_ADDR,
        dst_addr: dst,
        next_header: IpProtocol::Tcp,
        payload_len: tcp.buffer_len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; 14 + ip.buffer_len() + tcp.buffer_len()];
    let mut eth = EthernetFrame::new_unchecked(&mut buf);
    eth.set_src_addr(EthernetAddress(GUEST_MAC));
    eth.set_dst_addr(EthernetAddress(GATEWAY_MAC));
    eth.set_ethertype(EthernetProtocol::Ipv4);
    let caps = smoltcp::phy::ChecksumCapabilities::default();
    let mut ipp = Ipv4Packet::new_unchecked(eth.payload_mut());
    ip.emit(&mut ipp, &caps);
    let mut tp = TcpPacket::new_unchecked(ipp.payload_mut());
    tcp.emit(&mut tp, &IpAddress::Ipv4(GUEST_ADDR), &IpAddress::Ipv4(dst), &caps);
    buf
}

#[test]
fn a_flood_of_garbage_frames_neither_panics_nor_blocks_good_traffic() {
    let port = echo_server();
    // Only loopback may be dialled: a mutated SYN never leaves this machine.
    let mut w = World::new(policy(Egress::Deny, &["127.0.0.0/8"], &[]), true, config());
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    let good = syn_frame(GATEWAY_ADDR, 999, closed_port());
    let msg = data(2 << 20, 3);
    let mut sent = 0;
    let mut got = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut garbage = 0u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < msg.len() {
        assert!(Instant::now() < deadline);
        // 20 garbage frames per round: random bytes and mutated SYNs.
        for i in 0..20 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut f = if i % 2 == 0 {
                data((x % 1600) as usize, x)
            } else {
                let mut f = good.clone();
                let at = (x as usize >> 8) % f.len();
                f[at] ^= (x >> 40) as u8 | 1;
                f
            };
            f.truncate(1600);
            let _ = w.stack.send_frame(&f);
            garbage += 1;
        }
        let s = w.tcp(h);
        if sent < msg.len() && s.can_send() {
            sent += s.send_slice(&msg[sent..]).unwrap();
        }
        while s.can_recv() {
            let mut buf = [0u8; 65536];
            let n = s.recv_slice(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        w.pump();
    }
    assert_eq!(got, msg);
    println!("{garbage} garbage frames; stats {:?}", w.stack.stats());
    assert!(w.stack.stats().open_connections >= 1);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn random_and_mutated_frames_never_panic(
            frames in proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 0..1600), any::<u16>(), any::<u8>(), any::<bool>()),
                1..40,
            )
        ) {
            let mut cfg = config();
            cfg.max_connections = 8;
            cfg.max_guest_frames = 16;
            // Only loopback may be dialled (a mutated SYN never leaves
            // this machine); a domain rule turns sniffing on.
            let control = NetControl::new(
                &policy(Egress::Deny, &["127.0.0.0/8"], &["x.test"]),
                None,
                Arc::new(ServerNetPolicy {
                    permit_ranges: vec!["127.0.0.0/8".parse().unwrap()],
                    host_addrs: Default::default(),
                }),
                64,
            ).unwrap();
            let mut stack = NetStack::new(cfg, control).unwrap();
            for (bytes, pos, xor, mutate) in frames {
                let f = if mutate {
                    // A valid SYN to a public address, one byte changed.
                    let mut f = syn_frame(GATEWAY_ADDR, 1234, pos | 1);
                    let at = pos as usize % f.len();
                    f[at] ^= xor;
                    f
                } else {
                    bytes
                };
                let _ = stack.send_frame(&f);
                stack.poll();
                while stack.peek_frame().is_some() {
                    stack.pop_frame();
                }
            }
            stack.reset();
            prop_assert_eq!(stack.stats().open_connections, 0);
        }

        #[test]
        fn random_and_mutated_dns_queries_never_panic(
            queries in proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 0..600), any::<u16>(), any::<u8>(), any::<bool>()),
                1..30,
            )
        ) {
            let mut cfg = config();
            cfg.static_hosts.insert("s.test".into(), IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)));
            let control = NetControl::new(
                &policy(Egress::Allow, &[], &["x.test"]),
                None,
                Arc::new(ServerNetPolicy::default()),
                64,
            ).unwrap();
            let mut stack = NetStack::new(cfg, control).unwrap();
            let mut q = Message::new(1, MessageType::Query, OpCode::Query);
            q.add_query(Query::query(Name::from_ascii("s.test.").unwrap(), RecordType::A));
            let valid = q.to_vec().unwrap();
            for (bytes, pos, xor, mutate) in queries {
                let payload = if mutate {
                    let mut v = valid.clone();
                    let at = pos as usize % v.len();
                    v[at] ^= xor;
                    v
                } else {
                    bytes
                };
                let _ = stack.send_frame(&udp_frame(DNS_ADDR, 53, &payload));
                stack.poll();
                while let Some(f) = stack.peek_frame() {
                    prop_assert!(f.len() <= 1514);
                    stack.pop_frame();
                }
            }
        }
    }
}

#[test]
fn udp_flows_go_through_the_policy_and_come_back() {
    let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = echo.local_addr().unwrap().port();
    thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = echo.recv_from(&mut buf) {
            let _ = echo.send_to(&buf[..n], from);
        }
    });
    let mut w = World::new(NetworkPolicy::default(), true, config());
    let mut s = udp::Socket::new(
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 16384]),
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 16384]),
    );
    s.bind(5353).unwrap();
    let h = w.sockets.add(s);
    let to = IpEndpoint::new(GATEWAY_ADDR.into(), port);
    let mut got = Vec::new();
    for i in 0..3u8 {
        let msg = vec![i; 1000];
        w.sockets.get_mut::<udp::Socket>(h).send_slice(&msg, to).unwrap();
        w.until("a UDP echo", |w| {
            if let Ok((data, meta)) = w.sockets.get_mut::<udp::Socket>(h).recv() {
                assert_eq!(meta.endpoint, to);
                got.push(data.to_vec());
            }
            got.len() > usize::from(i)
        });
        assert_eq!(got[usize::from(i)], msg);
    }
    assert_eq!(w.stack.stats().open_connections, 1);
    w.stack.reset();
    assert_eq!(w.stack.stats().open_connections, 0);
    let recs = rec_for(&w.log(), Protocol::Udp, port);
    assert_eq!(recs.len(), 1, "one record per flow");
    assert!(recs[0].allowed);
    assert_eq!((recs[0].bytes_out, recs[0].bytes_in), (3000, 3000));

    // Refused by default (loopback): one record for the flow, nothing sent.
    let mut w = World::new(NetworkPolicy::default(), false, config());
    let s = udp::Socket::new(
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 16384]),
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 16384]),
    );
    let h = w.sockets.add(s);
    w.sockets.get_mut::<udp::Socket>(h).bind(5353).unwrap();
    for _ in 0..3 {
        w.sockets.get_mut::<udp::Socket>(h).send_slice(b"x", to).unwrap();
        for _ in 0..20 {
            w.pump();
        }
    }
    assert!(w.sockets.get_mut::<udp::Socket>(h).recv().is_err());
    let recs = rec_for(&w.log(), Protocol::Udp, port);
    assert_eq!(recs.len(), 1);
    assert!(!recs[0].allowed);
    assert_eq!(recs[0].rule, "blocked-range:127.0.0.0/8");
}

#[test]
fn a_guest_that_takes_no_frames_stops_the_host_reads_without_spinning() {
    const LEN: usize = 8 << 20;
    let payload = data(LEN, 5);
    let sum = Sha256::digest(&payload);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let _ = c.write_all(&payload);
    });
    let mut cfg = config();
    cfg.max_guest_frames = 32;
    // Room in the connection's buffer for more than the queue holds.
    cfg.tcp_buffer_bytes = 256 * 1024;
    let mut w = World::new(NetworkPolicy::default(), true, cfg);
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    w.until("the first bytes", |w| w.tcp(h).recv_queue() > 0);
    // The device stops taking frames: the stack fills its queue, then
    // waits. Count how often its epoll fd wakes it in 500 ms.
    let start = Instant::now();
    let mut wakes = 0;
    while start.elapsed() < Duration::from_millis(500) {
        let mut pfd = libc::pollfd { fd: w.stack.epoll_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, count 1.
        if unsafe { libc::poll(&mut pfd, 1, 50) } > 0 {
            wakes += 1;
            w.stack.poll();
        }
    }
    let mut queued = 0;
    while w.stack.peek_frame().is_some() {
        queued += 1;
        w.dev.rx.push_back(w.stack.peek_frame().unwrap().to_vec());
        w.stack.pop_frame();
    }
    println!("{wakes} wake-ups in 500 ms with a full queue of {queued} frames");
    assert_eq!(queued, 32);
    assert!(wakes < 50, "{wakes} wake-ups: the stack spins");
    // The guest takes frames again: everything arrives.
    let mut hasher = Sha256::new();
    let mut got = 0;
    w.until("the rest", |w| {
        let s = w.tcp(h);
        while s.can_recv() {
            s.recv(|b| {
                hasher.update(&*b);
                got += b.len();
                (b.len(), ())
            })
            .unwrap();
        }
        !s.may_recv()
    });
    assert_eq!(got, LEN);
    assert_eq!(hasher.finalize(), sum);
}

#[test]
fn a_port_reused_while_the_old_connection_is_in_time_wait_connects() {
    // The host closes first, so the NAT's side ends in TIME-WAIT.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        for c in l.incoming() {
            let _ = c.unwrap().write_all(b"bye");
        }
    });
    let mut w = World::new(NetworkPolicy::default(), true, config());
    for round in 0..3 {
        let mut s = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 65536]), tcp::SocketBuffer::new(vec![0; 65536]));
        s.connect(w.iface.context(), (IpAddress::Ipv4(GATEWAY_ADDR), port), 45000).unwrap();
        let h = w.sockets.add(s);
        if round > 0 {
            // One round trip: the SYN (the gateway's MAC is known by now)
            // is admitted at once although the old connection on this
            // 4-tuple is in TIME-WAIT at the NAT.
            w.pump();
            assert_eq!(w.stack.stats().open_connections, 1, "round {round}");
        }
        assert!(w.connected(h), "round {round}");
        let mut got = Vec::new();
        w.until("the server's close", |w| {
            let s = w.tcp(h);
            while s.can_recv() {
                let mut b = [0u8; 16];
                let n = s.recv_slice(&mut b).unwrap();
                got.extend_from_slice(&b[..n]);
            }
            !s.may_recv()
        });
        assert_eq!(got, b"bye");
        w.tcp(h).close();
        w.until("the guest's close", |w| w.tcp(h).state() == tcp::State::Closed);
        w.until("the NAT's side done", |w| w.stack.stats().open_connections == 0);
        w.sockets.remove(h);
    }
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 3);
    assert!(recs.iter().all(|r| r.allowed && r.bytes_in == 3 && r.duration_ms.is_some()));
}

#[test]
fn ping_answers_for_the_gateway_only() {
    use smoltcp::socket::icmp;
    use smoltcp::wire::{Icmpv4Packet, Icmpv4Repr};
    let mut w = World::new(NetworkPolicy::default(), true, config());
    let mut s = icmp::Socket::new(
        icmp::PacketBuffer::new(vec![icmp::PacketMetadata::EMPTY; 4], vec![0; 4096]),
        icmp::PacketBuffer::new(vec![icmp::PacketMetadata::EMPTY; 4], vec![0; 4096]),
    );
    s.bind(icmp::Endpoint::Ident(0x77)).unwrap();
    let h = w.sockets.add(s);
    let caps = smoltcp::phy::ChecksumCapabilities::default();
    let ping = |w: &mut World, dst: Ipv4Addr, seq: u16| -> bool {
        let repr = Icmpv4Repr::EchoRequest { ident: 0x77, seq_no: seq, data: b"ping" };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut Icmpv4Packet::new_unchecked(&mut buf), &caps);
        w.sockets.get_mut::<icmp::Socket>(h).send_slice(&buf, IpAddress::Ipv4(dst)).unwrap();
        // smoltcp's guest waits 1 s before retrying after an ARP miss.
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            w.pump();
            if let Ok((data, from)) = w.sockets.get_mut::<icmp::Socket>(h).recv() {
                let p = Icmpv4Packet::new_checked(data).unwrap();
                let r = Icmpv4Repr::parse(&p, &caps).unwrap();
                assert_eq!(from, IpAddress::Ipv4(dst));
                assert!(matches!(r, Icmpv4Repr::EchoReply { seq_no, .. } if seq_no == seq));
                return true;
            }
        }
        false
    };
    assert!(ping(&mut w, GATEWAY_ADDR, 1));
    assert!(ping(&mut w, DNS_ADDR, 2));
    // Beyond the gateway: no answer made up by the NAT.
    assert!(!ping(&mut w, Ipv4Addr::new(192, 0, 2, 1), 3));
}

#[test]
fn resets_pass_both_ways() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        // First connection: the host resets it after a byte.
        let (mut c, _) = l.accept().unwrap();
        let mut one = [0u8; 1];
        c.read_exact(&mut one).unwrap();
        socket2::SockRef::from(&c).set_linger(Some(Duration::ZERO)).unwrap();
        drop(c);
        // Second: the guest resets it; report what the host's read says.
        let (mut c, _) = l.accept().unwrap();
        let mut buf = [0u8; 16];
        let first = c.read(&mut buf);
        let after = c.read(&mut buf).map_err(|e| e.kind());
        tx.send((first.ok(), after)).unwrap();
    });
    let mut w = World::new(NetworkPolicy::default(), true, config());
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(b"x").unwrap();
    // Host RST -> guest RST (a FIN would leave the guest in CLOSE-WAIT).
    w.until("the guest's reset", |w| w.tcp(h).state() == tcp::State::Closed);
    w.until("the removal", |w| w.stack.stats().open_connections == 0);

    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(b"x").unwrap();
    w.until("the byte's ACK", |w| w.tcp(h).send_queue() == 0);
    w.tcp(h).abort();
    w.until("the removal", |w| w.stack.stats().open_connections == 0);
    let (first, after) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(first, Some(1));
    assert_eq!(after, Err(std::io::ErrorKind::ConnectionReset));
}

#[test]
fn dns_over_tcp_judges_every_query() {
    // A TCP DNS upstream on 127.0.0.1: answers A 127.0.0.1, reports names.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let server = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        loop {
            let mut head = [0u8; 2];
            if c.read_exact(&mut head).is_err() {
                break;
            }
            let mut msg = vec![0u8; usize::from(u16::from_be_bytes(head))];
            c.read_exact(&mut msg).unwrap();
            let q = Message::from_vec(&msg).unwrap();
            let question = q.queries[0].clone();
            tx.send(question.name().to_ascii()).unwrap();
            let mut r = Message::response(q.metadata.id, OpCode::Query);
            r.add_answer(Record::from_rdata(question.name().clone(), 30, RData::A(A(Ipv4Addr::LOCALHOST))));
            r.add_query(question);
            let bytes = r.to_vec().unwrap();
            c.write_all(&(bytes.len() as u16).to_be_bytes()).unwrap();
            c.write_all(&bytes).unwrap();
        }
    });
    let mut cfg = config();
    cfg.dns_upstreams = vec![upstream];
    let mut w = World::new(policy(Egress::Allow, &[], &["bad.test"]), false, cfg);
    let h = w.connect(DNS_ADDR, 53);
    assert!(w.connected(h));
    let framed = |name: &str, id: u16| {
        let mut q = Message::new(id, MessageType::Query, OpCode::Query);
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        let bytes = q.to_vec().unwrap();
        let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&bytes);
        out
    };
    // Sent in two pieces: the NAT waits for the whole message.
    let good = framed("good.test.", 7);
    w.tcp(h).send_slice(&good[..5]).unwrap();
    for _ in 0..20 {
        w.pump();
    }
    w.tcp(h).send_slice(&good[5..]).unwrap();
    let mut answer = Vec::new();
    w.until("the TCP answer", |w| {
        let s = w.tcp(h);
        while s.can_recv() {
            let mut b = [0u8; 512];
            let n = s.recv_slice(&mut b).unwrap();
            answer.extend_from_slice(&b[..n]);
        }
        answer.len() > 2 && answer.len() >= 2 + usize::from(u16::from_be_bytes([answer[0], answer[1]]))
    });
    let m = Message::from_vec(&answer[2..]).unwrap();
    assert_eq!(m.metadata.id, 7);
    assert_eq!(answers(&m), vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    // A denied name: the connection is reset, the query never leaves.
    w.tcp(h).send_slice(&framed("bad.test.", 8)).unwrap();
    w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
    // The upstream's connection was reset (its loop ended): it saw one query.
    server.join().unwrap();
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec!["good.test.".to_string()]);
    let recs = rec_for(&w.log(), Protocol::Dns, 53);
    assert_eq!(recs.len(), 1);
    assert!(!recs[0].allowed);
    assert_eq!(recs[0].rule, "deny:bad.test");
    assert_eq!(recs[0].domain.as_deref(), Some("bad.test"));
}

// ----------------------------------------------------------------- inbound

#[test]
fn an_inbound_connection_carries_16_mib_each_way_into_a_guest_port() {
    const LEN: usize = 16 << 20;
    let down = data(LEN, 3);
    let up = data(LEN, 5);
    let down_sum = Sha256::digest(&down);
    let up_sum = Sha256::digest(&up);
    let mut w = World::new(NetworkPolicy { egress: Egress::Deny, ..Default::default() }, false, config());
    let h = w.listen(8000);
    let mut stream = w.control.connect_inbound(8000).unwrap();
    // The host's side: everything down, then read everything up.
    let host = thread::spawn(move || {
        stream.write_all(&down).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        read_hashed(&mut stream)
    });
    let start = Instant::now();
    let (mut got, mut hasher, mut sent) = (0usize, Sha256::new(), 0usize);
    w.until("both ways", |w| {
        w.recv_hashed(h, &mut hasher, &mut got);
        let s = w.tcp(h);
        while sent < LEN && s.can_send() {
            let n = s.send_slice(&up[sent..]).unwrap();
            if n == 0 {
                break;
            }
            sent += n;
        }
        if sent == LEN && !s.may_recv() {
            s.close();
        }
        host.is_finished()
    });
    let secs = start.elapsed().as_secs_f64();
    println!(
        "inbound, both ways at once: 2 x {} MiB in {secs:.2} s = {:.1} MB/s",
        LEN >> 20,
        2.0 * LEN as f64 / secs / 1e6
    );
    let (n, sum) = host.join().unwrap();
    assert_eq!((got, n), (LEN, LEN));
    assert_eq!(hasher.finalize(), down_sum);
    assert_eq!(sum, up_sum);
    // Logged as inbound, to the guest's port, with its bytes, closed.
    w.until("the record to close", |w| w.log().iter().any(|r| r.duration_ms.is_some()));
    let log = w.log();
    assert_eq!(log.len(), 1, "{log:?}");
    let r = &log[0];
    assert_eq!(
        (r.direction, r.protocol, r.addr, r.port),
        (Direction::Inbound, Protocol::Tcp, IpAddr::V4(GUEST_ADDR), 8000)
    );
    assert_eq!((r.allowed, r.rule.as_str()), (true, netstack::stack::RULE_INBOUND));
    assert_eq!((r.bytes_out, r.bytes_in), (LEN as u64, LEN as u64));
}

#[test]
fn an_inbound_connection_to_a_port_nobody_listens_on_closes_its_stream() {
    let mut w = World::new(NetworkPolicy::default(), false, config());
    let mut stream = w.control.connect_inbound(8001).unwrap();
    stream.set_nonblocking(true).unwrap();
    let mut eof = false;
    w.until("the stream to close", |_| {
        let mut b = [0u8; 1];
        eof = matches!(stream.read(&mut b), Ok(0));
        eof || matches!(stream.read(&mut b), Err(ref e) if e.kind() != std::io::ErrorKind::WouldBlock)
    });
    assert!(eof);
    w.until("the record to close", |w| w.log().iter().any(|r| r.duration_ms.is_some()));
    let r = &w.log()[0];
    assert_eq!((r.direction, r.port), (Direction::Inbound, 8001));
    assert_eq!(w.stack.stats().open_connections, 0);
}

#[test]
fn inbound_connections_count_against_the_cap_and_port_0_is_refused() {
    let mut w = World::new(NetworkPolicy::default(), false, StackConfig { max_connections: 1, ..config() });
    assert!(matches!(w.control.connect_inbound(0), Err(InboundError::Port)));
    let h = w.listen(8002);
    let first = w.control.connect_inbound(8002).unwrap();
    w.until("the first to be accepted", |w| w.tcp(h).state() == tcp::State::Established);
    let mut second = w.control.connect_inbound(8002).unwrap();
    second.set_nonblocking(true).unwrap();
    w.until("the second to be refused", |_| matches!(second.read(&mut [0u8; 1]), Ok(0)));
    assert_eq!(w.stack.stats().refused_by_cap, 1);
    let log = w.log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[1].rule, netstack::stack::RULE_LIMIT_CONNECTIONS);
    assert_eq!(log[1].direction, Direction::Inbound);
    drop(first);
}

// --------------------------------------------------------------- resources

/// A port on 127.0.0.1 whose listener's accept queue is full: Linux drops
/// further SYNs to it, so a connect there never completes. The listener
/// and the connection filling its queue live as long as the guard.
fn unanswering_port() -> (u16, Vec<socket2::Socket>) {
    use socket2::{Domain, SockAddr, Socket, Type};
    let l = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    l.bind(&SockAddr::from(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))).unwrap();
    l.listen(0).unwrap();
    let addr = l.local_addr().unwrap();
    // A backlog of 0 holds one connection.
    let filler = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    filler.connect(&addr).unwrap();
    let port = addr.as_socket().unwrap().port();
    (port, vec![l, filler])
}

#[test]
fn a_host_connect_that_never_answers_times_out_without_busy_wake_ups() {
    let (port, _guard) = unanswering_port();
    let timeout = Duration::from_millis(1500);
    let mut w = World::new(NetworkPolicy::default(), true, StackConfig { connect_timeout: timeout, ..config() });
    let start = Instant::now();
    let h = w.connect(GATEWAY_ADDR, port);
    w.until("the SYN to be held", |w| w.stack.stats().open_connections == 1);
    // The connect is pending: count how often the stack's epoll fd wakes
    // it in 500 ms (it used to wake every 1 ms).
    let mut wakes = 0;
    let counting = Instant::now();
    while counting.elapsed() < Duration::from_millis(500) {
        let mut pfd = libc::pollfd { fd: w.stack.epoll_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, count 1.
        if unsafe { libc::poll(&mut pfd, 1, 50) } > 0 {
            wakes += 1;
            w.stack.poll();
        }
    }
    println!("{wakes} wake-ups in 500 ms with a connect pending");
    assert!(wakes <= 5, "{wakes} wake-ups: the stack spins");
    assert_eq!(w.tcp(h).state(), tcp::State::SynSent);
    // At the deadline the guest gets a RST and the slot is free.
    assert!(!w.connected(h));
    assert!(start.elapsed() >= timeout, "reset after {:?}", start.elapsed());
    assert_eq!(w.stack.stats().open_connections, 0);
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 1);
    assert!(recs[0].duration_ms.is_some_and(|ms| ms >= 1500), "{recs:?}");
}

#[test]
fn connections_to_a_host_that_never_reads_stay_within_the_buffer_bound() {
    const CONNS: usize = 32;
    const EACH: usize = 256 * 1024;
    // The host accepts and never reads.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming() {
            let Ok(c) = c else { break };
            held.push(c);
        }
    });
    let cfg =
        StackConfig { max_connections: CONNS, tcp_buffer_bytes: 16 * 1024, host_buffer_bytes: 8 * 1024, ..config() };
    let mut w = World::new(NetworkPolicy::default(), true, cfg);
    let bound = w.stack.buffer_bytes_max();
    let payload = data(EACH, 9);
    let hs: Vec<_> = (0..CONNS).map(|_| w.connect(GATEWAY_ADDR, port)).collect();
    for &h in &hs {
        assert!(w.connected(h));
        assert_eq!(w.tcp(h).send_slice(&payload).unwrap(), EACH);
    }
    // Pump until the stack holds no more than it did 200 rounds ago.
    let (mut most, mut still) = (0, 0);
    w.until("the buffers to fill", |w| {
        let now = w.stack.buffered_bytes();
        assert!(now <= bound, "{now} bytes buffered, bound {bound}");
        if now > most {
            (most, still) = (now, 0);
        } else {
            still += 1;
        }
        still >= 200
    });
    println!("{CONNS} stuck connections hold {most} bytes in the stack; its bound is {bound}");
    // The guests' data is stuck (the host reads nothing), the smoltcp
    // buffers are full, and all of it is within the bound.
    assert!(most >= (CONNS * 16 * 1024) as u64, "{most}");
    assert!(hs.iter().all(|&h| w.tcp(h).send_queue() > 0));
    assert_eq!(w.stack.stats().open_connections, CONNS);
}

// -------------------------------------------------------------- name check

/// A server on 127.0.0.1 that reads each connection to its end (EOF or a
/// reset) and reports the bytes it got.
fn recorder() -> (u16, mpsc::Receiver<Vec<u8>>) {
    answering(b"")
}

impl World {
    /// Pumps until the recorder reports a connection's bytes.
    fn recorded(&mut self, rx: &mpsc::Receiver<Vec<u8>>) -> Vec<u8> {
        let mut got = None;
        self.until("the host's bytes", |_| {
            got = rx.try_recv().ok();
            got.is_some()
        });
        got.unwrap()
    }

    /// Sends all of `bytes` on `h` and waits until the NAT acknowledged them.
    fn send_acked(&mut self, h: SocketHandle, bytes: &[u8]) {
        let mut sent = 0;
        self.until("the bytes' ACK", |w| {
            let s = w.tcp(h);
            if sent < bytes.len() && s.can_send() {
                sent += s.send_slice(&bytes[sent..]).unwrap();
            }
            sent == bytes.len() && s.send_queue() == 0
        });
    }

    /// The one TCP record for `port`.
    fn record_for(&self, port: u16) -> NetRecord {
        let recs = rec_for(&self.log(), Protocol::Tcp, port);
        assert_eq!(recs.len(), 1, "{recs:?}");
        recs[0].clone()
    }
}

/// A guest under a deny-by-default policy with one allowed domain,
/// `allowed.test`, which the resolver answers with 127.0.0.1 (the guest
/// has asked): 127.0.0.1 is admitted only through the domain rule.
fn domain_world() -> World {
    let mut cfg = config();
    cfg.static_hosts.insert("allowed.test".into(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    let mut w = World::new(policy(Egress::Deny, &["allowed.test"], &[]), true, cfg);
    let m = w.dns("allowed.test.", RecordType::A, 1);
    assert_eq!(answers(&m), vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    w
}

/// A TLS 1.3 ClientHello in one record (RFC 8446 §4.1.2) with `sni` as
/// its server_name (RFC 6066 §3; `None`: no such extension).
fn client_hello(sni: Option<&str>) -> Vec<u8> {
    let vec16 = |b: &[u8]| {
        let mut v = (b.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(b);
        v
    };
    let mut body = vec![3, 3];
    body.extend_from_slice(&[0x5a; 32]);
    body.push(32);
    body.extend_from_slice(&[0x11; 32]);
    body.extend_from_slice(&vec16(&[0x13, 0x01, 0x13, 0x02]));
    body.extend_from_slice(&[1, 0]);
    let mut exts = Vec::new();
    if let Some(name) = sni {
        let mut list = vec![0];
        list.extend_from_slice(&vec16(name.as_bytes()));
        exts.extend_from_slice(&0u16.to_be_bytes());
        exts.extend_from_slice(&vec16(&vec16(&list)));
    }
    // supported_versions (TLS 1.3) and a key_share-sized filler.
    exts.extend_from_slice(&43u16.to_be_bytes());
    exts.extend_from_slice(&vec16(&[2, 3, 4]));
    exts.extend_from_slice(&51u16.to_be_bytes());
    exts.extend_from_slice(&vec16(&[0x77; 1200]));
    body.extend_from_slice(&vec16(&exts));
    let mut msg = vec![1];
    msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    msg.extend_from_slice(&body);
    let mut rec = vec![22, 3, 1];
    rec.extend_from_slice(&vec16(&msg));
    rec
}

#[test]
fn a_client_hello_stalled_for_1_1_s_is_still_judged_by_its_name() {
    let (port, rx) = recorder();
    let mut w = domain_world();
    for (sni, allowed) in [("allowed.test", true), ("other.test", false)] {
        let hello = client_hello(Some(sni));
        let h = w.connect(Ipv4Addr::LOCALHOST, port);
        assert!(w.connected(h));
        // The first half, acknowledged; 1.1 s with nothing; the rest.
        let (first, rest) = hello.split_at(hello.len() / 2);
        w.send_acked(h, first);
        let resume = Instant::now() + Duration::from_millis(1100);
        w.until("the stall's end", |_| Instant::now() >= resume);
        assert!(w.tcp(h).is_active(), "{sni}: held, not judged, during the stall");
        assert_eq!(w.tcp(h).send_slice(rest).unwrap(), rest.len());
        if allowed {
            w.tcp(h).close();
            assert_eq!(w.recorded(&rx), hello, "{sni}: the whole hello reached the host");
        } else {
            w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
            assert!(w.recorded(&rx).is_empty(), "{sni}: nothing reached the host");
        }
        w.until("the connection's end", |w| w.stack.stats().open_connections == 0);
    }
    let recs = rec_for(&w.log(), Protocol::Tcp, port);
    assert_eq!(recs.len(), 2);
    assert_eq!(
        (recs[0].allowed, recs[0].rule.as_str(), recs[0].domain.as_deref()),
        (true, "allow:allowed.test", Some("allowed.test"))
    );
    assert_eq!(
        (recs[1].allowed, recs[1].rule.as_str(), recs[1].domain.as_deref()),
        (false, "egress:deny", Some("other.test"))
    );
}

#[test]
fn a_client_hello_without_sni_is_refused() {
    let (port, rx) = recorder();
    let mut w = domain_world();
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(&client_hello(None)).unwrap();
    w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
    assert!(w.recorded(&rx).is_empty());
    let r = w.record_for(port);
    assert_eq!((r.allowed, r.rule.as_str()), (false, netstack::stack::RULE_SNI_MISSING));
}

#[test]
fn a_second_keep_alive_request_with_another_host_is_refused() {
    let (port, rx) = recorder();
    let mut w = domain_world();
    let first = b"POST /a HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 36\r\n\r\nGET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
    let second = b"GET /b HTTP/1.1\r\nHost: other.test\r\n\r\n";
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(w.connected(h));
    // The first request (whose body looks like a request: it is body) goes.
    w.send_acked(h, first);
    w.tcp(h).send_slice(second).unwrap();
    w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
    assert_eq!(w.recorded(&rx), first, "the first request only");
    let r = w.record_for(port);
    assert_eq!((r.allowed, r.rule.as_str(), r.domain.as_deref()), (false, "egress:deny", Some("other.test")));
    assert_eq!(r.bytes_out, first.len() as u64);
}

#[test]
fn an_absolute_form_target_to_another_host_is_refused() {
    let (port, rx) = recorder();
    let mut w = domain_world();
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(b"GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n").unwrap();
    w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
    assert!(w.recorded(&rx).is_empty());
    let r = w.record_for(port);
    assert_eq!((r.allowed, r.rule.as_str(), r.domain.as_deref()), (false, "egress:deny", Some("other.test")));
}

#[test]
fn udp_to_an_address_only_a_domain_rule_allows_is_refused() {
    let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
    echo.set_nonblocking(true).unwrap();
    let port = echo.local_addr().unwrap().port();
    // The resolver still answers (domain_world asked it).
    let mut w = domain_world();
    let mut s = udp::Socket::new(
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 16384]),
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 16384]),
    );
    s.bind(5353).unwrap();
    let h = w.sockets.add(s);
    let to = IpEndpoint::new(IpAddress::Ipv4(Ipv4Addr::LOCALHOST), port);
    w.sockets.get_mut::<udp::Socket>(h).send_slice(b"a QUIC Initial", to).unwrap();
    w.until("the refusal", |w| !rec_for(&w.log(), Protocol::Udp, port).is_empty());
    let recs = rec_for(&w.log(), Protocol::Udp, port);
    assert_eq!((recs[0].allowed, recs[0].rule.as_str()), (false, netstack::stack::RULE_UDP_DOMAIN_ONLY));
    assert_eq!(recs[0].domain.as_deref(), Some("allowed.test"));
    assert!(echo.recv_from(&mut [0u8; 64]).is_err(), "nothing reached the host");
    assert_eq!(w.stack.stats().open_connections, 0);
}

#[test]
fn dns_queries_past_the_rate_are_refused_and_logged_once() {
    let mut cfg = config();
    cfg.static_hosts.insert("s.test".into(), IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)));
    cfg.dns_rate = Some(netstack::stack::RateLimit { per_second: 0, burst: 2 });
    let mut w = World::new(NetworkPolicy::default(), false, cfg);
    let codes: Vec<ResponseCode> =
        (0..5).map(|i| w.dns("s.test.", RecordType::A, 0x100 + i).metadata.response_code).collect();
    assert_eq!(codes[..2], [ResponseCode::NoError; 2]);
    assert_eq!(codes[2..], [ResponseCode::Refused; 3]);
    assert_eq!(w.stack.stats().dns_refused_by_rate, 3);
    let recs = rec_for(&w.log(), Protocol::Dns, 53);
    assert_eq!(recs.len(), 3, "two answered, one refusal logged: {recs:?}");
    assert_eq!((recs[2].allowed, recs[2].rule.as_str()), (false, netstack::stack::RULE_LIMIT_RATE));
}

/// A sandbox's secrets as the tests give them: TLS to `api.test` goes to
/// a "broker" that answers the guest itself with what it got and keeps
/// the upstream connection it was given; the placeholder `tine_ph_1` may
/// go to `api.test` only.
#[derive(Debug)]
struct TestHandoff {
    refuse: bool,
    taken: std::sync::Mutex<Vec<(String, u64, SocketAddr)>>,
}

impl netstack::control::Handoff for TestHandoff {
    fn active(&self) -> bool {
        true
    }
    fn wants(&self, name: &str) -> bool {
        name == "api.test"
    }
    fn take(
        &self,
        name: String,
        mut guest: std::os::unix::net::UnixStream,
        upstream: std::net::TcpStream,
        record: u64,
    ) {
        self.taken.lock().unwrap().push((name, record, upstream.peer_addr().unwrap()));
        thread::spawn(move || {
            let _upstream = upstream;
            let mut first = vec![0u8; 4096];
            let n = guest.read(&mut first).unwrap_or(0);
            let _ = guest.write_all(format!("broker got {n} bytes").as_bytes());
        });
    }
    fn leaked(&self, host: &str, head: &[u8]) -> Vec<String> {
        let found = head.windows(9).any(|w| w == b"tine_ph_1");
        if found && host != "api.test" {
            vec!["api".into()]
        } else {
            Vec::new()
        }
    }
    fn refuse_leaks(&self) -> bool {
        self.refuse
    }
}

#[test]
fn tls_to_a_secrets_host_goes_to_the_broker_and_other_tls_is_spliced() {
    let (port, rx) = recorder();
    // Egress allow without domain rules: no name would be looked at, but
    // a sandbox with secrets has every first message looked at.
    let mut w = World::new(policy(Egress::Allow, &[], &[]), true, config());
    let handoff = Arc::new(TestHandoff { refuse: false, taken: Default::default() });
    w.control.set_handoff(Some(handoff.clone()));
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    let hello = client_hello(Some("api.test"));
    w.send_acked(h, &hello);
    let mut got = Vec::new();
    w.until("the broker's answer", |w| {
        let mut buf = [0u8; 64];
        if let Ok(n) = w.tcp(h).recv_slice(&mut buf) {
            got.extend_from_slice(&buf[..n]);
        }
        !got.is_empty()
    });
    assert_eq!(
        String::from_utf8(got).unwrap(),
        format!("broker got {} bytes", hello.len()),
        "the ClientHello went to the broker"
    );
    let taken = handoff.taken.lock().unwrap().clone();
    assert_eq!(taken.len(), 1);
    assert_eq!((taken[0].0.as_str(), taken[0].2.port()), ("api.test", port), "with the host connection the NAT made");
    assert_eq!(w.record_for(port).domain.as_deref(), Some("api.test"));
    // The host connection the broker was given closes with its thread,
    // having carried nothing.
    assert_eq!(w.recorded(&rx), Vec::<u8>::new());
    // TLS to another name is spliced to the host as before.
    let h = w.connect(GATEWAY_ADDR, port);
    assert!(w.connected(h));
    let other = client_hello(Some("other.test"));
    w.send_acked(h, &other);
    w.tcp(h).close();
    assert_eq!(w.recorded(&rx), other);
    assert_eq!(handoff.taken.lock().unwrap().len(), 1);
}

#[test]
fn a_placeholder_in_plain_http_to_another_host_is_logged_or_refused() {
    let (port, rx) = recorder();
    for refuse in [false, true] {
        let mut w = World::new(policy(Egress::Allow, &[], &[]), true, config());
        w.control.set_handoff(Some(Arc::new(TestHandoff { refuse, taken: Default::default() })));
        let h = w.connect(GATEWAY_ADDR, port);
        assert!(w.connected(h));
        // The first request is clean; the second, on the same keep-alive
        // connection, carries the placeholder to a host it may not go to.
        let clean = b"GET / HTTP/1.1\r\nHost: ok.test\r\n\r\n".to_vec();
        let leaky = b"GET /?k=tine_ph_1 HTTP/1.1\r\nHost: evil.test\r\n\r\n".to_vec();
        let both = [clean.clone(), leaky.clone()].concat();
        assert_eq!(w.tcp(h).send_slice(&both).unwrap(), both.len());
        if refuse {
            w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
            assert_eq!(w.recorded(&rx), clean, "refused before any of its bytes reached the host");
        } else {
            w.tcp(h).close();
            assert_eq!(w.recorded(&rx), [clean, leaky].concat(), "passed on unchanged");
        }
        let leak: Vec<NetRecord> =
            w.log().into_iter().filter(|r| r.rule == "secret-leak-blocked" && !r.secrets.is_empty()).collect();
        assert_eq!(leak.len(), 1, "{:?}", w.log());
        assert_eq!(leak[0].addr, IpAddr::V4(Ipv4Addr::LOCALHOST), "the address as the connection's record has it");
        let conn = w.log().into_iter().find(|r| r.secrets.is_empty()).unwrap();
        assert_eq!((conn.allowed, conn.rule == "secret-leak-blocked"), (!refuse, refuse), "{conn:?}");
        assert_eq!(
            (leak[0].domain.as_deref(), leak[0].secrets.clone(), leak[0].allowed),
            (Some("evil.test"), vec!["api".to_string()], !refuse)
        );
    }
}

/// A server on 127.0.0.1 that reads each connection's first request head,
/// writes `answer` (nothing if empty), then reads the connection to its
/// end (EOF or a reset) and reports every byte it got.
fn answering(answer: &'static [u8]) -> (u16, mpsc::Receiver<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { break };
            let tx = tx.clone();
            thread::spawn(move || {
                let (mut got, mut answered) = (Vec::new(), false);
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = c.read(&mut buf) {
                    got.extend_from_slice(&buf[..n]);
                    if !answered && got.windows(4).any(|w| w == b"\r\n\r\n") {
                        answered = true;
                        if c.write_all(answer).is_err() {
                            break;
                        }
                    }
                }
                let _ = tx.send(got);
            });
        }
    });
    (port, rx)
}

#[test]
fn after_an_upgrade_the_next_request_is_judged_unless_the_server_answered_101() {
    let upgrade = &b"GET /ws HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"[..];
    let other = b"GET /b HTTP/1.1\r\nHost: other.test\r\n\r\n";
    // Declined: the request sent right behind the Upgrade waits for the
    // answer, is judged as a request and refused; the server never sees it.
    let (port, rx) = answering(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n");
    let mut w = domain_world();
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(w.connected(h));
    w.tcp(h).send_slice(&[upgrade, other].concat()).unwrap();
    w.until("the reset", |w| w.tcp(h).state() == tcp::State::Closed);
    assert_eq!(w.recorded(&rx), upgrade, "the Upgrade request only");
    let r = w.record_for(port);
    assert_eq!((r.allowed, r.rule.as_str(), r.domain.as_deref()), (false, "egress:deny", Some("other.test")));
    // Switched: the bytes behind it are another protocol and go on once the
    // 101 has come back.
    let (port, rx) =
        answering(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n");
    let mut w = domain_world();
    let h = w.connect(Ipv4Addr::LOCALHOST, port);
    assert!(w.connected(h));
    let sent = [upgrade, b"\x82\x05hello", other].concat();
    w.send_acked(h, &sent);
    w.tcp(h).close();
    assert_eq!(w.recorded(&rx), sent);
    let mut got = vec![0u8; 256];
    let n = w.tcp(h).recv_slice(&mut got).unwrap();
    assert!(got[..n].starts_with(b"HTTP/1.1 101 "), "{:?}", String::from_utf8_lossy(&got[..n]));
    assert!(w.record_for(port).allowed);
}
