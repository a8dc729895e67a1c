//! A sandbox's secrets ([`crate::secrets`]): binding them (a placeholder
//! in the guest's host environment per secret), and its network's
//! hand-over of their flows to the broker ([`SandboxHandoff`], the
//! [`Handoff`] the NAT asks).

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, Weak};

use netstack::control::{Handoff, NetControl};
use tine_broker::{BrokerEvent, Flow, FlowHooks};

use super::{Manager, Sandbox, SandboxError};
use crate::lock;
use crate::secrets::{broker_binding, new_placeholder, SecretBinding, SecretsSetup, MAX_BINDINGS};

/// How long the agent has to take the host environment.
const HOST_ENV_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl Manager {
    /// The bindings `requests` (environment variable → secret name) ask
    /// for in a sandbox of `tenant` that has `old` bound: a pair bound
    /// already keeps its placeholder, a new one gets a new placeholder.
    /// Checked before anything changes.
    ///
    /// Errors: [`SandboxError::Secrets`] (no secrets or no network on this
    /// server, a secret the tenant may not use, a variable name the protocol
    /// refuses or given twice, more than [`MAX_BINDINGS`]).
    pub(super) fn bind_secrets(
        &self,
        tenant: Option<&str>,
        old: &[SecretBinding],
        requests: &[(String, String)],
    ) -> Result<Vec<SecretBinding>, SandboxError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let bad = |m: String| SandboxError::Secrets(m);
        let Some(setup) = &self.config.secrets else {
            return Err(bad("this server has no secret store ([secrets] in its configuration)".into()));
        };
        if self.config.network.is_none() {
            return Err(bad(
                "this server gives sandboxes no network ([network] enabled = false): a secret could go nowhere".into(),
            ));
        }
        if requests.len() > MAX_BINDINGS {
            return Err(bad(format!("{} secrets: a sandbox binds at most {MAX_BINDINGS}", requests.len())));
        }
        let mut out: Vec<SecretBinding> = Vec::with_capacity(requests.len());
        for (env, secret) in requests {
            if out.iter().any(|b| b.env == *env) {
                return Err(bad(format!("environment variable {env} names two secrets")));
            }
            if setup.source.lookup(tenant, secret).is_none() {
                return Err(bad(format!("no secret {secret:?} that this caller may use (secret_list shows them)")));
            }
            let kept = old.iter().find(|b| b.env == *env && b.secret == *secret);
            let placeholder = match kept {
                Some(b) => b.placeholder.clone(),
                None => new_placeholder().map_err(|e| bad(format!("a placeholder: {e}")))?,
            };
            out.push(SecretBinding { env: env.clone(), secret: secret.clone(), placeholder });
        }
        let vars: Vec<(String, String)> = out.iter().map(|b| (b.env.clone(), b.placeholder.clone())).collect();
        tine_protocol::check_sandbox_env(&vars).map_err(|e| bad(e.to_string()))?;
        Ok(out)
    }

    /// Binds `requests` to sandbox `id` in place of its bindings: the
    /// guest's host environment gets the placeholders (a paused or
    /// hibernated sandbox is woken), then the broker swaps them.
    ///
    /// Errors: as [`Manager::bind_secrets`]; [`SandboxError::NotFound`]; as
    /// [`Manager::exec`] for the agent (`Unsupported` from an agent older
    /// than the operation).
    pub async fn set_secrets(
        &self,
        id: &str,
        requests: &[(String, String)],
    ) -> Result<Vec<SecretBinding>, SandboxError> {
        let sb = self.get(id)?;
        let old = lock(&sb.secrets).clone();
        let bindings = self.bind_secrets(sb.tenant().as_deref(), &old, requests)?;
        let vars: Vec<(String, String)> = bindings.iter().map(|b| (b.env.clone(), b.placeholder.clone())).collect();
        self.with_agent(id, |a| async move { a.set_host_env(vars, HOST_ENV_TIMEOUT).await }).await?;
        *lock(&sb.secrets) = bindings.clone();
        self.attach_handoff(&sb);
        self.record_in_background(&sb);
        tracing::info!(sandbox = %id, secrets = ?bindings.iter().map(|b| &b.secret).collect::<Vec<_>>(), "secrets bound");
        Ok(bindings)
    }

    /// Gives sandbox `sb`'s network its hand-over to the broker (over its
    /// own bindings; none: no hand-over). Call after its network control
    /// or its bindings changed hands (create, recovery, branch, merge).
    pub(super) fn attach_handoff(&self, sb: &Arc<Sandbox>) {
        let Some(control) = lock(&sb.net).clone() else { return };
        let handoff = match &self.config.secrets {
            Some(setup) if !lock(&sb.secrets).is_empty() => {
                let Ok(rt) = tokio::runtime::Handle::try_current() else {
                    tracing::warn!(sandbox = %sb.id, "no runtime for the secret broker: its secrets are not swapped");
                    return;
                };
                Some(Arc::new(SandboxHandoff {
                    sandbox: sb.id.clone(),
                    tenant: sb.tenant(),
                    bindings: sb.secrets.clone(),
                    body_budget: sb.body_budget.clone(),
                    setup: setup.clone(),
                    control: Arc::downgrade(&control),
                    rt,
                }) as Arc<dyn Handoff>)
            }
            _ => None,
        };
        control.set_handoff(handoff);
    }
}

