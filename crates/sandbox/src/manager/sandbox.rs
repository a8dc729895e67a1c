//! One sandbox: its fixed shape, its state ([`SandboxState`]) and the one
//! function that changes it ([`Sandbox::transition`]), its VM and agent,
//! its lineage, and what it reports ([`SandboxInfo`]).
//!
//! # Lock order
//!
//! A sandbox has five mutexes. Whoever holds more than one takes them in
//! this order, and takes none of them before the manager's map except
//! `control`:
//!
//! 1. `control` (kill, pause, resume, snapshot, branch, merge; held for
//!    the VM operation, for a branch while its branch point is taken; a
//!    merge takes the ancestor's before the descendant's). A tokio mutex:
//!    the blocking operations take it on the blocking pool
//!    (`blocking_lock`), a kill awaits it, so no tokio worker waits for a
//!    snapshot's copy,
//! 2. the manager's `records` (a record written or a pin made), then its
//!    map of sandboxes,
//! 3. `status` (state, error, boot time, agent),
//! 4. `vm` (the VM handle and its monitor thread),
//! 5. `lineage`, then `dir`, then `memory`.
//!
//! `labels`, `idle_timeout`, `owner`, `handout`, `base`, `hibernation`,
//! `pin` and the manager's `pool` are leaves: nothing else is taken while one is held.
//! So are `net`, `name`, `tenant`, `volumes`, `ports`, `secrets` and
//! `last_cpu`, but that a branch copies its source's `secrets` and
//! `volumes` into its new child's (source first). A value built from
//! several of them copies each out in a statement of its own: a guard taken
//! inside a struct expression lives to the expression's end, so its locks
//! would be held together in field order (`info` and a record written at
//! the same time deadlocked that way).
//!
//! No lock is held across an `.await`; `vm` is not held while joining the
//! monitor thread (which takes `vm` and `status` itself).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
use serde::Serialize;
use tine_agent_client::AgentClient;

use super::backend::{Base, ExitWatch, VmEnd, VmHandle};
use super::{remove_dir, unix_ms, SandboxId};
use crate::events::{keep_end, EventKind, SandboxEvent, CONSOLE_TAIL_BYTES};
use crate::lock;
use crate::memory::Reservation;

/// Most bytes of a crash event's `error` (its start is kept).
const CRASH_ERROR_BYTES: usize = 4 << 10;

/// Guest console lines kept in a boot timeout's error.
pub(super) const CONSOLE_TAIL_LINES: usize = 25;

/// A sandbox's lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// The VM is booting; the agent has not answered yet.
    Starting,
    /// The agent answers; tools work.
    Running,
    /// The vCPUs are parked; memory and files are kept. Tools that need
    /// the guest resume it by themselves.
    Paused,
    /// Its memory, vCPU and device state are on disk and its VM is freed
    /// ([`crate::Manager::hibernate`]). Tools that need the guest resume
    /// it by themselves.
    Hibernated,
    /// The guest powered off or rebooted by itself.
    Stopped,
    /// The guest crashed or could not start; `error` says why.
    Failed,
}

impl SandboxState {
    /// Whether the sandbox counts as live (against the live-sandbox cap).
    pub fn is_live(self) -> bool {
        matches!(self, SandboxState::Starting | SandboxState::Running | SandboxState::Paused)
    }

    /// Whether the sandbox holds its disk (live or hibernated): it counts
    /// against the disk budget and its tenant's disk quota.
    pub fn holds_disk(self) -> bool {
        self.is_live() || self == SandboxState::Hibernated
    }
}

