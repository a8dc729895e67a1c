//! What the sandbox manager holds per sandbox: the live policy and the log,
//! shared with the VM's [`crate::stack::NetStack`] (which runs on the VM's
//! network thread).
//!
//! Locks are std's; a lock poisoned by a panicking holder is used as is
//! (the data are a policy pointer and a ring of plain records: nothing a
//! half-done update can leave inconsistent), so no caller ever panics here.

use std::sync::{Arc, Mutex, MutexGuard, RwLock};

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
        }))
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
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9))
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
            addr: public(),
            port: 53,
            domain: Some("example.com".into()),
            allowed: true,
            rule: "egress:allow".into(),
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: None,
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
}
