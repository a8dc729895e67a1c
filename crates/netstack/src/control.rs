//! What the sandbox manager holds per sandbox: the live policy, the log
//! and the inbound connections asked for, shared with the VM's
//! [`crate::stack::NetStack`] (which runs on the VM's network thread).
//!
//! Locks are std's; a lock poisoned by a panicking holder is used as is
//! (the data are a policy pointer and a ring of plain records: nothing a
//! half-done update can leave inconsistent), so no caller ever panics here.

use std::collections::VecDeque;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::log::{NetLog, NetRecord};
use crate::policy::{CompiledPolicy, NetworkPolicy, PolicyError, ServerNetPolicy};

/// Shared between the manager and the network thread of one sandbox.
#[derive(Debug)]
pub struct NetControl {
    /// Server-wide settings every compiled policy uses.
    server: Arc<ServerNetPolicy>,
    /// The current policy; replaced whole by [`NetControl::set_policy`].
    policy: RwLock<Arc<CompiledPolicy>>,
    /// The sandbox's network log.
    log: Mutex<NetLog>,
    /// Inbound connections not yet dialled, and how to wake the stack.
    inbound: Mutex<Inbound>,
    /// Where flows that carry the sandbox's secrets go (`None`: it has
    /// none).
    handoff: RwLock<Option<Arc<dyn Handoff>>>,
    /// The bytes the stack's buffers held when it last said
    /// ([`crate::stack::BUFFERED_REPORT_EVERY`]).
    buffered: std::sync::atomic::AtomicU64,
}

/// A sandbox's secrets as its network sees them: which TLS connections go
/// to the server's secret broker instead of being spliced, and which
/// plain HTTP requests carry a placeholder to a host its secret may not
/// go to. The sandbox manager implements it over the broker
/// (`crates/broker`); the stack calls it from its network thread, so
/// every method returns at once.
pub trait Handoff: Send + Sync + std::fmt::Debug {
    /// Whether the sandbox has secrets now: then the first message of
    /// every TCP connection is looked at (a ClientHello's SNI, an HTTP
    /// request's `Host`), also where the policy needs no name.
    fn active(&self) -> bool;
    /// Whether TLS whose ClientHello names `name` goes to the broker (a
    /// secret of the sandbox may be sent there).
    fn wants(&self, name: &str) -> bool;
    /// Takes a flow for `name`: `guest` is the end of a stream pair whose
    /// other end the stack now splices the guest's connection to (so the
    /// ClientHello and what follows arrive on it), `upstream` the host
    /// connection the stack had made (connected, non-blocking), `record`
    /// the flow's record in the network log.
    fn take(&self, name: String, guest: UnixStream, upstream: std::net::TcpStream, record: u64);
    /// The secrets (names) whose placeholders occur in `head` (a plain
    /// HTTP request head to `host`) and may not go there.
    fn leaked(&self, host: &str, head: &[u8]) -> Vec<String>;
    /// Whether such a request is refused (the connection reset) as well
    /// as logged.
    fn refuse_leaks(&self) -> bool;
    /// Host memory the sandbox's flows hold in the broker now (bytes;
    /// request bodies read to swap in them), counted in
    /// [`NetControl::buffered_bytes`].
    fn buffered_bytes(&self) -> u64 {
        0
    }
}

/// Inbound connections asked for, at most, while the stack has not
/// dialled them (it dials all it finds at each wake-up).
pub const MAX_PENDING_INBOUND: usize = 64;

/// An inbound connection not dialled within this is dropped (its stream
/// closes): whoever asked has given up (the VM did not run meanwhile).
pub const INBOUND_MAX_WAIT: Duration = Duration::from_secs(60);

