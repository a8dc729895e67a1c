//! The tools' result types (their JSON Schemas are the tools'
//! `outputSchema`; the same JSON is the `structuredContent` and the text),
//! and how the agent's replies become them.

use schemars::JsonSchema;
use serde::Serialize;
use tine_protocol::{DirEntry, ExecReply, ExitStatus, FileKind, Output, PythonReply};
use tine_sandbox::{DiffReport, ProcessInfo, SandboxInfo, TemplateInfo};

use super::budget;

/// `template_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateListResult {
    /// Every template, by name; the first ones only if `truncated`.
    pub templates: Vec<TemplateInfo>,
    /// Templates were left out to fit the result budget.
    pub truncated: bool,
}

/// `sandbox_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListResult {
    /// The sandboxes, by id; the first ones only if `truncated`.
    pub sandboxes: Vec<SandboxInfo>,
    /// How many sandboxes matched.
    pub total: u64,
    /// Sandboxes were left out to fit the result budget (filter by labels
    /// to see the others).
    pub truncated: bool,
}

/// `sandbox_kill`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct KillResult {
    /// The sandbox that is gone.
    pub sandbox_id: String,
    /// Always true.
    pub killed: bool,
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
    /// Destination address (the host loopback for the gateway 10.0.2.2).
    pub addr: String,
    /// Destination port (0 for ICMP).
    pub port: u16,
    /// The DNS name asked or resolved, or the TLS SNI / HTTP Host seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Whether the policy allowed it.
    pub allowed: bool,
    /// The deciding rule: "allow:<entry>", "deny:<entry>",
    /// "blocked-range:<cidr>", "egress:allow", "egress:deny",
    /// "limit:connections", ...
    pub rule: String,
    /// Bytes from the sandbox to the destination.
    pub bytes_out: u64,
    /// Bytes from the destination to the sandbox.
    pub bytes_in: u64,
    /// How long it lasted (ms); absent while open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
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
                addr: r.addr.to_string(),
                port: r.port,
                domain: r.domain,
                allowed: r.allowed,
                rule: r.rule,
                bytes_out: r.bytes_out,
                bytes_in: r.bytes_in,
                duration_ms: r.duration_ms,
            })
            .collect();
        let next_since_ms = if full { records.last().map(|r| r.time_ms) } else { None };
        NetworkLogResult { sandbox_id, records, dropped: log.dropped, next_since_ms }
    }
}

/// `sandbox_exec`'s result. Each stream is cut to [`EXEC_STREAM_BUDGET`]
/// bytes of JSON (after the agent's own 32 KiB cap per stream);
/// `stdout_bytes` and `stderr_bytes` say how much the command wrote.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ExecResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The exit code, if the command exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// Killed at its timeout.
    pub timed_out: bool,
    /// Standard output (invalid UTF-8 replaced), possibly cut.
    pub stdout: String,
    /// Standard error (invalid UTF-8 replaced), possibly cut.
    pub stderr: String,
    /// Bytes the command wrote to stdout in all.
    pub stdout_bytes: u64,
    /// Bytes the command wrote to stderr in all.
    pub stderr_bytes: u64,
    /// Output was cut: past 32 KiB per stream, or to fit the result
    /// budget. Redirect to a file and read it with sandbox_files_read for
    /// all of it.
    pub truncated: bool,
    /// Wall time (ms).
    pub duration_ms: u64,
    /// With background: the process's id, for the sandbox_process_*
    /// tools (e.g. "sb-3:p7").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process_id: Option<String>,
    /// With background: the process as it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessInfo>,
}

/// A Python exception.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PythonError {
    /// Type name, e.g. `ZeroDivisionError`.
    pub name: String,
    /// `str(exception)`, possibly cut.
    pub message: String,
    /// The traceback, possibly cut (its end, the innermost frames, is kept).
    pub traceback: String,
}