/// Resource use of a running sandbox.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct Usage {
    /// CPU time the vCPUs used since start (ms).
    pub cpu_time_ms: u64,
    /// The vCPUs' use over the interval since the last usage reading
    /// (since start at the first), in % of one CPU.
    pub cpu_percent: f64,
    /// Host memory backing guest RAM now (bytes): the pages the guest touched.
    pub host_memory_bytes: u64,
    /// Guest RAM the guest kernel reports in use (bytes), if the agent answered.
    pub guest_memory_used_bytes: Option<u64>,
    /// Guest RAM (bytes) as the guest kernel sees it, if the agent answered.
    pub guest_memory_total_bytes: Option<u64>,
    /// Free space on the guest's writable root (bytes), if the agent answered.
    pub disk_free_bytes: Option<u64>,
    /// The size of the sandbox's own disk (bytes; README, Storage), if it
    /// has one.
    pub disk_size_bytes: Option<u64>,
    /// Host disk its own disk layers take (bytes: its writes since it was
    /// made, not what it shares with its template), if it has a disk.
    pub disk_host_bytes: Option<u64>,
    /// Files its disk is made of (the base, the frozen layers, the top),
    /// if it has a disk: each capture that found writes adds one; a resume,
    /// a template's making or (in the background) a branch merges more
    /// than [`crate::Limits::max_disk_layers`] frozen layers into one.
    pub disk_layers: Option<u64>,
}

/// What a sandbox is and how it is doing.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct SandboxInfo {
    /// The id.
    pub sandbox_id: SandboxId,
    /// Its name, if it was given one (`sandbox_create { name }`), which
    /// tools take wherever they take its id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The tenant it belongs to (shown to the operator; `None`: the
    /// server's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The state.
    pub state: SandboxState,
    /// Why it failed or stopped (with the guest console's last lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory (MiB).
    pub memory_mib: u64,
    /// The size of its own disk (MiB; 0: none, it writes to guest memory).
    pub disk_mib: u64,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// The template it was restored from (`None`: booted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Branch parent and children.
    #[serde(skip_serializing_if = "Lineage::is_empty")]
    pub lineage: Lineage,
    /// Creation time, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// Time since creation (ms).
    pub uptime_ms: u64,
    /// VM start (boot or restore) to agent ready (ms), once running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_ms: Option<u64>,
    /// Idle timeout (s).
    pub idle_timeout_secs: u64,
    /// Time since the last tool call on it (ms).
    pub idle_ms: u64,
    /// The egress policy (`None`: no network device).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<serde_json::Value>"))]
    pub network: Option<netstack::policy::NetworkPolicy>,
    /// The operator's ceiling over `network` for its tenant: a connection
    /// must pass both (`None`: no ceiling).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<serde_json::Value>"))]
    pub network_ceiling: Option<netstack::policy::NetworkPolicy>,
    /// Whether it was handed out ready from the warm pool (restored from
    /// the default template ahead of the create; `uptime_ms` counts from
    /// that restore).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub from_pool: bool,
    /// When it was hibernated, ms since the Unix epoch (hibernated only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hibernated_at_ms: Option<u64>,
    /// When a hibernated sandbox is deleted unless a call resumes it first,
    /// ms since the Unix epoch ([`crate::Limits::hibernated_retention_secs`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Resource use, from `info` on a running sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Volumes attached to it (`sandbox_create { volumes }`; a branch
    /// child's copies of its parent's writable ones are `shared: false`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::volumes::AttachedVolume>,
    /// Host ports the server listens on for it (`sandbox_create { ports
    /// }`, [`crate::published_ports`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<crate::published_ports::PublishedPort>,
    /// Its secrets: each environment variable, the secret it stands for
    /// and the placeholder it holds (never the value).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::secrets::SecretBinding>,
}

/// A sandbox's place in a branch tree.
#[derive(Clone, Debug, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct Lineage {
    /// The sandbox it was branched from (which may be gone since).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<SandboxId>,
    /// When it was branched, ms since the Unix epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub branched_at_ms: Option<u64>,
    /// Live sandboxes branched from it, oldest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<SandboxId>,
    /// The last sandbox merged into it, whose VM it now runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merged_from: Option<SandboxId>,
    /// When that merge happened, ms since the Unix epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merged_at_ms: Option<u64>,
}

impl Lineage {
    /// Whether there is nothing to say.
    pub fn is_empty(&self) -> bool {
        self.parent.is_none() && self.children.is_empty() && self.merged_from.is_none()
    }
}

/// A use in flight on a sandbox ([`Sandbox::mark_busy`],
/// [`Sandbox::mark_busy_owned`]), holding it by reference or by `Arc`.
pub(super) struct BusyGuard<S: std::ops::Deref<Target = Sandbox>>(S);