/// A sandbox's hand-over to the broker: its bindings (shared with the
/// sandbox, so a change counts at once), resolved against the store at
/// every question.
struct SandboxHandoff {
    sandbox: String,
    tenant: Option<String>,
    bindings: Arc<Mutex<Vec<SecretBinding>>>,
    /// The sandbox's ([`Sandbox::body_budget`]).
    body_budget: Arc<tine_broker::BodyBudget>,
    setup: SecretsSetup,
    control: Weak<NetControl>,
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for SandboxHandoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxHandoff").field("sandbox", &self.sandbox).finish_non_exhaustive()
    }
}

impl SandboxHandoff {
    /// The bindings now, resolved for the broker (a secret deleted from
    /// the store, or no longer the tenant's to use, drops out).
    fn resolved(&self) -> Vec<Arc<tine_broker::Binding>> {
        let bindings = lock(&self.bindings).clone();
        bindings
            .iter()
            .filter_map(|b| {
                let rule = self.setup.source.lookup(self.tenant.as_deref(), &b.secret)?;
                Some(Arc::new(broker_binding(b, &rule)))
            })
            .collect()
    }
}

impl Handoff for SandboxHandoff {
    fn active(&self) -> bool {
        !lock(&self.bindings).is_empty()
    }

    fn wants(&self, name: &str) -> bool {
        self.resolved().iter().any(|b| b.allows(name))
    }

    fn take(&self, name: String, guest: UnixStream, upstream: std::net::TcpStream, record: u64) {
        let peer = upstream.peer_addr().ok();
        // The port the guest dialled: the NAT connected to it.
        let port = peer.map_or(tine_broker::authority::HTTPS_PORT, |p| p.port());
        let hooks =
            Arc::new(FlowLog { handoff: Arc::new(self.clone_view()), record, peer, swapped: Mutex::new(Vec::new()) });
        let broker = self.setup.broker.clone();
        let sandbox = self.sandbox.clone();
        self.rt.spawn(async move {
            let guest = guest.set_nonblocking(true).and_then(|()| tokio::net::UnixStream::from_std(guest));
            let upstream = upstream.set_nonblocking(true).and_then(|()| tokio::net::TcpStream::from_std(upstream));
            let (guest, upstream) = match (guest, upstream) {
                (Ok(g), Ok(u)) => (g, u),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!(sandbox = %sandbox, host = %name, "secret broker: {e}");
                    return;
                }
            };
            match broker.serve(guest, Flow { name: name.clone(), port, upstream, hooks }).await {
                Ok(stats) => tracing::debug!(sandbox = %sandbox, host = %name, ?stats, "secret broker flow ended"),
                Err(e) => tracing::info!(sandbox = %sandbox, host = %name, "secret broker flow: {e}"),
            }
        });
    }

    fn leaked(&self, host: &str, head: &[u8]) -> Vec<String> {
        tine_broker::swap::leaked_in(head, host, &self.resolved())
    }

    fn refuse_leaks(&self) -> bool {
        self.setup.source.refuse_leaks()
    }

    fn buffered_bytes(&self) -> u64 {
        self.body_budget.held()
    }
}

