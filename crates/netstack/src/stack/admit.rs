//! One admission path for every new guest TCP connection and UDP flow:
//! the policy's verdict, the connection cap, the host socket and the log
//! record, each once.
//!
//! [`admit`] judges a new connection by its destination (the policy's
//! [`CompiledPolicy::check_addr`], with the names the resolver gave that
//! address) or by a verdict of the stack's own (DNS over TCP), then by
//! [`StackConfig::max_connections`](super::StackConfig::max_connections);
//! a refusal is logged there and then. [`Admitted::open`] opens the host
//! side and logs the connection, allowed whether or not the host socket
//! could be made (a failed one is logged with a duration of 0). The
//! [`Meter`] it returns counts the connection's bytes and closes its
//! record; [`Meter::judge_name`] judges a name seen later in the
//! connection (TLS SNI, HTTP `Host`, a DNS query) into the same record.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::time::Instant;

use crate::control::NetControl;
use crate::dns::NameMap;
use crate::log::{Direction, NetRecord, Protocol};
use crate::policy::{NameCheck, Verdict};
use crate::rate::{Limiter, Take, RULE_LIMIT_RATE};
use crate::GATEWAY_ADDR;

/// The rule of a log record for a connection refused by
/// [`StackConfig::max_connections`](super::StackConfig::max_connections).
pub const RULE_LIMIT_CONNECTIONS: &str = "limit:connections";

/// The rule of a log record for a UDP flow refused because only a domain
/// rule allowed its address ([`NameCheck::Required`]): a datagram carries
/// no name the stack checks.
pub const RULE_UDP_DOMAIN_ONLY: &str = "udp:domain-only";

/// Where a guest connection or flow goes on the host, and what the policy
/// judges and the log shows: 127.0.0.1 for the gateway, else the address
/// dialled.
pub(super) fn host_ip(dst: Ipv4Addr) -> Ipv4Addr {
    if dst == GATEWAY_ADDR {
        Ipv4Addr::LOCALHOST
    } else {
        dst
    }
}

/// A new connection or flow to judge.
pub(super) struct Ask {
    /// What the log calls it.
    pub protocol: Protocol,
    /// Which side opens it.
    pub direction: Direction,
    /// The destination the guest dialled.
    pub dst: SocketAddrV4,
    /// A verdict of the stack's own instead of the policy's (DNS over TCP
    /// to the resolver).
    pub fixed: Option<Verdict>,
}

/// Where a new connection stands against the cap and the rate.
pub(super) struct Cap<'a> {
    /// Connections and flows open now.
    pub open: usize,
    /// [`StackConfig::max_connections`](super::StackConfig::max_connections).
    pub max: usize,
    /// [`StackStats::refused_by_cap`](super::StackStats::refused_by_cap).
    pub refused: &'a mut u64,
    /// [`StackConfig::connection_rate`](super::StackConfig::connection_rate)'s
    /// limiter (`None`: not limited, as inbound connections are not).
    pub rate: Option<&'a mut Limiter>,
}

/// A connection the policy and the cap let through; its record is not in
/// the log until [`Admitted::open`].
pub(super) struct Admitted {
    record: NetRecord,
    /// What it must still show by name ([`NameCheck::Off`] for a verdict
    /// of the stack's own).
    pub names: NameCheck,
    /// Where the host side goes.
    pub host_ip: Ipv4Addr,
}

/// Judges `ask` (policy, then rate, then cap); a refusal is logged with a
/// duration of 0 and gives `None` (a rate refusal only the first of each
/// second, see [`crate::rate`]).
pub(super) fn admit(ask: Ask, control: &NetControl, names: &NameMap, cap: Cap<'_>) -> Option<Admitted> {
    let judged = host_ip(*ask.dst.ip());
    let port = ask.dst.port();
    let names = &names.names(IpAddr::V4(*ask.dst.ip()));
    let policy = control.policy();
    let (verdict, check) = match ask.fixed {
        Some(v) => (v, NameCheck::Off),
        None => {
            let v = policy.check_addr(IpAddr::V4(judged), port, names);
            let check = if v.allowed { policy.name_check(IpAddr::V4(judged), names) } else { NameCheck::Off };
            (v, check)
        }
    };
    let mut record = NetRecord::starting(ask.protocol, IpAddr::V4(judged), port, names.first().cloned(), verdict);
    record.direction = ask.direction;
    if record.allowed && ask.protocol == Protocol::Udp && check == NameCheck::Required {
        // No name to check in a datagram (QUIC's Initial is not parsed).
        record.allowed = false;
        record.rule = RULE_UDP_DOMAIN_ONLY.to_owned();
    }
    if record.allowed {
        if let Some(Take::Refused { log }) = cap.rate.map(|r| r.take(Instant::now())) {
            if !log {
                return None;
            }
            record.allowed = false;
            record.rule = RULE_LIMIT_RATE.to_owned();
        }
    }
    if record.allowed && cap.open >= cap.max {
        *cap.refused += 1;
        record.allowed = false;
        record.rule = RULE_LIMIT_CONNECTIONS.to_owned();
    }
    if !record.allowed {
        record.duration_ms = Some(0);
        control.record(record);
        return None;
    }
    Some(Admitted { record, names: check, host_ip: judged })
}