/// `sandbox_run_python`'s result. `result` is cut to
/// [`PY_RESULT_BUDGET`] and each stream to [`PY_STREAM_BUDGET`] bytes of
/// JSON.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PythonResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// `repr()` of the final expression's value, if any; possibly cut
    /// (see result_truncated).
    pub result: Option<String>,
    /// `result` was cut to fit the result budget.
    pub result_truncated: bool,
    /// The whole `repr()`'s length (bytes of UTF-8), if there was one.
    pub result_bytes: Option<u64>,
    /// Printed output, possibly cut.
    pub stdout: String,
    /// Standard error, possibly cut.
    pub stderr: String,
    /// Bytes the cell wrote to stdout in all.
    pub stdout_bytes: u64,
    /// Bytes the cell wrote to stderr in all.
    pub stderr_bytes: u64,
    /// stdout or stderr was cut.
    pub truncated: bool,
    /// The exception raised, if any (the state is kept).
    pub error: Option<PythonError>,
    /// Interrupted at its timeout (the state is kept).
    pub timed_out: bool,
}

/// `sandbox_files_read`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ReadResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The path.
    pub path: String,
    /// The text read.
    pub content: String,
    /// Where it started (bytes).
    pub offset: u64,
    /// Bytes of the file in `content`.
    pub bytes: u64,
    /// Where to read on (offset + bytes).
    pub next_offset: u64,
    /// The file's whole size as the sandbox reports it (bytes; 0 for
    /// devices and most /proc files).
    pub size: u64,
    /// Bytes after what was returned, by `size`; read on with
    /// `offset: next_offset`.
    pub remaining: u64,
    /// Fewer bytes than asked for were returned, to fit the result budget
    /// or because the chunk ended inside a character.
    pub truncated: bool,
}

/// `sandbox_download`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DownloadResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The path.
    pub path: String,
    /// The bytes, base64 (RFC 4648 §4).
    pub data_base64: String,
    /// Where they start (bytes).
    pub offset: u64,
    /// How many bytes.
    pub bytes: u64,
    /// Where to download on (offset + bytes).
    pub next_offset: u64,
    /// The file's whole size (bytes).
    pub size: u64,
    /// Bytes after these; download on with `offset: next_offset`.
    pub remaining: u64,
}

/// `sandbox_files_write` and `sandbox_upload`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct WriteResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The path.
    pub path: String,
    /// Bytes written.
    pub bytes_written: u64,
}

/// One directory entry.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Entry {
    /// File name.
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    /// Size (bytes).
    pub size: u64,
    /// Permission bits, octal (e.g. `"644"`).
    pub mode: String,
    /// Modification time, ms since the Unix epoch.
    pub mtime_ms: i64,
}

/// `sandbox_files_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListDirResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// The directory.
    pub path: String,
    /// Its entries, by name; the first ones only if `truncated`.
    pub entries: Vec<Entry>,
    /// How many entries the directory has.
    pub total_entries: u64,
    /// Entries were left out to fit the result budget.
    pub truncated: bool,
}

/// Bytes of JSON each of `sandbox_exec`'s streams may take: 80 KiB.
pub const EXEC_STREAM_BUDGET: usize = 80 << 10;
/// Bytes of JSON `sandbox_run_python`'s `result` may take: 64 KiB.
pub const PY_RESULT_BUDGET: usize = 64 << 10;
/// Bytes of JSON each of `sandbox_run_python`'s streams may take: 32 KiB.
pub const PY_STREAM_BUDGET: usize = 32 << 10;
/// Bytes of JSON a Python traceback may take (its end is kept): 24 KiB.
pub const PY_TRACEBACK_BUDGET: usize = 24 << 10;
/// Bytes of JSON a Python exception's message may take: 8 KiB.
pub const PY_MESSAGE_BUDGET: usize = 8 << 10;
/// Bytes of JSON a Python exception's type name may take.
pub const PY_NAME_BUDGET: usize = 256;

/// `sandbox_diff`'s result: the report, cut to the result budget.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DiffResult {
    /// The report; with `report_truncated`, the first paths of each list
    /// only and unified diffs cut (each cut one ends in a line saying so).
    #[serde(flatten)]
    pub report: DiffReport,
    /// Paths or unified-diff text were left out to fit the result budget.
    /// Compare fewer files, leave out `unified`, or read files directly.
    pub report_truncated: bool,
    /// How many changed paths the report has (added + removed + modified),
    /// listed or not.
    pub total_changes: u64,
}

/// Bytes of JSON one unified diff may take in `sandbox_diff`: 32 KiB.
pub const DIFF_TEXT_BUDGET: usize = 32 << 10;

