//! `/mcp/superserve`: Superserve's 19 MCP tools (`superserve-ai/superserve`,
//! `packages/mcp`, `@superserve/mcp` 0.1.3): sandboxes by explicit
//! `sandbox_id`; results' structured content has Superserve's fields
//! (its mixed casing kept: `previewAccess`, `memoryMib` beside
//! `vcpu_count`), the text block a short summary. `metadata` is Tine's
//! labels, `timeout_seconds` the idle timeout, `from_template` and
//! `from_snapshot` a template, `allow_out`/`deny_out` the network policy,
//! secrets Tine's secrets, preview URLs Tine's.

use std::io::{Read, Write};

use base64::Engine;
use rmcp::model::Tool;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{field, parse, tool, Answer, NativeCall, Seed, SeedError, Step};

/// The endpoint.
pub struct Superserve;

/// Where Superserve's guests work: its agent runs every command without a
/// `cwd` in `/home/user`, with `HOME` there (its `boxd`), and its docs'
/// examples rely on it (`python script.py`).
pub const HOME: &str = "/home/user";

/// Superserve's own templates as a native template: its base, Python and
/// Node.js ones are the default template (Python 3 and Node.js), `None`;
/// another of its names (`superserve/code-interpreter`, ...) is refused;
/// any other name is a Tine template's.
///
/// Errors: [`SeedError::Unsupported`] for a Superserve template Tine has no
/// counterpart of.
fn template_of(tool: &str, template: Option<String>) -> Result<Option<String>, SeedError> {
    match template.as_deref() {
        None | Some("superserve/base" | "superserve/python-3.11" | "superserve/node-22") => Ok(None),
        Some(t) if t.starts_with("superserve/") => Err(SeedError::Unsupported {
            tool: tool.to_string(),
            why: format!(
                "template {t} is not here: leave from_template out for Python 3 and Node.js, or build one with \
                 sandbox_template_create"
            ),
        }),
        Some(_) => Ok(template),
    }
}

/// A string map (`metadata`, `env_vars`, `secrets`).
type StrMap = std::collections::BTreeMap<String, String>;

/// `sandbox_create`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct Create {
    /// A name (1-63 lowercase letters, digits, '-', '_'; default: none).
    #[schemars(length(max = 63))]
    pub name: Option<String>,
    /// The template to start from (default: the default template).
    #[schemars(length(max = 63))]
    pub from_template: Option<String>,
    /// A snapshot (a Tine template made by sandbox_snapshot on /mcp).
    #[schemars(length(max = 63))]
    pub from_snapshot: Option<String>,
    /// Idle seconds before the sandbox is hibernated.
    #[schemars(range(min = 1, max = 604800))]
    pub timeout_seconds: Option<u64>,
    /// Not supported here (the idle timeout applies); refused when set.
    #[schemars(range(max = 2592000))]
    pub auto_delete_seconds: Option<u64>,
    /// Key-value metadata (Tine labels: keys of letters, digits, '.', '_', '/', '-').
    #[serde(default)]
    #[schemars(extend("maxProperties" = 64, "propertyNames" = {"maxLength": 64}), inner(length(max = 256)))]
    pub metadata: StrMap,
    /// Environment variables.
    #[serde(default)]
    #[schemars(extend("maxProperties" = 256, "propertyNames" = {"maxLength": 256}), inner(length(max = 32768)))]
    pub env_vars: StrMap,
    /// Secrets: environment variable -> secret name (see secret_list).
    #[serde(default)]
    #[schemars(extend("maxProperties" = 64, "propertyNames" = {"maxLength": 256}), inner(length(max = 63)))]
    pub secrets: StrMap,
    /// Domains or CIDRs it may reach even when deny_out covers them.
    #[serde(default)]
    #[schemars(length(max = 256), inner(length(max = 253)))]
    pub allow_out: Vec<String>,
    /// CIDRs or domains it may not reach ("0.0.0.0/0": all but allow_out).
    #[serde(default)]
    #[schemars(length(max = 256), inner(length(max = 253)))]
    pub deny_out: Vec<String>,
    /// "public" (default) or "private": what sandbox_preview_url makes.
    #[schemars(length(max = 16))]
    pub preview_access: Option<String>,
}

