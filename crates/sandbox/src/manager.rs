//! The sandbox manager: creation, lookup, agent calls, idle reaping, crash
//! handling and cleanup.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use schemars::JsonSchema;
use serde::Serialize;
use tine_agent_client::{AgentClient, ClientError, AGENT_PORT};
use tine_protocol::{
    AgentError, Command, DirEntry, Exec, ExecReply, FileData, FileStat, Op, Python, PythonReply, ReadFile, Reply,
    Reseed, WriteFile,
};
use vmm::{
    BuildError, ControlError, DiskConfig, HostProfile, MemoryBacking, RunningVm, VmConfig, VmOutcome, VsockConfig,
};

use crate::limits::{Limits, LimitsError};

mod branch;
use crate::templates::{Template, TemplateError, TemplateInfo, TemplateMeta, TemplateStore, DEFAULT_TEMPLATE};
pub use branch::BranchResult;

/// A sandbox's id, `sb-<n>`.
pub type SandboxId = String;

/// The guest CID every sandbox's vsock device gets (each VM has its own
/// device and host socket, so CIDs need not differ).
const GUEST_CID: u64 = 3;
/// Guest console lines kept in a failed sandbox's error.
const CONSOLE_TAIL_LINES: usize = 25;
/// Pause between attempts to reach a booting guest's agent.
const AGENT_RETRY: Duration = Duration::from_millis(250);
/// Extra time a call gets beyond the timeout the agent enforces itself
/// (the agent's answer has to travel back; guests on slow hosts are slow).
const CALL_GRACE: Duration = Duration::from_secs(30);
/// Timeout of short agent calls (files, info, reseed).
const SHORT_CALL: Duration = Duration::from_secs(60);
/// Entropy handed to each new guest (bytes).
const SEED_BYTES: usize = 64;
/// Restores allowed at once per boot slot ([`Limits::concurrent_boots`]).
const RESTORES_PER_BOOT_SLOT: usize = 2;
/// Longest Unix socket path (`sun_path` is 108 bytes with its NUL).
const MAX_UDS_PATH: usize = 107;

/// Where the manager finds images and keeps its files.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Guest kernel (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Root filesystem image (ext4), attached read-only to every sandbox.
    pub rootfs: PathBuf,
    /// Directory for per-sandbox files; created if missing, and emptied of
    /// a previous run's leftovers at start.
    pub run_dir: PathBuf,
    /// Directory of templates (see [`crate::templates`]); created if missing.
    pub templates_dir: PathBuf,
    /// How restored sandboxes get their memory from a template's file.
    pub memory_backing: MemoryBacking,
    /// The host profile.
    pub profile: HostProfile,
    /// Defaults and caps.
    pub limits: Limits,
}

/// What to create.
#[derive(Clone, Debug, Default)]
pub struct SandboxSpec {
    /// vCPUs (`None`: the default).
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (`None`: the default).
    pub memory_mib: Option<u64>,
    /// Free-form labels, for `list` filters.
    pub labels: BTreeMap<String, String>,
    /// Idle timeout in seconds (`None`: the default).
    pub idle_timeout_secs: Option<u64>,
    /// Restore from this template instead of booting (`None`: the default
    /// template, when it exists and has the requested shape).
    pub template: Option<String>,
}

/// A sandbox's lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// The VM is booting; the agent has not answered yet.
    Starting,
    /// The agent answers; tools work.
    Running,
    /// The vCPUs are parked; memory and files are kept. Tools that need
    /// the guest resume it by themselves.
    Paused,
    /// The guest powered off or rebooted by itself.
    Stopped,
    /// The guest crashed or could not start; `error` says why.
    Failed,
}

/// Resource use of a running sandbox.
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct Usage {
    /// CPU time the vCPUs used since start (ms).
    pub cpu_time_ms: u64,
    /// Host memory backing guest RAM now (bytes): the pages the guest touched.
    pub host_memory_bytes: u64,
    /// Guest RAM the guest kernel reports in use (bytes), if the agent answered.
    pub guest_memory_used_bytes: Option<u64>,
    /// Guest RAM (bytes) as the guest kernel sees it, if the agent answered.
    pub guest_memory_total_bytes: Option<u64>,
    /// Free space on the guest's writable root (bytes), if the agent answered.
    pub disk_free_bytes: Option<u64>,
}

