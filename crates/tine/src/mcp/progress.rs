//! Progress notifications (MCP 2025-06-18 / 2025-11-25, "Utilities /
//! Progress"): a long tool call whose request carries
//! `_meta.progressToken` sends `notifications/progress` while it works.
//!
//! A [`Reporter`] is made per call from its request context. The sandbox
//! manager reports through the [`ProgressSink`] of the [`CallContext`] it
//! is given; the sink only stores the latest update (never blocks the
//! manager), and one task per call sends at most one notification per
//! [`MIN_INTERVAL`], with `progress` strictly increasing (the spec's
//! rule), `total` left out when below it and the message cut to
//! [`MESSAGE_BYTES`]. [`Reporter::finish`] ends the task before the tool
//! returns, waiting for a send in flight, so no notification follows the
//! result (the spec forbids progress after the response); dropping a
//! reporter aborts its task too. A client that takes no notification for
//! [`SEND_TIMEOUT`] gets no more for that call (at most that one may then
//! still reach it late), and a cancelled request (`notifications/
//! cancelled`) gets none from then on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::model::ProgressNotificationParam;
use rmcp::service::RequestContext;
use rmcp::RoleServer;
use tine_sandbox::{CallContext, ProgressSink, ProgressUpdate};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Least time between two notifications of one call: 500 ms.
pub const MIN_INTERVAL: Duration = Duration::from_millis(500);
/// Longest message of a notification (bytes of UTF-8): 1 KiB.
pub const MESSAGE_BYTES: usize = 1024;
/// Longest a notification's send may take (a client that does not read
/// its stream cannot stall the call): 2 s. Past it, reporting for the call
/// stops.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Smallest step between two progress values sent.
const STEP: f64 = 0.001;

/// What has been sent for one call; decides what the next update sends.
#[derive(Debug, Default)]
struct ProgressState {
    /// The last progress value sent.
    last: Option<f64>,
    /// When the last notification went.
    last_sent: Option<Instant>,
}

impl ProgressState {
    /// How long from `now` until the next notification may go.
    fn delay(&self, now: Instant) -> Duration {
        self.last_sent.map_or(Duration::ZERO, |t| (t + MIN_INTERVAL).saturating_duration_since(now))
    }

    /// What to send for `u` at `now` (progress, total, message), or
    /// `None` if it is too early (see [`ProgressState::delay`]). Progress
    /// is forced above the last value sent; a total below the progress is
    /// left out; the message is cut to [`MESSAGE_BYTES`] on a character
    /// boundary.
    fn next(&mut self, u: ProgressUpdate, now: Instant) -> Option<(f64, Option<f64>, String)> {
        if !self.delay(now).is_zero() {
            return None;
        }
        let mut progress = if u.progress.is_finite() { u.progress.max(0.0) } else { 0.0 };
        if let Some(last) = self.last {
            // `last + STEP` rounds back to `last` for huge values.
            progress = progress.max(last + STEP).max(last.next_up());
        }
        let total = u.total.filter(|t| t.is_finite() && *t >= progress);
        let mut message = u.message;
        if message.len() > MESSAGE_BYTES {
            let mut end = MESSAGE_BYTES;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
        }
        self.last = Some(progress);
        self.last_sent = Some(now);
        Some((progress, total, message))
    }
}

/// One tool call's progress reporting: inactive when the request has no
/// progress token.
pub struct Reporter {
    /// Where the sink puts the latest update.
    tx: Option<Arc<watch::Sender<Option<ProgressUpdate>>>>,
    /// Stops the task at [`Reporter::finish`].
    stop: CancellationToken,
    /// The task that sends the notifications.
    task: Option<JoinHandle<()>>,
}