/// `sandbox_update`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Update {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// New metadata (replaces the old).
    #[schemars(extend("maxProperties" = 64, "propertyNames" = {"maxLength": 64}), inner(length(max = 256)))]
    pub metadata: Option<StrMap>,
    /// New allow_out (with deny_out: the network policy from now on).
    #[schemars(length(max = 256), inner(length(max = 253)))]
    pub allow_out: Option<Vec<String>>,
    /// New deny_out.
    #[schemars(length(max = 256), inner(length(max = 253)))]
    pub deny_out: Option<Vec<String>>,
    /// Not supported here; refused when set to a number.
    #[schemars(range(max = 2592000))]
    pub auto_delete_seconds: Option<u64>,
    /// A new idle timeout (seconds).
    #[schemars(range(min = 1, max = 604800))]
    pub timeout_seconds: Option<u64>,
    /// Ignored (preview URLs are made public).
    #[schemars(length(max = 16))]
    pub preview_access: Option<String>,
}

/// `sandbox_list`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct List {
    /// Only sandboxes with all of this metadata.
    #[serde(default)]
    #[schemars(extend("maxProperties" = 64, "propertyNames" = {"maxLength": 64}), inner(length(max = 256)))]
    pub metadata: StrMap,
}

/// A sandbox by id.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ById {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
}

/// `sandbox_exec`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Exec {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// A shell command line.
    #[schemars(length(min = 1, max = 131071))]
    pub command: String,
    /// Working directory.
    #[schemars(length(max = 4096))]
    pub cwd: Option<String>,
    /// Environment variables for this command.
    #[serde(default)]
    #[schemars(extend("maxProperties" = 256, "propertyNames" = {"maxLength": 256}), inner(length(max = 32768)))]
    pub env: StrMap,
    /// Milliseconds before it is killed (default 60000, at most 600000).
    #[schemars(range(min = 1, max = 600000))]
    pub timeout_ms: Option<u64>,
}

/// `sandbox_files_read` and `_write`'s encoding.
#[derive(Debug, Default, Clone, Copy, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text.
    #[default]
    Text,
    /// Base64 (RFC 4648 §4).
    Base64,
}

/// `sandbox_files_read`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Read_ {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// Absolute path.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// "text" (default) or "base64".
    #[serde(default)]
    pub encoding: Encoding,
}

/// `sandbox_files_write`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Write_ {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// Absolute path; parent directories are made.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// The content, as encoding says.
    #[schemars(length(max = 11184812))]
    pub content: String,
    /// "text" (default) or "base64".
    #[serde(default)]
    pub encoding: Encoding,
}

/// A path in a sandbox.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct AtPath {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// Absolute path.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
}

/// `sandbox_preview_url`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Preview {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// The guest port its server listens on.
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// Seconds the URL works (default 3600).
    #[schemars(range(min = 1, max = 604800))]
    pub expires_in_seconds: Option<u64>,
}

/// `sandbox_network_log`'s verdict filter.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Let through.
    Allowed,
    /// Refused by the policy.
    Blocked,
    /// Let through but failed (not told apart here: none match).
    Failed,
}

/// `sandbox_network_log`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct NetLog {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// Most events (default 50, at most 200).
    #[schemars(range(min = 1, max = 200))]
    pub limit: Option<usize>,
    /// Only events with this verdict.
    pub verdict: Option<Verdict>,
}

/// `sandbox_template_list`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct TemplateList {
    /// Only templates whose name starts with this.
    #[schemars(length(max = 63))]
    pub name_prefix: Option<String>,
}

/// `sandbox_template_create`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct TemplateCreate {
    /// The template's name.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// An OCI image reference ("python:3.11").
    #[schemars(length(min = 1, max = 512))]
    pub from: String,
    /// vCPUs.
    #[schemars(range(min = 1, max = 64))]
    pub vcpu: Option<u64>,
    /// Guest memory (MiB).
    #[schemars(range(min = 64, max = 1048576))]
    pub memory_mib: Option<u64>,
    /// Ignored: a template's disk is its image's.
    #[schemars(range(max = 1048576))]
    pub disk_mib: Option<u64>,
    /// Shell commands run in order to build it.
    #[serde(default)]
    #[schemars(length(max = 64), inner(length(max = 131071)))]
    pub run_steps: Vec<String>,
    /// A command started in the background at the end of the build (it keeps
    /// running in every sandbox made from the template).
    #[schemars(length(max = 131071))]
    pub start_cmd: Option<String>,
    /// A command that must succeed after start_cmd before the snapshot.
    #[schemars(length(max = 131071))]
    pub ready_cmd: Option<String>,
}

/// Tools without arguments (none others taken: strict converters want
/// `additionalProperties: false`).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

