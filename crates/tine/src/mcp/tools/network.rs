//! The network family: the outbound policy `sandbox_create` and
//! `sandbox_update` take ([`NetworkParams`]; the tools themselves are in
//! the sandbox family, as `sandbox_update` changes other settings in the
//! same call), and `sandbox_network_log`, what a sandbox's connections
//! did.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router, Json};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::mcp::bounds::{MAX_ID_CHARS, MAX_OFFSET, MAX_POLICY_ENTRY_CHARS, MAX_POLICY_RULES};
use crate::mcp::errors::ToolError;
use crate::mcp::TineMcp;

/// The default verdict of a network policy.
#[derive(Clone, Copy, Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EgressParam {
    /// Destinations no rule matches are allowed (public internet).
    Allow,
    /// Destinations no rule matches are refused: only `allow` is reachable.
    Deny,
}

/// A sandbox's outbound network policy. Loopback, private (RFC 1918),
/// link-local (cloud metadata), CGNAT and multicast addresses are always
/// refused unless the server's configuration allows them.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
pub struct NetworkParams {
    /// "allow" (default): public internet; "deny": nothing but `allow`.
    pub egress: Option<EgressParam>,
    /// Reachable destinations: domains ("pypi.org"), wildcards
    /// ("*.pythonhosted.org": names below it), IP addresses or CIDRs.
    #[serde(default)]
    #[schemars(length(max = MAX_POLICY_RULES), inner(length(max = MAX_POLICY_ENTRY_CHARS)))]
    pub allow: Vec<String>,
    /// Refused destinations, same syntax; a deny beats an allow.
    #[serde(default)]
    #[schemars(length(max = MAX_POLICY_RULES), inner(length(max = MAX_POLICY_ENTRY_CHARS)))]
    pub deny: Vec<String>,
}

impl NetworkParams {
    /// The policy the sandbox manager takes.
    pub fn into_policy(self) -> tine_sandbox::network::NetworkPolicy {
        use tine_sandbox::network::Egress;
        tine_sandbox::network::NetworkPolicy {
            egress: match self.egress {
                Some(EgressParam::Deny) => Egress::Deny,
                Some(EgressParam::Allow) | None => Egress::Allow,
            },
            allow: self.allow,
            deny: self.deny,
        }
    }
}

/// `sandbox_network_log`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct NetworkLogParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Only records that started at or after this time (ms since the Unix
    /// epoch; default 0).
    #[schemars(range(max = MAX_OFFSET))]
    pub since_ms: Option<u64>,
    /// At most this many records, oldest first (default and maximum 200).
    #[schemars(range(min = 1, max = NETWORK_LOG_MAX))]
    pub limit: Option<usize>,
}

/// Most network log records one `sandbox_network_log` call returns (each
/// is at most about 400 bytes of JSON, sent twice: well under the 1 MiB
/// client limit).
pub const NETWORK_LOG_MAX: usize = 200;

/// One record of a sandbox's network log.
#[derive(Debug, Serialize, JsonSchema)]
pub struct NetworkRecord {
    /// Sequence number in the sandbox's log (from 1).
    pub id: u64,
    /// Start, ms since the Unix epoch.
    pub time_ms: u64,
    /// "tcp", "udp", "dns" or "icmp".
    pub protocol: String,
    /// "outbound" (the sandbox connected out) or "inbound" (a port
    /// forward into the sandbox).
    pub direction: String,
    /// Destination address (the host loopback for the gateway 10.0.2.2;
    /// the sandbox's own 10.0.2.15 for an inbound connection).
    pub addr: String,
    /// Destination port (0 for ICMP; the sandbox's port for an inbound
    /// connection).
    pub port: u16,
    /// The DNS name asked or resolved, or the TLS SNI / HTTP Host seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Whether the policy allowed it.
    pub allowed: bool,
    /// The deciding rule: "allow:<entry>", "deny:<entry>",
    /// "blocked-range:<cidr>", "egress:allow", "egress:deny",
    /// "limit:connections", "secret-leak-blocked", "secret-echo-scrubbed", ...
    pub rule: String,
    /// Bytes from the sandbox to the destination.
    pub bytes_out: u64,
    /// Bytes from the destination to the sandbox.
    pub bytes_in: u64,
    /// How long it lasted (ms); absent while open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// The sandbox's secrets it concerns (names): swapped in on this
    /// connection, found where they may not go ("secret-leak-blocked"), or
    /// whose values a response carried and the broker replaced by their
    /// placeholders ("secret-echo-scrubbed").
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// `sandbox_network_log`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct NetworkLogResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// Records, oldest first.
    pub records: Vec<NetworkRecord>,
    /// Records that fell out of the sandbox's bounded log so far.
    pub dropped: u64,
    /// Call again with since_ms = this to page on (the last record's
    /// time), when `records` was cut at the limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_since_ms: Option<u64>,
}

impl NetworkLogResult {
    /// The result for `log`, asked with `limit`.
    pub fn new(sandbox_id: String, log: tine_sandbox::NetworkLog, limit: usize) -> Self {
        let full = log.records.len() >= limit;
        let records: Vec<NetworkRecord> = log
            .records
            .into_iter()
            .map(|r| NetworkRecord {
                id: r.id,
                time_ms: r.time_ms,
                protocol: serde_json::to_value(r.protocol)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                direction: serde_json::to_value(r.direction)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                addr: r.addr.to_string(),
                port: r.port,
                domain: r.domain,
                allowed: r.allowed,
                rule: r.rule,
                bytes_out: r.bytes_out,
                bytes_in: r.bytes_in,
                duration_ms: r.duration_ms,
                secrets: r.secrets,
            })
            .collect();
        let next_since_ms = if full { records.last().map(|r| r.time_ms) } else { None };
        NetworkLogResult { sandbox_id, records, dropped: log.dropped, next_since_ms }
    }
}

#[tool_router(router = network_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "A sandbox's network log: its outbound connections, UDP flows and DNS queries, oldest \
                       first, each with time, protocol, destination, domain, verdict and the rule that decided, \
                       bytes each way and duration. Page with since_ms and limit (at most 200).",
        annotations(title = "Network log", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_network_log(
        &self,
        Parameters(p): Parameters<NetworkLogParams>,
    ) -> Result<Json<NetworkLogResult>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let limit = p.limit.unwrap_or(NETWORK_LOG_MAX).clamp(1, NETWORK_LOG_MAX);
        let log = self.manager.network_log(&id, p.since_ms.unwrap_or(0), limit)?;
        Ok(Json(NetworkLogResult::new(id, log, limit)))
    }
}