impl Reporter {
    /// Starts reporting for the call of `ctx`, if its request carries a
    /// `progressToken`; else an inactive reporter whose context has no
    /// sink. Must run inside a Tokio runtime.
    pub fn start(ctx: &RequestContext<RoleServer>) -> Self {
        let stop = CancellationToken::new();
        let Some(token) = ctx.meta.get_progress_token() else {
            return Reporter { tx: None, stop, task: None };
        };
        let (tx, mut rx) = watch::channel::<Option<ProgressUpdate>>(None);
        let peer = ctx.peer.clone();
        let stopped = stop.clone();
        let cancelled = ctx.ct.clone();
        let task = tokio::spawn(async move {
            let mut state = ProgressState::default();
            loop {
                tokio::select! {
                    biased;
                    _ = stopped.cancelled() => return,
                    _ = cancelled.cancelled() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                }
                let wait = state.delay(Instant::now());
                if !wait.is_zero() {
                    tokio::select! {
                        biased;
                        _ = stopped.cancelled() => return,
                        _ = cancelled.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                // The latest update wins; those in between are skipped.
                let latest = rx.borrow_and_update().as_ref().map(|u| ProgressUpdate {
                    progress: u.progress,
                    total: u.total,
                    message: u.message.clone(),
                });
                let Some(u) = latest else { continue };
                let Some((progress, total, message)) = state.next(u, Instant::now()) else { continue };
                let mut param = ProgressNotificationParam::new(token.clone(), progress).with_message(message);
                if let Some(t) = total {
                    param = param.with_total(t);
                }
                match tokio::time::timeout(SEND_TIMEOUT, peer.notify_progress(param)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::debug!("progress notification not sent: {e}");
                        return;
                    }
                    Err(_) => {
                        // rmcp has queued it and may still send it: never
                        // start a second one beside it.
                        tracing::debug!("progress stopped: the client did not take a notification in 2 s");
                        return;
                    }
                }
            }
        });
        Reporter { tx: Some(Arc::new(tx)), stop, task: Some(task) }
    }

    /// The call context to give the sandbox manager: `base` (the caller's
    /// session key, tenant and quota) with progress going to this
    /// reporter.
    pub fn context(&self, base: CallContext) -> CallContext {
        let progress = match &self.tx {
            Some(tx) => {
                let tx = tx.clone();
                ProgressSink::new(move |u| {
                    tx.send_replace(Some(u));
                })
            }
            None => ProgressSink::none(),
        };
        CallContext { progress, ..base }
    }

    /// Runs `call` with the call context `base` whose progress goes to the
    /// request's client, and ends reporting before it returns `call`'s
    /// output: no notification can follow the tool's result.
    pub async fn around<T>(
        ctx: &RequestContext<RoleServer>,
        base: CallContext,
        call: impl AsyncFnOnce(&CallContext) -> T,
    ) -> T {
        let reporter = Reporter::start(ctx);
        let out = call(&reporter.context(base)).await;
        reporter.finish().await;
        out
    }

    /// Ends reporting: an update not yet sent is dropped, a send in flight
    /// is waited for (it gives up after [`SEND_TIMEOUT`] by itself); after
    /// it returns, nothing more is sent for the call. Call it before
    /// returning the tool's result.
    pub async fn finish(mut self) {
        self.stop.cancel();
        self.tx = None;
        if let Some(mut task) = self.task.take() {
            // The task ends within SEND_TIMEOUT (its send's own bound); the
            // slack only guards against a scheduler stall.
            if tokio::time::timeout(SEND_TIMEOUT * 2, &mut task).await.is_err() {
                task.abort();
            }
        }
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(progress: f64, total: Option<f64>, message: &str) -> ProgressUpdate {
        ProgressUpdate { progress, total, message: message.into() }
    }

    #[test]
    fn the_first_update_goes_at_once_then_one_per_interval() {
        let t0 = Instant::now();
        let mut s = ProgressState::default();
        assert_eq!(s.delay(t0), Duration::ZERO);
        assert_eq!(s.next(update(1.0, Some(60.0), "booting"), t0), Some((1.0, Some(60.0), "booting".into())));
        assert_eq!(s.delay(t0 + Duration::from_millis(200)), Duration::from_millis(300));
        assert_eq!(s.next(update(2.0, None, "x"), t0 + Duration::from_millis(200)), None, "too early");
        let t1 = t0 + MIN_INTERVAL;
        assert_eq!(s.delay(t1), Duration::ZERO);
        assert_eq!(s.next(update(2.0, None, "x"), t1), Some((2.0, None, "x".into())));
    }

    #[test]
    fn progress_strictly_increases_and_totals_below_it_are_left_out() {
        let mut t = Instant::now();
        let mut s = ProgressState::default();
        let mut sent = Vec::new();
        let updates = [
            (5.0, Some(4.0)),
            (5.0, Some(10.0)),
            (3.0, None),
            (f64::NAN, None),
            (-1.0, Some(1.0)),
            (1.8e16, None),
            (1.8e16, None),
        ];
        for (p, total) in updates {
            let (progress, total, _) = s.next(update(p, total, ""), t).expect("an interval passed");
            sent.push(progress);
            if let Some(total) = total {
                assert!(total >= progress);
            }
            t += MIN_INTERVAL;
        }
        assert!(sent.windows(2).all(|w| w[1] > w[0]), "{sent:?}");
        assert_eq!(sent[0], 5.0);
        let mut s = ProgressState::default();
        assert_eq!(s.next(update(5.0, Some(4.0), ""), t).map(|x| x.1), Some(None), "a total below progress is dropped");
    }

    #[test]
    fn messages_are_cut_on_a_character_boundary() {
        let mut s = ProgressState::default();
        let long = "é".repeat(MESSAGE_BYTES);
        let (_, _, m) = s.next(update(1.0, None, &long), Instant::now()).unwrap();
        assert!(m.len() <= MESSAGE_BYTES && m.len() >= MESSAGE_BYTES - 1, "{}", m.len());
        assert!(m.chars().all(|c| c == 'é'));
    }
}
