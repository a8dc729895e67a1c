//! A sandbox's network as the manager sees it: each sandbox's
//! [`NetControl`] (made at create, inherited by branch children, taken over
//! by a merge), changing the policy of a running sandbox, reading its
//! network log, and the server's CA certificates given to a started or
//! restored guest to trust.

use std::sync::Arc;

use netstack::control::NetControl;
use netstack::log::NetRecord;
use netstack::policy::NetworkPolicy;
use tine_agent_client::AgentClient;

use super::{Manager, Sandbox, SandboxError};
use crate::lock;

/// Deadline of the trust install in the guest (a bundle of a few hundred
/// KiB read and written where every guest system call is emulated).
const TRUST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A page of a sandbox's network log.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NetworkLog {
    /// Records, oldest first.
    pub records: Vec<NetRecord>,
    /// Records that fell out of the bounded log since the sandbox started.
    pub dropped: u64,
}

impl Manager {
    /// A new sandbox's network control with `policy` (`None`: the
    /// server's default); `None` when the server gives no network.
    ///
    /// Errors: [`SandboxError::Network`] for a bad rule;
    /// [`SandboxError::NoNetwork`] for a policy on a server without network.
    pub(super) fn net_control(
        &self,
        policy: Option<&NetworkPolicy>,
        ceiling: Option<&NetworkPolicy>,
    ) -> Result<Option<Arc<NetControl>>, SandboxError> {
        match &self.config.network {
            Some(n) => Ok(Some(n.control(policy, ceiling)?)),
            None if policy.is_some() => Err(SandboxError::NoNetwork),
            None => Ok(None),
        }
    }

    /// The egress policy of new sandboxes that name none (`None`: no
    /// network).
    pub fn default_network_policy(&self) -> Option<&NetworkPolicy> {
        self.config.network.as_ref().map(|n| &n.default_policy)
    }

    /// One sentence for tool descriptions: what network sandboxes of
    /// this server have by default.
    pub fn network_summary(&self) -> String {
        let Some(n) = &self.config.network else {
            return "Network: none (this server gives sandboxes no network device).".into();
        };
        let default = match (n.default_policy.egress, n.default_policy.allow.is_empty()) {
            (netstack::policy::Egress::Allow, _) => "the public internet".to_string(),
            (netstack::policy::Egress::Deny, true) => "no outbound connections by default".to_string(),
            (netstack::policy::Egress::Deny, false) => format!("only {}", n.default_policy.allow.join(", ")),
        };
        format!(
            "Network: {default}, through a NAT (not loopback, private or metadata addresses); policy: \
             sandbox_update {{ network }}."
        )
    }

    /// A branch child's control: its parent's policy as it is now, a log
    /// of its own.
    pub(super) fn inherit_net(&self, parent: &Sandbox) -> Result<Option<Arc<NetControl>>, SandboxError> {
        let compiled = lock(&parent.net).as_ref().map(|c| c.policy());
        let policy = compiled.as_ref().map(|c| c.policy().clone());
        let ceiling = compiled.as_ref().and_then(|c| c.ceiling()).map(|c| c.policy().clone());
        self.net_control(policy.as_ref(), ceiling.as_ref())
    }

    /// Replaces the egress policy of sandbox `id`; connections opened from
    /// now on follow it (open ones are not cut). Returns the new policy.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::NoNetwork`],
    /// [`SandboxError::Network`] (the old policy stays).
    pub fn set_network_policy(&self, id: &str, policy: &NetworkPolicy) -> Result<NetworkPolicy, SandboxError> {
        let sb = self.get(id)?;
        let control = lock(&sb.net).clone().ok_or(SandboxError::NoNetwork)?;
        control.set_policy(policy)?;
        self.record_in_background(&sb);
        sb.touch();
        tracing::info!(sandbox = %id, policy = %control.policy().summary(), "network policy changed");
        Ok(control.policy().policy().clone())
    }

    /// Sandbox `id`'s network log: records that started at or after
    /// `since_ms` (ms since the Unix epoch), oldest first, at most `limit`.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::NoNetwork`].
    pub fn network_log(&self, id: &str, since_ms: u64, limit: usize) -> Result<NetworkLog, SandboxError> {
        let sb = self.get(id)?;
        let control = lock(&sb.net).clone().ok_or(SandboxError::NoNetwork)?;
        let (records, dropped) = control.query(since_ms, limit);
        Ok(NetworkLog { records, dropped })
    }

    /// Gives a started or restored guest the server's CA certificates to
    /// trust beside its own store (`Op::InstallTrust`; a template's guest
    /// may have been made with others, or none). An agent older than the
    /// operation goes on without them (logged).
    ///
    /// Errors: [`SandboxError::Connection`] when the agent fails.
    pub(super) async fn install_trust(&self, sb: &Sandbox, agent: &AgentClient) -> Result<(), SandboxError> {
        let Some(pem) = self.config.network.as_ref().map(|n| n.ca_pem.clone()).filter(|p| !p.is_empty()) else {
            return Ok(());
        };
        match agent.install_trust(pem, TRUST_TIMEOUT).await {
            Ok(()) => Ok(()),
            Err(tine_agent_client::ClientError::Agent(tine_protocol::AgentError::Unsupported { reason })) => {
                tracing::warn!(sandbox = %sb.id, "its agent cannot install the server's CA certificates ({reason}); TLS through the secret broker or a TLS-inspecting proxy will not verify in it");
                Ok(())
            }
            Err(e) => {
                Err(SandboxError::Connection { id: sb.id.clone(), reason: format!("install the CA certificates: {e}") })
            }
        }
    }
}
