//! The tools' parameter types (their JSON Schemas are the tools'
//! `inputSchema`), and the checks on parameters that need no sandbox.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

use super::bounds::{
    string_map, MAX_ARGV_WORDS, MAX_CODE_CHARS, MAX_COMMAND_CHARS, MAX_ENV_NAME_CHARS, MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS, MAX_ID_CHARS, MAX_MODE, MAX_NAME_CHARS, MAX_OFFSET, MAX_PATH_CHARS, MAX_PATTERN_CHARS,
    MAX_POLICY_ENTRY_CHARS, MAX_POLICY_RULES, MAX_PROCESS_WRITE_CHARS, MAX_SIGNAL_CHARS, MAX_TEXT_CHARS,
    MAX_TIMEOUT_SECS, NAME_PATTERN,
};
use super::bounds::{
    DEFAULT_MAX_IDLE_SECS, DEFAULT_MAX_LABELS, DEFAULT_MAX_MEMORY_MIB, DEFAULT_MAX_SANDBOXES, DEFAULT_MAX_VCPUS,
    MIN_MEMORY_MIB,
};
use super::errors::ToolError;

/// Schema of a labels map: keys of 64 and values of 256 characters; the
/// count is `[limits] max_labels` ([`super::bounds::apply_limits`]).
fn labels_map(schema: &mut schemars::Schema) {
    const KEY: u64 = tine_sandbox::MAX_LABEL_KEY as u64;
    const VALUE: u64 = tine_sandbox::MAX_LABEL_VALUE as u64;
    string_map::<DEFAULT_MAX_LABELS, KEY, VALUE>(schema);
}

/// Schema of an environment map (the whole is checked again in bytes by
/// the manager and the agent).
fn env_map(schema: &mut schemars::Schema) {
    string_map::<MAX_ENV_VARS, MAX_ENV_NAME_CHARS, MAX_ENV_VALUE_CHARS>(schema);
}

/// Schema of a recipe's files, path -> content (the contents' total is
/// checked in bytes by the manager).
fn files_map(schema: &mut schemars::Schema) {
    string_map::<{ tine_sandbox::MAX_FILES as u64 }, MAX_PATH_CHARS, MAX_TEXT_CHARS>(schema);
}

/// `sandbox_create`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct CreateParams {
    /// vCPUs (default 1).
    #[schemars(range(min = 1, max = DEFAULT_MAX_VCPUS))]
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (default 512).
    #[schemars(range(min = MIN_MEMORY_MIB, max = DEFAULT_MAX_MEMORY_MIB))]
    pub memory_mib: Option<u64>,
    /// Labels to find the sandbox by later (`sandbox_list`).
    #[serde(default)]
    #[schemars(transform = labels_map)]
    pub labels: BTreeMap<String, String>,
    /// Kill the sandbox after this many seconds without a tool call on it
    /// (default 900).
    #[schemars(range(min = 1, max = DEFAULT_MAX_IDLE_SECS))]
    pub idle_timeout_secs: Option<u64>,
    /// Start from this template (see template_list) instead of the default
    /// one: its memory, processes, files and Python state. vcpus and
    /// memory_mib come from the template.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub template: Option<String>,
    /// Outbound network policy (default: the server's, usually public
    /// internet; see sandbox_info.network).
    pub network: Option<NetworkParams>,
    /// Environment variables for the whole sandbox: every exec, background
    /// process and Python cell gets them (a call's own env wins). Names of
    /// letters, digits and '_'; at most 256 variables, 64 KiB in all.
    #[serde(default)]
    #[schemars(transform = env_map)]
    pub env: BTreeMap<String, String>,
}

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

/// `sandbox_update`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct UpdateParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// A new outbound network policy; connections opened from now on
    /// follow it.
    pub network: Option<NetworkParams>,
    /// New environment variables for the whole sandbox, replacing the old
    /// ones ({} clears them); later execs, processes and Python cells get
    /// them, running processes keep theirs.
    #[schemars(transform = env_map)]
    pub env: Option<BTreeMap<String, String>>,
    /// New labels, replacing the old ones.
    #[schemars(transform = labels_map)]
    pub labels: Option<BTreeMap<String, String>>,
    /// A new idle timeout (seconds); the time already idle counts.
    #[schemars(range(min = 1, max = DEFAULT_MAX_IDLE_SECS))]
    pub idle_timeout_secs: Option<u64>,
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
    #[schemars(range(min = 1, max = super::results::NETWORK_LOG_MAX))]
    pub limit: Option<usize>,
}