/// Errors of [`NetControl::connect_inbound`].
#[derive(Debug, thiserror::Error)]
pub enum InboundError {
    /// Port 0.
    #[error("port 0 cannot be connected to; give a port from 1 to 65535")]
    Port,
    /// [`MAX_PENDING_INBOUND`] connections wait already.
    #[error("{MAX_PENDING_INBOUND} inbound connections are waiting for the sandbox's network; try again")]
    Busy,
    /// The socket pair could not be made.
    #[error("inbound connection: {0}")]
    Io(#[from] io::Error),
}

/// A connection into a guest port the host asked for, not yet dialled.
#[derive(Debug)]
pub(crate) struct InboundRequest {
    /// The guest's TCP port.
    pub port: u16,
    /// The stack's end of the pair.
    pub stream: UnixStream,
    /// When it was asked for.
    pub asked: Instant,
}

#[derive(Debug, Default)]
struct Inbound {
    pending: VecDeque<InboundRequest>,
    /// The running stack's wake-up eventfd (`None`: no stack yet).
    waker: Option<EventFd>,
}

impl NetControl {
    /// A control with `policy` under `ceiling` (see [`crate::policy`]) and
    /// a log of `log_capacity` records.
    ///
    /// Errors: [`PolicyError`] for a bad rule.
    pub fn new(
        policy: &NetworkPolicy,
        ceiling: Option<&NetworkPolicy>,
        server: Arc<ServerNetPolicy>,
        log_capacity: usize,
    ) -> Result<Arc<Self>, PolicyError> {
        let ceiling = ceiling.map(|c| CompiledPolicy::new(c, &server).map(Arc::new)).transpose()?;
        let compiled = CompiledPolicy::new(policy, &server)?.with_ceiling(ceiling);
        Ok(Arc::new(Self {
            server,
            policy: RwLock::new(Arc::new(compiled)),
            log: Mutex::new(NetLog::new(log_capacity)),
            inbound: Mutex::new(Inbound::default()),
            handoff: RwLock::new(None),
            buffered: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// The bytes the sandbox's network buffers held at the stack's last
    /// report (at most a second old while it runs;
    /// [`crate::stack::NetStack::buffered_bytes`]): what the sandbox
    /// manager charges to the memory budget on top of guest memory,
    /// with what its flows hold in the broker now ([`Handoff::buffered_bytes`]).
    pub fn buffered_bytes(&self) -> u64 {
        let broker = self.handoff().map_or(0, |h| h.buffered_bytes());
        self.buffered.load(std::sync::atomic::Ordering::Relaxed).saturating_add(broker)
    }

    /// The stack's report of [`NetControl::buffered_bytes`].
    pub(crate) fn set_buffered_bytes(&self, bytes: u64) {
        self.buffered.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets where the sandbox's secret flows go (`None`: it has no
    /// secrets); connections opened from now on follow it.
    pub fn set_handoff(&self, handoff: Option<Arc<dyn Handoff>>) {
        *self.handoff.write().unwrap_or_else(|p| p.into_inner()) = handoff;
    }

    /// Where the sandbox's secret flows go, if it has secrets.
    pub fn handoff(&self) -> Option<Arc<dyn Handoff>> {
        self.handoff.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The server-wide settings this control compiles policies with.
    pub fn server(&self) -> &Arc<ServerNetPolicy> {
        &self.server
    }

    /// Replaces the policy, under the same ceiling; connections opened
    /// from now on follow it (open ones are not cut).
    ///
    /// Errors: [`PolicyError`]; the old policy stays.
    pub fn set_policy(&self, policy: &NetworkPolicy) -> Result<(), PolicyError> {
        let ceiling = self.policy().ceiling().cloned();
        let compiled = Arc::new(CompiledPolicy::new(policy, &self.server)?.with_ceiling(ceiling));
        let mut guard = self.policy.write().unwrap_or_else(|e| e.into_inner());
        *guard = compiled;
        Ok(())
    }

    /// Replaces the ceiling (`None`: none), keeping the policy.
    ///
    /// Errors: [`PolicyError`]; the old ceiling stays.
    pub fn set_ceiling(&self, ceiling: Option<&NetworkPolicy>) -> Result<(), PolicyError> {
        let ceiling = ceiling.map(|c| CompiledPolicy::new(c, &self.server).map(Arc::new)).transpose()?;
        // The policy as compiled already: only the ceiling is new.
        let compiled = Arc::new(CompiledPolicy::clone(&self.policy()).with_ceiling(ceiling));
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) = compiled;
        Ok(())
    }

    /// The current policy (cheap: an `Arc` clone).
    pub fn policy(&self) -> Arc<CompiledPolicy> {
        let guard = self.policy.read().unwrap_or_else(|e| e.into_inner());
        Arc::clone(&guard)
    }

    fn log(&self) -> MutexGuard<'_, NetLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends a record; returns its id.
    pub fn record(&self, record: NetRecord) -> u64 {
        self.log().push(record)
    }

    /// Updates record `id` if still in the log.
    pub fn update(&self, id: u64, f: impl FnOnce(&mut NetRecord)) {
        self.log().update(id, f)
    }

    /// Asks the sandbox's stack for a TCP connection from the gateway
    /// ([`crate::GATEWAY_ADDR`], a port from 49152 up) into the guest's
    /// `port`, and returns the host's end of it: a Unix stream socket whose
    /// bytes are the connection's, both ways, and whose shutdown is the
    /// connection's FIN. A guest that refuses (nothing listens on `port`)
    /// or never answers (120 s) closes the stream before any byte comes;
    /// dropping the stream closes the connection. The connection is
    /// dialled when the stack next runs: at once while the VM runs, else
    /// when it runs again within [`INBOUND_MAX_WAIT`]. It is logged with
    /// [`crate::log::Direction::Inbound`] and counts against the stack's
    /// connection cap (a refusal closes the stream, as above).
    ///
    /// Errors: [`InboundError`].
    pub fn connect_inbound(&self, port: u16) -> Result<UnixStream, InboundError> {
        if port == 0 {
            return Err(InboundError::Port);
        }
        let mut inbound = self.inbound();
        if inbound.pending.len() >= MAX_PENDING_INBOUND {
            return Err(InboundError::Busy);
        }
        let (ours, stack) = UnixStream::pair()?;
        inbound.pending.push_back(InboundRequest { port, stream: stack, asked: Instant::now() });
        if let Some(w) = &inbound.waker {
            let _ = w.write(1);
        }
        Ok(ours)
    }

    /// The inbound connections asked for since the last call (for the
    /// stack).
    pub(crate) fn take_inbound(&self) -> Vec<InboundRequest> {
        self.inbound().pending.drain(..).collect()
    }

    /// Sets the eventfd [`NetControl::connect_inbound`] wakes the stack
    /// with (a new stack replaces the old one's); written at once if
    /// connections wait already.
    pub(crate) fn set_inbound_waker(&self, waker: EventFd) {
        let mut inbound = self.inbound();
        if !inbound.pending.is_empty() {
            let _ = waker.write(1);
        }
        inbound.waker = Some(waker);
    }

    fn inbound(&self) -> MutexGuard<'_, Inbound> {
        self.inbound.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// See [`crate::log::NetLog::query`].
    pub fn query(&self, since_ms: u64, limit: usize) -> (Vec<NetRecord>, u64) {
        self.log().query(since_ms, limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::Protocol;
    use crate::policy::Egress;
    use std::net::{IpAddr, Ipv4Addr};

    fn public() -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(11, 0, 113, 9))
    }

    #[test]
    fn set_policy_replaces_and_keeps_old_on_error() {
        let ctl = NetControl::new(&NetworkPolicy::default(), None, Arc::default(), 16).unwrap();
        assert!(ctl.policy().check_addr(public(), 443, &[]).allowed);
        let held = ctl.policy();

        let deny = NetworkPolicy { egress: Egress::Deny, ..Default::default() };
        ctl.set_policy(&deny).unwrap();
        let v = ctl.policy().check_addr(public(), 443, &[]);
        assert_eq!((v.allowed, v.rule.as_str()), (false, "egress:deny"));
        // A policy taken before the change stays as it was.
        assert!(held.check_addr(public(), 443, &[]).allowed);

        let bad = NetworkPolicy { allow: vec!["not a rule!".into()], ..Default::default() };
        assert!(matches!(ctl.set_policy(&bad), Err(PolicyError::BadRule(r)) if r == "not a rule!"));
        assert_eq!(ctl.policy().policy(), &deny);
    }

    #[test]
    fn new_rejects_bad_rule() {
        let bad = NetworkPolicy { deny: vec!["10.0.0.0/33".into()], ..Default::default() };
        assert!(NetControl::new(&bad, None, Arc::default(), 16).is_err());
    }

    #[test]
    fn log_through_control_and_poisoned_lock_does_not_panic() {
        let ctl = NetControl::new(&NetworkPolicy::default(), None, Arc::default(), 4).unwrap();
        let id = ctl.record(NetRecord {
            id: 0,
            time_ms: 5,
            protocol: Protocol::Dns,
            direction: crate::log::Direction::Outbound,
            addr: public(),
            port: 53,
            domain: Some("example.com".into()),
            allowed: true,
            rule: "egress:allow".into(),
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: None,
            secrets: Vec::new(),
        });
        assert_eq!(id, 1);
        // Poison the log's lock: a thread panics while holding it.
        let c2 = Arc::clone(&ctl);
        let joined = std::thread::spawn(move || c2.update(id, |_| panic!("holder panics"))).join();
        assert!(joined.is_err());
        assert!(ctl.log.is_poisoned());
        ctl.update(id, |r| r.bytes_out = 12);
        let (got, dropped) = ctl.query(0, 10);
        assert_eq!((got.len(), got[0].bytes_out, dropped), (1, 12, 0));
    }

    #[test]
    fn inbound_requests_wake_the_stack_and_are_bounded() {
        let ctl = NetControl::new(&NetworkPolicy::default(), None, Arc::default(), 4).unwrap();
        assert!(matches!(ctl.connect_inbound(0), Err(InboundError::Port)));
        // Asked before any stack runs: the stack's waker fires when set.
        let _early = ctl.connect_inbound(80).unwrap();
        let waker = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        ctl.set_inbound_waker(waker.try_clone().unwrap());
        assert_eq!(waker.read().unwrap(), 1);
        let mut held = Vec::new();
        for _ in 1..MAX_PENDING_INBOUND {
            held.push(ctl.connect_inbound(8080).unwrap());
        }
        assert!(matches!(ctl.connect_inbound(8080), Err(InboundError::Busy)));
        assert_eq!(waker.read().unwrap(), (MAX_PENDING_INBOUND - 1) as u64);
        let taken = ctl.take_inbound();
        assert_eq!(taken.len(), MAX_PENDING_INBOUND);
        assert_eq!((taken[0].port, taken[1].port), (80, 8080));
        // Dropping the stack's end closes the asker's.
        drop(taken);
        let mut buf = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &held[0], &mut buf).unwrap(), 0);
        assert!(ctl.connect_inbound(8080).is_ok(), "room again");
    }
}