impl<S: std::ops::Deref<Target = Sandbox>> BusyGuard<S> {
    fn new(sb: S) -> Self {
        sb.busy.fetch_add(1, Ordering::SeqCst);
        sb.touch();
        Self(sb)
    }

    /// The sandbox held busy.
    pub fn sandbox(&self) -> &Sandbox {
        &self.0
    }
}

impl<S: std::ops::Deref<Target = Sandbox>> Drop for BusyGuard<S> {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The state and what goes with it; changed only by [`Sandbox::transition`]
/// (except `agent`, which stopping a VM and a merge also take away).
pub(super) struct Status {
    pub state: SandboxState,
    pub error: Option<String>,
    pub boot_ms: Option<u64>,
    /// The agent's connection, while running or paused.
    pub agent: Option<Arc<AgentClient>>,
}

/// A state change ([`Sandbox::transition`]).
pub(super) enum Transition {
    /// `starting` -> `running`: the agent answered.
    Ready { agent: Arc<AgentClient>, boot_ms: u64 },
    /// `running` -> `paused`.
    Pause,
    /// `paused` -> `running`.
    Resume,
    /// `running`/`paused` -> `hibernated`: the hibernation is on disk; the
    /// agent connection is dropped.
    Hibernate,
    /// `hibernated` -> `starting`: its VM is being restored from disk.
    Wake,
    /// `starting`/`running`/`paused`/`hibernated` -> `to` (`stopped` or `failed`),
    /// with the reason; the agent connection is dropped.
    End { to: SandboxState, error: Option<String> },
    /// `starting` (a sandbox listed again from its record at start, with
    /// no VM) -> its kept state.
    Restored { to: SandboxState, error: Option<String> },
    /// Any state -> the state of the sandbox whose VM this one takes over
    /// (a merge).
    TakeOver { to: SandboxState, boot_ms: Option<u64>, agent: Option<Arc<AgentClient>> },
}

/// A transition that does not apply to the current state.
#[derive(Debug)]
pub(super) struct Refused {
    /// The current state.
    pub state: SandboxState,
    /// Its error, if it ended.
    pub error: Option<String>,
}

/// The VM and the thread that notices its end.
#[derive(Default)]
pub(super) struct VmSlot {
    /// `None` once stopped; whoever takes it stops it.
    pub vm: Option<Box<dyn VmHandle>>,
    pub monitor: Option<JoinHandle<()>>,
}

/// The sandbox's shares of the memory budget ([`crate::memory`]), held
/// while its VM runs: given back when the VM stops (teardown, a VM that
/// ended by itself) and handed over by a merge.
#[derive(Default)]
pub(super) struct MemoryHeld {
    /// Its guest memory.
    pub own: Option<Reservation>,
    /// The branch point it was restored from, shared with its siblings.
    pub branch_point: Option<Arc<Reservation>>,
}

/// Where a hibernated sandbox's state is and how long it is kept.
#[derive(Clone, Debug)]
pub(super) struct Hibernated {
    /// The hibernation's directory (`<kept>/<id>/hib-<g>`).
    pub dir: PathBuf,
    /// When it was written, ms since the Unix epoch.
    pub at_ms: u64,
    /// When it is deleted unless a call resumes it first, ms since the
    /// Unix epoch.
    pub expires_at_ms: u64,
}

/// A pooled sandbox's hand-out in flight: `None` until it ends, then
/// `Ok` or why it failed.
pub(super) type HandOut = tokio::sync::watch::Receiver<Option<Result<(), String>>>;

/// What a new sandbox is given besides its id, directory and shape.
pub(super) struct SandboxSetup {
    pub labels: BTreeMap<String, String>,
    /// The template it is restored from (`None`: booted, or a branch child
    /// of a booted sandbox).
    pub template: Option<String>,
    pub idle_timeout: Duration,
    /// The key of the caller it is made for ([`crate::CallContext::owner`]).
    pub owner: Option<u64>,
    /// The tenant it belongs to ([`crate::CallContext::tenant`]).
    pub tenant: Option<String>,
    /// Where its events go (`None`: nowhere, e.g. the default template's
    /// build VM).
    pub events: Option<tokio::sync::broadcast::Sender<SandboxEvent>>,
    /// The size of its own disk (MiB; 0: none), [`Sandbox::disk_mib`].
    pub disk_mib: u64,
    /// Its root filesystem image, [`Sandbox::rootfs`].
    pub rootfs: Option<PathBuf>,
}

/// One sandbox. See the module doc for the lock order.
pub(super) struct Sandbox {
    pub id: SandboxId,
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The size of its own disk (MiB; 0: it has none and writes to guest
    /// memory): what it takes of the server's disk budget and its
    /// tenant's disk quota while it is live or hibernated (sparse on the
    /// host, but accounted by its size).
    pub disk_mib: u64,
    /// The read-only root filesystem image its VM has as `/dev/vda`: a base
    /// image built from an OCI image (`tine_image`) for sandboxes of a
    /// template made from one, their branch children and their
    /// hibernations; `None`: the server's root filesystem.
    pub rootfs: Option<PathBuf>,
    /// Its labels ([`Sandbox::labels`]; `update` replaces them).
    labels: Mutex<BTreeMap<String, String>>,
    pub template: Option<String>,
    /// Its idle timeout ([`Sandbox::idle_timeout`]; `update` changes it).
    idle_timeout: Mutex<Duration>,
    pub created: Instant,
    pub created_at_ms: u64,
    /// Held by kill, pause, resume, snapshot, branch and merge, one at a
    /// time: the later one finds what the earlier one left (a sandbox
    /// killed or merged away is gone).
    pub control: tokio::sync::Mutex<()>,
    pub status: Mutex<Status>,
    pub vm: Mutex<VmSlot>,
    /// Where it came from and what came from it.
    pub lineage: Mutex<Lineage>,
    /// The VM's files (vsock socket, console log). A merge gives a sandbox
    /// its winner's VM, and with it the winner's directory.
    pub dir: Mutex<PathBuf>,
    /// Its shares of the memory budget.
    pub memory: Mutex<MemoryHeld>,
    /// The last use, in ms after `created`.
    last_used_ms: AtomicU64,
    /// Calls in flight ([`Sandbox::mark_busy`]); the reaper leaves busy
    /// sandboxes alone.
    pub busy: AtomicU64,
    /// The memory its VM was restored from, which a hibernation is
    /// written against ([`Base`]). A merge gives a sandbox its winner's.
    pub base: Mutex<Base>,
    /// Its hibernation while it is hibernated.
    pub hibernation: Mutex<Option<Hibernated>>,
    /// The pinned copy of its base (a directory name in the kept
    /// directory's bases) that its hibernations are written against, once
    /// it has been hibernated from a template.
    pub pin: Mutex<Option<String>>,
    /// Its network's policy and log, shared with its VM's NAT (`None`:
    /// no network). A merge gives a sandbox its winner's VM, and with it
    /// the winner's.
    pub net: Mutex<Option<Arc<netstack::control::NetControl>>>,
    /// The key of the caller it was made for (a pooled sandbox gets its
    /// owner when it is handed out).
    owner: Mutex<Option<u64>>,
    /// The tenant it belongs to (a pooled sandbox gets its tenant when it
    /// is handed out; `None`: the server's own).
    tenant: Mutex<Option<String>>,
    /// Whether it was handed out from the warm pool ([`super::pool`]).
    pub from_pool: std::sync::atomic::AtomicBool,
    /// A pooled sandbox's hand-out (reseed, environment) while it is in
    /// flight: agent calls wait for it ([`Sandbox::handed_out`]); `None`
    /// once done, or for a sandbox not from the pool.
    pub handout: Mutex<Option<HandOut>>,
    /// Where its events go.
    events: Option<tokio::sync::broadcast::Sender<SandboxEvent>>,
    /// The volumes attached to it ([`super::volumes`]), by slot.
    pub volumes: Mutex<Vec<crate::volumes::AttachedVolume>>,
    /// Its VM's device slots' chains when the VM last stopped (the tops
    /// included): what a writer's release gives its volume.
    pub slot_chains: Mutex<Vec<tine_storage::ChainSpec>>,
    /// The host ports published for it ([`crate::published_ports`]); a
    /// branch child has none.
    pub ports: Mutex<Vec<crate::published_ports::PublishedPort>>,
    /// Its secrets ([`crate::secrets`]), shared with its network's
    /// hand-over to the broker.
    pub secrets: Arc<Mutex<Vec<crate::secrets::SecretBinding>>>,
    /// The request bodies its broker flows may hold at once to swap
    /// secrets in them (one budget for all its flows, kept when its
    /// bindings change).
    pub body_budget: Arc<tine_broker::BodyBudget>,
    /// Its name ([`super::names`]; `None`: none).
    pub name: Mutex<Option<String>>,
    /// Its vCPU time at the last usage reading, and when: the interval its
    /// CPU % is over ([`Usage::cpu_percent`]).
    pub last_cpu: Mutex<Option<(std::time::Instant, Duration)>>,
}

impl Sandbox {
    /// A sandbox in state `starting`, created now, with no VM yet.
    pub fn new(id: SandboxId, dir: PathBuf, vcpus: u8, memory_mib: u64, setup: SandboxSetup) -> Self {
        let SandboxSetup { labels, template, idle_timeout, owner, tenant, events, disk_mib, rootfs } = setup;
        Sandbox {
            id,
            vcpus,
            memory_mib,
            disk_mib,
            rootfs,
            labels: Mutex::new(labels),
            template,
            idle_timeout: Mutex::new(idle_timeout),
            owner: Mutex::new(owner),
            tenant: Mutex::new(tenant),
            from_pool: std::sync::atomic::AtomicBool::new(false),
            handout: Mutex::new(None),
            events,
            created: Instant::now(),
            created_at_ms: unix_ms(),
            control: tokio::sync::Mutex::new(()),
            status: Mutex::new(Status { state: SandboxState::Starting, error: None, boot_ms: None, agent: None }),
            vm: Mutex::new(VmSlot::default()),
            lineage: Mutex::new(Lineage::default()),
            dir: Mutex::new(dir),
            memory: Mutex::new(MemoryHeld::default()),
            last_used_ms: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            base: Mutex::new(Base::None),
            hibernation: Mutex::new(None),
            pin: Mutex::new(None),
            net: Mutex::new(None),
            volumes: Mutex::new(Vec::new()),
            slot_chains: Mutex::new(Vec::new()),
            ports: Mutex::new(Vec::new()),
            secrets: Arc::new(Mutex::new(Vec::new())),
            body_budget: tine_broker::BodyBudget::new(tine_broker::DEFAULT_SANDBOX_BODY_BUDGET),
            name: Mutex::new(None),
            last_cpu: Mutex::new(None),
        }
    }