impl DiffResult {
    /// `report`, cut to fit `max` bytes of JSON: each unified diff to
    /// [`DIFF_TEXT_BUDGET`], then the lists to what fits, in the order
    /// added, removed, modified.
    pub fn new(mut report: DiffReport, max: usize) -> Self {
        let total_changes = (report.added.len() + report.removed.len() + report.modified.len()) as u64;
        let mut cut_any = false;
        for change in report.added.iter_mut().chain(report.removed.iter_mut()).chain(report.modified.iter_mut()) {
            if let Some(text) = change.unified_diff.take() {
                let len = text.len();
                let c = budget::cut(text, DIFF_TEXT_BUDGET);
                cut_any |= c.truncated;
                change.unified_diff = Some(if c.truncated {
                    format!("{}\n[unified diff cut at {} of {len} bytes]\n", c.text, c.text.len())
                } else {
                    c.text
                });
            }
        }
        let fixed = budget::json_len(&DiffResult {
            report: DiffReport { added: vec![], removed: vec![], modified: vec![], ..report.clone() },
            report_truncated: true,
            total_changes,
        });
        let mut room = max.saturating_sub(fixed);
        for list in [&mut report.added, &mut report.removed, &mut report.modified] {
            let dropped = budget::fit_list(list, room);
            cut_any |= dropped > 0;
            room = room.saturating_sub(budget::json_len(list));
        }
        DiffResult { report, report_truncated: cut_any, total_changes }
    }
}

/// An output stream as text (invalid UTF-8 replaced), cut to `max` bytes
/// of JSON; whether it was cut (here or by the agent).
fn stream(o: Output, max: usize) -> (String, bool) {
    let c = budget::cut(String::from_utf8_lossy(&o.data).into_owned(), max);
    (c.text, c.truncated || o.truncated)
}

/// The end of `s` that fits `max` bytes of JSON, after a marker saying
/// what was cut (tracebacks: the innermost frames are at the end).
fn tail(s: String, max: usize) -> String {
    if budget::escaped_len(&s) <= max {
        return s;
    }
    let marker = format!("[{} bytes cut] ...", s.len());
    let room = max.saturating_sub(budget::escaped_len(&marker));
    marker + budget::fit_suffix(&s, room)
}

impl ExecResult {
    /// The result of `sandbox_exec` on `sandbox_id` that answered `r`.
    pub fn new(sandbox_id: String, r: ExecReply) -> Self {
        let (exit_code, signal, timed_out) = match r.status {
            ExitStatus::Code(c) => (Some(c), None, false),
            ExitStatus::Signal(s) => (None, Some(s), false),
            ExitStatus::TimedOut => (None, None, true),
        };
        let (stdout_bytes, stderr_bytes) = (r.stdout.total_bytes, r.stderr.total_bytes);
        let (stdout, out_cut) = stream(r.stdout, EXEC_STREAM_BUDGET);
        let (stderr, err_cut) = stream(r.stderr, EXEC_STREAM_BUDGET);
        ExecResult {
            sandbox_id,
            exit_code,
            signal,
            timed_out,
            stdout,
            stderr,
            stdout_bytes,
            stderr_bytes,
            truncated: out_cut || err_cut,
            duration_ms: r.duration_ms,
            process_id: None,
            process: None,
        }
    }

    /// The result of `sandbox_exec { background: true }`: the process
    /// started; no status or output yet.
    pub fn background(sandbox_id: String, process: ProcessInfo) -> Self {
        ExecResult {
            sandbox_id,
            exit_code: None,
            signal: None,
            timed_out: false,
            stdout: String::new(),
            stderr: String::new(),
            stdout_bytes: 0,
            stderr_bytes: 0,
            truncated: false,
            duration_ms: 0,
            process_id: Some(process.process_id.clone()),
            process: Some(process),
        }
    }
}