impl SandboxHandoff {
    /// Another handle on the same bindings, for a flow.
    fn clone_view(&self) -> SandboxHandoff {
        SandboxHandoff {
            sandbox: self.sandbox.clone(),
            tenant: self.tenant.clone(),
            bindings: self.bindings.clone(),
            body_budget: self.body_budget.clone(),
            setup: self.setup.clone(),
            control: self.control.clone(),
            rt: self.rt.clone(),
        }
    }
}

/// One brokered flow's side: the sandbox's bindings, and its network log
/// (the flow's record names the secrets swapped in; a leak gets a record
/// of its own).
struct FlowLog {
    handoff: Arc<SandboxHandoff>,
    record: u64,
    /// The upstream's address (for a leak's record).
    peer: Option<std::net::SocketAddr>,
    swapped: Mutex<Vec<String>>,
}

impl FlowLog {
    /// A record of its own in the network log for a broker event on this
    /// flow: the upstream's address, `host`, the verdict `rule`, the
    /// secrets it names.
    fn broker_record(&self, host: String, allowed: bool, rule: &str, secrets: Vec<String>) -> netstack::log::NetRecord {
        let unknown = std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0));
        let peer = self.peer.unwrap_or(unknown);
        let mut record = netstack::log::NetRecord::starting(
            netstack::log::Protocol::Tcp,
            peer.ip(),
            peer.port(),
            Some(host),
            netstack::policy::Verdict { allowed, rule: rule.into() },
        );
        record.secrets = secrets;
        record.duration_ms = Some(0);
        record
    }
}

impl FlowHooks for FlowLog {
    fn bindings(&self) -> Vec<Arc<tine_broker::Binding>> {
        self.handoff.resolved()
    }

    fn event(&self, event: BrokerEvent) {
        let Some(control) = self.handoff.control.upgrade() else { return };
        match event {
            BrokerEvent::Request { swapped, .. } if !swapped.is_empty() => {
                let names = {
                    let mut all = lock(&self.swapped);
                    for s in swapped {
                        if !all.contains(&s) {
                            all.push(s);
                        }
                    }
                    all.clone()
                };
                control.update(self.record, |r| r.secrets = names);
            }
            BrokerEvent::Request { .. } => {}
            BrokerEvent::LeakBlocked { host, secrets } => {
                control.record(self.broker_record(host, true, "secret-leak-blocked", secrets));
            }
            BrokerEvent::EchoScrubbed { host, path, secrets } => {
                tracing::info!(sandbox = %self.handoff.sandbox, %host, %path, ?secrets, "secret broker: a secret's value in a response was replaced by its placeholder");
                control.record(self.broker_record(host, true, "secret-echo-scrubbed", secrets));
            }
            BrokerEvent::Misdirected { host, authority } => {
                tracing::info!(sandbox = %self.handoff.sandbox, %host, %authority, "secret broker: a request for another authority was refused (421)");
            }
            BrokerEvent::BodyBudget { host, limit } => {
                tracing::warn!(sandbox = %self.handoff.sandbox, %host, limit, "secret broker: a request body past the sandbox's budget was refused (503)");
                control.record(self.broker_record(host, false, "secret-body-budget", Vec::new()));
            }
        }
    }

    fn body_budget(&self) -> Arc<tine_broker::BodyBudget> {
        self.handoff.body_budget.clone()
    }
}
