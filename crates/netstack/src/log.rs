//! The network log of a sandbox: a bounded ring of connection records.
//!
//! Records get ids from 1 in the order they are pushed; the ring keeps the
//! newest `capacity` of them and counts the ones that fell out, so a reader
//! can tell that it missed some.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// The protocol of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// A TCP connection.
    Tcp,
    /// A UDP flow (other than DNS).
    Udp,
    /// A DNS query to the gateway's resolver.
    Dns,
    /// ICMP echo.
    Icmp,
}

/// Which side opened a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// The guest, to the host or beyond.
    #[default]
    Outbound,
    /// The host, into a port of the guest (a preview URL, a port forward).
    Inbound,
}

/// One record: a connection, a flow or a DNS query.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NetRecord {
    /// Sequence number in this sandbox's log (from 1).
    pub id: u64,
    /// Start, ms since the Unix epoch.
    pub time_ms: u64,
    /// The protocol.
    pub protocol: Protocol,
    /// Which side opened it.
    pub direction: Direction,
    /// Destination address (the guest's for an inbound connection).
    pub addr: IpAddr,
    /// Destination port (0 for ICMP; the guest's port for an inbound
    /// connection).
    pub port: u16,
    /// The domain: the DNS name asked, or the one the address was resolved
    /// from, or the SNI/Host seen.
    pub domain: Option<String>,
    /// Whether it was allowed.
    pub allowed: bool,
    /// The deciding rule (see [`crate::policy::Verdict`]).
    pub rule: String,
    /// Bytes from the guest to the destination.
    pub bytes_out: u64,
    /// Bytes from the destination to the guest.
    pub bytes_in: u64,
    /// How long it lasted (ms); `None` while open.
    pub duration_ms: Option<u64>,
    /// The sandbox's secrets this record is about (names, never values):
    /// swapped in by the broker on this connection, or found where they
    /// may not go (rule `secret-leak-blocked`), or whose values a response
    /// carried and the broker scrubbed (rule `secret-echo-scrubbed`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// The current time in ms since the Unix epoch (0 if the clock is before
/// the epoch); the unit of [`NetRecord::time_ms`] and of `since_ms`.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// Records preallocated at most, whatever the capacity (the ring grows up
/// to its capacity as records come).
const PREALLOC_RECORDS: usize = 1024;

impl NetRecord {
    /// A record of something starting now (id assigned by
    /// [`NetLog::push`]), judged by `verdict`, with no bytes moved yet and
    /// still open.
    pub fn starting(
        protocol: Protocol,
        addr: IpAddr,
        port: u16,
        domain: Option<String>,
        verdict: crate::policy::Verdict,
    ) -> Self {
        NetRecord {
            id: 0,
            time_ms: now_ms(),
            protocol,
            direction: Direction::Outbound,
            addr,
            port,
            domain,
            allowed: verdict.allowed,
            rule: verdict.rule,
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: None,
            secrets: Vec::new(),
        }
    }
}

/// The bounded ring of [`NetRecord`]s.
#[derive(Debug)]
pub struct NetLog {
    /// Records in id order (ids consecutive), oldest first.
    records: VecDeque<NetRecord>,
    /// Records held at most.
    capacity: usize,
    /// The id the next record gets.
    next_id: u64,
    /// Records that fell out of the ring (or never fit: capacity 0).
    dropped: u64,
}

impl NetLog {
    /// A log holding at most `capacity` records (older ones fall out and
    /// are counted). A capacity of 0 keeps nothing and counts every record
    /// as dropped.
    pub fn new(capacity: usize) -> Self {
        Self { records: VecDeque::with_capacity(capacity.min(PREALLOC_RECORDS)), capacity, next_id: 1, dropped: 0 }
    }

    /// Records held at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records held now.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the log holds no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Records that fell out of the ring so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Appends `record` (its `id` is assigned here); returns the id.
    pub fn push(&mut self, mut record: NetRecord) -> u64 {
        let id = self.next_id;
        self.next_id = self.next_id.saturating_add(1);
        record.id = id;
        if self.capacity == 0 {
            self.dropped = self.dropped.saturating_add(1);
            return id;
        }
        while self.records.len() >= self.capacity {
            self.records.pop_front();
            self.dropped = self.dropped.saturating_add(1);
        }
        self.records.push_back(record);
        id
    }

