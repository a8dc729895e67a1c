//! The audit log: one line per tool call and per change of who may do
//! what, to the server's log under the tracing target [`TARGET`], so an
//! operator can send it elsewhere (`RUST_LOG=tine::audit=info`, or
//! `journalctl -u tine | grep tine::audit` under systemd). It names the
//! principal, the session, the tool, the ids the call named, its outcome
//! and duration, and never the arguments' contents (code, file data,
//! environment values).

use std::time::Duration;

/// The tracing target of audit lines.
pub const TARGET: &str = "tine::audit";

/// One tool call: who (`tenant`, `admin` for the operator; MCP session
/// `session`), which `tool`, the sandbox and process `ids` its arguments
/// named, whether it succeeded, and how long it took.
pub fn tool_call(tenant: &str, session: u64, tool: &str, ids: &[String], ok: bool, took: Duration) {
    tracing::info!(
        target: TARGET,
        tenant,
        session,
        tool,
        ids = %ids.join(","),
        outcome = if ok { "ok" } else { "error" },
        duration_ms = took.as_millis() as u64,
        "tool call"
    );
}

/// A change of tenants, keys or policies: `what` happened to `subject`.
pub fn change(what: &str, subject: &str) {
    tracing::info!(target: TARGET, what, subject, "policy change");
}