    /// Broadcasts `kind` as this sandbox's event (no subscriber: dropped).
    /// Takes `lineage`: call it holding none of the sandbox's locks.
    pub fn emit(&self, kind: EventKind) {
        let Some(tx) = &self.events else { return };
        let parent = lock(&self.lineage).parent.clone();
        let owner = *lock(&self.owner);
        let event = SandboxEvent { sandbox_id: self.id.clone(), owner, parent, at_ms: unix_ms(), kind };
        let _ = tx.send(event);
    }

    pub fn state(&self) -> SandboxState {
        lock(&self.status).state
    }

    pub fn dir(&self) -> PathBuf {
        lock(&self.dir).clone()
    }

    /// Counts a call in flight until the guard is dropped, which also
    /// happens when the call's future is dropped midway (a cancelled MCP
    /// request); touches the sandbox at both ends.
    pub fn mark_busy(&self) -> BusyGuard<&Sandbox> {
        BusyGuard::new(self)
    }

    /// As [`Sandbox::mark_busy`], for a use that outlives the caller's
    /// borrow (a connection into the guest).
    pub fn mark_busy_owned(self: &Arc<Self>) -> BusyGuard<Arc<Sandbox>> {
        BusyGuard::new(Arc::clone(self))
    }

    /// Records a use now (resets the idle clock).
    pub fn touch(&self) {
        self.last_used_ms.store(self.created.elapsed().as_millis() as u64, Ordering::SeqCst);
    }

