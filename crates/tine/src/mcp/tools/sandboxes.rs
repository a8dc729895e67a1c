//! The sandbox family: `sandbox_create`, `_list`, `_info`, `_update`,
//! `_kill`, `_pause`, `_resume` (a sandbox's life and settings), and
//! `sandbox_snapshot`, `_branch`, `_diff`, `_merge_into` (its copies: a
//! template, children, their comparison, a child kept in its parent's
//! place).

use std::collections::BTreeMap;

use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_router, Json, RoleServer};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tine_sandbox::{BranchResult, DiffOptions, DiffReport, SandboxInfo, SandboxSpec, SandboxUpdate, TemplateInfo};

use super::common::env_map;
use super::network::NetworkParams;
use crate::mcp::bounds::{
    string_map, DEFAULT_MAX_DISK_MIB, DEFAULT_MAX_IDLE_SECS, DEFAULT_MAX_LABELS, DEFAULT_MAX_MEMORY_MIB,
    DEFAULT_MAX_SANDBOXES, DEFAULT_MAX_VCPUS, MAX_ID_CHARS, MAX_NAME_CHARS, MAX_PATH_CHARS, MIN_DISK_MIB,
    MIN_MEMORY_MIB, NAME_PATTERN,
};
use crate::mcp::errors::ToolError;
use crate::mcp::progress::Reporter;
use crate::mcp::{budget, TineMcp};

/// Schema of a labels map: keys of 64 and values of 256 characters; the
/// count is `[limits] max_labels` ([`crate::mcp::bounds::apply_limits`]).
fn labels_map(schema: &mut schemars::Schema) {
    const KEY: u64 = tine_sandbox::MAX_LABEL_KEY as u64;
    const VALUE: u64 = tine_sandbox::MAX_LABEL_VALUE as u64;
    string_map::<DEFAULT_MAX_LABELS, KEY, VALUE>(schema);
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
    /// Size of the sandbox's own disk in MiB, where everything it writes
    /// goes (default 10240, the default template's). Another size boots a
    /// new VM (slower than the default's restore); a template's sandboxes
    /// have its disk.
    #[schemars(range(min = MIN_DISK_MIB, max = DEFAULT_MAX_DISK_MIB))]
    pub disk_mib: Option<u64>,
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
    /// Volumes (volume_create) to mount, each at `path` (an absolute
    /// directory, made if missing); read_only: true to share one that
    /// another sandbox writes. At most the template's volume slots
    /// (limits.volume_slots, 2 by default).
    #[serde(default)]
    #[schemars(length(max = tine_sandbox::MAX_VOLUME_SLOTS))]
    pub volumes: Vec<tine_sandbox::volumes::VolumeRequest>,
    /// Host ports the server listens on for the sandbox's life, each
    /// connection going to a guest port: "HOST_PORT:GUEST_PORT"
    /// ("5432:5432"), on the server host's loopback unless the operator
    /// allows other addresses ("ADDRESS:HOST_PORT:GUEST_PORT"). Raw TCP,
    /// no auth: for HTTP to a person, use sandbox_preview_url.
    #[serde(default)]
    #[schemars(length(max = tine_sandbox::published_ports::MAX_PUBLISHED_PORTS), inner(length(max = 64)))]
    pub ports: Vec<String>,
    /// Secrets (see secret_list): environment variable -> secret name. The
    /// variable holds a placeholder that the server replaces with the
    /// value in HTTPS requests to the secret's hosts only.
    #[serde(default)]
    #[schemars(transform = secrets_map)]
    pub secrets: BTreeMap<String, String>,
    /// A name for it, unique among your sandboxes on this server: 1-63
    /// lowercase letters, digits, '-' or '_' (not "sb-..."). Every tool
    /// then takes the name wherever it takes sandbox_id.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), pattern(NAME_PATTERN))]
    pub name: Option<String>,
    /// The absolute directory commands without a cwd and the Python and
    /// JavaScript interpreters start in, made if missing (default: `/` for
    /// commands, /root for the interpreters; a template's own if it has one).
    #[schemars(length(min = 1, max = MAX_PATH_CHARS))]
    pub working_dir: Option<String>,
    /// Make this many sandboxes at once (default 1), all of this spec;
    /// the result's `sandboxes` lists them all. Leave name out with count.
    #[schemars(range(min = 1, max = tine_sandbox::MAX_SPAWN))]
    pub count: Option<usize>,
}