/// What a sandbox is and how it is doing.
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct SandboxInfo {
    /// The id.
    pub sandbox_id: SandboxId,
    /// The state.
    pub state: SandboxState,
    /// Why it failed or stopped (with the guest console's last lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory (MiB).
    pub memory_mib: u64,
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
    /// Resource use, from `info` on a running sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A command to run.
#[derive(Clone, Debug, Default)]
pub struct ExecRequest {
    /// `bash -c` script.
    pub command: String,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Bytes for stdin.
    pub stdin: Vec<u8>,
    /// Timeout (ms; 0: the agent's default).
    pub timeout_ms: u32,
    /// Output cap per stream (bytes; 0: the agent's default).
    pub output_limit: u32,
}

/// Errors of the manager. Messages are meant for the person or model that
/// made the call: each says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// No sandbox has this id.
    #[error("no sandbox {0}; call sandbox_list to see the live ones, or sandbox_create for a new one")]
    NotFound(SandboxId),
    /// The live-sandbox cap is reached.
    #[error("{live} sandboxes are live, the limit is {max}; kill one with sandbox_kill first")]
    TooMany {
        /// Live sandboxes.
        live: usize,
        /// The cap.
        max: usize,
    },
    /// The request is outside the limits.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// The sandbox is still booting.
    #[error("sandbox {0} is still starting; try again in a few seconds")]
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
        source: ControlError,
    },
    /// The sandbox is not running any more.
    #[error("sandbox {id} is {state:?} and cannot run anything: {reason}. Kill it and create a new one")]
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
    Start(#[source] BuildError),
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
    /// The server is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// A template cannot be used or made.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The requested shape differs from the template's.
    #[error("template {name:?} makes sandboxes of {vcpus} vCPUs and {memory_mib} MiB; leave out vcpus and memory_mib, or make a template of the shape you need")]
    TemplateShape {
        /// The template.
        name: String,
        /// Its vCPUs.
        vcpus: u8,
        /// Its memory (MiB).
        memory_mib: u64,
    },
    /// Taking a snapshot failed.
    #[error("cannot snapshot sandbox {id}: {source}")]
    Snapshot {
        /// The id.
        id: SandboxId,
        /// Why.
        #[source]
        source: ControlError,
    },
    /// Taking the branch point failed.
    #[error("cannot branch sandbox {id}: {source}")]
    Branch {
        /// The id.
        id: SandboxId,
        /// Why.
        #[source]
        source: ControlError,
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
    #[error("sandbox {winner} was not branched from {parent} (its lineage: {lineage}); merge a sandbox into the one it was branched from, or an ancestor of it")]
    NotDescendant {
        /// The would-be winner.
        winner: SandboxId,
        /// The would-be parent.
        parent: SandboxId,
        /// The winner's ancestors, nearest first.
        lineage: String,
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

struct Status {
    state: SandboxState,
    error: Option<String>,
    boot_ms: Option<u64>,
}

struct Sandbox {
    id: SandboxId,
    vcpus: u8,
    memory_mib: u64,
    labels: BTreeMap<String, String>,
    template: Option<String>,
    idle_timeout: Duration,
    created: Instant,
    created_at_ms: u64,
    /// The VM's files (vsock socket, console log). A merge gives a sandbox
    /// its winner's VM, and with it the winner's directory.
    dir: Mutex<PathBuf>,
    /// Where it came from and what came from it.
    lineage: Mutex<Lineage>,
    status: Mutex<Status>,
    last_used: Mutex<Instant>,
    /// `None` once stopped; whoever takes it stops it.
    vm: Mutex<Option<RunningVm>>,
    agent: Mutex<Option<Arc<AgentClient>>>,
    monitor: Mutex<Option<JoinHandle<()>>>,
    /// Calls in flight; the reaper leaves busy sandboxes alone.
    busy: AtomicU64,
    /// Held by pause, resume and snapshot, one at a time.
    control: Mutex<()>,
}

/// A sandbox's place in a branch tree.
#[derive(Clone, Debug, Default, Serialize, JsonSchema)]
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
    /// The last sandbox merged into it (`sandbox_merge_into`), whose VM
    /// it now runs.
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Sandbox {
    /// A sandbox in state `starting`, created now, with no VM yet.
    fn new(
        id: SandboxId,
        dir: PathBuf,
        vcpus: u8,
        memory_mib: u64,
        labels: BTreeMap<String, String>,
        template: Option<String>,
        idle_timeout: Duration,
    ) -> Self {
        Sandbox {
            id,
            dir: Mutex::new(dir),
            vcpus,
            memory_mib,
            labels,
            template,
            idle_timeout,
            created: Instant::now(),
            created_at_ms: unix_ms(),
            lineage: Mutex::new(Lineage::default()),
            status: Mutex::new(Status { state: SandboxState::Starting, error: None, boot_ms: None }),
            last_used: Mutex::new(Instant::now()),
            vm: Mutex::new(None),
            agent: Mutex::new(None),
            monitor: Mutex::new(None),
            busy: AtomicU64::new(0),
            control: Mutex::new(()),
        }
    }

    fn state(&self) -> SandboxState {
        lock(&self.status).state
    }

    fn dir(&self) -> PathBuf {
        lock(&self.dir).clone()
    }

    fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }

    fn info(&self, usage: Option<Usage>) -> SandboxInfo {
        let st = lock(&self.status);
        SandboxInfo {
            sandbox_id: self.id.clone(),
            state: st.state,
            error: st.error.clone(),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            labels: self.labels.clone(),
            template: self.template.clone(),
            lineage: lock(&self.lineage).clone(),
            created_at_ms: self.created_at_ms,
            uptime_ms: self.created.elapsed().as_millis() as u64,
            boot_ms: st.boot_ms,
            idle_timeout_secs: self.idle_timeout.as_secs(),
            idle_ms: lock(&self.last_used).elapsed().as_millis() as u64,
            usage,
        }
    }

    /// Marks the sandbox ended (unless it already is) and drops the agent.
    fn end(&self, state: SandboxState, error: Option<String>) {
        let mut st = lock(&self.status);
        if matches!(st.state, SandboxState::Starting | SandboxState::Running | SandboxState::Paused) {
            st.state = state;
            st.error = error;
        }
        drop(st);
        lock(&self.agent).take();
    }

    /// Stops the VM and joins its threads (blocking).
    fn stop_vm(&self) {
        let vm = lock(&self.vm).take();
        if let Some(mut vm) = vm {
            let _ = vm.stop();
        }
        lock(&self.agent).take();
        let monitor = lock(&self.monitor).take();
        if let Some(m) = monitor {
            let _ = m.join();
        }
    }

    /// Called by the monitor thread when the VM has stopped on its own.
    fn on_vm_exit(&self) {
        let Some(mut vm) = lock(&self.vm).take() else { return };
        let outcome = vm.stop();
        drop(vm);
        let (state, error) = match outcome {
            Ok(VmOutcome::PowerOff) => (SandboxState::Stopped, "the guest powered off".to_string()),
            Ok(VmOutcome::Reset) => (SandboxState::Stopped, "the guest rebooted".to_string()),
            Ok(VmOutcome::Stopped) => return,
            Err(e) => (SandboxState::Failed, e.to_string()),
        };
        tracing::warn!(sandbox = %self.id, ?state, "sandbox ended: {}", error.lines().next().unwrap_or(""));
        self.end(state, Some(error));
    }
}

/// Starts the thread that waits for `sb`'s VM (`watcher`) to end by
/// itself and records why ([`Sandbox::on_vm_exit`]).
fn spawn_monitor(sb: &Arc<Sandbox>, watcher: vmm::ExitWatcher) -> std::io::Result<JoinHandle<()>> {
    let weak: Weak<Sandbox> = Arc::downgrade(sb);
    std::thread::Builder::new().name(format!("mon-{}", sb.id)).spawn(move || {
        watcher.wait(None);
        if let Some(sb) = weak.upgrade() {
            sb.on_vm_exit();
        }
    })
}

/// The error for a task that panicked or was cancelled (`what`: "branch
/// task", ...).
fn task_failed(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> SandboxError {
    move |e| SandboxError::Io { what: what.into(), source: std::io::Error::other(e) }
}

/// Removes `dir` and everything in it; a missing directory is fine.
fn remove_dir(dir: &std::path::Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("cannot remove {}: {e}", dir.display()),
    }
}

/// The sandbox manager. Cheap to share: hold it in an `Arc`.
pub struct Manager {
    config: ManagerConfig,
    sandboxes: Mutex<BTreeMap<SandboxId, Arc<Sandbox>>>,
    next_id: AtomicU64,
    shutting_down: AtomicBool,
    /// Kills in progress (their sandboxes have already left the map);
    /// [`Manager::shutdown`] waits for them.
    dying: AtomicU64,
    dying_done: tokio::sync::Notify,
    /// One permit per boot allowed at once ([`Limits::concurrent_boots`]).
    boot_slots: tokio::sync::Semaphore,
    /// Restores (from a template or a branch point) allowed at once, until
    /// the agent answers: [`RESTORES_PER_BOOT_SLOT`] per boot slot.
    /// Restored guests all handle their device resets and reconnect at
    /// once; 32 at a time on 2 host CPUs starved each other for minutes.
    restore_slots: tokio::sync::Semaphore,
    templates: TemplateStore,
    /// Whether the default template is being built.
    default_building: tokio::sync::watch::Sender<bool>,
}

/// Where a new sandbox's VM comes from.
enum Origin {
    Boot,
    Template(Arc<Template>),
    /// A branch point of another sandbox.
    Branch(Arc<vmm::Snapshot>),
}

/// Marks the default template as being built for as long as it lives.
struct BuildFlag<'a>(&'a tokio::sync::watch::Sender<bool>);

impl<'a> BuildFlag<'a> {
    fn set(flag: &'a tokio::sync::watch::Sender<bool>) -> Self {
        flag.send_replace(true);
        BuildFlag(flag)
    }
}

impl Drop for BuildFlag<'_> {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// Counts a kill in progress for as long as it lives.
struct Dying<'a>(&'a Manager);

