//! What the sandbox manager holds per sandbox: the live policy and the log,
//! shared with the VM's [`crate::stack::NetStack`] (which runs on the VM's
//! network thread).
//!
//! STUB: the lead wrote the types and signatures; the policy helper fills
//! in the logic (see /work/wt/DESIGN-15.md).

use std::sync::Arc;

use crate::log::NetRecord;
use crate::policy::{CompiledPolicy, NetworkPolicy, PolicyError, ServerNetPolicy};

/// Shared between the manager and the network thread of one sandbox.
#[derive(Debug)]
pub struct NetControl {
    _p: (),
}

impl NetControl {
    /// A control with `policy` and a log of `log_capacity` records.
    ///
    /// Errors: [`PolicyError`] for a bad rule.
    pub fn new(
        _policy: &NetworkPolicy,
        _server: Arc<ServerNetPolicy>,
        _log_capacity: usize,
    ) -> Result<Arc<Self>, PolicyError> {
        todo!("policy helper")
    }

    /// Replaces the policy; connections opened from now on follow it
    /// (open ones are not cut).
    ///
    /// Errors: [`PolicyError`]; the old policy stays.
    pub fn set_policy(&self, _policy: &NetworkPolicy) -> Result<(), PolicyError> {
        todo!("policy helper")
    }

    /// The current policy (cheap: an `Arc` clone).
    pub fn policy(&self) -> Arc<CompiledPolicy> {
        todo!("policy helper")
    }

    /// Appends a record; returns its id.
    pub fn record(&self, _record: NetRecord) -> u64 {
        todo!("policy helper")
    }

    /// Updates record `id` if still in the log.
    pub fn update(&self, _id: u64, _f: impl FnOnce(&mut NetRecord)) {
        todo!("policy helper")
    }

    /// See [`crate::log::NetLog::query`].
    pub fn query(&self, _since_ms: u64, _limit: usize) -> (Vec<NetRecord>, u64) {
        todo!("policy helper")
    }
}