/// `sandbox_create`'s result: the (first) sandbox's info, and with `count`
/// every sandbox made.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CreateResult {
    /// The sandbox (the first made, with `count`).
    #[serde(flatten)]
    pub info: SandboxInfo,
    /// With `count`: every sandbox made, oldest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sandboxes: Vec<SandboxInfo>,
    /// With `count`: how long making them took (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spawn_ms: Option<u64>,
    /// With `count`: why fewer than asked were made, if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spawn_error: Option<String>,
}

/// Schema of a secrets map: environment variable names to secret names.
fn secrets_map(schema: &mut schemars::Schema) {
    string_map::<{ tine_sandbox::secrets::MAX_BINDINGS as u64 }, 256, 64>(schema);
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
    /// New secret bindings (environment variable -> secret name),
    /// replacing the old ones ({} detaches all): a detached secret stops
    /// being swapped at once; later execs see the new variables.
    #[schemars(transform = secrets_map)]
    pub secrets: Option<BTreeMap<String, String>>,
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
    /// One sandbox ("before"; default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub a: Option<String>,
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
    /// The sandbox that takes the winner's state and keeps its own id
    /// (default: this session's own sandbox).
    #[schemars(length(max = MAX_ID_CHARS))]
    pub parent: Option<String>,
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
    /// Also each running sandbox's use: CPU % since the last reading,
    /// memory, disk (default false; slower: each guest is asked).
    #[serde(default)]
    pub usage: bool,
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

#[tool_router(router = sandboxes_router, vis = "pub(super)")]
impl TineMcp {
    #[tool(
        description = "Create a sandbox: an isolated Linux microVM (Debian, bash, Python 3, Node.js) with its own \
                       kernel. Returns its info and sandbox_id; it becomes this session's sandbox, which tools \
                       called without sandbox_id use. Reports progress (a cold boot can take long) when the \
                       request has a progressToken.",
        annotations(
            title = "Create sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_create(
        &self,
        Parameters(p): Parameters<CreateParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<CreateResult>, ToolError> {
        let count = p.count.unwrap_or(1);
        if count > 1 && !p.ports.is_empty() {
            return Err(ToolError::Spawn("host ports name one sandbox: leave ports out with count".into()));
        }
        let spec = SandboxSpec {
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            disk_mib: p.disk_mib,
            labels: p.labels,
            idle_timeout_secs: p.idle_timeout_secs,
            template: p.template.map(|t| self.resolve_template(&t)),
            network: p.network.map(|n| n.into_policy()),
            env: p.env,
            // Only a template's build from an OCI image boots a base image.
            base: None,
            volumes: p.volumes,
            secrets: p.secrets.into_iter().collect(),
            name: p.name,
            working_dir: p.working_dir,
        };
        self.check_ceiling(spec.network.as_ref())?;
        if p.count.is_some() {
            let made =
                Reporter::around(&ctx, self.cx(), async |cx| self.manager.create_many(spec, count, cx).await).await?;
            for s in &made.sandboxes {
                self.log.watch(&s.sandbox_id);
            }
            let Some(last) = made.sandboxes.last() else {
                return Err(ToolError::Spawn("no sandbox was made".into()));
            };
            self.session.created(&last.sandbox_id).await;
            let info = made.sandboxes[0].clone();
            return Ok(Json(CreateResult {
                info,
                sandboxes: made.sandboxes,
                spawn_ms: Some(made.ms),
                spawn_error: made.error.map(|e| ToolError::from(e).to_string()),
            }));
        }
        // Host ports are bound before the VM starts: a taken one costs none.
        let ports = self.ports.config().check(&p.ports, &self.caller())?;
        let bound = self.ports.bind(&ports).await?;
        let mut info = Reporter::around(&ctx, self.cx(), async |cx| self.manager.create_with(spec, cx).await).await?;
        if !bound.is_empty() {
            self.ports.start(&info.sandbox_id, bound);
            info.ports = self.manager.published_ports(&info.sandbox_id);
        }
        self.log.watch(&info.sandbox_id);
        self.session.created(&info.sandbox_id).await;
        Ok(Json(CreateResult { info, sandboxes: Vec::new(), spawn_ms: None, spawn_error: None }))
    }

    #[tool(
        description = "List your sandboxes (every session's of your key): ids, names, states; optionally only \
                       those carrying all the given labels, and with usage: true each one's CPU %, memory and \
                       disk.",
        annotations(title = "List sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_list(&self, Parameters(p): Parameters<ListParams>) -> Result<Json<ListResult>, ToolError> {
        let caller = self.caller();
        let mut sandboxes = self.manager.list(&p.labels);
        sandboxes.retain(|s| caller.owns(s.tenant.as_deref()));
        if p.usage {
            let asked = sandboxes.iter().map(|s| self.manager.info(&s.sandbox_id));
            let read = futures_util::future::join_all(asked).await;
            for (s, r) in sandboxes.iter_mut().zip(read) {
                if let Ok(info) = r {
                    *s = info;
                }
            }
        }
        let total = sandboxes.len() as u64;
        let truncated = budget::fit_list(&mut sandboxes, budget::CONTENT_BUDGET - 128) > 0;
        Ok(Json(ListResult { sandboxes, total, truncated }))
    }

    #[tool(
        description = "A sandbox's state (running, paused, hibernated, stopped, failed), shape, labels, uptime, \
                       network policy, and CPU, memory and disk use.",
        annotations(title = "Sandbox info", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_info(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.info(&id).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Change a sandbox's settings; each one given replaces the old: env (variables every \
                       later exec, background process and Python cell gets), labels, idle_timeout_secs, and \
                       network (egress \"allow\" or \"deny\", allow and deny lists of domains, *.domains, \
                       addresses and CIDRs; connections opened from then on follow it), and secrets (ENV_NAME: \
                       secret name, see secret_list; {} detaches all). A refused value changes nothing. Returns \
                       the sandbox's info.",
        annotations(
            title = "Update sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_update(&self, Parameters(p): Parameters<UpdateParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let update = SandboxUpdate {
            labels: p.labels,
            idle_timeout_secs: p.idle_timeout_secs,
            env: p.env,
            network: p.network.map(|n| n.into_policy()),
            secrets: p.secrets.map(|s| s.into_iter().collect()),
        };
        self.check_ceiling(update.network.as_ref())?;
        self.manager.update(&id, update).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Kill a sandbox: stop its VM and delete everything in it (without sandbox_id: this \
                       session's sandbox; a new one is made on next use).",
        annotations(
            title = "Kill sandbox",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_kill(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<KillResult>, ToolError> {
        let id = match p.sandbox_id {
            Some(id) => id,
            None => self.session.current().await.ok_or(ToolError::NoOwnSandbox)?,
        };
        self.watch(&id);
        self.manager.kill(&id).await?;
        self.session.forget(&id).await;
        Ok(Json(KillResult { sandbox_id: id, killed: true }))
    }

    #[tool(
        description = "Pause a sandbox: its vCPUs stop and use no CPU; memory, processes, files and Python state \
                       are kept. With to_disk: true it is hibernated: its state goes to disk, its memory is freed, \
                       and it survives a server restart. sandbox_exec, sandbox_run_python and the file tools \
                       resume it by themselves.",
        annotations(
            title = "Pause sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_pause(&self, Parameters(p): Parameters<PauseParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        let paused = if p.to_disk { self.manager.hibernate(&id).await } else { self.manager.pause(&id).await };
        paused.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Resume a paused sandbox where it left off.",
        annotations(
            title = "Resume sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_resume(&self, Parameters(p): Parameters<SandboxParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let id = self.target(p.sandbox_id).await?;
        self.manager.resume(&id).await.map(Json).map_err(ToolError::from)
    }

    #[tool(
        description = "Save a running sandbox as a new template under a name: its memory, running processes, \
                       files and Python state as they are now. The sandbox pauses for the copy and goes on. \
                       Then sandbox_create { template: name } makes copies of it, each with fresh randomness \
                       and the current clock.",
        annotations(
            title = "Snapshot sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_snapshot(
        &self,
        Parameters(p): Parameters<SnapshotParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<TemplateInfo>, ToolError> {
        Reporter::around(&ctx, self.cx(), async |cx| {
            let id = self.target_with(p.sandbox_id, cx).await?;
            let made = self.manager.snapshot_with(&id, &self.own_template(&p.name), cx).await?;
            Ok(Json(self.shown_template(made)))
        })
        .await
    }

    #[tool(
        description = "Branch a running sandbox into n children, each starting from its exact state now (memory, \
                       processes, Python variables, files) and going its own way; the source goes on (paused for \
                       milliseconds). Returns the children. Compare them with sandbox_diff, keep the best with \
                       sandbox_merge_into, kill the rest.",
        annotations(
            title = "Branch sandbox",
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_branch(
        &self,
        Parameters(p): Parameters<BranchParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<BranchResult>, ToolError> {
        Reporter::around(&ctx, self.cx(), async |cx| {
            let id = self.target_with(p.sandbox_id, cx).await?;
            Ok(Json(self.manager.branch_with(&id, p.n, cx).await?))
        })
        .await
    }

    #[tool(
        description = "Compare two sandboxes' filesystems (everything written since boot, and /tmp): the paths \
                       added, removed and modified from a to b, with size, mode and SHA-256, and on request a \
                       unified diff of small text files. A report larger than the result budget is cut \
                       (report_truncated, total_changes).",
        annotations(title = "Diff sandboxes", read_only_hint = true, open_world_hint = false)
    )]
    async fn sandbox_diff(&self, Parameters(p): Parameters<DiffParams>) -> Result<Json<DiffResult>, ToolError> {
        let mut opts = DiffOptions { unified: p.unified, ..DiffOptions::default() };
        if let Some(max) = p.max_text_bytes {
            opts.max_text_bytes = max;
        }
        let a = self.target(p.a).await?;
        self.watch(&p.b);
        let report: DiffReport = self.manager.diff(&a, &p.b, opts).await?;
        Ok(Json(DiffResult::new(report, budget::CONTENT_BUDGET)))
    }

    #[tool(
        description = "Merge a branched sandbox (winner) into the sandbox it was branched from (parent): the \
                       parent's VM is replaced by the winner's, so the parent's id now has the winner's memory, \
                       processes, Python state and files; the winner's id ceases to exist; other children are \
                       untouched. A session that used the winner as its sandbox now uses the parent.",
        annotations(
            title = "Merge sandbox into its parent",
            read_only_hint = false,
            destructive_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_merge_into(&self, Parameters(p): Parameters<MergeParams>) -> Result<Json<SandboxInfo>, ToolError> {
        let parent = self.target(p.parent).await?;
        let info = self.manager.merge_into(&p.winner, &parent).await?;
        self.session.merged(&p.winner, &parent).await;
        Ok(Json(info))
    }
}

#[cfg(test)]
mod tests {
    use tine_sandbox::diff::{Kind, PathChange};

    use super::*;
    use crate::mcp::budget::{json_len, CONTENT_BUDGET};

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