    /// Time since the last use.
    pub fn idle(&self) -> Duration {
        self.created.elapsed().saturating_sub(Duration::from_millis(self.last_used_ms.load(Ordering::SeqCst)))
    }

    /// The agent connection, while running.
    pub fn agent(&self) -> Option<Arc<AgentClient>> {
        let st = lock(&self.status);
        if st.state == SandboxState::Running {
            st.agent.clone()
        } else {
            None
        }
    }

    /// The one place the state changes; see [`Transition`] for which
    /// changes apply. Returns the state it left.
    ///
    /// Errors: [`Refused`] with the current state if `t` does not apply.
    pub fn transition(&self, t: Transition) -> Result<SandboxState, Refused> {
        let mut st = lock(&self.status);
        let from = st.state;
        let refused = |st: &Status| Err(Refused { state: st.state, error: st.error.clone() });
        match t {
            Transition::Ready { agent, boot_ms } => {
                if from != SandboxState::Starting {
                    return refused(&st);
                }
                st.state = SandboxState::Running;
                st.boot_ms = Some(boot_ms);
                st.agent = Some(agent);
            }
            Transition::Pause => {
                if from != SandboxState::Running {
                    return refused(&st);
                }
                st.state = SandboxState::Paused;
            }
            Transition::Resume => {
                if from != SandboxState::Paused {
                    return refused(&st);
                }
                st.state = SandboxState::Running;
            }
            Transition::Hibernate => {
                if !matches!(from, SandboxState::Running | SandboxState::Paused) {
                    return refused(&st);
                }
                st.state = SandboxState::Hibernated;
                st.agent = None;
            }
            Transition::Wake => {
                if from != SandboxState::Hibernated {
                    return refused(&st);
                }
                st.state = SandboxState::Starting;
            }
            Transition::End { to, error } => {
                // The agent goes whatever the state; the first end's reason stays.
                st.agent = None;
                if !from.is_live() && from != SandboxState::Hibernated {
                    return refused(&st);
                }
                st.state = to;
                st.error = error;
            }
            Transition::Restored { to, error } => {
                if from != SandboxState::Starting {
                    return refused(&st);
                }
                st.state = to;
                st.error = error;
            }
            Transition::TakeOver { to, boot_ms, agent } => {
                st.state = to;
                st.error = None;
                st.boot_ms = boot_ms;
                st.agent = agent;
            }
        }
        Ok(from)
    }

