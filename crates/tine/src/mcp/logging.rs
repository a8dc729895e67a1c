//! MCP logging (MCP 2025-06-18 / 2025-11-25, "Utilities / Logging"): the
//! server declares the `logging` capability, takes `logging/setLevel` per
//! session and sends `notifications/message` about the session's
//! sandboxes: ready, paused, resumed, killed, merged (`info`); reaped by
//! the idle timeout, guest powered off or rebooted (`warning`); crashed
//! (with the console's last lines) and failed creates (`error`). Until a
//! client sets a level, a session gets `warning` and above.
//!
//! A session's sandboxes: those it created (the manager's events carry
//! the session's key as `owner`), those it named in a tool call, and
//! children branched from either. One forwarder task per session reads the
//! manager's event broadcast, filters, and sends; it holds the session's
//! [`SessionLog`] weakly and ends with it, when the broadcast closes or
//! when the transport is gone. Notifications that are not about a request
//! go on the session's standalone GET stream (rmcp caches the last 16 for
//! a client that opens it later); a send that takes over 2 s is dropped.
//!
//! Logging is deprecated in the 2026-07-28 draft (SEP-2577), and rmcp
//! marks its types so; this module and `get_info` allow that.
#![allow(deprecated)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam};
use rmcp::service::Peer;
use rmcp::RoleServer;
use serde_json::{Map, Value};
use tine_sandbox::{EventKind, SandboxEvent, Severity};
use tokio::sync::broadcast;
use tokio::task::AbortHandle;

use super::budget;

