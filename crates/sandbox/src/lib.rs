//! Tine's sandbox manager.
//!
//! A sandbox is a microVM booted from the guest kernel and the shared,
//! read-only root filesystem image, with the guest agent reached over
//! hybrid vsock. The [`Manager`] gives sandboxes unguessable ids (`sb-<host>-<random>`, [`ids`]),
//! tracks their [`SandboxState`], enforces [`Limits`] (vCPUs, memory, how
//! many live at once), reaps sandboxes left idle past their idle timeout,
//! turns a crashed guest into a `failed` sandbox that carries the console's
//! last lines, and on [`Manager::shutdown`] kills every sandbox, waits for
//! kills in progress and the default template's build, and empties its run
//! directory (a create still starting its VM then is not waited for).
//!
//! Templates ([`templates`]) are snapshots of a ready sandbox; a sandbox
//! restored from one is ready in a fraction of a boot's time. The manager
//! builds the default template on request ([`Manager::ensure_default_template`])
//! and makes others from live sandboxes ([`Manager::snapshot`]).
//!
//! [`Manager::diff`] ([`diff`]) compares two sandboxes' file systems: the
//! paths added, removed and modified, with unified diffs of small text
//! files on request.
//!
//! Long calls report progress through the [`CallContext`] they are given
//! ([`progress`]); what happens to sandboxes is broadcast as
//! [`SandboxEvent`]s ([`events`], [`Manager::subscribe_events`]).
//! Background processes in a sandbox's guest are reached by
//! [`ProcessId`]s (`sb-3:p7`) through [`Manager::spawn`] and its siblings.
//!
//! Files: each sandbox owns `<run_dir>/<id>/` with `vsock.sock` (the
//! hybrid-vsock socket) and `console.log`; the directory goes with the
//! sandbox.

#![deny(missing_docs)]

pub mod diff;
pub mod disks;
pub mod events;
pub mod ids;
mod limits;
mod manager;
pub mod memory;
pub mod network;
pub mod progress;
pub mod published_ports;
pub mod secrets;
pub mod store;
pub mod templates;
pub mod volumes;

pub use diff::{DiffOptions, DiffReport};
pub use events::{EventKind, SandboxEvent, Severity};
pub use limits::{
    derived_memory_budget_mib, IdleAction, Limits, LimitsError, Quota, MAX_LABEL_KEY, MAX_LABEL_VALUE,
    MAX_VOLUME_SLOTS, MIN_DISK_MIB, MIN_MEMORY_MIB,
};
/// Templates from OCI images: `[images]`, the base-image cache.
pub use manager::images;
pub use manager::{
    BackendError, BranchResult, DiskBytes, ExecRequest, Lineage, Manager, ManagerConfig, NetworkLog, PoolStatus,
    PortConnection, PortLease, ProcessId, ProcessInfo, ProcessPage, ProcessState, Recipe, SandboxError, SandboxId,
    SandboxInfo, SandboxSpec, SandboxState, SandboxUpdate, SetupStep, Spawned, Usage, WaitResult, WaitSpec, MAX_FILES,
    MAX_SPAWN, MAX_STEPS,
};
pub use memory::{BudgetUse, OverBudget};
pub use progress::{CallContext, ProgressSink, ProgressUpdate};
pub use templates::{TemplateError, TemplateInfo, TemplateState, DEFAULT_TEMPLATE};
/// The protocol's terms for process output streams and waits, as the
/// process calls take and return them.
pub use tine_protocol::{StreamKind, StreamSet, WaitFor, WaitMatch, WaitOutcome};

// Locks a mutex, going on with the data of a holder that panicked (every
// lock here guards plain data that stays consistent): the VMM's helper.
use vmm::sync::lock;