    /// Its labels now.
    pub fn labels(&self) -> BTreeMap<String, String> {
        lock(&self.labels).clone()
    }

    /// Replaces its labels.
    pub fn set_labels(&self, labels: BTreeMap<String, String>) {
        *lock(&self.labels) = labels;
    }

    /// Its idle timeout now.
    pub fn idle_timeout(&self) -> Duration {
        *lock(&self.idle_timeout)
    }

    /// Changes its idle timeout; the time it has been idle so far counts.
    pub fn set_idle_timeout(&self, timeout: Duration) {
        *lock(&self.idle_timeout) = timeout;
    }

    /// The key of the caller it was made for.
    pub fn owner(&self) -> Option<u64> {
        *lock(&self.owner)
    }

    /// Waits until a pooled sandbox's hand-out (reseed, environment) is
    /// done; at once for any other sandbox.
    ///
    /// Errors: [`super::SandboxError::Connection`] when the hand-out failed.
    pub async fn handed_out(&self) -> Result<(), super::SandboxError> {
        let Some(mut rx) = lock(&self.handout).clone() else { return Ok(()) };
        let done = rx.wait_for(Option::is_some).await.map(|r| r.clone()).ok().flatten();
        match done {
            Some(Ok(())) => {
                *lock(&self.handout) = None;
                Ok(())
            }
            Some(Err(reason)) => Err(super::SandboxError::Connection { id: self.id.clone(), reason }),
            None => Err(super::SandboxError::Connection {
                id: self.id.clone(),
                reason: "its hand-out from the warm pool ended without a result".into(),
            }),
        }
    }

    /// Gives it to the caller `owner` (a pooled sandbox at hand-out).
    pub fn set_owner(&self, owner: Option<u64>) {
        *lock(&self.owner) = owner;
    }

    /// The tenant it belongs to (`None`: the server's own).
    pub fn tenant(&self) -> Option<String> {
        lock(&self.tenant).clone()
    }

    /// Gives it to `tenant` (a pooled sandbox at hand-out).
    pub fn set_tenant(&self, tenant: Option<String>) {
        *lock(&self.tenant) = tenant;
    }