/// `sandbox_snapshot`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct SnapshotParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// The new template's name: 1-63 lowercase letters, digits, '-' or '_'.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
}

/// `sandbox_branch`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct BranchParams {
    /// The sandbox to branch (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// How many children (at least 1; at most the live-sandbox limit minus
    /// the live sandboxes).
    #[schemars(range(min = 1, max = DEFAULT_MAX_SANDBOXES))]
    pub n: usize,
}

/// `sandbox_diff`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct DiffParams {
    /// One sandbox ("before").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub a: String,
    /// The other ("after").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub b: String,
    /// Also return a unified diff of each changed text file up to
    /// max_text_bytes (default false).
    #[serde(default)]
    pub unified: bool,
    /// Largest file (bytes) that gets a unified diff (default 65536, at
    /// most 8388607).
    #[schemars(range(min = 1, max = tine_protocol::MAX_FILE_CHUNK - 1))]
    pub max_text_bytes: Option<u64>,
}

/// `sandbox_merge_into`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct MergeParams {
    /// The sandbox whose state wins: a sandbox branched (directly or not)
    /// from parent. Its id ceases to exist.
    #[schemars(length(max = MAX_ID_CHARS))]
    pub winner: String,
    /// The sandbox that takes the winner's state and keeps its own id.
    #[schemars(length(max = MAX_ID_CHARS))]
    pub parent: String,
}

/// Tools that only need the sandbox.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct SandboxParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
}

/// `sandbox_pause`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct PauseParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Hibernate: write the sandbox's memory and state to disk and free
    /// its VM (state `hibernated`); it survives a server restart, and the
    /// next call that needs it resumes it (about as long as a create).
    #[serde(default)]
    pub to_disk: bool,
}

/// `sandbox_list`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ListParams {
    /// Only sandboxes that carry all of these labels.
    #[serde(default)]
    #[schemars(transform = labels_map)]
    pub labels: BTreeMap<String, String>,
}

/// `sandbox_exec`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ExecParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// A bash script, run as `bash -c` in its own process group. Give
    /// this or argv.
    #[schemars(length(max = MAX_COMMAND_CHARS))]
    pub command: Option<String>,
    /// A program and its arguments, run without a shell (no bash start-up,
    /// no quoting), e.g. ["python3", "-c", "print(1)"]; the program is
    /// looked up in PATH. Give this or command.
    #[schemars(length(min = 1, max = MAX_ARGV_WORDS), inner(length(max = MAX_COMMAND_CHARS)))]
    pub argv: Option<Vec<String>>,
    /// Working directory (default `/`).
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    #[schemars(transform = env_map)]
    pub env: BTreeMap<String, String>,
    /// Text fed to stdin (at most 8 MiB). With background, the first input
    /// (at most 64 KiB); stdin then stays open for sandbox_process_write.
    #[schemars(length(max = MAX_TEXT_CHARS))]
    pub stdin: Option<String>,
    /// Kill the command (and its children) after this many seconds
    /// (default 60, at most 600). Not with background.
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
    /// Run in the background: return at once with a process_id, and
    /// follow it with the sandbox_process_* tools (default false).
    #[serde(default)]
    pub background: bool,
}

impl ExecParams {
    /// The bash script or the argv to run: exactly one of `command` and
    /// `argv` (`argv` not empty, at most [`MAX_ARGV_WORDS`] words).
    ///
    /// Errors: [`ToolError::ExecCommand`] saying which rule was broken.
    pub fn command_or_argv(&mut self) -> Result<(String, Vec<String>), ToolError> {
        match (self.command.take(), self.argv.take()) {
            (Some(c), None) => Ok((c, Vec::new())),
            (None, Some(a)) if a.is_empty() => Err(ToolError::ExecCommand("argv is empty; give the program first")),
            (None, Some(a)) if a.len() as u64 > MAX_ARGV_WORDS => {
                Err(ToolError::ExecCommand("argv has more than 4096 words; pass long input on stdin"))
            }
            (None, Some(a)) => Ok((String::new(), a)),
            (Some(_), Some(_)) => Err(ToolError::ExecCommand(
                "give command (a bash script) or argv (a program and its arguments), not both",
            )),
            (None, None) => Err(ToolError::ExecCommand(
                "give command (a bash script, e.g. \"ls -l\") or argv (e.g. [\"ls\", \"-l\"])",
            )),
        }
    }
}

