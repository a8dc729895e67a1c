//! The tools' parameter types (their JSON Schemas are the tools'
//! `inputSchema`), and the checks on parameters that need no sandbox.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

use super::errors::ToolError;

/// `sandbox_create`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct CreateParams {
    /// vCPUs (default 1).
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (default 512).
    pub memory_mib: Option<u64>,
    /// Labels to find the sandbox by later (`sandbox_list`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Kill the sandbox after this many seconds without a tool call on it
    /// (default 900).
    pub idle_timeout_secs: Option<u64>,
    /// Start from this template (see template_list) instead of the default
    /// one: its memory, processes, files and Python state. vcpus and
    /// memory_mib come from the template.
    pub template: Option<String>,
    /// Outbound network policy (default: the server's, usually public
    /// internet; see sandbox_info.network).
    pub network: Option<NetworkParams>,
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
    pub allow: Vec<String>,
    /// Refused destinations, same syntax; a deny beats an allow.
    #[serde(default)]
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
    pub sandbox_id: Option<String>,
    /// A new outbound network policy; connections opened from now on
    /// follow it.
    pub network: Option<NetworkParams>,
}

/// `sandbox_network_log`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct NetworkLogParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Only records that started at or after this time (ms since the Unix
    /// epoch; default 0).
    pub since_ms: Option<u64>,
    /// At most this many records, oldest first (default and maximum 200).
    pub limit: Option<usize>,
}

/// `sandbox_snapshot`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct SnapshotParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// The new template's name: 1-63 lowercase letters, digits, '-' or '_'.
    pub name: String,
}

/// `sandbox_branch`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct BranchParams {
    /// The sandbox to branch (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// How many children (at least 1; at most the live-sandbox limit minus
    /// the live sandboxes).
    pub n: usize,
}

/// `sandbox_diff`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct DiffParams {
    /// One sandbox ("before").
    pub a: String,
    /// The other ("after").
    pub b: String,
    /// Also return a unified diff of each changed text file up to
    /// max_text_bytes (default false).
    #[serde(default)]
    pub unified: bool,
    /// Largest file (bytes) that gets a unified diff (default 65536).
    pub max_text_bytes: Option<u64>,
}

/// `sandbox_merge_into`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct MergeParams {
    /// The sandbox whose state wins: a sandbox branched (directly or not)
    /// from parent. Its id ceases to exist.
    pub winner: String,
    /// The sandbox that takes the winner's state and keeps its own id.
    pub parent: String,
}

/// Tools that only need the sandbox.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct SandboxParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
}

/// `sandbox_list`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ListParams {
    /// Only sandboxes that carry all of these labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// `sandbox_exec`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ExecParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// A bash script, run as `bash -c` in its own process group.
    pub command: String,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Text fed to stdin.
    pub stdin: Option<String>,
    /// Kill the command (and its children) after this many seconds
    /// (default 60, at most 600).
    pub timeout_secs: Option<u32>,
}

/// `sandbox_run_python`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PythonParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Python code; variables, imports and definitions persist between
    /// calls; the value of a final expression is returned.
    pub code: String,
    /// Interrupt the code after this many seconds; the interpreter's state
    /// is kept (default 60, at most 600).
    pub timeout_secs: Option<u32>,
}

/// `sandbox_files_read` and `sandbox_download`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReadParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox.
    pub path: String,
    /// Byte offset to start at (default 0).
    #[serde(default)]
    pub offset: u64,
    /// Bytes to read (default: to the end, up to the tool's limit).
    pub length: Option<u64>,
}

/// `sandbox_files_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct WriteParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    pub path: String,
    /// The text to write (UTF-8).
    pub content: String,
    /// Append instead of replacing.
    #[serde(default)]
    pub append: bool,
    /// Permission bits for a new file, e.g. 493 (0o755); default 420 (0o644).
    pub mode: Option<u32>,
}

/// `sandbox_upload`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct UploadParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path in the sandbox; missing parent directories are made.
    pub path: String,
    /// The bytes, base64 (RFC 4648 §4, with padding); at most 8 MiB decoded.
    pub data_base64: String,
    /// Permission bits for a new file (default 0o644).
    pub mode: Option<u32>,
}

/// `sandbox_files_list`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListDirParams {
    /// The sandbox (default: this session's own sandbox).
    pub sandbox_id: Option<String>,
    /// Absolute path of a directory (default `/`).
    pub path: Option<String>,
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
}

/// `template_delete`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct TemplateDeleteParams {
    /// The template to delete (not `default` or `tine-*`: the server's own).
    pub name: String,
}