/// `sandbox_attach_secret`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Attach {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// The environment variable that holds the secret's placeholder.
    #[schemars(length(min = 1, max = 256))]
    pub env_key: String,
    /// The secret (see secret_list).
    #[schemars(length(min = 1, max = 63))]
    pub secret_name: String,
}

/// `sandbox_detach_secret`.
// Some fields are read only as the seed\'s shape (their docs say so).
#[allow(dead_code)]
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Detach {
    /// The sandbox.
    #[schemars(length(min = 1, max = 128))]
    pub sandbox_id: String,
    /// The environment variable to detach.
    #[schemars(length(min = 1, max = 256))]
    pub env_key: String,
}

/// Superserve's status of a native state.
fn status(state: &Value) -> &'static str {
    match state.as_str() {
        Some("running") => "active",
        Some("starting") => "starting",
        Some("paused" | "hibernated") => "paused",
        _ => "failed",
    }
}

/// RFC 3339 from ms since the Unix epoch.
fn iso(ms: &Value) -> Value {
    match ms.as_u64() {
        Some(ms) => {
            json!(humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
                .to_string())
        }
        None => Value::Null,
    }
}

/// The native network policy of `allow_out` and `deny_out`: Superserve's
/// allow_out wins over deny_out, Tine's deny wins over allow, so a deny of
/// everything becomes `egress: deny` with allow_out as the allow list.
fn policy(allow_out: &[String], deny_out: &[String]) -> Value {
    let all = |d: &String| d == "0.0.0.0/0" || d == "::/0" || d == "*";
    if deny_out.iter().any(all) {
        json!({ "egress": "deny", "allow": allow_out,
                "deny": deny_out.iter().filter(|d| !all(d)).collect::<Vec<_>>() })
    } else {
        json!({ "egress": "allow", "deny": deny_out })
    }
}

/// A native policy as Superserve's `{ allow_out, deny_out }`.
fn network_of(p: &Value) -> Value {
    if p.is_null() {
        return Value::Null;
    }
    let mut deny = p["deny"].clone();
    if p["egress"] == "deny" {
        if let Some(d) = deny.as_array_mut() {
            d.push(json!("0.0.0.0/0"));
        }
    }
    json!({ "allow_out": p["allow"], "deny_out": deny })
}

/// A native sandbox as Superserve's list entry.
fn summary(sb: &Value) -> Value {
    json!({
        "id": sb["sandbox_id"],
        "name": sb["name"],
        "status": status(&sb["state"]),
        "metadata": sb["labels"],
        "previewAccess": "public",
    })
}

/// The native name of a template state.
fn template(t: &Value) -> Value {
    json!({
        "id": t["name"],
        "name": t["name"],
        "status": match t["state"].as_str() { Some("ready") => "ready", Some("failed") => "failed", _ => "building" },
        "vcpu": t["vcpus"],
        "memoryMib": t["memory_mib"],
        "diskMib": t["disk_bytes"].as_u64().map(|b| b.div_ceil(1 << 20)),
    })
}

/// A `.tar.gz` (base64) as a ZIP of its regular files and directories
/// (symlinks and other entries are skipped, as Superserve does), base64.
///
/// Errors: a message for an archive that does not read.
fn zip_of_tar_gz(data_base64: &str) -> Result<(String, u64), String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let tgz = b64.decode(data_base64).map_err(|e| format!("the archive is not base64: {e}"))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&tgz[..]));
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    for entry in archive.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path().map_err(|e| e.to_string())?.to_string_lossy().trim_start_matches("./").to_string();
        if path.is_empty() {
            continue;
        }
        let mode = entry.header().mode().unwrap_or(0o644);
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                zip.add_directory(path, opts.unix_permissions(mode)).map_err(|e| e.to_string())?;
            }
            tar::EntryType::Regular => {
                let mut data = Vec::new();
                entry.read_to_end(&mut data).map_err(|e| e.to_string())?;
                zip.start_file(path, opts.unix_permissions(mode)).map_err(|e| e.to_string())?;
                zip.write_all(&data).map_err(|e| e.to_string())?;
            }
            _ => {}
        }
    }
    let bytes = zip.finish().map_err(|e| e.to_string())?.into_inner();
    Ok((b64.encode(&bytes), bytes.len() as u64))
}

const CREATE: &str = "Create a sandbox (a Linux microVM; from_template or from_snapshot, else the default with \
    Python 3 and Node.js). metadata labels it, env_vars and secrets (env var -> secret name) go to its \
    environment, allow_out/deny_out set its egress (deny_out [\"0.0.0.0/0\"] with allow_out: an allowlist), \
    timeout_seconds its idle timeout. Returns {id, name, status}.";