impl PythonResult {
    /// The result of `sandbox_run_python` on `sandbox_id` that answered `r`.
    pub fn new(sandbox_id: String, r: PythonReply) -> Self {
        // The guest cuts a repr over its own cap and reports the whole
        // size; the host cuts again to its budget.
        let result_bytes = r.value.as_ref().map(|v| if r.value_truncated { r.value_bytes } else { v.len() as u64 });
        let value = r.value.map(|v| budget::cut(v, PY_RESULT_BUDGET));
        let (stdout_bytes, stderr_bytes) = (r.stdout.total_bytes, r.stderr.total_bytes);
        let (stdout, out_cut) = stream(r.stdout, PY_STREAM_BUDGET);
        let (stderr, err_cut) = stream(r.stderr, PY_STREAM_BUDGET);
        PythonResult {
            sandbox_id,
            result_truncated: r.value_truncated || value.as_ref().is_some_and(|c| c.truncated),
            result: value.map(|c| c.text),
            result_bytes,
            stdout,
            stderr,
            stdout_bytes,
            stderr_bytes,
            truncated: out_cut || err_cut,
            error: r.exception.map(|e| PythonError {
                name: budget::cut(e.name, PY_NAME_BUDGET).text,
                message: budget::cut(e.message, PY_MESSAGE_BUDGET).text,
                traceback: tail(e.traceback, PY_TRACEBACK_BUDGET),
            }),
            timed_out: r.timed_out,
        }
    }
}

impl From<DirEntry> for Entry {
    fn from(e: DirEntry) -> Self {
        Entry {
            name: e.name,
            kind: match e.stat.kind {
                FileKind::File => "file",
                FileKind::Dir => "dir",
                FileKind::Symlink => "symlink",
                FileKind::Other => "other",
            }
            .into(),
            size: e.stat.size,
            mode: format!("{:o}", e.stat.mode & 0o7777),
            mtime_ms: e.stat.mtime_ms,
        }
    }
}

/// `sandbox_process_list`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessListResult {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its background processes (running, and ended ones still in its
    /// table of 32), by id; the first ones only if `truncated`.
    pub processes: Vec<ProcessInfo>,
    /// Processes were left out to fit the result budget.
    pub truncated: bool,
}

/// Bytes of JSON the `data` of one `sandbox_process_output` page may take:
/// 128 KiB.
pub const PROCESS_PAGE_BUDGET: usize = 128 << 10;

/// `sandbox_process_output`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessOutputResult {
    /// The process.
    pub process_id: String,
    /// "stdout" or "stderr".
    pub stream: String,
    /// The output (invalid UTF-8 replaced by U+FFFD).
    pub data: String,
    /// Stream offset of data's first byte.
    pub offset: u64,
    /// Bytes of the stream data covers.
    pub bytes: u64,
    /// Where to read on (offset + bytes).
    pub next_offset: u64,
    /// Bytes the stream produced so far.
    pub total_bytes: u64,
    /// Bytes between the offset asked for and `offset` that had already
    /// fallen out of the buffer (counted, not shown).
    pub skipped_bytes: u64,
    /// Size of the per-stream buffer (bytes): the last this many bytes are
    /// held.
    pub buffer_bytes: u64,
    /// Fewer bytes than read were returned, to fit the result budget or
    /// because the page ended inside a character; read on at next_offset.
    pub truncated: bool,
    /// The process now.
    pub process: ProcessInfo,
}

/// Where a wait's text or pattern appeared.
#[derive(Debug, Serialize, JsonSchema)]
pub struct WaitMatched {
    /// "stdout" or "stderr".
    pub stream: String,
    /// Stream offset of the match.
    pub offset: u64,
    /// The line holding it (at most 4 KiB).
    pub line: String,
}

/// Offsets to search from to find the next occurrence.
#[derive(Debug, Serialize, JsonSchema)]
pub struct WaitResume {
    /// Pass as stdout_offset.
    pub stdout_offset: u64,
    /// Pass as stderr_offset.
    pub stderr_offset: u64,
}

/// `sandbox_process_wait`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessWaitResult {
    /// The process.
    pub process_id: String,
    /// "matched" (the text or pattern appeared), "exited" (the process
    /// ended) or "timeout".
    pub outcome: String,
    /// Where it matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<WaitMatched>,
    /// How long the wait took (ms).
    pub waited_ms: u64,
    /// The last lines of stdout (at most 4 KiB).
    pub stdout_tail: String,
    /// The last lines of stderr (at most 4 KiB).
    pub stderr_tail: String,
    /// Output that fell out of the buffer before it was searched (bytes).
    pub missed_bytes: u64,
    /// Where a next wait for the next occurrence starts.
    pub resume: WaitResume,
    /// The process now.
    pub process: ProcessInfo,
}