impl Drop for Dying<'_> {
    fn drop(&mut self) {
        self.0.dying.fetch_sub(1, Ordering::SeqCst);
        self.0.dying_done.notify_waiters();
    }
}

impl Manager {
    /// Checks the images and limits, prepares `run_dir` (removing what a
    /// previous run left there) and returns the manager.
    ///
    /// Errors: [`SandboxError::Limits`], [`SandboxError::Io`] naming the
    /// missing image or the directory that cannot be made.
    pub fn new(config: ManagerConfig) -> Result<Arc<Self>, SandboxError> {
        config.limits.validate()?;
        for (what, p) in [("guest kernel", &config.kernel), ("root filesystem image", &config.rootfs)] {
            std::fs::metadata(p)
                .map_err(|source| SandboxError::Io { what: format!("{what} {}", p.display()), source })?;
        }
        let io = |what: String| move |source| SandboxError::Io { what, source };
        std::fs::create_dir_all(&config.run_dir).map_err(io(format!("create {}", config.run_dir.display())))?;
        let entries = std::fs::read_dir(&config.run_dir).map_err(io(format!("read {}", config.run_dir.display())))?;
        for e in entries.flatten() {
            tracing::info!("removing {} left by an earlier run", e.path().display());
            remove_dir(&e.path());
        }
        let templates = TemplateStore::new(config.templates_dir.clone(), config.kernel.clone(), config.rootfs.clone())?;
        Ok(Arc::new(Manager {
            templates,
            default_building: tokio::sync::watch::Sender::new(false),
            sandboxes: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            dying: AtomicU64::new(0),
            dying_done: tokio::sync::Notify::new(),
            boot_slots: tokio::sync::Semaphore::new(config.limits.concurrent_boots()),
            restore_slots: tokio::sync::Semaphore::new(config.limits.concurrent_boots() * RESTORES_PER_BOOT_SLOT),
            config,
        }))
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.config.limits
    }

    fn get(&self, id: &str) -> Result<Arc<Sandbox>, SandboxError> {
        lock(&self.sandboxes).get(id).cloned().ok_or_else(|| SandboxError::NotFound(id.to_string()))
    }