const UPDATE: &str = "Change a sandbox's metadata, egress (allow_out/deny_out) or idle timeout (timeout_seconds).";
const LIST: &str =
    "List sandboxes, optionally those with all of metadata: {sandboxes: [{id, name, status, metadata}]}.";
const INFO: &str = "One sandbox: id, name, status, vcpu_count, memory_mib, created_at, metadata, timeout_seconds, \
    network, secrets.";
const EXEC: &str = "Run a shell command in a sandbox: {stdout, stderr, exit_code, truncated} (each stream cut at \
    32 KiB; stdout_bytes and stderr_bytes give the full sizes). Killed at timeout_ms (default 60000).";
const READ: &str = "Read a file: {path, content, encoding, bytes}; encoding \"base64\" for binary files. Files \
    larger than about 380 KiB come back cut (truncated: true).";
const WRITE: &str = "Write a file (parents are made): content as text or, with encoding \"base64\", bytes. \
    Returns {path, bytes}.";
const FILES_LIST: &str = "List a directory: {path, entries: [{name, type, size, modified}]}.";
const DOWNLOAD_DIR: &str = "Download a directory as a ZIP, base64 in content: {path, format: \"zip\", encoding, \
    bytes, content}. Differs from Superserve: a directory whose archive is over 96 KiB comes as a URL to a \
    .tar.gz instead (format \"tar.gz\", url).";
const PAUSE: &str = "Pause a sandbox (memory and processes kept; any later call resumes it).";
const RESUME: &str = "Resume a paused sandbox.";
const KILL: &str = "Delete a sandbox and everything in it.";
const PREVIEW: &str = "A public HTTPS URL for a server listening on port in the sandbox (anyone with the URL \
    reaches it until it expires): {sandbox_id, port, url, access}.";
const NET_LOG: &str = "The sandbox's recent network connections and DNS queries, newest last, each with host, \
    dstIp, dstPort, verdict (allowed or blocked) and matchRule.";
const TEMPLATE_LIST: &str = "List templates: {templates: [{id, name, status, vcpu, memoryMib, diskMib}]}.";
const TEMPLATE_CREATE: &str = "Build a template from an OCI image (from, e.g. \"python:3.11\") with run_steps \
    (shell commands); start_cmd is left running in it. Returns at once with status \"building\": poll \
    sandbox_template_list until \"ready\", then sandbox_create { from_template }.";
const SECRET_LIST: &str = "List the secrets you may attach (names and hosts; never values).";
const ATTACH: &str = "Attach a secret to a running sandbox as env_key: the variable holds a placeholder that \
    becomes the secret only in HTTPS requests to the secret's hosts; later commands see it.";
const DETACH: &str = "Detach a secret from a sandbox: it is no longer swapped in from now on.";