/// Bytes of JSON a wait's tail or matched line may take: 4 KiB.
pub const WAIT_TEXT_BUDGET: usize = 4 << 10;

/// The stream's name in results.
pub fn stream_name(s: tine_protocol::StreamKind) -> &'static str {
    match s {
        tine_protocol::StreamKind::Stdout => "stdout",
        tine_protocol::StreamKind::Stderr => "stderr",
    }
}

/// The end of `bytes` as text (invalid UTF-8 replaced) that fits `max`
/// bytes of JSON, starting on a line when one fits.
fn tail_text(bytes: &[u8], max: usize) -> String {
    let s = String::from_utf8_lossy(bytes);
    if budget::escaped_len(&s) <= max {
        return s.into_owned();
    }
    let kept = budget::fit_suffix(&s, max);
    // Start on a whole line when the kept part holds a line break.
    match kept.find('\n') {
        Some(n) if n + 1 < kept.len() => kept[n + 1..].to_string(),
        _ => kept.to_string(),
    }
}

impl ProcessWaitResult {
    /// The result of a wait on `process_id` that answered `r`; it resumes
    /// at the agent's offsets (where its search stopped on each stream).
    pub fn new(process_id: String, r: tine_sandbox::WaitResult) -> Self {
        use tine_protocol::WaitOutcome;
        let outcome = match r.outcome {
            WaitOutcome::Matched => "matched",
            WaitOutcome::Exited => "exited",
            WaitOutcome::TimedOut => "timeout",
        };
        let resume = WaitResume { stdout_offset: r.resume.0, stderr_offset: r.resume.1 };
        let matched = r.found.map(|m| WaitMatched {
            stream: stream_name(m.stream).into(),
            offset: m.offset,
            line: budget::cut(String::from_utf8_lossy(&m.line).into_owned(), WAIT_TEXT_BUDGET).text,
        });
        ProcessWaitResult {
            process_id,
            outcome: outcome.into(),
            matched,
            waited_ms: r.waited_ms,
            stdout_tail: tail_text(&r.stdout_tail, WAIT_TEXT_BUDGET),
            stderr_tail: tail_text(&r.stderr_tail, WAIT_TEXT_BUDGET),
            missed_bytes: r.missed,
            resume,
            process: r.info,
        }
    }
}

/// `sandbox_process_write`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessWriteResult {
    /// The process.
    pub process_id: String,
    /// Bytes written to its stdin (fewer than given when the process
    /// stopped reading for 10 s, or closed stdin).
    pub bytes_written: u64,
    /// Stdin is still open for writes.
    pub stdin_open: bool,
}

/// `sandbox_process_kill`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcessKillResult {
    /// The process.
    pub process_id: String,
    /// The signal sent ("TERM" by default, then KILL after 3 s if needed).
    pub signal: String,
    /// The process after the signal (state, exit_code or signal).
    pub process: ProcessInfo,
}

/// `template_delete`'s result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TemplateDeleteResult {
    /// The template that is gone.
    pub name: String,
    /// Always true.
    pub deleted: bool,
}

#[cfg(test)]
mod tests {
    use tine_protocol::PythonException;
    use tine_sandbox::diff::{Kind, PathChange};

    use super::*;
    use crate::mcp::budget::{json_len, CONTENT_BUDGET};

    fn output(data: Vec<u8>, truncated: bool) -> Output {
        let total_bytes = data.len() as u64 * if truncated { 10 } else { 1 };
        Output { data, truncated, total_bytes }
    }

