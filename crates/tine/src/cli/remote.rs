//! What the commands that talk to a running server share (`tine sandbox
//! ...`, `tine template ls|rm`): the `--url`, `--token-file` and `--json`
//! flags, an MCP session on a runtime of its own ([`Session`], over
//! [`crate::mcp_client`]), tool calls and their errors ([`RemoteError`],
//! with the exit codes they give), and plain-text tables for people.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use rmcp::model::CallToolRequestParams;
use serde_json::Value;

use crate::mcp_client::{self, Client, Endpoint, McpClientError};

/// How long a command waits for its session's `initialize` answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a command waits for its session's end (`DELETE /mcp`).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// The exit code of a tool error (the server refused or failed the call).
pub(super) const TOOL_ERROR_EXIT: u8 = 2;
/// The exit code after Ctrl-C (128 + SIGINT, as shells give).
pub(super) const INTERRUPTED_EXIT: u8 = 130;

/// The flags of every command that talks to a running server; the same as
/// `tine port-forward`'s, and `--json`.
#[derive(Args, Clone, Debug, Default)]
pub(super) struct RemoteArgs {
    /// The server's URL, with or without /mcp [default: $TINE_URL, else
    /// http://127.0.0.1:5555].
    #[arg(long, global = true)]
    pub url: Option<String>,
    /// A file holding the bearer token (the operator's or a tenant's API
    /// key) [default: $TINE_TOKEN_FILE, else the token in $TINE_TOKEN;
    /// none: no token, as a --dev server takes].
    #[arg(long, global = true)]
    pub token_file: Option<PathBuf>,
    /// Print the tool's structured result as JSON (for scripts) instead
    /// of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

/// Errors of the commands that talk to a server.
#[derive(Debug, thiserror::Error)]
pub(super) enum RemoteError {
    /// The session or a call failed below the tool (connection, HTTP,
    /// protocol).
    #[error("{err}{hint}", err = .0, hint = connect_hint(.0))]
    Client(#[from] McpClientError),
    /// The tool answered with an error (`isError`): its message.
    #[error("{tool}: {message}")]
    Tool {
        /// The tool.
        tool: String,
        /// The server's message (it says what to do next).
        message: String,
    },
    /// The command line asks for something that cannot be done.
    #[error("{0}")]
    Usage(String),
    /// A local file or stream.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file transfer through a signed URL failed.
    #[error("{0}")]
    Transfer(String),
    /// The runtime could not be made.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// What to try when the session could not be made at all.
fn connect_hint(e: &McpClientError) -> &'static str {
    match e {
        McpClientError::Connect { .. } | McpClientError::InitializeTimeout { .. } => {
            " (is a server running there? --url or $TINE_URL names another; a server with a token takes \
             $TINE_TOKEN or --token-file)"
        }
        _ => "",
    }
}

impl RemoteError {
    /// The exit code this error gives: [`TOOL_ERROR_EXIT`] for a tool
    /// error, 1 for the others.
    pub(super) fn exit_code(&self) -> u8 {
        match self {
            RemoteError::Tool { .. } => TOOL_ERROR_EXIT,
            _ => 1,
        }
    }

    /// Prints the error as `tine: error: ...` and returns its exit code.
    pub(super) fn report(&self) -> ExitCode {
        eprintln!("tine: error: {self}");
        ExitCode::from(self.exit_code())
    }
}

/// An MCP session with the server that a command's flags name, on a
/// runtime of its own.
pub(super) struct Session {
    runtime: tokio::runtime::Runtime,
    client: Option<Client>,
    /// For file transfers through signed URLs.
    pub http: reqwest::Client,
}

/// A tool's outcome once the caller stopped waiting: its result, or
/// Ctrl-C (the call was cancelled on the server).
pub(super) enum Outcome {
    /// The tool's structured result.
    Done(Value),
    /// Ctrl-C came first; the server was sent the cancellation.
    Interrupted,
}

impl Session {
    /// Opens a session with the server `args` name.
    ///
    /// Errors: [`RemoteError::Client`] (bad URL or token file, no server,
    /// refused), [`RemoteError::Runtime`].
    pub(super) fn open(args: &RemoteArgs) -> Result<Session, RemoteError> {
        let endpoint = Endpoint::resolve(args.url.clone(), args.token_file.clone())?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(RemoteError::Runtime)?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| RemoteError::Transfer(format!("HTTP client: {e}")))?;
        let client = runtime.block_on(endpoint.connect(http.clone(), CONNECT_TIMEOUT))?;
        Ok(Session { runtime, client: Some(client), http })
    }

    fn client(&self) -> &Client {
        self.client.as_ref().expect("the session is open until dropped")
    }

    /// Runs `f` on the session's runtime.
    pub(super) fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }

    /// Calls `tool` with `args` (a JSON object); its structured result.
    ///
    /// Errors: [`RemoteError::Tool`] for a tool error, [`RemoteError::Client`].
    pub(super) fn call(&self, tool: &str, args: Value) -> Result<Value, RemoteError> {
        match self.call_inner(tool, args, false)? {
            Outcome::Done(v) => Ok(v),
            // Only Ctrl-C interrupts, and this call does not listen for it.
            Outcome::Interrupted => Err(RemoteError::Usage(format!("{tool} was interrupted"))),
        }
    }