impl Seed for Superserve {
    fn name(&self) -> &'static str {
        "superserve"
    }

    fn instructions(&self) -> &'static str {
        "Tine, serving Superserve's MCP tools: create a sandbox with sandbox_create, then pass its id as \
         sandbox_id to every other tool; a paused or hibernated sandbox resumes by itself on the next call. \
         Secrets are attached by name and never readable inside the sandbox. Preview URLs are public."
    }

    fn tools(&self) -> Vec<Tool> {
        vec![
            tool::<Create>("sandbox_create", CREATE),
            tool::<TemplateList>("sandbox_template_list", TEMPLATE_LIST),
            tool::<TemplateCreate>("sandbox_template_create", TEMPLATE_CREATE),
            tool::<List>("sandbox_list", LIST),
            tool::<ById>("sandbox_info", INFO),
            tool::<ById>("sandbox_pause", PAUSE),
            tool::<ById>("sandbox_resume", RESUME),
            tool::<ById>("sandbox_kill", KILL),
            tool::<Update>("sandbox_update", UPDATE),
            tool::<Preview>("sandbox_preview_url", PREVIEW),
            tool::<NetLog>("sandbox_network_log", NET_LOG),
            tool::<Exec>("sandbox_exec", EXEC),
            tool::<Read_>("sandbox_files_read", READ),
            tool::<Write_>("sandbox_files_write", WRITE),
            tool::<AtPath>("sandbox_files_list", FILES_LIST),
            tool::<AtPath>("sandbox_files_download_dir", DOWNLOAD_DIR),
            tool::<NoArgs>("secret_list", SECRET_LIST),
            tool::<Attach>("sandbox_attach_secret", ATTACH),
            tool::<Detach>("sandbox_detach_secret", DETACH),
        ]
    }

    fn plan(&self, name: &str, args: Value) -> Result<NativeCall, SeedError> {
        let unsupported = |why: &str| SeedError::Unsupported { tool: name.to_string(), why: why.to_string() };
        Ok(match name {
            "sandbox_create" => {
                let a: Create = parse(name, args)?;
                if a.auto_delete_seconds.is_some() {
                    return Err(unsupported(
                        "auto_delete_seconds is not supported: kill the sandbox with sandbox_kill when done",
                    ));
                }
                if a.preview_access.as_deref().is_some_and(|p| p != "public") {
                    return Err(unsupported("preview_access: only \"public\" preview URLs are made here"));
                }
                let network =
                    (!a.allow_out.is_empty() || !a.deny_out.is_empty()).then(|| policy(&a.allow_out, &a.deny_out));
                let template = match a.from_template {
                    Some(t) => template_of(name, Some(t))?,
                    None => a.from_snapshot,
                };
                // HOME as Superserve's agent sets it, under the caller's.
                let mut env = a.env_vars;
                env.entry("HOME".into()).or_insert_with(|| HOME.into());
                NativeCall::new(
                    "sandbox_create",
                    json!({
                        "name": a.name,
                        "template": template,
                        "idle_timeout_secs": a.timeout_seconds,
                        "labels": a.metadata,
                        "working_dir": HOME,
                        "env": env,
                        "secrets": a.secrets,
                        "network": network,
                    }),
                )
            }
            "sandbox_update" => {
                let a: Update = parse(name, args)?;
                if a.auto_delete_seconds.is_some() {
                    return Err(unsupported("auto_delete_seconds is not supported"));
                }
                let network = (a.allow_out.is_some() || a.deny_out.is_some())
                    .then(|| policy(&a.allow_out.unwrap_or_default(), &a.deny_out.unwrap_or_default()));
                NativeCall::new(
                    "sandbox_update",
                    json!({ "sandbox_id": a.sandbox_id, "labels": a.metadata, "network": network,
                            "idle_timeout_secs": a.timeout_seconds }),
                )
            }
            "sandbox_list" => {
                let a: List = parse(name, args)?;
                NativeCall::new("sandbox_list", json!({ "labels": a.metadata }))
            }
            "sandbox_info" | "sandbox_pause" | "sandbox_resume" | "sandbox_kill" => {
                let a: ById = parse(name, args)?;
                let native = match name {
                    "sandbox_info" => "sandbox_info",
                    "sandbox_pause" => "sandbox_pause",
                    "sandbox_resume" => "sandbox_resume",
                    _ => "sandbox_kill",
                };
                NativeCall::new(native, json!({ "sandbox_id": a.sandbox_id }))
            }
            "sandbox_exec" => {
                let a: Exec = parse(name, args)?;
                let secs = a.timeout_ms.unwrap_or(60_000).clamp(1, 600_000).div_ceil(1000);
                NativeCall::new(
                    "sandbox_exec",
                    json!({ "sandbox_id": a.sandbox_id, "command": a.command, "cwd": a.cwd, "env": a.env,
                            "timeout_secs": secs }),
                )
            }
            "sandbox_files_read" => {
                let a: Read_ = parse(name, args)?;
                let native = if a.encoding == Encoding::Base64 { "sandbox_download" } else { "sandbox_files_read" };
                NativeCall::new(native, json!({ "sandbox_id": a.sandbox_id, "path": a.path }))
            }
            "sandbox_files_write" => {
                let a: Write_ = parse(name, args)?;
                match a.encoding {
                    Encoding::Text => NativeCall::new(
                        "sandbox_files_write",
                        json!({ "sandbox_id": a.sandbox_id, "path": a.path, "content": a.content }),
                    ),
                    Encoding::Base64 => NativeCall::new(
                        "sandbox_upload",
                        json!({ "sandbox_id": a.sandbox_id, "path": a.path, "data_base64": a.content }),
                    ),
                }
            }
            "sandbox_files_list" => {
                let a: AtPath = parse(name, args)?;
                NativeCall::new("sandbox_files_list", json!({ "sandbox_id": a.sandbox_id, "path": a.path }))
            }
            "sandbox_files_download_dir" => {
                let a: AtPath = parse(name, args)?;
                NativeCall::new("sandbox_download_dir", json!({ "sandbox_id": a.sandbox_id, "path": a.path }))
            }
            "sandbox_preview_url" => {
                let a: Preview = parse(name, args)?;
                NativeCall::new(
                    "sandbox_preview_url",
                    json!({ "sandbox_id": a.sandbox_id, "port": a.port, "public": true,
                            "ttl_secs": a.expires_in_seconds.unwrap_or(3600) }),
                )
            }
            "sandbox_network_log" => {
                let a: NetLog = parse(name, args)?;
                NativeCall::new("sandbox_network_log", json!({ "sandbox_id": a.sandbox_id }))
            }
            "sandbox_template_list" => NativeCall::new("template_list", json!({})),
            "sandbox_template_create" => {
                let a: TemplateCreate = parse(name, args)?;
                let mut setup = a.run_steps;
                if let Some(start) = a.start_cmd {
                    setup.push(format!("nohup bash -c {} >/tmp/start_cmd.log 2>&1 &", crate::mcp::shell_quote(&start)));
                }
                if let Some(ready) = a.ready_cmd {
                    setup.push(format!("for i in $(seq 600); do ({ready}) && exit 0; sleep 1; done; exit 1"));
                }
                NativeCall::new(
                    "template_create",
                    json!({ "name": a.name, "image": a.from, "vcpus": a.vcpu, "memory_mib": a.memory_mib,
                            "setup": setup, "wait_secs": 0 }),
                )
            }
            "secret_list" => NativeCall::new("secret_list", json!({})),
            "sandbox_attach_secret" | "sandbox_detach_secret" => {
                let id = args.get("sandbox_id").cloned();
                // The bindings are replaced whole: read them first.
                if name == "sandbox_attach_secret" {
                    parse::<Attach>(name, args)?;
                } else {
                    parse::<Detach>(name, args)?;
                }
                NativeCall::new("sandbox_info", json!({ "sandbox_id": id }))
            }
            other => return Err(SeedError::UnknownTool(other.to_string())),
        })
    }

    fn answer(&self, name: &str, args: &Value, step: usize, native: Value) -> Result<Step, SeedError> {
        let done = |text: String, v: Value| Ok(Step::Done(Answer::with_text(text, v)));
        let id = || args["sandbox_id"].clone();
        match name {
            "sandbox_create" => {
                // The first sandbox's info is at the top of the native result.
                let info = native.get("info").unwrap_or(&native);
                field(name, info, "sandbox_id")?;
                let st = status(&info["state"]);
                done(
                    format!("created sandbox {} ({}), status {st}", info["sandbox_id"], info["name"]),
                    json!({ "id": info["sandbox_id"], "name": info["name"], "status": st,
                            "metadata": info["labels"], "previewAccess": "public" }),
                )
            }
            "sandbox_update" => done(format!("updated sandbox {}", id()), json!({ "id": id() })),
            "sandbox_list" => {
                let list: Vec<Value> =
                    field(name, &native, "sandboxes")?.as_array().into_iter().flatten().map(summary).collect();
                done(format!("{} sandboxes", list.len()), json!({ "sandboxes": list }))
            }
            "sandbox_info" => {
                let secrets: Vec<Value> = native["secrets"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|b| json!({ "env_key": b["env"], "secret_name": b["secret"], "revoked": false }))
                    .collect();
                let v = json!({
                    "id": field(name, &native, "sandbox_id")?,
                    "name": native["name"],
                    "status": status(&native["state"]),
                    "vcpu_count": native["vcpus"],
                    "memory_mib": native["memory_mib"],
                    "created_at": iso(&native["created_at_ms"]),
                    "metadata": native["labels"],
                    "timeout_seconds": native["idle_timeout_secs"],
                    "network": network_of(&native["network"]),
                    "secrets": secrets,
                });
                done(format!("sandbox {} is {}", v["id"], v["status"]), v)
            }
            "sandbox_pause" => done(format!("paused {}", id()), json!({ "id": id(), "status": "paused" })),
            "sandbox_resume" => done(format!("resumed {}", id()), json!({ "id": id(), "status": "active" })),
            "sandbox_kill" => done(format!("deleted {}", id()), json!({ "id": id(), "deleted": true })),
            "sandbox_exec" => {
                let code = native["exit_code"].as_i64().unwrap_or(-1);
                let v = json!({
                    "stdout": field(name, &native, "stdout")?,
                    "stderr": native["stderr"],
                    "exit_code": code,
                    "truncated": native["truncated"],
                    "stdout_bytes": native["stdout_bytes"],
                    "stderr_bytes": native["stderr_bytes"],
                });
                let mut text = format!("exit {code}");
                for s in ["stdout", "stderr"] {
                    if let Some(out) = v[s].as_str().filter(|o| !o.is_empty()) {
                        text.push_str(&format!("\n--- {s} ---\n{out}"));
                    }
                }
                done(text, v)
            }
            "sandbox_files_read" => {
                let base64 = args["encoding"] == "base64";
                let content = if base64 { &native["data_base64"] } else { &native["content"] };
                let v = json!({
                    "path": field(name, &native, "path")?,
                    "content": content,
                    "encoding": if base64 { "base64" } else { "text" },
                    "bytes": native["size"],
                    "truncated": native["remaining"].as_u64().is_some_and(|r| r > 0),
                });
                done(format!("read {} ({} bytes)", v["path"], v["bytes"]), v)
            }
            "sandbox_files_write" => {
                let v = json!({ "path": field(name, &native, "path")?, "bytes": native["bytes_written"] });
                done(format!("wrote {} bytes to {}", v["bytes"], v["path"]), v)
            }
            "sandbox_files_list" => {
                let entries: Vec<Value> = field(name, &native, "entries")?
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        let kind = match e["kind"].as_str() {
                            Some("file") => "file",
                            Some("dir") => "directory",
                            Some("symlink") => "symlink",
                            _ => "other",
                        };
                        json!({ "name": e["name"], "type": kind, "size": e["size"], "modified": iso(&e["mtime_ms"]) })
                    })
                    .collect();
                done(format!("{} entries", entries.len()), json!({ "path": native["path"], "entries": entries }))
            }
            "sandbox_files_download_dir" => {
                let path = field(name, &native, "path")?.clone();
                if let Some(data) = native["data_base64"].as_str() {
                    let (content, bytes) =
                        zip_of_tar_gz(data).map_err(|why| SeedError::Unsupported { tool: name.to_string(), why })?;
                    done(
                        format!("downloaded {path} as a zip ({bytes} bytes; base64 in structured content)"),
                        json!({ "path": path, "format": "zip", "encoding": "base64", "bytes": bytes,
                                "content": content }),
                    )
                } else {
                    done(
                        format!("{path} is too large to return inline: GET {} (a .tar.gz)", native["url"]),
                        json!({ "path": path, "format": "tar.gz", "bytes": native["bytes"], "url": native["url"],
                                "archive_path": native["archive_path"] }),
                    )
                }
            }
            "sandbox_preview_url" => {
                let url = field(name, &native, "url")?.clone();
                done(
                    url.as_str().unwrap_or_default().to_string(),
                    json!({ "sandbox_id": id(), "port": args["port"], "url": url, "access": "public",
                            "previewAccess": "public", "authenticated": false }),
                )
            }
            "sandbox_network_log" => {
                let verdict = args.get("verdict").and_then(Value::as_str);
                let limit = args.get("limit").and_then(Value::as_u64).unwrap_or(50).min(200) as usize;
                let mut events: Vec<Value> = field(name, &native, "records")?
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        json!({
                            "kind": if r["protocol"] == "tcp" { "connection" } else { "request" },
                            "id": r["id"].to_string(),
                            "ts": iso(&r["time_ms"]),
                            "host": r["domain"],
                            "dstIp": r["addr"],
                            "dstPort": r["port"],
                            "verdict": if r["allowed"] == true { "allowed" } else { "blocked" },
                            "matchRule": r["rule"],
                            "bytesSent": r["bytes_out"],
                            "bytesRecv": r["bytes_in"],
                            "latencyMs": r["duration_ms"],
                        })
                    })
                    .filter(|e| verdict.is_none_or(|v| e["verdict"] == v))
                    .collect();
                let has_more = events.len() > limit;
                events.drain(..events.len().saturating_sub(limit));
                done(format!("{} events", events.len()), json!({ "events": events, "has_more": has_more }))
            }
            "sandbox_template_list" => {
                let prefix = args.get("name_prefix").and_then(Value::as_str).unwrap_or("");
                let list: Vec<Value> = field(name, &native, "templates")?
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|t| t["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
                    .map(template)
                    .collect();
                done(format!("{} templates", list.len()), json!({ "templates": list }))
            }
            "sandbox_template_create" => {
                let t = template(&native);
                done(format!("building template {}", t["name"]), json!({ "template": t }))
            }
            "secret_list" => {
                let list: Vec<Value> = field(name, &native, "secrets")?
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        json!({ "name": s["name"], "authType": if s["header"].is_null() { "placeholder" } else { "header" },
                                "hosts": s["hosts"] })
                    })
                    .collect();
                done(format!("{} secrets", list.len()), json!({ "secrets": list }))
            }
            "sandbox_attach_secret" | "sandbox_detach_secret" if step == 0 => {
                let mut bindings: Map<String, Value> = native["secrets"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|b| Some((b["env"].as_str()?.to_string(), b["secret"].clone())))
                    .collect();
                let key = args["env_key"].as_str().unwrap_or_default().to_string();
                if name == "sandbox_attach_secret" {
                    bindings.insert(key, args["secret_name"].clone());
                } else {
                    bindings.remove(&key);
                }
                Ok(Step::Then(NativeCall::new(
                    "sandbox_update",
                    json!({ "sandbox_id": native["sandbox_id"], "secrets": bindings }),
                )))
            }
            "sandbox_attach_secret" => done(
                format!("attached {} as {}", args["secret_name"], args["env_key"]),
                json!({ "sandbox_id": id(), "env_key": args["env_key"], "secret_name": args["secret_name"] }),
            ),
            "sandbox_detach_secret" => {
                done(format!("detached {}", args["env_key"]), json!({ "sandbox_id": id(), "env_key": args["env_key"] }))
            }
            other => Err(SeedError::UnknownTool(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_calls_map_to_native_calls() {
        let s = Superserve;
        let create = s
            .plan(
                "sandbox_create",
                json!({"name": "primes", "from_template": "py", "metadata": {"team": "a"},
                       "allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"], "secrets": {"OPENAI_API_KEY": "openai"}}),
            )
            .unwrap();
        assert_eq!(
            create,
            NativeCall::new(
                "sandbox_create",
                json!({"name": "primes", "template": "py", "labels": {"team": "a"}, "env": {"HOME": "/home/user"},
                       "working_dir": "/home/user", "secrets": {"OPENAI_API_KEY": "openai"},
                       "network": {"egress": "deny", "allow": ["pypi.org"], "deny": []}})
            )
        );
        let exec = s.plan("sandbox_exec", json!({"sandbox_id": "sb-1", "command": "ls", "timeout_ms": 1500})).unwrap();
        assert_eq!(exec.args, json!({"sandbox_id": "sb-1", "command": "ls", "env": {}, "timeout_secs": 2}));
        assert!(s.plan("sandbox_create", json!({"auto_delete_seconds": 60})).is_err());
        // Superserve's own templates: its base, Python and Node.js ones are
        // the default; one Tine lacks is refused with what to do.
        let base = s.plan("sandbox_create", json!({"from_template": "superserve/python-3.11"})).unwrap();
        assert_eq!(base.args["template"], Value::Null, "{base:?}");
        let e = s.plan("sandbox_create", json!({"from_template": "superserve/code-interpreter"})).unwrap_err();
        assert!(e.to_string().contains("sandbox_template_create"), "{e}");
        let mine = s.plan("sandbox_create", json!({"env_vars": {"HOME": "/srv"}})).unwrap();
        assert_eq!(mine.args["env"], json!({"HOME": "/srv"}), "the caller's HOME wins");
        let attach = s
            .plan("sandbox_attach_secret", json!({"sandbox_id": "sb-1", "env_key": "K", "secret_name": "gh"}))
            .unwrap();
        assert_eq!(attach, NativeCall::new("sandbox_info", json!({"sandbox_id": "sb-1"})));
        let next = s
            .answer(
                "sandbox_attach_secret",
                &json!({"sandbox_id": "sb-1", "env_key": "K", "secret_name": "gh"}),
                0,
                json!({"sandbox_id": "sb-1", "secrets": [{"env": "OLD", "secret": "o", "placeholder": "p"}]}),
            )
            .unwrap();
        assert_eq!(
            next,
            Step::Then(NativeCall::new(
                "sandbox_update",
                json!({"sandbox_id": "sb-1", "secrets": {"K": "gh", "OLD": "o"}})
            ))
        );
    }

    #[test]
    fn a_tar_gz_becomes_a_zip_of_the_same_files() {
        let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        let mut h = tar::Header::new_gnu();
        h.set_size(5);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, "./a/b.txt", &b"hello"[..]).unwrap();
        let tgz = tar.into_inner().unwrap().finish().unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        let (zip_b64, bytes) = zip_of_tar_gz(&b64.encode(&tgz)).unwrap();
        let zip_bytes = b64.decode(zip_b64).unwrap();
        assert_eq!(zip_bytes.len() as u64, bytes);
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(zip_bytes)).unwrap();
        let mut s = String::new();
        zip.by_name("a/b.txt").unwrap().read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello");
    }
}