    /// Updates the record `id` if it is still in the ring (a binary search:
    /// records are in id order). `f` must not change the id.
    pub fn update(&mut self, id: u64, f: impl FnOnce(&mut NetRecord)) {
        if let Ok(i) = self.records.binary_search_by_key(&id, |r| r.id) {
            if let Some(r) = self.records.get_mut(i) {
                f(r);
                r.id = id;
            }
        }
    }

    /// Records that started at or after `since_ms`, oldest first, at most
    /// `limit`; and how many records fell out of the ring so far.
    pub fn query(&self, since_ms: u64, limit: usize) -> (Vec<NetRecord>, u64) {
        let records = self.records.iter().filter(|r| r.time_ms >= since_ms).take(limit).cloned().collect();
        (records, self.dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn rec(time_ms: u64) -> NetRecord {
        NetRecord {
            id: 0,
            time_ms,
            protocol: Protocol::Tcp,
            direction: Direction::Outbound,
            addr: IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7)),
            port: 443,
            domain: Some("example.com".into()),
            allowed: true,
            rule: "egress:allow".into(),
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: None,
            secrets: Vec::new(),
        }
    }

    #[test]
    fn ids_from_one_and_ring_drops_oldest() {
        let mut log = NetLog::new(3);
        let ids: Vec<u64> = (0..5).map(|t| log.push(rec(t))).collect();
        assert_eq!(ids, vec![1, 2, 3, 4, 5]);
        assert_eq!(log.len(), 3);
        let (got, dropped) = log.query(0, usize::MAX);
        assert_eq!(dropped, 2);
        assert_eq!(got.iter().map(|r| r.id).collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(got.iter().map(|r| r.time_ms).collect::<Vec<_>>(), vec![2, 3, 4]);
    }

    #[test]
    fn update_finds_records_in_ring_and_ignores_gone_ones() {
        let mut log = NetLog::new(2);
        let a = log.push(rec(10));
        let b = log.push(rec(11));
        let c = log.push(rec(12));
        log.update(a, |r| r.bytes_in = 99); // fell out: no effect, no panic
        log.update(b, |r| {
            r.bytes_out = 5;
            r.duration_ms = Some(7);
            r.id = 1000; // ignored: ids stay
        });
        log.update(c, |r| r.bytes_in = 3);
        log.update(42, |r| r.bytes_in = 1);
        let (got, _) = log.query(0, 10);
        assert_eq!(got[0].id, b);
        assert_eq!((got[0].bytes_out, got[0].duration_ms), (5, Some(7)));
        assert_eq!((got[1].id, got[1].bytes_in), (c, 3));
        assert!(got.iter().all(|r| r.bytes_in != 99 && r.bytes_in != 1));
    }

    #[test]
    fn query_since_and_limit_oldest_first() {
        let mut log = NetLog::new(100);
        for t in [100, 200, 300, 400] {
            log.push(rec(t));
        }
        let (got, dropped) = log.query(200, 2);
        assert_eq!(dropped, 0);
        assert_eq!(got.iter().map(|r| r.time_ms).collect::<Vec<_>>(), vec![200, 300]);
        assert!(log.query(401, 10).0.is_empty());
        assert!(log.query(0, 0).0.is_empty());
    }

    #[test]
    fn zero_capacity_keeps_nothing_counts_all() {
        let mut log = NetLog::new(0);
        assert_eq!(log.push(rec(1)), 1);
        assert_eq!(log.push(rec(2)), 2);
        assert!(log.is_empty());
        assert_eq!(log.query(0, 10), (vec![], 2));
    }

    #[test]
    fn now_ms_is_after_2020() {
        // 2020-01-01T00:00:00Z in ms: the clock is the real one.
        assert!(now_ms() > 1_577_836_800_000);
    }
}