/// The language of `sandbox_run_code`.
#[derive(Clone, Copy, Debug, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CodeLanguage {
    /// The persistent Python 3 interpreter (as sandbox_run_python).
    Python,
    /// The persistent Node.js interpreter.
    Javascript,
}

/// `sandbox_run_code`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunCodeParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// "python" or "javascript".
    pub language: CodeLanguage,
    /// The code; variables and definitions persist between calls of the
    /// same language; the value of a final expression is returned.
    #[schemars(length(max = MAX_CODE_CHARS))]
    pub code: String,
    /// Interrupt the code after this many seconds; the interpreter's state
    /// is kept (default 60, at most 600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
}

/// `sandbox_run_python`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PythonParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Python code; variables, imports and definitions persist between
    /// calls; the value of a final expression is returned.
    #[schemars(length(max = MAX_CODE_CHARS))]
    pub code: String,
    /// Interrupt the code after this many seconds; the interpreter's state
    /// is kept (default 60, at most 600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
}

/// `sandbox_files_read` and `sandbox_download`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReadParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// Byte offset to start at (default 0).
    #[serde(default)]
    #[schemars(range(max = MAX_OFFSET))]
    pub offset: u64,
    /// Bytes to read (default: to the end, up to the tool's limit).
    #[schemars(range(max = MAX_OFFSET))]
    pub length: Option<u64>,
}

/// `sandbox_files_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct WriteParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// The text to write (UTF-8, at most 8 MiB).
    #[schemars(length(max = MAX_TEXT_CHARS))]
    pub content: String,
    /// Append instead of replacing.
    #[serde(default)]
    pub append: bool,
    /// Permission bits for a new file, e.g. 493 (0o755); default 420 (0o644).
    #[schemars(range(max = MAX_MODE))]
    pub mode: Option<u32>,
}

/// `sandbox_upload`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct UploadParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: String,
    /// The bytes, base64 (RFC 4648 §4, with padding); at most 8 MiB decoded.
    #[schemars(length(max = super::bounds::MAX_BASE64_CHARS))]
    pub data_base64: String,
    /// Permission bits for a new file (default 0o644).
    #[schemars(range(max = MAX_MODE))]
    pub mode: Option<u32>,
}

/// `sandbox_files_list`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListDirParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
    /// Absolute path of a directory (default `/`).
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub path: Option<String>,
}

/// Default `max_bytes` of `sandbox_process_output`: 64 KiB.
pub const DEFAULT_PAGE_BYTES: u32 = 64 << 10;
/// Default `timeout_secs` of `sandbox_process_wait`: 30 s.
pub const DEFAULT_WAIT_SECS: u32 = 30;

/// A background process's output stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StreamParam {
    /// Standard output.
    #[default]
    Stdout,
    /// Standard error.
    Stderr,
}

impl StreamParam {
    /// The agent's name for it.
    pub fn kind(self) -> tine_protocol::StreamKind {
        match self {
            StreamParam::Stdout => tine_protocol::StreamKind::Stdout,
            StreamParam::Stderr => tine_protocol::StreamKind::Stderr,
        }
    }
}

/// Which streams a wait searches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StreamsParam {
    /// Standard output only.
    Stdout,
    /// Standard error only.
    Stderr,
    /// Both (default).
    #[default]
    Both,
}

impl StreamsParam {
    /// The agent's name for it.
    pub fn set(self) -> tine_protocol::StreamSet {
        match self {
            StreamsParam::Stdout => tine_protocol::StreamSet::Stdout,
            StreamsParam::Stderr => tine_protocol::StreamSet::Stderr,
            StreamsParam::Both => tine_protocol::StreamSet::Both,
        }
    }
}

/// `sandbox_process_list`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ProcessListParams {
    /// The sandbox (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub sandbox_id: Option<String>,
}

/// `sandbox_process_output`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessOutputParams {
    /// The process, as sandbox_exec { background: true } returned it
    /// (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// "stdout" (default) or "stderr".
    #[serde(default)]
    pub stream: StreamParam,
    /// Stream offset to read from (bytes since the process started;
    /// default: the oldest byte still held). Page on with next_offset.
    #[schemars(range(max = MAX_OFFSET))]
    pub offset: Option<u64>,
    /// Most bytes to read (default 65536, at most 262144); fewer come back
    /// when their JSON text would not fit the result budget.
    #[schemars(range(min = 1, max = tine_protocol::MAX_PROCESS_CHUNK))]
    pub max_bytes: Option<u32>,
}