    pub fn info(&self, usage: Option<Usage>) -> SandboxInfo {
        let hib = lock(&self.hibernation).clone();
        let policy = lock(&self.net).as_ref().map(|c| c.policy());
        // One lock at a time: a guard taken inside the struct expression
        // lives to its end, so several would be held at once in the
        // expression's order (with `status`, and against `records::record_of`,
        // which takes the same ones: the two deadlocked over `name`).
        let name = lock(&self.name).clone();
        let lineage = lock(&self.lineage).clone();
        // The stored names (with the tenant) are the server's.
        let volumes = lock(&self.volumes)
            .iter()
            .map(|v| crate::volumes::AttachedVolume { stored: String::new(), ..v.clone() })
            .collect();
        let ports = lock(&self.ports).clone();
        let secrets = lock(&self.secrets).clone();
        let (state, error, boot_ms) = {
            let st = lock(&self.status);
            (st.state, st.error.clone(), st.boot_ms)
        };
        SandboxInfo {
            sandbox_id: self.id.clone(),
            name,
            tenant: self.tenant(),
            state,
            error,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            disk_mib: self.disk_mib,
            labels: self.labels(),
            template: self.template.clone(),
            lineage,
            created_at_ms: self.created_at_ms,
            uptime_ms: self.created.elapsed().as_millis() as u64,
            boot_ms,
            idle_timeout_secs: self.idle_timeout().as_secs(),
            idle_ms: self.idle().as_millis() as u64,
            network: policy.as_ref().map(|c| c.policy().clone()),
            network_ceiling: policy.as_ref().and_then(|c| c.ceiling().map(|c| c.policy().clone())),
            from_pool: self.from_pool.load(Ordering::SeqCst),
            hibernated_at_ms: hib.as_ref().map(|h| h.at_ms),
            expires_at_ms: hib.as_ref().map(|h| h.expires_at_ms),
            usage,
            volumes,
            ports,
            secrets,
        }
    }

    /// [`SandboxError::Gone`] for a sandbox that left the map: why, from
    /// its end's reason.
    pub fn gone(&self) -> super::SandboxError {
        let reason = lock(&self.status).error.clone().unwrap_or_else(|| "killed".into());
        super::SandboxError::Gone { id: self.id.clone(), reason }
    }

    /// Marks the sandbox ended (unless it already is) and drops the agent.
    pub fn end(&self, to: SandboxState, error: Option<String>) {
        let _ = self.transition(Transition::End { to, error });
    }

    /// Ends the sandbox for good and frees what it holds: marks it
    /// `stopped` with `reason` (unless it already ended), stops its VM off
    /// the async threads and removes its directory. The one teardown of a
    /// sandbox's resources: a kill, a failed create, a discarded branch
    /// child, a pooled sandbox let go and shutdown all come here. Taking it
    /// out of the manager's map is the caller's part. Waits for the VM's
    /// threads; see [`Sandbox::retire_in_background`] for callers that
    /// cannot wait.
    pub async fn retire(self: &Arc<Self>, reason: Option<String>) {
        self.end(SandboxState::Stopped, reason);
        let s = self.clone();
        let _ = tokio::task::spawn_blocking(move || s.free()).await;
    }