/// The logger name of the messages.
pub const LOGGER: &str = "tine.sandbox";
/// Largest `data` of one message (its JSON, bytes): 16 KiB.
pub const MAX_DATA_BYTES: usize = 16 << 10;
/// Longest one string field of `data` may be (bytes of JSON): 6 KiB, so
/// a crash's error and console tail together fit [`MAX_DATA_BYTES`].
const FIELD_BYTES: usize = 6 << 10;
/// Longest a message's send may take before it is dropped: 2 s.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The rank of `l` in RFC 5424 order (debug 0 ... emergency 7):
/// `LoggingLevel` is not `Ord`.
pub fn rank(l: LoggingLevel) -> u8 {
    match l {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

/// The level of a message about `kind`.
pub fn level_of(kind: &EventKind) -> LoggingLevel {
    match kind.severity() {
        Severity::Info => LoggingLevel::Info,
        Severity::Warning => LoggingLevel::Warning,
        Severity::Error => LoggingLevel::Error,
    }
}

/// `s` cut to at most `max` bytes of JSON, keeping its end (a console's
/// last lines) or its start.
fn cut_field(s: &str, max: usize, keep_end: bool) -> String {
    if budget::escaped_len(s) <= max {
        return s.to_string();
    }
    if keep_end {
        budget::fit_suffix(s, max).to_string()
    } else {
        budget::fit_prefix(s, max).to_string()
    }
}

/// The first line of `s`, at most 200 bytes.
fn headline(s: &str) -> &str {
    let line = s.lines().next().unwrap_or_default();
    budget::fit_prefix(line, 200)
}

/// One line saying what happened.
fn message(e: &SandboxEvent) -> String {
    let id = &e.sandbox_id;
    match &e.kind {
        EventKind::Ready { boot_ms, source } => format!("sandbox {id} is ready ({source}, {boot_ms} ms)"),
        EventKind::Paused => format!("sandbox {id} was paused"),
        EventKind::Resumed => format!("sandbox {id} was resumed"),
        EventKind::Hibernated { why, bytes, ms } => {
            format!(
                "sandbox {id} was hibernated ({why}): {} KiB written in {ms} ms; its next call resumes it",
                bytes >> 10
            )
        }
        EventKind::Woken { ms } => format!("sandbox {id} was resumed from disk in {ms} ms"),
        EventKind::Killed => format!("sandbox {id} was killed"),
        EventKind::Reaped { idle_secs } => format!(
            "sandbox {id} was killed after {idle_secs} s without a tool call (its idle timeout; background \
             processes do not count as activity)"
        ),
        EventKind::Expired => {
            format!("sandbox {id} was deleted: it stayed hibernated past the server's retention without a call")
        }
        EventKind::Merged { winner } => format!("sandbox {id} took the state of {winner} (merge)"),
        EventKind::Stopped { reason } => format!("sandbox {id} stopped: {}", headline(reason)),
        EventKind::Crashed { error, .. } => {
            format!("sandbox {id} crashed: {}; console_tail has the console's last lines", headline(error))
        }
        EventKind::CreateFailed { error } => format!("creating sandbox {id} failed: {}", headline(error)),
    }
}

/// The `data` of the message about `e`: `{"sandbox_id", "event",
/// "message", "at_ms", "parent"?, ...the event's fields}`, at most
/// [`MAX_DATA_BYTES`] of JSON (long fields are cut; a console tail keeps
/// its end).
pub fn data(e: &SandboxEvent) -> Value {
    let mut m = match serde_json::to_value(&e.kind) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    for (k, v) in m.iter_mut() {
        if let Value::String(s) = v {
            *s = cut_field(s, FIELD_BYTES, k == "console_tail");
        }
    }
    m.insert("sandbox_id".into(), Value::String(cut_field(&e.sandbox_id, 256, false)));
    m.insert("message".into(), Value::String(message(e)));
    m.insert("at_ms".into(), e.at_ms.into());
    if let Some(p) = &e.parent {
        m.insert("parent".into(), Value::String(cut_field(p, 256, false)));
    }
    // Several long fields: cut each further (an event has at most two).
    if budget::json_len(&m) > MAX_DATA_BYTES {
        for (k, v) in m.iter_mut() {
            if let Value::String(s) = v {
                *s = cut_field(s, FIELD_BYTES / 4, k == "console_tail");
            }
        }
    }
    Value::Object(m)
}

/// How many sandbox ids a session's log follows besides those it made.
pub const MAX_WATCHED: usize = 1024;

/// One MCP session's logging: its level and which sandboxes are its own.
pub struct SessionLog {
    /// The session's key: the `owner` of sandboxes it creates.
    key: u64,
    /// [`rank`] of the least level sent.
    level: AtomicU8,
    /// Sandboxes the session named, and children branched from them.
    watched: Mutex<BTreeSet<String>>,
    /// The forwarder task, once started.
    task: Mutex<Option<AbortHandle>>,
}

impl SessionLog {
    /// The log of the session with `key`: level `warning`, nothing watched,
    /// no forwarder yet.
    pub fn new(key: u64) -> Arc<Self> {
        Arc::new(SessionLog {
            key,
            level: AtomicU8::new(rank(LoggingLevel::Warning)),
            watched: Mutex::new(BTreeSet::new()),
            task: Mutex::new(None),
        })
    }

    /// `logging/setLevel`: messages of level `l` and above are sent.
    pub fn set_level(&self, l: LoggingLevel) {
        self.level.store(rank(l), Ordering::Relaxed);
    }

    /// Whether messages of level `l` are sent.
    pub fn enabled(&self, l: LoggingLevel) -> bool {
        rank(l) >= self.level.load(Ordering::Relaxed)
    }

    /// The session used sandbox `id`: its events (and its branch
    /// children's) are the session's from now on.
    ///
    /// At most [`MAX_WATCHED`] ids of at most 64 bytes are kept (a client
    /// may name any string); past that, events reach the session only for
    /// the sandboxes it made.
    pub fn watch(&self, id: &str) {
        let mut w = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        if id.len() <= 64 && w.len() < MAX_WATCHED && !w.contains(id) {
            w.insert(id.to_string());
        }
    }

    /// Whether the session follows any sandbox (made or named one).
    pub fn follows_any(&self) -> bool {
        !self.watched.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    /// Whether `e` is about one of the session's sandboxes; a branch child
    /// of a watched sandbox becomes watched.
    pub fn is_ours(&self, e: &SandboxEvent) -> bool {
        let mut w = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        if e.owner == Some(self.key) || w.contains(&e.sandbox_id) {
            return true;
        }
        if e.parent.as_ref().is_some_and(|p| w.contains(p)) {
            if w.len() < MAX_WATCHED {
                w.insert(e.sandbox_id.clone());
            }
            return true;
        }
        false
    }

    /// Starts the forwarder of `events` to `peer`, once per session (later
    /// calls do nothing). Must run inside a Tokio runtime.
    pub fn start(self: &Arc<Self>, peer: Peer<RoleServer>, events: broadcast::Receiver<SandboxEvent>) {
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        if task.is_some() {
            return;
        }
        let me = Arc::downgrade(self);
        *task = Some(tokio::spawn(forward(me, peer, events)).abort_handle());
    }
}

impl Drop for SessionLog {
    fn drop(&mut self) {
        if let Some(t) = self.task.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }
}

/// The forwarder: sends the session's events at or above its level.
async fn forward(log: Weak<SessionLog>, peer: Peer<RoleServer>, mut events: broadcast::Receiver<SandboxEvent>) {
    loop {
        let received = events.recv().await;
        let Some(me) = log.upgrade() else { return };
        let (level, data) = match received {
            Ok(e) => {
                if !me.is_ours(&e) {
                    continue;
                }
                (level_of(&e.kind), data(&e))
            }
            // Only for a session that follows some sandbox (the count says
            // nothing about which): others learn nothing of other sessions.
            Err(broadcast::error::RecvError::Lagged(_)) if !me.follows_any() => continue,
            Err(broadcast::error::RecvError::Lagged(n)) => (
                LoggingLevel::Notice,
                serde_json::json!({
                    "event": "dropped",
                    "message": format!("{n} sandbox events were dropped (the server was busy); \
                                        sandbox_list shows the sandboxes' states"),
                }),
            ),
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let enabled = me.enabled(level);
        drop(me);
        if peer.is_transport_closed() {
            return;
        }
        if !enabled {
            continue;
        }
        let param = LoggingMessageNotificationParam::new(level, data).with_logger(LOGGER);
        match tokio::time::timeout(SEND_TIMEOUT, peer.notify_logging_message(param)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!("log message not sent: {e}");
                return;
            }
            Err(_) => tracing::debug!("log message dropped: the client did not take it in 2 s"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEVELS: [LoggingLevel; 8] = [
        LoggingLevel::Debug,
        LoggingLevel::Info,
        LoggingLevel::Notice,
        LoggingLevel::Warning,
        LoggingLevel::Error,
        LoggingLevel::Critical,
        LoggingLevel::Alert,
        LoggingLevel::Emergency,
    ];

    fn event(id: &str, owner: Option<u64>, parent: Option<&str>, kind: EventKind) -> SandboxEvent {
        SandboxEvent { sandbox_id: id.into(), owner, parent: parent.map(Into::into), at_ms: 1, kind }
    }

    #[test]
    fn ranks_follow_rfc_5424_order_and_serde_names() {
        for (i, l) in LEVELS.iter().enumerate() {
            assert_eq!(rank(*l) as usize, i);
        }
        let names: Vec<String> = LEVELS.iter().map(|l| serde_json::to_value(l).unwrap().to_string()).collect();
        assert_eq!(names[0], "\"debug\"");
        assert_eq!(names[7], "\"emergency\"");
    }

    #[test]
    fn the_level_filters_and_defaults_to_warning() {
        let log = SessionLog::new(1);
        assert!(!log.enabled(LoggingLevel::Info));
        assert!(log.enabled(LoggingLevel::Warning) && log.enabled(LoggingLevel::Error));
        log.set_level(LoggingLevel::Info);
        assert!(log.enabled(LoggingLevel::Info) && !log.enabled(LoggingLevel::Debug));
        log.set_level(LoggingLevel::Emergency);
        assert!(!log.enabled(LoggingLevel::Critical));
        for l in LEVELS {
            log.set_level(l);
            assert!(LEVELS.iter().all(|m| log.enabled(*m) == (rank(*m) >= rank(l))));
        }
    }

    #[test]
    fn events_map_to_fitting_levels() {
        let crash = EventKind::Crashed { error: "guest fault".into(), console_tail: "sysrq".into() };
        assert_eq!(level_of(&crash), LoggingLevel::Error);
        assert_eq!(level_of(&EventKind::CreateFailed { error: "x".into() }), LoggingLevel::Error);
        assert_eq!(level_of(&EventKind::Reaped { idle_secs: 1 }), LoggingLevel::Warning);
        assert_eq!(level_of(&EventKind::Stopped { reason: "reboot".into() }), LoggingLevel::Warning);
        for k in [EventKind::Paused, EventKind::Resumed, EventKind::Killed, EventKind::Merged { winner: "sb-2".into() }]
        {
            assert_eq!(level_of(&k), LoggingLevel::Info);
        }
        assert_eq!(level_of(&EventKind::Ready { boot_ms: 5, source: "boot".into() }), LoggingLevel::Info);
    }

    #[test]
    fn a_session_sees_its_own_watched_and_their_children() {
        let log = SessionLog::new(7);
        assert!(log.is_ours(&event("sb-1", Some(7), None, EventKind::Paused)), "created by the session");
        assert!(!log.is_ours(&event("sb-2", Some(8), None, EventKind::Paused)), "another session's");
        assert!(!log.is_ours(&event("sb-3", None, None, EventKind::Paused)));
        log.watch("sb-3");
        assert!(log.is_ours(&event("sb-3", None, None, EventKind::Paused)), "named in a call");
        assert!(log.is_ours(&event("sb-4", Some(8), Some("sb-3"), EventKind::Paused)), "a child of a watched one");
        assert!(log.is_ours(&event("sb-4", Some(8), None, EventKind::Killed)), "the child is watched now");
        assert!(!log.is_ours(&event("sb-5", None, Some("sb-2"), EventKind::Paused)));
    }

    #[test]
    fn data_names_the_sandbox_and_event_and_stays_small() {
        let e = event(
            "sb-9",
            Some(1),
            Some("sb-1"),
            EventKind::Crashed {
                error: "\0".repeat(100_000),
                console_tail: "x".repeat(100_000) + "Kernel panic - sysrq triggered crash",
            },
        );
        let d = data(&e);
        assert_eq!(d["sandbox_id"], "sb-9");
        assert_eq!(d["event"], "crashed");
        assert_eq!(d["parent"], "sb-1");
        assert!(d["message"].as_str().unwrap().starts_with("sandbox sb-9 crashed"), "{}", d["message"]);
        assert!(d["console_tail"].as_str().unwrap().ends_with("sysrq triggered crash"));
        assert!(budget::json_len(&d) <= MAX_DATA_BYTES, "{}", budget::json_len(&d));

        let d = data(&event("sb-2", None, None, EventKind::Reaped { idle_secs: 900 }));
        assert_eq!(d["event"], "reaped");
        assert_eq!(d["idle_secs"], 900);
        assert!(d.get("parent").is_none());
        assert!(d["message"].as_str().unwrap().contains("idle timeout"));
    }
}