/// `sandbox_process_wait`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessWaitParams {
    /// The process (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// Give up after this many seconds (default 30, 1..=600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub timeout_secs: Option<u32>,
    /// Return when this text appears in the output (may span lines; at
    /// most 1024 bytes).
    #[schemars(length(min = 1, max = MAX_PATTERN_CHARS))]
    pub until_text: Option<String>,
    /// Return when a line matches this regular expression (Rust regex
    /// syntax, matched per line without its newline, and against the
    /// unfinished last line; at most 1024 bytes). Not with until_text.
    #[schemars(length(min = 1, max = MAX_PATTERN_CHARS))]
    pub until_regex: Option<String>,
    /// Which output to search: "stdout", "stderr" or "both" (default).
    #[serde(default)]
    pub stream: StreamsParam,
    /// Search stdout from this offset (default: all output still held,
    /// so a line printed before the call matches). Pass resume.stdout_offset
    /// of an earlier wait to find the next occurrence.
    #[schemars(range(max = MAX_OFFSET))]
    pub stdout_offset: Option<u64>,
    /// Search stderr from this offset, as stdout_offset.
    #[schemars(range(max = MAX_OFFSET))]
    pub stderr_offset: Option<u64>,
}

/// `sandbox_process_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessWriteParams {
    /// The process (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// Text to write to its stdin (at most 1 MiB); include the newline a
    /// line-reading program waits for.
    #[serde(default)]
    #[schemars(length(max = MAX_PROCESS_WRITE_CHARS))]
    pub data: String,
    /// Close stdin after writing: the process reads end of file (default
    /// false).
    #[serde(default)]
    pub close_stdin: bool,
}

/// A signal: a name ("TERM", "SIGKILL", ...) or a number (1..=64).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SignalParam {
    /// A number, 1..=64.
    Number(#[schemars(range(min = 1, max = 64))] i64),
    /// A name, with or without "SIG": TERM, KILL, INT, HUP, QUIT, USR1,
    /// USR2, STOP, CONT.
    Name(#[schemars(length(min = 1, max = MAX_SIGNAL_CHARS))] String),
}

/// Signals by name (Linux numbering).
const SIGNALS: [(&str, i32); 9] = [
    ("TERM", libc::SIGTERM),
    ("KILL", libc::SIGKILL),
    ("INT", libc::SIGINT),
    ("HUP", libc::SIGHUP),
    ("QUIT", libc::SIGQUIT),
    ("USR1", libc::SIGUSR1),
    ("USR2", libc::SIGUSR2),
    ("STOP", libc::SIGSTOP),
    ("CONT", libc::SIGCONT),
];

impl SignalParam {
    /// The signal to send (`None`: TERM, then KILL after 3 s if the
    /// process group lives on) and its name for the result.
    ///
    /// Errors: [`ToolError::Signal`] for an unknown name or a number
    /// outside 1..=64.
    pub fn resolve(p: Option<&SignalParam>) -> Result<(Option<i32>, String), ToolError> {
        let bad = || {
            ToolError::Signal(match p {
                Some(SignalParam::Number(n)) => n.to_string(),
                Some(SignalParam::Name(s)) => s.clone(),
                None => String::new(),
            })
        };
        match p {
            None => Ok((None, "TERM".into())),
            Some(SignalParam::Number(n)) => {
                let n = i32::try_from(*n).ok().filter(|n| (1..=64).contains(n)).ok_or_else(bad)?;
                let name =
                    SIGNALS.iter().find(|(_, s)| *s == n).map_or_else(|| n.to_string(), |(name, _)| (*name).into());
                // TERM, however it is named, is the default: escalated.
                Ok(((name != "TERM").then_some(n), name))
            }
            Some(SignalParam::Name(s)) => {
                let t = s.trim().to_ascii_uppercase();
                if let Ok(n) = t.parse::<i64>() {
                    return SignalParam::resolve(Some(&SignalParam::Number(n))).map_err(|_| bad());
                }
                let name = t.strip_prefix("SIG").unwrap_or(&t);
                let (name, n) = SIGNALS.iter().find(|(n, _)| *n == name).ok_or_else(bad)?;
                Ok(((*name != "TERM").then_some(*n), (*name).into()))
            }
        }
    }
}

/// `sandbox_process_kill`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProcessKillParams {
    /// The process (e.g. "sb-3:p7").
    #[schemars(length(max = MAX_ID_CHARS))]
    pub process_id: String,
    /// Signal for the whole process group and the process's descendants:
    /// "TERM" (default: TERM, then KILL after 3 s for what is left),
    /// "KILL", "INT", "HUP", "QUIT", "USR1", "USR2", "STOP", "CONT", or a
    /// number 1..=64 (sent once).
    pub signal: Option<SignalParam>,
}

