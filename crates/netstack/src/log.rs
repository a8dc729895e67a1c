//! The network log of a sandbox: a bounded ring of connection records.
//!
//! STUB: the lead wrote the types and signatures; the policy helper fills
//! in the logic (see /work/wt/DESIGN-15.md).

use std::net::IpAddr;

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

/// One record: a connection, a flow or a DNS query.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NetRecord {
    /// Sequence number in this sandbox's log (from 1).
    pub id: u64,
    /// Start, ms since the Unix epoch.
    pub time_ms: u64,
    /// The protocol.
    pub protocol: Protocol,
    /// Destination address.
    pub addr: IpAddr,
    /// Destination port (0 for ICMP).
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
}

/// The bounded ring of [`NetRecord`]s.
#[derive(Debug)]
pub struct NetLog {
    _p: (),
}

impl NetLog {
    /// A log holding at most `capacity` records (older ones fall out and
    /// are counted).
    pub fn new(_capacity: usize) -> Self {
        todo!("policy helper")
    }

    /// Appends `record` (its `id` is assigned here); returns the id.
    pub fn push(&mut self, _record: NetRecord) -> u64 {
        todo!("policy helper")
    }

    /// Updates the record `id` if it is still in the ring.
    pub fn update(&mut self, _id: u64, _f: impl FnOnce(&mut NetRecord)) {
        todo!("policy helper")
    }

    /// Records that started at or after `since_ms`, oldest first, at most
    /// `limit`; and how many records fell out of the ring so far.
    pub fn query(&self, _since_ms: u64, _limit: usize) -> (Vec<NetRecord>, u64) {
        todo!("policy helper")
    }
}