    /// As [`Session::call`], but Ctrl-C cancels the call: the server is
    /// sent `notifications/cancelled` (which stops the call's work, e.g.
    /// kills an exec's command) and the outcome is [`Outcome::Interrupted`].
    ///
    /// Errors: as [`Session::call`].
    pub(super) fn call_interruptible(&self, tool: &str, args: Value) -> Result<Outcome, RemoteError> {
        self.call_inner(tool, args, true)
    }

    fn call_inner(&self, tool: &str, args: Value, interruptible: bool) -> Result<Outcome, RemoteError> {
        let Value::Object(args) = args else {
            return Err(RemoteError::Usage(format!("{tool}: the arguments must be a JSON object, not {args}")));
        };
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(args);
        let peer = self.client().peer().clone();
        let r = self.runtime.block_on(async move {
            let cancel = async {
                if !interruptible || tokio::signal::ctrl_c().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            mcp_client::call_tool(&peer, params, cancel).await
        });
        match r {
            Ok(r) => mcp_client::tool_outcome(r)
                .map(Outcome::Done)
                .map_err(|message| RemoteError::Tool { tool: tool.to_owned(), message }),
            Err(McpClientError::Cancelled { .. }) => Ok(Outcome::Interrupted),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Session {
    /// Ends the MCP session (`DELETE /mcp`), waiting at most 5 s.
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            let _ = self.runtime.block_on(async { tokio::time::timeout(CLOSE_TIMEOUT, client.cancel()).await });
        }
    }
}

/// Prints `v` as pretty JSON on stdout.
pub(super) fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
}

/// `rows` under `headers` in columns two spaces apart, each as wide as its
/// widest cell (in characters); the last column is not padded. Every line
/// ends with a newline.
pub(super) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let last = cells.len().saturating_sub(1);
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            l.push_str(cell);
            if i < last {
                let pad = widths.get(i).copied().unwrap_or(0).saturating_sub(cell.chars().count()) + 2;
                l.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(headers.to_vec(), &mut out);
    for row in rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

pub(super) use tine_sandbox::progress::human_bytes;

/// `ms` for people: `850ms`, `12s`, `3m12s`, `2h05m`, `3d04h`.
pub(super) fn human_duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms}ms"),
        1..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// `ms` since the Unix epoch as UTC `YYYY-MM-DD HH:MM:SS`.
pub(super) fn utc_time(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// `KEY=VALUE` pairs as a JSON object (for labels and env).
///
/// Errors: [`RemoteError::Usage`] for a pair without `=` or with an empty
/// key.
pub(super) fn pairs(flag: &str, given: &[String]) -> Result<serde_json::Map<String, Value>, RemoteError> {
    let mut map = serde_json::Map::new();
    for p in given {
        match p.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                map.insert(k.to_owned(), Value::from(v));
            }
            _ => return Err(RemoteError::Usage(format!("--{flag} {p:?}: give KEY=VALUE"))),
        }
    }
    Ok(map)
}

/// A string field of `v`, or `""`.
pub(super) fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// An unsigned field of `v`, or 0.
pub(super) fn number(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns_and_leave_the_last_unpadded() {
        let rows = vec![
            vec!["sb-h1-1".to_string(), "running".to_string(), "a=b".to_string()],
            vec!["sb-h1-22222".to_string(), "paused".to_string(), String::new()],
        ];
        let t = table(&["ID", "STATE", "LABELS"], &rows);
        assert_eq!(t, "ID           STATE    LABELS\nsb-h1-1      running  a=b\nsb-h1-22222  paused\n");
        // No rows: the header alone; wide characters count once.
        assert_eq!(table(&["NAME"], &[]), "NAME\n");
        let t = table(&["A", "B"], &[vec!["é".into(), "x".into()]]);
        assert_eq!(t, "A  B\né  x\n");
    }

    #[test]
    fn sizes_durations_and_times_read_as_people_write_them() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(10 << 30), "10.0 GiB");
        assert_eq!(human_duration(850), "850ms");
        assert_eq!(human_duration(12_400), "12s");
        assert_eq!(human_duration(192_000), "3m12s");
        assert_eq!(human_duration(7_500_000), "2h05m");
        assert_eq!(human_duration(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
        assert_eq!(utc_time(0), "1970-01-01 00:00:00");
        assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(utc_time(1_764_620_845_123), "2025-12-01 20:27:25");
    }

    #[test]
    fn pairs_need_a_key_and_an_equals_sign() {
        let m = pairs("label", &["a=b".into(), "c=".into(), "d=e=f".into()]).unwrap();
        assert_eq!(Value::Object(m), serde_json::json!({"a": "b", "c": "", "d": "e=f"}));
        assert!(pairs("env", &["novalue".into()]).unwrap_err().to_string().contains("--env \"novalue\""));
        assert!(pairs("env", &["=v".into()]).is_err());
    }
}
