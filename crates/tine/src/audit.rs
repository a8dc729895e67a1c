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

/// Bytes of the `ids` field at most: ids are what the caller sent, and a
/// malformed call's "id" may be megabytes (the rest is counted, not
/// written).
pub const MAX_IDS_BYTES: usize = 512;

/// One tool call: who (`tenant`, `admin` for the operator; MCP session
/// `session`), which `tool`, the sandbox and process `ids` its arguments
/// named (comma-separated, at most [`MAX_IDS_BYTES`] of them), whether it
/// succeeded, and how long it took.
pub fn tool_call(tenant: &str, session: u64, tool: &str, ids: &[String], ok: bool, took: Duration) {
    tracing::info!(
        target: TARGET,
        tenant,
        session,
        tool,
        ids = %bounded(&ids.join(",")),
        outcome = if ok { "ok" } else { "error" },
        duration_ms = took.as_millis() as u64,
        "tool call"
    );
}

/// `s`, or its first [`MAX_IDS_BYTES`] (at a character boundary) and how
/// many bytes were left out.
fn bounded(s: &str) -> std::borrow::Cow<'_, str> {
    if s.len() <= MAX_IDS_BYTES {
        return s.into();
    }
    let mut end = MAX_IDS_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...({} more bytes)", &s[..end], s.len() - end).into()
}

/// A change of tenants, keys or policies: `what` happened to `subject`.
pub fn change(what: &str, subject: &str) {
    tracing::info!(target: TARGET, what, subject, "policy change");
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_ids_are_cut_at_a_character_boundary() {
        assert_eq!(super::bounded("sb-1,sb-2"), "sb-1,sb-2");
        let long = "é".repeat(1000);
        let cut = super::bounded(&long);
        assert!(cut.starts_with(&"é".repeat(256)) && cut.ends_with("...(1488 more bytes)"), "{cut}");
    }
}
