//! Progress of long manager calls, and the context a call carries.
//!
//! A caller that wants to hear how a long call goes (a create waiting for
//! a cold boot or the default template, a branch, a command, a template
//! build, a wait for a background process's output) passes a
//! [`CallContext`] whose [`ProgressSink`] is active; the manager reports
//! [`ProgressUpdate`]s into it as the call goes on. The sink is a plain
//! callback: it must not block (the MCP layer keeps only the latest update
//! and sends it at its own pace). Without a sink nothing is reported and
//! the calls behave as before.

use std::fmt;
use std::sync::Arc;

/// One progress report of a long call.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgressUpdate {
    /// How far the call is: elapsed seconds, or steps done (see the
    /// call's documentation); rises from one update to the next.
    pub progress: f64,
    /// The end of the scale, when known (the timeout in seconds, the
    /// number of steps).
    pub total: Option<f64>,
    /// What the call is doing now: one line, optionally followed by the
    /// latest output lines.
    pub message: String,
}

/// Where a call's progress goes: a callback, or nowhere ([`ProgressSink::none`]).
#[derive(Clone, Default)]
pub struct ProgressSink(Option<Arc<dyn Fn(ProgressUpdate) + Send + Sync>>);

impl ProgressSink {
    /// A sink that hands every update to `f` (called on the manager's
    /// tasks and threads: it must not block).
    pub fn new(f: impl Fn(ProgressUpdate) + Send + Sync + 'static) -> Self {
        ProgressSink(Some(Arc::new(f)))
    }

    /// A sink that drops everything.
    pub fn none() -> Self {
        ProgressSink(None)
    }

    /// Whether updates go anywhere (calls skip the work of progress, such
    /// as asking the agent for progress frames, otherwise).
    pub fn is_active(&self) -> bool {
        self.0.is_some()
    }

    /// Reports `progress` of `total` with `message`.
    pub fn report(&self, progress: f64, total: Option<f64>, message: impl Into<String>) {
        if let Some(f) = &self.0 {
            f(ProgressUpdate { progress, total, message: message.into() });
        }
    }
}

impl fmt::Debug for ProgressSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_active() { "ProgressSink(active)" } else { "ProgressSink(none)" })
    }
}

/// What a call carries besides its arguments.
#[derive(Clone, Debug, Default)]
pub struct CallContext {
    /// The caller's key (an MCP session), recorded as the owner of the
    /// sandboxes it creates and named in their [`crate::SandboxEvent`]s.
    pub owner: Option<u64>,
    /// The caller's tenant, recorded as the tenant of the sandboxes it
    /// creates (`None`: the server's own, seen only by the operator).
    pub tenant: Option<String>,
    /// The tenant's quota, checked when the call makes sandboxes or
    /// templates for it (`None`: only the server's [`crate::Limits`]).
    pub quota: Option<std::sync::Arc<crate::limits::Quota>>,
    /// The tenant's network ceiling over the sandboxes the call makes
    /// ([`netstack::policy`]: both are enforced on every connection).
    pub ceiling: Option<netstack::policy::NetworkPolicy>,
    /// Where the call's progress goes.
    pub progress: ProgressSink,
    /// Cancelled when the caller gives up on the call (an MCP
    /// `notifications/cancelled`): an exec then has its command killed in
    /// the guest ([`crate::Manager::exec_with`]). Never cancelled by
    /// default.
    pub cancel: tokio_util::sync::CancellationToken,
}

/// `n` bytes for people: `0 B`, `512 B`, `3.1 KiB`, `2.0 MiB` (binary
/// units, one decimal; progress messages and the command line's tables).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

/// `s` cut to at most `max` bytes on a character boundary, with `…`
/// marking a cut.
pub(crate) fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The last `n` non-empty lines of `tail` (lossy UTF-8, each cut to
/// [`TAIL_LINE_CHARS`] bytes).
pub(crate) fn last_lines(tail: &[u8], n: usize) -> Vec<String> {
    let text = String::from_utf8_lossy(tail);
    let lines: Vec<&str> = text.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| cut(l, TAIL_LINE_CHARS)).collect()
}

/// Most bytes of one output line in a progress message.
pub(crate) const TAIL_LINE_CHARS: usize = 200;

/// The latest output of a running command or process, for a progress
/// message: at most 3 lines, stdout's, with stderr's last line (marked)
/// when it has one.
pub(crate) fn output_lines(stdout_tail: &[u8], stderr_tail: &[u8]) -> String {
    let err = last_lines(stderr_tail, 1);
    let mut lines = last_lines(stdout_tail, if err.is_empty() { 3 } else { 2 });
    lines.extend(err.into_iter().map(|l| format!("stderr: {l}")));
    lines.join("\n")
}

/// Reports the agent's progress frames of a running command or wait on
/// `sink` until the client closes `frames` (at the call's end): each
/// message is `head`, the elapsed and total seconds, both streams' byte
/// counts and the latest output lines; progress is the elapsed seconds.
pub(crate) async fn report_frames(
    mut frames: tokio::sync::mpsc::Receiver<tine_protocol::Progress>,
    sink: &ProgressSink,
    head: &str,
    total_secs: u64,
) {
    while let Some(f) = frames.recv().await {
        let mut message = format!(
            "{head}{} s of {total_secs} s; stdout {}, stderr {}",
            f.elapsed_ms / 1000,
            human_bytes(f.stdout_bytes),
            human_bytes(f.stderr_bytes)
        );
        let lines = output_lines(&f.stdout_tail, &f.stderr_tail);
        if !lines.is_empty() {
            message.push('\n');
            message.push_str(&lines);
        }
        sink.report(f.elapsed_ms as f64 / 1000.0, Some(total_secs as f64), message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_lines_read_well() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(3174), "3.1 KiB");
        assert_eq!(human_bytes(2 << 20), "2.0 MiB");
        assert_eq!(output_lines(b"a\nb\n\nc\nd", b""), "b\nc\nd");
        assert_eq!(output_lines(b"a\nb\nc\n", b"oops\n"), "b\nc\nstderr: oops");
        let long = "é".repeat(150);
        let l = last_lines(long.as_bytes(), 1);
        assert!(l[0].len() <= TAIL_LINE_CHARS + '…'.len_utf8() && l[0].ends_with('…'), "{}", l[0]);
    }

    #[test]
    fn an_inactive_sink_drops_and_an_active_one_delivers() {
        let none = ProgressSink::none();
        assert!(!none.is_active());
        none.report(1.0, None, "nowhere");
        let got = Arc::new(std::sync::Mutex::new(Vec::new()));
        let g = got.clone();
        let sink = ProgressSink::new(move |u| g.lock().unwrap().push(u));
        assert!(sink.is_active() && CallContext::default().owner.is_none());
        sink.clone().report(2.0, Some(4.0), "step");
        let got = got.lock().unwrap();
        assert_eq!(*got, [ProgressUpdate { progress: 2.0, total: Some(4.0), message: "step".into() }]);
    }
}
