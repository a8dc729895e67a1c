//! `GET /metrics`: the server's metrics in the Prometheus text exposition
//! format (version 0.0.4; <https://prometheus.io/docs/instrumenting/exposition_formats/>),
//! through the Prometheus project's Rust client (`prometheus-client`).
//! Behind the bearer token like `/mcp` (a `--dev` server has none).
//!
//! | series | type | labels |
//! |---|---|---|
//! | `tine_sandboxes` | gauge | `state`: starting, running, paused, hibernated, stopped, failed |
//! | `tine_sandboxes_created_total` | counter | `how`: boot, restore, pool, branch |
//! | `tine_sandbox_start_seconds` | histogram | `how`: VM start to agent ready |
//! | `tine_sandboxes_killed_total` | counter | `reason`: kill, idle, expired |
//! | `tine_hibernate_seconds` | histogram | `why`: request, idle, shutdown, memory (the budget), watermark (host memory low), cap (`max_sandboxes` running); the write, VM paused |
//! | `tine_hibernated_bytes` | histogram | `why`: the page files' sizes |
//! | `tine_resume_seconds` | histogram | `from`: disk; restore to agent ready |
//! | `tine_tool_calls_total` | counter | `tool`, `tenant` (`admin`: the operator), `outcome`: ok, error |
//! | `tine_tenant_sandboxes` | gauge | `tenant`, `state`: each tenant's sandboxes (the server's own under `admin`) |
//! | `tine_tool_call_duration_seconds` | histogram | `tool` |
//! | `tine_guest_memory_bytes` | gauge | guest memory reserved (sandboxes, branch points, templates) |
//! | `tine_guest_memory_budget_bytes` | gauge | |
//! | `tine_disk_bytes` | gauge | `kind`: host disk used by sandbox (layers only live sandboxes hold), template, hibernation (kept sandboxes' files), image (pulled OCI blobs and base images), volume (volumes' layers) |
//! | `tine_disk_reserved_bytes`, `tine_disk_budget_bytes` | gauge | the size of the disks live and hibernated sandboxes hold, and the disk budget |
//! | `tine_pool_ready`, `tine_pool_size` | gauge | the warm pool |
//! | `tine_mcp_sessions` | gauge | MCP sessions open on this host |
//! | `tine_forwarded_calls_total` | counter | `peer`, `outcome`: requests and tool calls passed to other hosts |
//! | `tine_build_info` | gauge (1) | `version`, `host` |
//!
//! Gauges are read from the manager when scraped; counters and
//! histograms follow tool calls and the manager's sandbox events.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tine_sandbox::events::EventKind;
use tine_sandbox::{Manager, SandboxState};

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HowLabel {
    how: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WhyLabel {
    why: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FromLabel {
    from: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabel {
    tool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolOutcome {
    tool: String,
    tenant: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantState {
    tenant: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerOutcome {
    peer: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    host: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Latency buckets (s): 1 ms to about 262 s, doubling.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 19))
}

/// Size buckets (bytes): 64 KiB to 64 GiB, quadrupling.
fn sizes() -> Histogram {
    Histogram::new(exponential_buckets(65536.0, 4.0, 11))
}

/// Requests and tool calls forwarded to other hosts, by peer and outcome
/// (kept by [`crate::cluster::Cluster`]).
#[derive(Clone, Default)]
pub struct Forwarded(Family<PeerOutcome, Counter>);

impl Forwarded {
    /// One more forwarded call to `peer`.
    pub fn observe(&self, peer: &str, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.0.get_or_create(&PeerOutcome { peer: peer.to_string(), outcome }).inc();
    }
}

/// The server's metrics.
pub struct Metrics {
    registry: Registry,
    sandboxes: Family<StateLabel, Gauge>,
    tenant_sandboxes: Family<TenantState, Gauge>,
    created: Family<HowLabel, Counter>,
    start: Histograms<HowLabel>,
    killed: Family<ReasonLabel, Counter>,
    tool_calls: Family<ToolOutcome, Counter>,
    tool_duration: Histograms<ToolLabel>,
    hibernate: Histograms<WhyLabel>,
    hibernated_bytes: Family<WhyLabel, Histogram, fn() -> Histogram>,
    resume: Histograms<FromLabel>,
    guest_memory: Gauge,
    budget: Gauge,
    disk: Family<KindLabel, Gauge>,
    disk_reserved: Gauge,
    disk_budget: Gauge,
    pool_ready: Gauge,
    pool_size: Gauge,
    sessions: Gauge,
}

/// Every [`SandboxState`] with its label, so a state with no sandboxes
/// reads 0 rather than vanishing.
const STATES: [(SandboxState, &str); 6] = [
    (SandboxState::Starting, "starting"),
    (SandboxState::Running, "running"),
    (SandboxState::Paused, "paused"),
    (SandboxState::Hibernated, "hibernated"),
    (SandboxState::Stopped, "stopped"),
    (SandboxState::Failed, "failed"),
];

impl Metrics {
    /// The series of the module's table, `forwarded` among them, with
    /// `host` in `tine_build_info`.
    pub fn new(host: &str, forwarded: &Forwarded) -> Arc<Self> {
        let mut m = Metrics {
            sandboxes: Family::default(),
            tenant_sandboxes: Family::default(),
            created: Family::default(),
            start: Family::new_with_constructor(latency),
            killed: Family::default(),
            tool_calls: Family::default(),
            tool_duration: Family::new_with_constructor(latency),
            hibernate: Family::new_with_constructor(latency),
            hibernated_bytes: Family::new_with_constructor(sizes),
            resume: Family::new_with_constructor(latency),
            guest_memory: Gauge::default(),
            budget: Gauge::default(),
            disk: Family::default(),
            disk_reserved: Gauge::default(),
            disk_budget: Gauge::default(),
            pool_ready: Gauge::default(),
            pool_size: Gauge::default(),
            sessions: Gauge::default(),
            registry: Registry::default(),
        };
        m.registry.register("tine_sandboxes", "Sandboxes on this host by state", m.sandboxes.clone());
        m.registry.register(
            "tine_tenant_sandboxes",
            "Sandboxes on this host by tenant and state",
            m.tenant_sandboxes.clone(),
        );
        m.registry.register(
            "tine_sandboxes_created",
            "Sandboxes made ready, by where their VM came from",
            m.created.clone(),
        );
        m.registry.register(
            "tine_sandbox_start_seconds",
            "VM start to agent ready (s), by where the VM came from",
            m.start.clone(),
        );
        m.registry.register("tine_sandboxes_killed", "Sandboxes killed, on request or idle", m.killed.clone());
        m.registry.register("tine_hibernate_seconds", "Hibernation write time (s), by why", m.hibernate.clone());
        m.registry.register(
            "tine_hibernated_bytes",
            "Hibernation page file sizes (bytes), by why",
            m.hibernated_bytes.clone(),
        );
        m.registry.register("tine_resume_seconds", "Resume from disk to agent ready (s)", m.resume.clone());
        m.registry.register("tine_tool_calls", "MCP tool calls by tool and outcome", m.tool_calls.clone());
        m.registry.register("tine_tool_call_duration_seconds", "MCP tool call time (s)", m.tool_duration.clone());
        m.registry.register(
            "tine_guest_memory_bytes",
            "Guest memory reserved by sandboxes, branch points and loaded templates (bytes)",
            m.guest_memory.clone(),
        );
        m.registry.register("tine_guest_memory_budget_bytes", "The guest memory budget (bytes)", m.budget.clone());
        m.registry.register("tine_disk_bytes", "Host disk used (bytes), by kind", m.disk.clone());
        m.registry.register(
            "tine_disk_reserved_bytes",
            "The size of the disks live and hibernated sandboxes hold (bytes)",
            m.disk_reserved.clone(),
        );
        m.registry.register("tine_disk_budget_bytes", "The sandboxes' disk budget (bytes)", m.disk_budget.clone());
        m.registry.register("tine_pool_ready", "Warm pool sandboxes ready", m.pool_ready.clone());
        m.registry.register("tine_pool_size", "Warm pool sandboxes wanted", m.pool_size.clone());
        m.registry.register("tine_mcp_sessions", "MCP sessions open on this host", m.sessions.clone());
        m.registry.register(
            "tine_forwarded_calls",
            "Requests and tool calls passed to other hosts, by peer and outcome",
            forwarded.0.clone(),
        );
        let build: Family<BuildLabels, Gauge> = Family::default();
        build.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION"), host: host.to_string() }).set(1);
        m.registry.register("tine_build_info", "This server's version and host name", build);
        for (_, state) in STATES {
            m.sandboxes.get_or_create(&StateLabel { state }).set(0);
        }
        Arc::new(m)
    }

    /// One tool call of `tool` that took `took` and failed or not.
    pub fn tool_call(&self, tool: &str, tenant: &str, took: Duration, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.tool_calls
            .get_or_create(&ToolOutcome { tool: tool.to_string(), tenant: tenant.to_string(), outcome })
            .inc();
        self.tool_duration.get_or_create(&ToolLabel { tool: tool.to_string() }).observe(took.as_secs_f64());
    }

    /// Counts what `event` says: a sandbox ready (and its start time),
    /// killed, hibernated or resumed from disk.
    fn event(&self, event: &EventKind) {
        match event {
            EventKind::Ready { boot_ms, source } => {
                let how = match source.split_once(':').map_or(source.as_str(), |(k, _)| k) {
                    "template" => "restore",
                    "pool" => "pool",
                    "branch" => "branch",
                    _ => "boot",
                };
                self.created.get_or_create(&HowLabel { how }).inc();
                self.start.get_or_create(&HowLabel { how }).observe(*boot_ms as f64 / 1000.0);
            }
            EventKind::Killed => {
                self.killed.get_or_create(&ReasonLabel { reason: "kill" }).inc();
            }
            EventKind::Reaped { .. } => {
                self.killed.get_or_create(&ReasonLabel { reason: "idle" }).inc();
            }
            EventKind::Expired => {
                self.killed.get_or_create(&ReasonLabel { reason: "expired" }).inc();
            }
            EventKind::Hibernated { why, bytes, ms } => {
                let label = WhyLabel { why: why.clone() };
                self.hibernate.get_or_create(&label).observe(*ms as f64 / 1000.0);
                self.hibernated_bytes.get_or_create(&label).observe(*bytes as f64);
            }
            EventKind::Woken { ms } => {
                self.resume.get_or_create(&FromLabel { from: "disk" }).observe(*ms as f64 / 1000.0);
            }
            _ => {}
        }
    }

    /// Follows `manager`'s sandbox events until the manager's channel
    /// closes (a lagging reader skips what it missed and says so).
    pub fn follow(self: &Arc<Self>, manager: &Manager) -> tokio::task::JoinHandle<()> {
        let mut events = manager.subscribe_events();
        let me = self.clone();
        tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match events.recv().await {
                    Ok(e) => me.event(&e.kind),
                    Err(RecvError::Lagged(n)) => tracing::warn!("metrics: {n} sandbox events missed"),
                    Err(RecvError::Closed) => return,
                }
            }
        })
    }

    /// The text exposition, gauges read from `manager` now and `sessions`
    /// MCP sessions open.
    pub fn render(&self, manager: &Manager, sessions: usize) -> String {
        let infos = manager.list(&Default::default());
        self.tenant_sandboxes.clear();
        for (state, label) in STATES {
            let mut n = 0;
            for i in infos.iter().filter(|i| i.state == state) {
                n += 1;
                let tenant = i.tenant.clone().unwrap_or_else(|| crate::auth::tenants::ADMIN.into());
                self.tenant_sandboxes.get_or_create(&TenantState { tenant, state: label }).inc();
            }
            self.sandboxes.get_or_create(&StateLabel { state: label }).set(n);
        }
        let (budget_mib, used) = manager.memory_use();
        self.guest_memory.set((used.total_mib() << 20) as i64);
        self.budget.set((budget_mib << 20) as i64);
        let disk = manager.disk_bytes();
        for (kind, bytes) in [
            ("sandbox", disk.sandbox_layers),
            ("template", disk.templates),
            ("hibernation", disk.hibernations),
            ("image", disk.images),
            ("volume", disk.volumes),
        ] {
            self.disk.get_or_create(&KindLabel { kind }).set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        self.disk_reserved.set(i64::try_from(disk.reserved).unwrap_or(i64::MAX));
        self.disk_budget.set(i64::try_from(disk.budget).unwrap_or(i64::MAX));
        let pool = manager.pool_status();
        self.pool_ready.set(pool.ready as i64);
        self.pool_size.set(pool.size as i64);
        self.sessions.set(sessions as i64);
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("metrics: cannot encode: {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_and_calls_are_counted() {
        let forwarded = Forwarded::default();
        let m = Metrics::new("h1", &forwarded);
        m.event(&EventKind::Ready { boot_ms: 250, source: "template:default".into() });
        m.event(&EventKind::Ready { boot_ms: 3, source: "branch:sb-h1-1".into() });
        m.event(&EventKind::Killed);
        m.tool_call("sandbox_exec", "acme", Duration::from_millis(20), true);
        m.tool_call("sandbox_exec", "acme", Duration::from_millis(20), false);
        forwarded.observe("h2", true);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &m.registry).unwrap();
        for want in [
            r#"tine_sandboxes_created_total{how="restore"} 1"#,
            r#"tine_sandboxes_created_total{how="branch"} 1"#,
            r#"tine_sandbox_start_seconds_count{how="restore"} 1"#,
            r#"tine_sandboxes_killed_total{reason="kill"} 1"#,
            r#"tine_tool_calls_total{tool="sandbox_exec",tenant="acme",outcome="error"} 1"#,
            r#"tine_tool_call_duration_seconds_count{tool="sandbox_exec"} 2"#,
            r#"tine_forwarded_calls_total{peer="h2",outcome="ok"} 1"#,
            r#"tine_sandboxes{state="paused"} 0"#,
            r#"tine_build_info{version=""#,
        ] {
            assert!(out.contains(want), "{want} in\n{out}");
        }
    }
}