    /// Creates a sandbox and waits until its agent answers (a cold boot:
    /// tens of seconds on hosts without hardware virtualization).
    ///
    /// The work runs in its own task, so a caller that goes away does not
    /// leave a half-made sandbox behind.
    ///
    /// Errors: [`SandboxError::Limits`], [`SandboxError::TooMany`],
    /// [`SandboxError::Start`], [`SandboxError::Boot`],
    /// [`SandboxError::ShuttingDown`], [`SandboxError::Io`].
    pub async fn create(self: &Arc<Self>, spec: SandboxSpec) -> Result<SandboxInfo, SandboxError> {
        let me = self.clone();
        match tokio::spawn(async move { me.create_inner(spec).await }).await {
            Ok(r) => r,
            Err(e) => Err(task_failed("sandbox creation task")(e)),
        }
    }

    /// Template `name`, loaded (and checked) off the async threads.
    async fn load_template(self: &Arc<Self>, name: String) -> Result<Arc<Template>, SandboxError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.templates.load(&name))
            .await
            .map_err(task_failed("template load task"))?
            .map_err(SandboxError::Template)
    }

    /// Where a sandbox of `spec` comes from: the named template, else the
    /// default template when it fits the requested shape (waiting for it
    /// if it is being built), else a boot.
    async fn origin(self: &Arc<Self>, spec: &SandboxSpec) -> Result<(Origin, u8, u64), SandboxError> {
        let limits = &self.config.limits;
        if let Some(name) = &spec.template {
            let t = self.load_template(name.clone()).await?;
            let (vcpus, memory_mib) = (t.meta.vcpus, t.meta.memory_mib);
            let differs =
                spec.vcpus.is_some_and(|v| v != u64::from(vcpus)) || spec.memory_mib.is_some_and(|m| m != memory_mib);
            if differs {
                return Err(SandboxError::TemplateShape { name: name.clone(), vcpus, memory_mib });
            }
            return Ok((Origin::Template(t), vcpus, memory_mib));
        }
        let vcpus = limits.vcpus(spec.vcpus)?;
        let memory_mib = limits.memory_mib(spec.memory_mib)?;
        if vcpus == limits.default_vcpus && memory_mib == limits.default_memory_mib {
            let mut building = self.default_building.subscribe();
            let _ = building.wait_for(|b| !*b).await;
            match self.load_template(DEFAULT_TEMPLATE.into()).await {
                Ok(t) if t.meta.vcpus == vcpus && t.meta.memory_mib == memory_mib => {
                    return Ok((Origin::Template(t), vcpus, memory_mib))
                }
                Ok(_) => tracing::info!("the default template has another shape than the limits' defaults; booting"),
                Err(e) => tracing::info!("booting instead of restoring: {e}"),
            }
        }
        Ok((Origin::Boot, vcpus, memory_mib))
    }

    async fn create_inner(self: Arc<Self>, spec: SandboxSpec) -> Result<SandboxInfo, SandboxError> {
        let limits = &self.config.limits;
        let idle_timeout = limits.idle_timeout(spec.idle_timeout_secs)?;
        limits.check_labels(&spec.labels)?;
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(SandboxError::ShuttingDown);
        }
        let (origin, vcpus, memory_mib) = self.origin(&spec).await?;

        // Reserve the slot and the id under the lock.
        let sandbox = {
            let mut map = lock(&self.sandboxes);
            if self.shutting_down.load(Ordering::SeqCst) {
                return Err(SandboxError::ShuttingDown);
            }
            let live = map
                .values()
                .filter(|s| matches!(s.state(), SandboxState::Starting | SandboxState::Running | SandboxState::Paused))
                .count();
            if live >= limits.max_sandboxes {
                return Err(SandboxError::TooMany { live, max: limits.max_sandboxes });
            }
            let id = format!("sb-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
            let template = match &origin {
                Origin::Template(t) => Some(t.meta.name.clone()),
                Origin::Boot | Origin::Branch(_) => None,
            };
            let sandbox = Arc::new(Sandbox::new(
                id.clone(),
                self.config.run_dir.join(&id),
                vcpus,
                memory_mib,
                spec.labels,
                template,
                idle_timeout,
            ));
            map.insert(id, sandbox.clone());
            sandbox
        };
        match self.boot(&sandbox, origin).await {
            Ok(()) => Ok(sandbox.info(None)),
            Err(e) => {
                lock(&self.sandboxes).remove(&sandbox.id);
                let sb = sandbox.clone();
                let _ = tokio::task::spawn_blocking(move || sb.stop_vm()).await;
                remove_dir(&sandbox.dir());
                tracing::warn!(sandbox = %sandbox.id, "creation failed: {e}");
                Err(e)
            }
        }
    }

    async fn boot(&self, sb: &Arc<Sandbox>, origin: Origin) -> Result<(), SandboxError> {
        let io = |what: String| move |source| SandboxError::Io { what, source };
        let dir = sb.dir();
        std::fs::create_dir(&dir).map_err(io(format!("create {}", dir.display())))?;
        let uds = dir.join("vsock.sock");
        if uds.as_os_str().len() > MAX_UDS_PATH {
            return Err(SandboxError::Io {
                what: format!(
                    "socket path {} is longer than {MAX_UDS_PATH} bytes; use a shorter data directory",
                    uds.display()
                ),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
        // Wait for a boot or restore slot; the boot timeout starts once
        // the VM does.
        let slots = match origin {
            Origin::Boot => &self.boot_slots,
            Origin::Template(_) | Origin::Branch(_) => &self.restore_slots,
        };
        let _slot = slots.acquire().await.map_err(|_| SandboxError::ShuttingDown)?;
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(SandboxError::ShuttingDown);
        }
        let mut config = VmConfig::new(sb.id.clone(), &self.config.kernel);
        config.profile = self.config.profile;
        config.vcpus = sb.vcpus;
        config.memory_mib = sb.memory_mib;
        config.console_log = Some(dir.join("console.log"));
        config.disks = vec![DiskConfig { path: self.config.rootfs.clone(), read_only: true, id: "root".into() }];
        config.vsock = Some(VsockConfig { cid: GUEST_CID, uds_path: uds.clone() });
        config.cmdline = "root=/dev/vda ro rootfstype=ext4 quiet".into();

        let backing = self.config.memory_backing;
        let vm = tokio::task::spawn_blocking(move || match origin {
            Origin::Boot => vmm::build_for_boot(&config),
            Origin::Template(t) => vmm::build_from_snapshot(&config, &t.snapshot, backing),
            // Children share the branch point's pages (MAP_PRIVATE of its
            // memfd) whatever the templates' backing.
            Origin::Branch(s) => vmm::build_from_snapshot(&config, &s, MemoryBacking::Private),
        })
        .await
        .map_err(task_failed("VM start task"))?
        .map_err(SandboxError::Start)?;
        let watcher = vm.exit_watcher();
        let started = vm.started();
        *lock(&sb.vm) = Some(vm);
        let monitor = spawn_monitor(sb, watcher.clone()).map_err(io("spawn the monitor thread".into()))?;
        *lock(&sb.monitor) = Some(monitor);

        let deadline = Instant::now() + Duration::from_secs(self.config.limits.boot_timeout_secs);
        let mut last_error = String::from("no attempt yet");
        let agent = loop {
            if watcher.is_stopped() {
                // The monitor records the reason; give it a moment.
                let m = lock(&sb.monitor).take();
                if let Some(m) = m {
                    let _ = tokio::task::spawn_blocking(move || m.join()).await;
                }
                let st = lock(&sb.status);
                let reason = st.error.clone().unwrap_or_else(|| "the VM stopped during boot".into());
                return Err(SandboxError::NotRunning { id: sb.id.clone(), state: SandboxState::Failed, reason });
            }
            if Instant::now() >= deadline || self.shutting_down.load(Ordering::SeqCst) {
                let console =
                    lock(&sb.vm).as_ref().map(|vm| vm.console().last_lines(CONSOLE_TAIL_LINES)).unwrap_or_default();
                return Err(SandboxError::Boot {
                    secs: self.config.limits.boot_timeout_secs,
                    reason: last_error,
                    console,
                });
            }
            match AgentClient::connect(&uds, AGENT_PORT).await {
                Ok(client) => match client.call(Op::Ping, Duration::from_secs(10)).await {
                    Ok(_) => break client,
                    Err(e) => last_error = e.to_string(),
                },
                Err(e) => last_error = e.to_string(),
            }
            tokio::time::sleep(AGENT_RETRY).await;
        };
        // A fresh guest gets host entropy and the host's clock; a restored
        // one must not go on with its template's RNG state and old clock.
        let mut entropy = vec![0u8; SEED_BYTES];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut entropy))
            .map_err(io("read /dev/urandom".into()))?;
        let unix_time_ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        agent
            .call(Op::Reseed(Reseed { entropy, unix_time_ns }), SHORT_CALL)
            .await
            .map_err(|e| SandboxError::Connection { id: sb.id.clone(), reason: format!("reseed: {e}") })?;

        let boot_ms = started.elapsed().as_millis() as u64;
        *lock(&sb.agent) = Some(Arc::new(agent));
        {
            let mut st = lock(&sb.status);
            if st.state != SandboxState::Starting {
                return Err(SandboxError::NotRunning {
                    id: sb.id.clone(),
                    state: st.state,
                    reason: st.error.clone().unwrap_or_default(),
                });
            }
            st.state = SandboxState::Running;
            st.boot_ms = Some(boot_ms);
        }
        sb.touch();
        tracing::info!(sandbox = %sb.id, vcpus = sb.vcpus, memory_mib = sb.memory_mib, template = ?sb.template,
            "sandbox ready in {boot_ms} ms");
        Ok(())
    }

    /// Whether a sandbox with this id exists (in any state).
    pub fn contains(&self, id: &str) -> bool {
        lock(&self.sandboxes).contains_key(id)
    }

    /// How many sandboxes exist (in any state).
    pub fn len(&self) -> usize {
        lock(&self.sandboxes).len()
    }

    /// Whether there are no sandboxes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every sandbox whose labels include all of `labels`, by id.
    pub fn list(&self, labels: &BTreeMap<String, String>) -> Vec<SandboxInfo> {
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        all.iter().filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(v))).map(|s| s.info(None)).collect()
    }

    /// One sandbox, with its resource use if it is running.
    ///
    /// Errors: [`SandboxError::NotFound`].
    pub async fn info(&self, id: &str) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        let state = sb.state();
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Ok(sb.info(None));
        }
        let (cpu, host_mem) = {
            let vm = lock(&sb.vm);
            match vm.as_ref() {
                Some(vm) => (vm.vcpu_cpu_time(), vm.resident_memory_bytes()),
                None => (Duration::ZERO, 0),
            }
        };
        // A paused guest cannot answer; its memory figures wait for resume.
        let agent = if state == SandboxState::Running { lock(&sb.agent).clone() } else { None };
        let guest = match agent {
            Some(a) => match a.call(Op::Info, Duration::from_secs(10)).await {
                Ok(Reply::Info(i)) => Some(i),
                _ => None,
            },
            None => None,
        };
        Ok(sb.info(Some(Usage {
            cpu_time_ms: cpu.as_millis() as u64,
            host_memory_bytes: host_mem,
            guest_memory_used_bytes: guest.as_ref().map(|g| g.mem_total.saturating_sub(g.mem_available)),
            guest_memory_total_bytes: guest.as_ref().map(|g| g.mem_total),
            disk_free_bytes: guest.as_ref().map(|g| g.disk_free),
        })))
    }

    /// Stops a sandbox's VM, removes its files and forgets it.
    ///
    /// Errors: [`SandboxError::NotFound`].
    pub async fn kill(&self, id: &str) -> Result<(), SandboxError> {
        let sb = {
            let mut map = lock(&self.sandboxes);
            let sb = map.remove(id).ok_or_else(|| SandboxError::NotFound(id.to_string()))?;
            self.dying.fetch_add(1, Ordering::SeqCst);
            sb
        };
        let _dying = Dying(self);
        self.leave_parent(&sb);
        sb.end(SandboxState::Stopped, Some("killed".into()));
        let s = sb.clone();
        let _ = tokio::task::spawn_blocking(move || s.stop_vm()).await;
        remove_dir(&sb.dir());
        tracing::info!(sandbox = %id, "sandbox killed");
        Ok(())
    }

    /// Kills every sandbox, concurrently, and refuses new ones (for
    /// SIGTERM/SIGINT).
    pub async fn shutdown(self: &Arc<Self>) {
        self.shutting_down.store(true, Ordering::SeqCst);
        // Boots waiting for a slot give up at once.
        self.boot_slots.close();
        self.restore_slots.close();
        let ids: Vec<SandboxId> = lock(&self.sandboxes).keys().cloned().collect();
        let mut kills = tokio::task::JoinSet::new();
        for id in ids {
            let me = self.clone();
            kills.spawn(async move { me.kill(&id).await });
        }
        while kills.join_next().await.is_some() {}
        // Kills started elsewhere (an MCP session that ended) finish too.
        loop {
            let done = self.dying_done.notified();
            if self.dying.load(Ordering::SeqCst) == 0 {
                break;
            }
            done.await;
        }
        // A default-template build gives up at its next check; wait for it.
        let mut building = self.default_building.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(30), building.wait_for(|b| !*b)).await;
        // A boot still inside vmm::build_for_boot when its sandbox was killed may have
        // made files after the kill removed its directory.
        if let Ok(entries) = std::fs::read_dir(&self.config.run_dir) {
            for e in entries.flatten() {
                tracing::warn!("removing {} left after shutdown", e.path().display());
                remove_dir(&e.path());
            }
        }
    }

    /// Starts the task that kills sandboxes idle past their timeout; it
    /// checks every `period` and ends when the manager is dropped.
    pub fn spawn_reaper(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { return };
                let idle: Vec<SandboxId> = lock(&me.sandboxes)
                    .values()
                    .filter(|s| s.state() != SandboxState::Starting && s.busy.load(Ordering::SeqCst) == 0)
                    .filter(|s| lock(&s.last_used).elapsed() >= s.idle_timeout)
                    .map(|s| s.id.clone())
                    .collect();
                for id in idle {
                    tracing::info!(sandbox = %id, "idle timeout: killing");
                    let _ = me.kill(&id).await;
                }
            }
        })
    }

    /// Sends `op` to a running sandbox's agent, waiting up to `timeout`.
    pub(crate) async fn call(&self, id: &str, op: Op, timeout: Duration) -> Result<Reply, SandboxError> {
        let sb = self.get(id)?;
        if sb.state() == SandboxState::Paused {
            tracing::info!(sandbox = %sb.id, "resuming a paused sandbox for a call");
            self.resume(id)?;
        }
        let agent = {
            let st = lock(&sb.status);
            match st.state {
                SandboxState::Running => lock(&sb.agent).clone(),
                SandboxState::Starting => return Err(SandboxError::Starting(sb.id.clone())),
                state => {
                    return Err(SandboxError::NotRunning {
                        id: sb.id.clone(),
                        state,
                        reason: st.error.clone().unwrap_or_else(|| "it ended".into()),
                    })
                }
            }
        };
        let Some(agent) = agent else {
            return Err(SandboxError::Connection { id: sb.id.clone(), reason: "the agent connection is gone".into() });
        };
        sb.busy.fetch_add(1, Ordering::SeqCst);
        sb.touch();
        let r = agent.call(op, timeout).await;
        sb.touch();
        sb.busy.fetch_sub(1, Ordering::SeqCst);
        match r {
            Ok(reply) => Ok(reply),
            Err(ClientError::Agent(e)) => Err(SandboxError::Agent(e)),
            Err(ClientError::Timeout(t)) => Err(SandboxError::Timeout { id: sb.id.clone(), secs: t.as_secs() }),
            Err(e) => {
                // A dead connection usually means a dead guest: let the
                // monitor record why before answering.
                let stopped = lock(&sb.vm).as_ref().map(|vm| vm.exit_watcher());
                if let Some(w) = stopped {
                    let _ = tokio::task::spawn_blocking(move || w.wait(Some(Duration::from_secs(2)))).await;
                }
                let st = lock(&sb.status);
                match st.state {
                    SandboxState::Running => Err(SandboxError::Connection { id: sb.id.clone(), reason: e.to_string() }),
                    state => Err(SandboxError::NotRunning {
                        id: sb.id.clone(),
                        state,
                        reason: st.error.clone().unwrap_or_default(),
                    }),
                }
            }
        }
    }

    /// Longest wait for every vCPU to park.
    const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

    /// Pauses a running sandbox: its vCPUs stop (no CPU use), its memory,
    /// processes and files stay. Pausing a paused sandbox does nothing.
    /// Blocks until every vCPU has parked (milliseconds; at most 5 s):
    /// call it from a blocking context.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`],
    /// [`SandboxError::Pause`].
    pub fn pause(&self, id: &str) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        let _control = lock(&sb.control);
        match sb.state() {
            SandboxState::Paused => return Ok(sb.info(None)),
            SandboxState::Running => {}
            state => return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "pause" }),
        }
        let took = match lock(&sb.vm).as_ref() {
            Some(vm) => {
                vm.pause(Self::PAUSE_TIMEOUT).map_err(|source| SandboxError::Pause { id: sb.id.clone(), source })?
            }
            None => return Err(SandboxError::BadState { id: sb.id.clone(), state: sb.state(), what: "pause" }),
        };
        {
            let mut st = lock(&sb.status);
            if st.state != SandboxState::Running {
                // It ended (or was killed) while pausing.
                let state = st.state;
                drop(st);
                if let Some(vm) = lock(&sb.vm).as_ref() {
                    vm.resume();
                }
                return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "pause" });
            }
            st.state = SandboxState::Paused;
        }
        sb.touch();
        tracing::info!(sandbox = %sb.id, "paused in {took:?}");
        Ok(sb.info(None))
    }

    /// Resumes a paused sandbox. Resuming a running sandbox does nothing.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`].
    pub fn resume(&self, id: &str) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        let _control = lock(&sb.control);
        let mut st = lock(&sb.status);
        match st.state {
            SandboxState::Running => {}
            SandboxState::Paused => {
                if let Some(vm) = lock(&sb.vm).as_ref() {
                    vm.resume();
                }
                st.state = SandboxState::Running;
                tracing::info!(sandbox = %sb.id, "resumed");
            }
            state => return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "resume" }),
        }
        drop(st);
        sb.touch();
        Ok(sb.info(None))
    }

    /// Every template, by name (see [`TemplateStore::list`]).
    pub fn templates(&self) -> Vec<TemplateInfo> {
        self.templates.list()
    }

    fn template_info(&self, name: &str) -> Result<TemplateInfo, SandboxError> {
        self.templates
            .list()
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| SandboxError::Template(TemplateError::NotFound(name.to_string())))
    }

    /// Snapshots sandbox `sb`'s VM as template `name` (paused for the
    /// copy, then resumed unless it was paused already). Blocking.
    fn snapshot_blocking(&self, sb: &Sandbox, name: &str, replace: bool) -> Result<(), SandboxError> {
        let _control = lock(&sb.control);
        let state = sb.state();
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "a snapshot" });
        }
        let tmp = self.templates.begin(name, replace)?;
        let (kernel, rootfs) = self.templates.images()?;
        let taken = {
            let vm = lock(&sb.vm);
            let Some(vm) = vm.as_ref() else {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(SandboxError::BadState { id: sb.id.clone(), state: sb.state(), what: "a snapshot" });
            };
            let start = Instant::now();
            let was_paused = vm.is_paused();
            let r = vm.pause(Self::PAUSE_TIMEOUT).and_then(|_| vm.snapshot(&tmp));
            if !was_paused {
                vm.resume();
            }
            r.map(|_| start.elapsed())
        };
        let took = match taken {
            Ok(t) => t,
            Err(source) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(SandboxError::Snapshot { id: sb.id.clone(), source });
            }
        };
        let meta = TemplateMeta {
            name: name.to_string(),
            vcpus: sb.vcpus,
            memory_mib: sb.memory_mib,
            created_at_ms: unix_ms(),
            source_sandbox: (!sb.id.starts_with("template-")).then(|| sb.id.clone()),
            kernel,
            rootfs,
        };
        if let Err(e) = self.templates.commit(&tmp, &meta, replace) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e.into());
        }
        tracing::info!(sandbox = %sb.id, template = name, "snapshot taken in {took:?} (the guest was paused for it)");
        Ok(())
    }

    /// Makes template `name` from a running or paused sandbox: its memory,
    /// processes, files and vCPU state as they are now. The sandbox is
    /// paused while its memory is copied (about 0.1 s per 40 MiB the guest
    /// has touched here), then goes on.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`],
    /// [`SandboxError::Template`] (bad or taken name),
    /// [`SandboxError::Snapshot`], [`SandboxError::Io`].
    pub async fn snapshot(self: &Arc<Self>, id: &str, name: &str) -> Result<TemplateInfo, SandboxError> {
        crate::templates::check_name(name)?;
        let sb = self.get(id)?;
        if sb.state() == SandboxState::Starting {
            return Err(SandboxError::Starting(sb.id.clone()));
        }
        sb.touch();
        let me = self.clone();
        let n = name.to_string();
        tokio::task::spawn_blocking(move || me.snapshot_blocking(&sb, &n, false))
            .await
            .map_err(task_failed("snapshot task"))??;
        self.template_info(name)
    }

    /// Makes sure the default template exists and is usable: unless
    /// `rebuild` is false and it loads (checksums, image identities), boots
    /// a sandbox of the default shape, waits for its agent, snapshots it as
    /// [`DEFAULT_TEMPLATE`] and stops it. Meanwhile `create` calls that
    /// would use it wait.
    ///
    /// Errors: those of `create` and [`Manager::snapshot`].
    pub async fn ensure_default_template(self: &Arc<Self>, rebuild: bool) -> Result<TemplateInfo, SandboxError> {
        if !rebuild {
            match self.load_template(DEFAULT_TEMPLATE.into()).await {
                Ok(_) => return self.template_info(DEFAULT_TEMPLATE),
                Err(SandboxError::Template(TemplateError::NotFound(_))) => {}
                Err(e) => tracing::warn!("rebuilding the default template: {e}"),
            }
        }
        let _building = BuildFlag::set(&self.default_building);
        let limits = &self.config.limits;
        let id = format!("template-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        let dir = self.config.run_dir.join(&id);
        let (vcpus, memory_mib) = (limits.vcpus(None)?, limits.memory_mib(None)?);
        let sb = Arc::new(Sandbox::new(id, dir, vcpus, memory_mib, BTreeMap::new(), None, Duration::MAX));
        tracing::info!("building the default template (a cold boot)");
        let r = match self.boot(&sb, Origin::Boot).await {
            Ok(()) => {
                let (me, s) = (self.clone(), sb.clone());
                tokio::task::spawn_blocking(move || me.snapshot_blocking(&s, DEFAULT_TEMPLATE, true))
                    .await
                    .map_err(task_failed("snapshot task"))
                    .and_then(|r| r)
            }
            Err(e) => Err(e),
        };
        sb.end(SandboxState::Stopped, None);
        let s = sb.clone();
        let _ = tokio::task::spawn_blocking(move || s.stop_vm()).await;
        remove_dir(&sb.dir());
        match r {
            Ok(()) => {
                tracing::info!("the default template is ready");
                self.template_info(DEFAULT_TEMPLATE)
            }
            Err(e) => {
                tracing::error!("cannot build the default template: {e}; sandboxes will boot instead");
                Err(e)
            }
        }
    }

    /// Runs a `bash -c` command.
    ///
    /// Errors: those of agent calls ([`SandboxError::NotFound`],
    /// [`SandboxError::Starting`], [`SandboxError::NotRunning`],
    /// [`SandboxError::Agent`], [`SandboxError::Timeout`],
    /// [`SandboxError::Connection`]).
    pub async fn exec(&self, id: &str, req: ExecRequest) -> Result<ExecReply, SandboxError> {
        let limits = tine_protocol::effective_limits(req.timeout_ms, req.output_limit)?;
        let op = Op::Exec(Exec {
            command: Command::Shell(req.command),
            cwd: req.cwd,
            env: req.env,
            stdin: req.stdin,
            timeout_ms: req.timeout_ms,
            output_limit: req.output_limit,
        });
        match self.call(id, op, Duration::from_millis(u64::from(limits.0)) + CALL_GRACE).await? {
            Reply::Exec(r) => Ok(r),
            other => Err(unexpected(id, &other)),
        }
    }

    /// Runs a cell in the sandbox's persistent Python interpreter.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn python(&self, id: &str, code: String, timeout_ms: u32) -> Result<PythonReply, SandboxError> {
        let limits = tine_protocol::effective_limits(timeout_ms, 0)?;
        let op = Op::Python(Python { code, timeout_ms, output_limit: 0 });
        match self.call(id, op, Duration::from_millis(u64::from(limits.0)) + CALL_GRACE).await? {
            Reply::Python(r) => Ok(r),
            other => Err(unexpected(id, &other)),
        }
    }

    /// Reads `length` bytes (default: to the end) at `offset` of a file.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn read_file(
        &self,
        id: &str,
        path: String,
        offset: u64,
        length: Option<u64>,
    ) -> Result<FileData, SandboxError> {
        match self.call(id, Op::ReadFile(ReadFile { path, offset, length }), SHORT_CALL).await? {
            Reply::File(f) => Ok(f),
            other => Err(unexpected(id, &other)),
        }
    }

    /// Writes (or appends to) a file, creating parent directories.
    /// Returns the bytes written.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn write_file(
        &self,
        id: &str,
        path: String,
        data: Vec<u8>,
        mode: Option<u32>,
        append: bool,
    ) -> Result<u64, SandboxError> {
        let op = Op::WriteFile(WriteFile { path, data, mode, append, create_parents: true });
        match self.call(id, op, SHORT_CALL).await? {
            Reply::Written { bytes } => Ok(bytes),
            other => Err(unexpected(id, &other)),
        }
    }

    /// Lists a directory, sorted by name.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn list_dir(&self, id: &str, path: String) -> Result<Vec<DirEntry>, SandboxError> {
        match self.call(id, Op::ListDir { path }, SHORT_CALL).await? {
            Reply::Entries(e) => Ok(e),
            other => Err(unexpected(id, &other)),
        }
    }

    /// Facts about one path.
    ///
    /// Errors: as [`Manager::exec`].
    pub async fn stat(&self, id: &str, path: String) -> Result<FileStat, SandboxError> {
        match self.call(id, Op::Stat { path }, SHORT_CALL).await? {
            Reply::Stat(s) => Ok(s),
            other => Err(unexpected(id, &other)),
        }
    }
}

pub(crate) fn unexpected(id: &str, reply: &Reply) -> SandboxError {
    SandboxError::Connection { id: id.to_string(), reason: format!("the agent answered with an unexpected {reply:?}") }
}
