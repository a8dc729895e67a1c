//! [`SandboxError`], the one error type of the sandbox manager.

use tine_protocol::AgentError;

use super::backend::BackendError;
use super::{SandboxId, SandboxState};
use crate::limits::LimitsError;
use crate::templates::TemplateError;

/// Errors of the manager. Messages say what happened, in the domain's
/// terms; what to do next depends on the caller (the MCP layer adds its
/// hints, naming its tools).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// No sandbox has this id.
    #[error("no sandbox {0}")]
    NotFound(SandboxId),
    /// The sandbox went away (killed, or merged into its parent) while
    /// this operation waited for the one before it.
    #[error("sandbox {id} no longer exists: {reason}")]
    Gone {
        /// The id.
        id: SandboxId,
        /// What happened to it ("killed", "merged into sb-1").
        reason: String,
    },
    /// The live-sandbox cap is reached.
    #[error("{live} sandboxes are running and none is idle enough to hibernate, the limit is {max}")]
    TooMany {
        /// Live sandboxes.
        live: usize,
        /// The cap.
        max: usize,
    },
    /// The cap on sandboxes kept in any state is reached
    /// ([`crate::Limits::max_kept_sandboxes`]).
    #[error("{kept} sandboxes are kept (running, hibernated or failed), the limit is {max}")]
    TooManyKept {
        /// Sandboxes kept.
        kept: usize,
        /// The cap.
        max: usize,
    },
    /// The request is outside the limits.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// The call would take a tenant past one of its quotas
    /// ([`crate::limits::Quota`]).
    #[error(
        "tenant {tenant} is at its quota of {quota}: {used} in use, {asked} more asked, the quota is {max}; {hint}"
    )]
    Quota {
        /// The tenant.
        tenant: String,
        /// The quota, e.g. "live sandboxes", "vCPUs".
        quota: &'static str,
        /// What its objects use now.
        used: u64,
        /// What the call asks for on top.
        asked: u64,
        /// The quota.
        max: u64,
        /// What frees some.
        hint: &'static str,
    },
    /// The sandboxes' disks would pass the server's disk budget
    /// ([`crate::Limits::disk_budget_mib`]).
    #[error(
        "disk budget {budget_mib} MiB: {sandboxes} sandboxes' disks take {used_mib} MiB; this needs {asked_mib} MiB more"
    )]
    DiskBudget {
        /// The budget (MiB).
        budget_mib: u64,
        /// Sandboxes holding a disk (live or hibernated).
        sandboxes: u64,
        /// The size of their disks together (MiB).
        used_mib: u64,
        /// What the call asks for (MiB).
        asked_mib: u64,
    },
    /// The sandbox is still booting.
    #[error("sandbox {0} is still starting")]
    Starting(SandboxId),
    /// Pause or resume does not apply in this state.
    #[error("sandbox {id} is {state:?}; {what} needs a running or paused sandbox")]
    BadState {
        /// The id.
        id: SandboxId,
        /// Its state.
        state: SandboxState,
        /// The operation.
        what: &'static str,
    },
    /// The VM refused to pause.
    #[error("cannot pause sandbox {id}: {source}")]
    Pause {
        /// The id.
        id: SandboxId,
        /// Why.
        #[source]
        source: BackendError,
    },
    /// The sandbox is not running any more.
    #[error("sandbox {id} is {state:?} and cannot run anything: {reason}")]
    NotRunning {
        /// The id.
        id: SandboxId,
        /// Its state.
        state: SandboxState,
        /// Why.
        reason: String,
    },
    /// The VM could not be started.
    #[error("could not start the VM: {0}")]
    Start(#[source] BackendError),
    /// The guest booted but its agent never answered.
    #[error("the guest agent did not answer within {secs} s of boot ({reason}); last console lines:\n{console}")]
    Boot {
        /// The boot timeout.
        secs: u64,
        /// The last error seen.
        reason: String,
        /// The guest console's last lines.
        console: String,
    },
    /// The agent refused the request (missing file, bad path, ...).
    #[error("{0}")]
    Agent(#[from] AgentError),
    /// The agent did not answer in time.
    #[error("sandbox {id} did not answer within {secs} s; the guest may be overloaded")]
    Timeout {
        /// The id.
        id: SandboxId,
        /// Seconds waited.
        secs: u64,
    },
    /// Talking to the agent failed.
    #[error("lost the connection to sandbox {id}'s agent: {reason}")]
    Connection {
        /// The id.
        id: SandboxId,
        /// Why.
        reason: String,
    },
    /// Guest memory beyond the server's budget ([`crate::memory`]).
    #[error(transparent)]
    OverBudget(#[from] crate::memory::OverBudget),
    /// The host's available memory is below the server's floor (half its
    /// watermark, [`crate::Limits::min_available_mib`]) and no sandbox is
    /// idle to hibernate.
    #[error(
        "the host has {available_mib} MiB of memory available, below the server's floor of {floor_mib} MiB (half \
         its watermark), and no sandbox is idle enough to hibernate: this {what} was refused"
    )]
    HostMemoryLow {
        /// `MemAvailable` (MiB).
        available_mib: u64,
        /// The floor (MiB).
        floor_mib: u64,
        /// What was refused ("create", "branch", "resume from disk").
        what: &'static str,
    },
    /// The server is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The caller cancelled the call ([`crate::CallContext::cancel`]);
    /// an exec's command was killed in the guest.
    #[error("the call on sandbox {id} was cancelled by its caller; its command was stopped")]
    Cancelled {
        /// The sandbox.
        id: SandboxId,
    },
    /// A template cannot be used or made.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A volume cannot be made, found, attached or deleted.
    #[error(transparent)]
    Volume(#[from] crate::volumes::VolumeError),
    /// A create's volumes cannot be attached as asked.
    #[error("{0}")]
    Volumes(String),
    /// A spawn that cannot be made as asked ([`super::spawn`]).
    #[error("{0}")]
    Spawn(String),
    /// A sandbox name that cannot be given ([`super::names`]).
    #[error("{0}")]
    Name(String),
    /// Secrets cannot be bound as asked ([`crate::secrets`]).
    #[error("secrets: {0}")]
    Secrets(String),
    /// A template's OCI image cannot be pulled or made a base image.
    #[error(transparent)]
    Image(#[from] super::images::ImageBuildError),
    /// The requested shape differs from the template's.
    #[error("template {name:?} makes sandboxes of {vcpus} vCPUs and {memory_mib} MiB")]
    TemplateShape {
        /// The template.
        name: String,
        /// Its vCPUs.
        vcpus: u8,
        /// Its memory (MiB).
        memory_mib: u64,
    },
    /// The requested disk size differs from the template's: a sandbox
    /// restored from a template has the template's disk.
    #[error("template {name:?} makes sandboxes with a {disk_mib} MiB disk")]
    TemplateDisk {
        /// The template.
        name: String,
        /// Its disk's size (MiB; 0: none).
        disk_mib: u64,
    },
    /// Taking a snapshot failed.
    #[error("cannot snapshot sandbox {id}: {source}")]
    Snapshot {
        /// The id.
        id: SandboxId,
        /// Why.
        #[source]
        source: BackendError,
    },
    /// Writing a hibernation failed; the sandbox keeps running (or stays
    /// paused).
    #[error("hibernating sandbox {id} failed: {reason}; the sandbox keeps running")]
    Hibernate {
        /// The id.
        id: SandboxId,
        /// Why (a full disk, an I/O error, ...).
        reason: String,
    },
    /// A hibernated sandbox could not be restored.
    #[error("sandbox {id} could not be resumed from disk: {reason}")]
    Wake {
        /// The id.
        id: SandboxId,
        /// Why.
        reason: String,
    },
    /// Taking the branch point failed.
    #[error("cannot branch sandbox {id}: {source}")]
    Branch {
        /// The id.
        id: SandboxId,
        /// Why.
        #[source]
        source: BackendError,
    },
    /// Children of a branch did not start; none were kept.
    #[error("{failed} of {n} children of sandbox {id} did not start, so none were kept (first error: {first}); the source is unchanged")]
    BranchChildren {
        /// The source.
        id: SandboxId,
        /// Children that failed.
        failed: usize,
        /// Children asked for.
        n: usize,
        /// The first failure.
        first: String,
    },
    /// A branch asked for no children, or more than the limit allows.
    #[error("n must be 1..={max} (the live-sandbox limit minus the live sandboxes), got {n}")]
    BranchCount {
        /// Requested children.
        n: usize,
        /// At most this many now.
        max: usize,
    },
    /// A merge between sandboxes that are not parent and descendant.
    #[error("sandbox {winner} was not branched from {parent} (its lineage: {lineage})")]
    NotDescendant {
        /// The would-be winner.
        winner: SandboxId,
        /// The would-be parent.
        parent: SandboxId,
        /// The winner's ancestors, nearest first.
        lineage: String,
    },
    /// A network rule is bad.
    #[error("bad network policy: {0}")]
    Network(#[from] netstack::policy::PolicyError),
    /// A new id could not be minted (no random bytes from the kernel).
    #[error(transparent)]
    Id(#[from] crate::ids::IdError),
    /// The server gives sandboxes no network.
    #[error("this server gives sandboxes no network ([network] enabled = false in its configuration)")]
    NoNetwork,
    /// A connection into a guest port could not be asked for.
    #[error(transparent)]
    Inbound(#[from] netstack::control::InboundError),
    /// A process id that does not read `<sandbox_id>:p<n>`.
    #[error("bad process id {0:?}: process ids look like sb-3:p7")]
    BadProcessId(String),
    /// The sandbox's process table has no such process (never started
    /// there, or evicted after it ended).
    #[error("no background process {process_id}")]
    NoSuchProcess {
        /// The process id asked for (`sb-3:p7`).
        process_id: String,
    },
    /// The sandbox runs as many background processes as its table holds.
    #[error("sandbox {id} runs {max} background processes already")]
    TooManyProcesses {
        /// The sandbox.
        id: SandboxId,
        /// The table's size.
        max: u32,
    },
    /// A host file or directory operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}