impl Admitted {
    /// Opens the host side with `open` and logs the connection; `None`
    /// (logged with a duration of 0) if `open` failed.
    pub(super) fn open<T>(self, control: &NetControl, open: impl FnOnce() -> io::Result<T>) -> Option<(T, Meter)> {
        let mut record = self.record;
        match open() {
            Ok(host) => Some((host, Meter::new(control.record(record)))),
            Err(e) => {
                tracing::debug!("host side of {:?} to {}:{}: {e}", record.protocol, record.addr, record.port);
                record.duration_ms = Some(0);
                control.record(record);
                None
            }
        }
    }
}

/// A connection's log record while it is open: its bytes so far.
#[derive(Debug)]
pub(super) struct Meter {
    /// The record's id in the log.
    record: u64,
    /// Bytes from the guest to the host.
    pub bytes_out: u64,
    /// Bytes from the host to the guest.
    pub bytes_in: u64,
    started: Instant,
}

impl Meter {
    fn new(record: u64) -> Self {
        Self { record, bytes_out: 0, bytes_in: 0, started: Instant::now() }
    }

    /// The record's id in the log.
    pub(super) fn record(&self) -> u64 {
        self.record
    }

    /// Writes the bytes and the duration (ms) into the record.
    pub(super) fn close(&self, control: &NetControl) {
        let (out, inn) = (self.bytes_out, self.bytes_in);
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        control.update(self.record, |r| {
            r.bytes_out = out;
            r.bytes_in = inn;
            r.duration_ms = Some(ms);
        });
    }

    /// Judges `name` (a connection's SNI or `Host`, or a DNS-over-TCP
    /// query's name) by the current policy and writes it into the record
    /// (the first name, and a denied one with the rule that denied it);
    /// returns whether it is allowed.
    pub(super) fn judge_name(&self, control: &NetControl, name: String) -> bool {
        let v = control.policy().check_name(&name);
        if v.allowed {
            control.update(self.record, |r| {
                if r.domain.is_none() {
                    r.domain = Some(name);
                }
            });
        } else {
            self.refuse_with(control, v.rule, Some(name));
        }
        v.allowed
    }

    /// Marks the record refused by `rule` (the connection is reset).
    pub(super) fn refuse(&self, control: &NetControl, rule: &str) {
        self.refuse_with(control, rule.to_owned(), None);
    }

