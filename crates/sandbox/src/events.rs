//! Sandbox events: what happened to a sandbox (ready, paused, resumed,
//! hibernated, woken,
//! killed, reaped, merged, crashed, stopped, failed to start), broadcast to
//! whoever subscribed ([`crate::Manager::subscribe_events`]), e.g. the MCP
//! layer's log notifications.
//!
//! Events are best effort: a subscriber that falls behind the channel's
//! capacity ([`EVENT_CAPACITY`]) loses the oldest ones and is told how many
//! (`tokio::sync::broadcast::error::RecvError::Lagged`). Branch children
//! that were discarded and the default template's build VM emit nothing.

use serde::Serialize;

use crate::SandboxId;

/// Events the broadcast channel holds for a slow subscriber.
pub const EVENT_CAPACITY: usize = 256;
/// Most bytes of [`EventKind::Crashed`]'s `console_tail` (its last lines
/// are kept).
pub const CONSOLE_TAIL_BYTES: usize = 8 << 10;

/// Something that happened to one sandbox.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SandboxEvent {
    /// The sandbox.
    pub sandbox_id: SandboxId,
    /// The key of the caller that created it (a branch child: its
    /// creator's, else its source's), see [`crate::CallContext::owner`].
    pub owner: Option<u64>,
    /// The sandbox it was branched from, if any.
    pub parent: Option<SandboxId>,
    /// When, ms since the Unix epoch.
    pub at_ms: u64,
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
}

/// What happened; serialized with its name in `event` (`"ready"`, ...).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// The sandbox's agent answered: it is running.
    Ready {
        /// VM start to agent ready (ms).
        boot_ms: u64,
        /// Where its VM came from: `boot`, `template:<name>` or
        /// `branch:<parent>`.
        source: String,
    },
    /// Its vCPUs were parked.
    Paused,
    /// Its vCPUs run again.
    Resumed,
    /// Its state went to disk and its VM was freed.
    Hibernated {
        /// Why: `request`, `idle`, `shutdown` or `memory`.
        why: String,
        /// The hibernation's page file (bytes).
        bytes: u64,
        /// How long the write took (ms).
        ms: u64,
    },
    /// It was restored from its hibernation and runs again.
    Woken {
        /// Restore to agent ready (ms).
        ms: u64,
    },
    /// It was killed on request.
    Killed,
    /// It was killed because it was idle past its idle timeout.
    Reaped {
        /// How long it had been idle (s).
        idle_secs: u64,
    },
    /// It was deleted: hibernated past its retention
    /// ([`crate::Limits::hibernated_retention_secs`]).
    Expired,
    /// A descendant's VM took its place (it now runs `winner`'s VM).
    Merged {
        /// The descendant merged into it (gone now).
        winner: SandboxId,
    },
    /// The guest powered off or rebooted by itself.
    Stopped {
        /// Which.
        reason: String,
    },
    /// The guest crashed (a fault, a kernel panic).
    Crashed {
        /// What the VMM saw (at most 4 KiB, its start).
        error: String,
        /// The guest console's last lines (at most 25 lines,
        /// [`CONSOLE_TAIL_BYTES`]).
        console_tail: String,
    },
    /// Creating it failed; it is gone.
    CreateFailed {
        /// Why.
        error: String,
    },
}

/// How much an event matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Routine: ready, paused, resumed, killed, merged.
    Info,
    /// Not asked for: reaped, powered off or rebooted.
    Warning,
    /// Failed: crashed, create failed.
    Error,
}

impl EventKind {
    /// How much this event matters.
    pub fn severity(&self) -> Severity {
        match self {
            EventKind::Ready { .. }
            | EventKind::Paused
            | EventKind::Resumed
            | EventKind::Hibernated { .. }
            | EventKind::Woken { .. }
            | EventKind::Killed
            | EventKind::Merged { .. } => Severity::Info,
            EventKind::Reaped { .. } | EventKind::Expired | EventKind::Stopped { .. } => Severity::Warning,
            EventKind::Crashed { .. } | EventKind::CreateFailed { .. } => Severity::Error,
        }
    }

    /// The event's name as serialized (`"ready"`, `"create_failed"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Ready { .. } => "ready",
            EventKind::Paused => "paused",
            EventKind::Resumed => "resumed",
            EventKind::Hibernated { .. } => "hibernated",
            EventKind::Woken { .. } => "woken",
            EventKind::Killed => "killed",
            EventKind::Reaped { .. } => "reaped",
            EventKind::Expired => "expired",
            EventKind::Merged { .. } => "merged",
            EventKind::Stopped { .. } => "stopped",
            EventKind::Crashed { .. } => "crashed",
            EventKind::CreateFailed { .. } => "create_failed",
        }
    }
}

/// The end of `s` within `max` bytes, cut on a character boundary (the
/// newest console lines are the ones that say most).
pub(crate) fn keep_end(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_flat_with_their_name() {
        let e = SandboxEvent {
            sandbox_id: "sb-2".into(),
            owner: Some(7),
            parent: Some("sb-1".into()),
            at_ms: 5,
            kind: EventKind::Reaped { idle_secs: 300 },
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["event"], "reaped");
        assert_eq!(v["idle_secs"], 300);
        assert_eq!(v["sandbox_id"], "sb-2");
        assert_eq!(e.kind.name(), "reaped");
        assert_eq!(e.kind.severity(), Severity::Warning);
        let crash = EventKind::Crashed { error: "x".into(), console_tail: "y".into() };
        assert_eq!((crash.name(), crash.severity()), ("crashed", Severity::Error));
        assert_eq!(keep_end("abcdé", 2), "é");
        assert_eq!(keep_end("abc", 8), "abc");
    }
}