/// A tool's `timeout_secs` as the agent's milliseconds (0: its default).
///
/// Errors: [`ToolError::Timeout`] outside 1..=600 s.
pub fn secs_to_ms(secs: Option<u32>) -> Result<u32, ToolError> {
    let max = tine_protocol::MAX_TIMEOUT_MS / 1000;
    match secs {
        None => Ok(0),
        Some(s) if (1..=max).contains(&s) => Ok(s * 1000),
        Some(s) => Err(ToolError::Timeout { got: s, max }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_checked_in_seconds() {
        let secs_to_ms = |s| secs_to_ms(s).map_err(|e| e.to_string());
        assert_eq!(secs_to_ms(None), Ok(0));
        assert_eq!(secs_to_ms(Some(2)), Ok(2000));
        assert_eq!(secs_to_ms(Some(600)), Ok(600_000));
        assert_eq!(secs_to_ms(Some(0)), Err("timeout_secs must be 1..=600, got 0".into()));
        assert!(secs_to_ms(Some(601)).is_err());
        assert!(secs_to_ms(Some(u32::MAX)).is_err());
    }

    #[test]
    fn signals_resolve_by_name_or_number() {
        let r = |v: serde_json::Value| {
            let p: Option<SignalParam> = serde_json::from_value(v).unwrap();
            SignalParam::resolve(p.as_ref()).map_err(|e| e.to_string())
        };
        assert_eq!(r(serde_json::Value::Null), Ok((None, "TERM".into())), "default: TERM, then KILL");
        assert_eq!(r("TERM".into()), Ok((None, "TERM".into())));
        assert_eq!(r("sigkill".into()), Ok((Some(9), "KILL".into())));
        assert_eq!(r("INT".into()), Ok((Some(2), "INT".into())));
        assert_eq!(r(9.into()), Ok((Some(9), "KILL".into())));
        assert_eq!(r("15".into()), Ok((None, "TERM".into())), "TERM by number escalates too");
        assert_eq!(r(15.into()), Ok((None, "TERM".into())));
        assert_eq!(r(40.into()), Ok((Some(40), "40".into())));
        for bad in [serde_json::json!(0), serde_json::json!(65), serde_json::json!(-9), serde_json::json!("BOOM")] {
            assert!(r(bad.clone()).unwrap_err().contains("signal"), "{bad}");
        }
    }
}

/// `template_create`: a recipe (see README "Templates from a recipe").
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateCreateParams {
    /// The new template's name: 1-63 lowercase letters, digits, '-' or '_'
    /// (not "default" nor "tine-*"); an existing one is replaced when the
    /// build succeeds.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
    /// The template to start from (default: "default").
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub from: Option<String>,
    /// vCPUs (default: from's).
    #[schemars(range(min = 1, max = DEFAULT_MAX_VCPUS))]
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (default: from's).
    #[schemars(range(min = MIN_MEMORY_MIB, max = DEFAULT_MAX_MEMORY_MIB))]
    pub memory_mib: Option<u64>,
    /// Environment variables of the template's sandboxes (and of the setup
    /// commands).
    #[serde(default)]
    #[schemars(transform = env_map)]
    pub env: BTreeMap<String, String>,
    /// Files written before the setup: absolute path -> UTF-8 content (at
    /// most 256 files, 8 MiB in all).
    #[serde(default)]
    #[schemars(transform = files_map)]
    pub files: BTreeMap<String, String>,
    /// Bash commands run in order (at most 64); the first that fails or
    /// times out stops the build (reported with its output).
    #[serde(default)]
    #[schemars(length(max = tine_sandbox::MAX_STEPS), inner(length(max = MAX_COMMAND_CHARS)))]
    pub setup: Vec<String>,
    /// Deadline of each setup command (seconds; default 600, at most 600).
    #[schemars(range(min = 1, max = MAX_TIMEOUT_SECS))]
    pub step_timeout_secs: Option<u32>,
    /// Wait up to this many seconds for the build (reporting progress when
    /// the request has a progressToken); default 0: return at once with
    /// state "building" and follow it with template_list. At most 600.
    #[schemars(range(max = super::MAX_TEMPLATE_WAIT_SECS))]
    pub wait_secs: Option<u64>,
}

/// `template_delete`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct TemplateDeleteParams {
    /// The template to delete (not `default` or `tine-*`: the server's own).
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: String,
}