    /// The one path by which an open connection's record becomes a
    /// refusal: `rule`, and `domain` if given.
    fn refuse_with(&self, control: &NetControl, rule: String, domain: Option<String>) {
        control.update(self.record, |r| {
            r.allowed = false;
            r.rule = rule;
            if domain.is_some() {
                r.domain = domain;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::policy::{Egress, NetworkPolicy, ServerNetPolicy};

    fn control(egress: Egress, allow: &[&str], deny: &[&str]) -> Arc<NetControl> {
        let policy = NetworkPolicy {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
        };
        let server =
            ServerNetPolicy { permit_ranges: vec!["127.0.0.0/8".parse().unwrap()], host_addrs: Default::default() };
        NetControl::new(&policy, None, Arc::new(server), 64).unwrap()
    }

    fn ask(dst: [u8; 4], port: u16) -> Ask {
        Ask {
            protocol: Protocol::Tcp,
            direction: Direction::Outbound,
            dst: SocketAddrV4::new(dst.into(), port),
            fixed: None,
        }
    }

    fn log(control: &NetControl) -> Vec<NetRecord> {
        control.query(0, 100).0
    }

    #[test]
    fn a_denied_connection_is_logged_once_and_opens_nothing() {
        let c = control(Egress::Deny, &[], &[]);
        let mut refused = 0;
        let got = admit(
            ask([11, 0, 2, 7], 443),
            &c,
            &NameMap::default(),
            Cap { open: 0, max: 8, refused: &mut refused, rate: None },
        );
        assert!(got.is_none());
        let log = log(&c);
        assert_eq!(log.len(), 1);
        assert!(!log[0].allowed);
        assert_eq!(log[0].duration_ms, Some(0));
        assert_eq!(refused, 0, "the policy refused it, not the cap");
    }

    #[test]
    fn the_cap_refuses_after_the_policy_allowed() {
        let c = control(Egress::Allow, &[], &[]);
        let mut refused = 0;
        let got = admit(
            ask([11, 0, 2, 7], 80),
            &c,
            &NameMap::default(),
            Cap { open: 8, max: 8, refused: &mut refused, rate: None },
        );
        assert!(got.is_none());
        assert_eq!(refused, 1);
        let log = log(&c);
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].rule, RULE_LIMIT_CONNECTIONS);
        assert!(!log[0].allowed);
    }

    #[test]
    fn the_gateway_is_judged_and_logged_as_loopback_with_the_resolved_name() {
        let c = control(Egress::Deny, &["127.0.0.1/32"], &[]);
        let mut names = NameMap::default();
        names.insert(IpAddr::V4(GATEWAY_ADDR), "host.tine.internal", 60, Instant::now());
        let mut refused = 0;
        let a = admit(
            ask(GATEWAY_ADDR.octets(), 8080),
            &c,
            &names,
            Cap { open: 0, max: 8, refused: &mut refused, rate: None },
        )
        .expect("allowed");
        assert_eq!(a.host_ip, Ipv4Addr::LOCALHOST);
        assert!(log(&c).is_empty(), "not logged before the host side opens");
        let (v, mut meter) = a.open(&c, || Ok(5)).unwrap();
        assert_eq!(v, 5);
        meter.bytes_out = 3;
        meter.bytes_in = 4;
        meter.close(&c);
        let log = log(&c);
        assert_eq!(log.len(), 1);
        let r = &log[0];
        assert_eq!((r.addr, r.port), (IpAddr::V4(Ipv4Addr::LOCALHOST), 8080));
        assert_eq!(r.domain.as_deref(), Some("host.tine.internal"));
        assert!(r.allowed);
        assert_eq!((r.bytes_out, r.bytes_in), (3, 4));
        assert!(r.duration_ms.is_some());
    }

    #[test]
    fn a_host_side_that_fails_is_logged_with_no_duration() {
        let c = control(Egress::Allow, &[], &[]);
        let mut refused = 0;
        let a = admit(
            ask([11, 0, 2, 7], 80),
            &c,
            &NameMap::default(),
            Cap { open: 0, max: 8, refused: &mut refused, rate: None },
        )
        .unwrap();
        assert!(a.open::<()>(&c, || Err(io::Error::other("refused"))).is_none());
        let log = log(&c);
        assert_eq!(log.len(), 1);
        assert!(log[0].allowed);
        assert_eq!(log[0].duration_ms, Some(0));
    }

    #[test]
    fn a_fixed_verdict_replaces_the_policy() {
        let c = control(Egress::Deny, &[], &[]);
        let mut refused = 0;
        let fixed = Ask { fixed: Some(Verdict { allowed: true, rule: "dns:tcp".into() }), ..ask([10, 0, 2, 3], 53) };
        let a =
            admit(fixed, &c, &NameMap::default(), Cap { open: 0, max: 8, refused: &mut refused, rate: None }).unwrap();
        a.open(&c, || Ok(())).unwrap();
        assert_eq!(log(&c)[0].rule, "dns:tcp");
    }

    #[test]
    fn a_name_seen_later_is_judged_into_the_same_record() {
        let c = control(Egress::Allow, &[], &["*.blocked.example"]);
        let mut refused = 0;
        let a = admit(
            ask([11, 0, 2, 7], 443),
            &c,
            &NameMap::default(),
            Cap { open: 0, max: 8, refused: &mut refused, rate: None },
        )
        .unwrap();
        let (_, meter) = a.open(&c, || Ok(())).unwrap();
        assert!(meter.judge_name(&c, "ok.example".into()));
        assert_eq!(log(&c)[0].domain.as_deref(), Some("ok.example"));
        assert!(!meter.judge_name(&c, "x.blocked.example".into()));
        let log = log(&c);
        assert_eq!(log.len(), 1);
        assert!(!log[0].allowed);
        assert_eq!(log[0].rule, "deny:*.blocked.example");
        assert_eq!(log[0].domain.as_deref(), Some("x.blocked.example"));
    }
}