    /// [`Sandbox::retire`] without waiting: the VM is stopped and the
    /// directory removed in a blocking task (or on this thread outside a
    /// tokio runtime).
    pub fn retire_in_background(self: Arc<Self>, reason: Option<String>) {
        self.end(SandboxState::Stopped, reason);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || self.free())),
            Err(_) => self.free(),
        }
    }

    /// Stops the VM and removes the sandbox's directory (blocking): the
    /// work of both retires.
    fn free(&self) {
        self.stop_vm();
        remove_dir(&self.dir());
    }

    /// A watcher of the VM's end, if there is a VM.
    pub fn exit_watch(&self) -> Option<Box<dyn ExitWatch>> {
        lock(&self.vm).vm.as_ref().map(|vm| vm.exit_watch())
    }

    /// Stops the VM and joins its threads (blocking).
    pub fn stop_vm(&self) {
        // The slot chains while the VM is still where a disk sweep sees
        // it, so no layer of theirs is unguarded meanwhile.
        if let Some(vm) = lock(&self.vm).vm.as_ref() {
            self.note_slot_chains(vm.as_ref());
        }
        let slot = std::mem::take(&mut *lock(&self.vm));
        if let Some(mut vm) = slot.vm {
            vm.stop();
        }
        lock(&self.status).agent = None;
        if let Some(m) = slot.monitor {
            let _ = m.join();
        }
        drop(std::mem::take(&mut *lock(&self.memory)));
    }

    /// The sandbox disk of its VM: its index among the VM's disks (after
    /// the root, before the device slots), its size (bytes) and its chain.
    /// `None` without a VM, or for a VM without a disk of its own (its
    /// disks after the root are all slots).
    pub(super) fn own_disk(&self) -> Option<(usize, u64, tine_storage::ChainSpec)> {
        let slot = lock(&self.vm);
        let vm = slot.vm.as_ref()?;
        let disks = vm.disks();
        // The root, then the sandbox disk if any, then the slots.
        let index = 1;
        if disks.len() <= index + vm.slot_count() {
            return None;
        }
        disks.into_iter().nth(index).map(|(size, chain)| (index, size, chain))
    }

    /// Keeps the chains of `vm`'s device slots ([`Sandbox::slot_chains`]),
    /// when it has volumes.
    fn note_slot_chains(&self, vm: &dyn VmHandle) {
        if !lock(&self.volumes).is_empty() {
            *lock(&self.slot_chains) = vm.slot_chains();
        }
    }

    /// Called by the monitor thread when the VM has stopped on its own.
    fn on_vm_exit(&self) {
        if let Some(vm) = lock(&self.vm).vm.as_ref() {
            self.note_slot_chains(vm.as_ref());
        }
        let Some(mut vm) = lock(&self.vm).vm.take() else { return };
        let end = vm.stop();
        // Read before the VM goes: a crash's event carries it.
        let console = match end {
            VmEnd::GuestFault(_) => vm.console_tail(CONSOLE_TAIL_LINES),
            _ => String::new(),
        };
        drop(vm);
        drop(std::mem::take(&mut *lock(&self.memory)));
        let (state, error) = match end {
            VmEnd::PowerOff => (SandboxState::Stopped, "the guest powered off".to_string()),
            VmEnd::Reset => (SandboxState::Stopped, "the guest rebooted".to_string()),
            VmEnd::Stopped => return,
            VmEnd::GuestFault(e) => (SandboxState::Failed, e),
        };
        tracing::warn!(sandbox = %self.id, ?state, "sandbox ended: {}", error.lines().next().unwrap_or(""));
        let ended = self.transition(Transition::End { to: state, error: Some(error.clone()) }).is_ok();
        if ended {
            self.emit(match state {
                SandboxState::Failed => EventKind::Crashed {
                    // Its first line says what happened.
                    error: crate::progress::cut(&error, CRASH_ERROR_BYTES),
                    console_tail: keep_end(&console, CONSOLE_TAIL_BYTES),
                },
                _ => EventKind::Stopped { reason: error },
            });
        }
    }

    /// Puts `vm` in the sandbox and starts the thread that waits for it to
    /// end by itself and records why.
    ///
    /// Errors: the thread could not be spawned (the VM is kept; stopping
    /// the sandbox stops it).
    pub fn attach_vm(self: &Arc<Self>, vm: Box<dyn VmHandle>) -> std::io::Result<()> {
        let watch = vm.exit_watch();
        lock(&self.vm).vm = Some(vm);
        self.spawn_monitor(watch)
    }

    /// Starts the monitor thread for the VM `watch` watches.
    pub fn spawn_monitor(self: &Arc<Self>, watch: Box<dyn ExitWatch>) -> std::io::Result<()> {
        let weak: Weak<Sandbox> = Arc::downgrade(self);
        let monitor = std::thread::Builder::new().name(format!("mon-{}", self.id)).spawn(move || {
            watch.wait(None);
            if let Some(sb) = weak.upgrade() {
                sb.on_vm_exit();
            }
        })?;
        lock(&self.vm).monitor = Some(monitor);
        Ok(())
    }
}