    #[test]
    fn a_5_mb_repr_and_nul_floods_fit_the_budget() {
        let r = PythonReply {
            value: Some(format!("'{}'", "x".repeat(5_000_000))),
            stdout: output(vec![0; 32 << 10], true),
            stderr: output(vec![b'"'; 32 << 10], true),
            exception: Some(PythonException {
                name: "E".repeat(10_000),
                message: "\0".repeat(100_000),
                traceback: "\u{1}".repeat(100_000) + "innermost",
            }),
            timed_out: false,
            value_truncated: false,
            value_bytes: 0,
            interpreter_start_ms: None,
        };
        let p = PythonResult::new("sb-1".into(), r);
        assert!(json_len(&p) <= CONTENT_BUDGET, "{}", json_len(&p));
        assert!(p.result_truncated && p.truncated);
        assert_eq!(p.result_bytes, Some(5_000_002));
        assert!(p.result.as_ref().unwrap().starts_with("'xxx"));
        assert_eq!(p.stdout_bytes, 10 * (32 << 10));
        let e = p.error.unwrap();
        assert!(e.traceback.starts_with("[100009 bytes cut] ...") && e.traceback.ends_with("innermost"), "{e:?}");

        let small = PythonResult::new(
            "sb-1".into(),
            PythonReply {
                value: Some("42".into()),
                stdout: output(b"hi\n".to_vec(), false),
                stderr: output(vec![], false),
                exception: None,
                timed_out: false,
                value_truncated: false,
                value_bytes: 0,
                interpreter_start_ms: None,
            },
        );
        assert_eq!((small.result.as_deref(), small.result_truncated, small.truncated), (Some("42"), false, false));
        assert_eq!((small.stdout.as_str(), small.stdout_bytes), ("hi\n", 3));
    }

    #[test]
    fn a_repr_the_guest_cut_keeps_its_whole_size() {
        let r = PythonReply {
            value: Some("x".repeat(64 << 10)),
            stdout: output(vec![], false),
            stderr: output(vec![], false),
            exception: None,
            timed_out: false,
            value_truncated: true,
            value_bytes: 5_000_002,
            interpreter_start_ms: None,
        };
        let p = PythonResult::new("sb-1".into(), r);
        assert!(p.result_truncated);
        assert_eq!(p.result_bytes, Some(5_000_002));
    }

    #[test]
    fn exec_streams_of_control_bytes_fit_the_budget() {
        let r = ExecReply {
            status: ExitStatus::Code(0),
            stdout: output(vec![1; 32 << 10], true),
            stderr: output(vec![0xff; 32 << 10], false),
            duration_ms: 1,
        };
        let x = ExecResult::new("sb-1".into(), r);
        assert!(json_len(&x) <= CONTENT_BUDGET, "{}", json_len(&x));
        assert!(x.truncated);
        assert_eq!((x.stdout_bytes, x.stderr_bytes), (10 * (32 << 10), 32 << 10));
        let v = serde_json::to_value(&x).unwrap();
        assert!(v.get("process_id").is_none() && v.get("process").is_none(), "only background execs name a process");
    }

    #[test]
    fn wait_tails_keep_whole_last_lines_within_the_budget() {
        let out: Vec<u8> = (0..2000).flat_map(|i| format!("line {i}\n").into_bytes()).collect();
        let t = tail_text(&out, 100);
        assert!(budget::escaped_len(&t) <= 100, "{t:?}");
        assert!(t.starts_with("line ") && t.ends_with("line 1999\n"), "{t:?}");
        assert_eq!(tail_text(b"short\xff", 100), "short\u{fffd}");
        // One long line: its end, cut on a character boundary.
        let t = tail_text("é".repeat(1000).as_bytes(), 101);
        assert_eq!(t, "é".repeat(50));
    }

    #[test]
    fn a_large_diff_report_is_cut_to_the_budget() {
        let change = |i: usize| PathChange {
            path: format!("/work/file-{i:06}-{}", "\0".repeat(50)),
            kind: Kind::File,
            a: None,
            b: None,
            unified_diff: Some("+\"line\"\n".repeat(20_000)),
        };
        let report = DiffReport {
            a: "sb-1".into(),
            b: "sb-2".into(),
            added: (0..5000).map(change).collect(),
            removed: vec![],
            modified: (0..5000).map(change).collect(),
            truncated: false,
        };
        let d = DiffResult::new(report, CONTENT_BUDGET);
        assert!(json_len(&d) <= CONTENT_BUDGET, "{}", json_len(&d));
        assert!(d.report_truncated);
        assert_eq!(d.total_changes, 10_000);
        let first = d.report.added[0].unified_diff.as_ref().unwrap();
        assert!(first.ends_with(&format!("of {} bytes]\n", 20_000 * 8)), "{}", &first[first.len() - 80..]);
    }
}
