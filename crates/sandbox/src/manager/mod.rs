//! The sandbox manager: the [`Manager`] itself (configuration, the map of
//! sandboxes, lookup, list, info, shutdown and the idle reaper).
//!
//! The rest is split by concern, one `impl Manager` per file:
//! [`lifecycle`] (create, kill, the default template), [`control`] (pause,
//! resume, snapshot), [`hibernate`] (to disk and back), [`pressure`] (what
//! frees memory: the budget and the host's watermark), [`calls`] (agent
//! calls), [`processes`] (background processes), [`branch`] (branch and
//! merge), [`diff`] (file-system diffs). A sandbox and its state machine
//! are in [`sandbox`], the VM seam in [`backend`] (real: [`kvm`]), the
//! errors in [`error`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vmm::{HostProfile, MemoryBacking};

use crate::limits::Limits;
use crate::lock;
use crate::memory::{MemoryBudget, MemoryUse, Reservation};
use crate::templates::TemplateStore;

mod backend;
mod branch;
mod calls;
mod control;
mod diff;
mod disk_budget;
mod disk_compact;
mod disk_sweep;
mod error;
#[cfg(test)]
mod fake;
mod hibernate;
pub mod images;
mod kvm;
mod lifecycle;
mod names;
mod network;
mod pool;
mod ports;
mod prefetch;
mod pressure;
mod processes;
mod published_ports;
mod quota;
mod recipes;
mod records;
mod sandbox;
mod secrets;
mod settings;
mod slots;
mod spawn;
mod spec;
#[cfg(test)]
mod tests;
mod volumes;

pub use backend::BackendError;
use backend::VmBackend;
pub use branch::BranchResult;
pub use calls::ExecRequest;
pub use disk_budget::DiskBytes;
pub use error::SandboxError;
pub use network::NetworkLog;
pub use pool::PoolStatus;
pub use ports::{PortConnection, PortLease};
pub use processes::{ProcessId, ProcessInfo, ProcessPage, ProcessState, WaitResult, WaitSpec};
pub use recipes::{Recipe, SetupStep, MAX_FILES, MAX_STEPS};
use sandbox::Sandbox;
pub use sandbox::{Lineage, SandboxInfo, SandboxState, Usage};
pub use settings::SandboxUpdate;
pub use spawn::{Spawned, MAX_SPAWN};
pub use spec::SandboxSpec;

/// A sandbox's id, `sb-[<host>-]<random>` ([`crate::ids`]).
pub type SandboxId = String;

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
    /// Directory of sandboxes' kept state: hibernations
    /// ([`Manager::hibernate`]); created if missing.
    pub kept_dir: PathBuf,
    /// Directory of templates (see [`crate::templates`]); created if missing.
    pub templates_dir: PathBuf,
    /// How restored sandboxes get their memory from a template's file.
    pub memory_backing: MemoryBacking,
    /// Record working sets of the default and recipe templates and
    /// prefetch them into restored sandboxes (see [`prefetch`]).
    pub prefetch: bool,
    /// The host profile.
    pub profile: HostProfile,
    /// Defaults and caps.
    pub limits: Limits,
    /// Sandbox networking (`None`: sandboxes have no network device).
    pub network: Option<crate::network::NetworkSetup>,
    /// Sandboxes of the default shape kept restored and ready for creates
    /// (see [`pool`]); 0: none.
    pub pool_size: usize,
    /// Guest RAM of 2 MiB huge pages from the host's hugetlbfs pool for
    /// every sandbox ([`vmm::VmConfig::huge_pages`]): a branch
    /// write-protects 512 times fewer page table entries; each restore
    /// copies its template's (or branch point's) data in up front, and no
    /// working set is recorded or prefetched.
    pub huge_pages: bool,
    /// The host's name in sandbox ids: `sb-<host>-<random>` (`sb-<random>`
    /// without one). Letters, digits and `-` only; the caller checks it.
    pub host_name: Option<String>,
    /// Templates from OCI images: `[images]` ([`images`]).
    pub images: images::ImagesConfig,
    /// Where pulled images (`oci/`) and base images (`bases/`) are kept;
    /// created when first needed.
    pub images_dir: PathBuf,
    /// Secrets ([`crate::secrets`]): the store and the broker (`None`:
    /// sandboxes cannot bind secrets).
    pub secrets: Option<crate::secrets::SecretsSetup>,
}

/// The sandbox manager. Cheap to share: hold it in an `Arc`.
pub struct Manager {
    config: ManagerConfig,
    backend: Arc<dyn VmBackend>,
    sandboxes: Mutex<BTreeMap<SandboxId, Arc<Sandbox>>>,
    shutting_down: AtomicBool,
    /// Kills in progress (their sandboxes have already left the map);
    /// [`Manager::shutdown`] waits for them.
    kills: lifecycle::Kills,
    /// Boots, restores and agent calls admitted at once ([`slots`]).
    slots: slots::Slots,
    templates: TemplateStore,
    /// Guest memory of running sandboxes, branch points and loaded
    /// templates ([`Limits::memory_budget_mib`]).
    memory: Arc<MemoryBudget>,
    /// The watermark on the host's available memory ([`pressure`]).
    watermark: pressure::Watermark,
    /// The default template's build: whether it runs, what it does.
    default_build: lifecycle::DefaultBuild,
    /// What happens to sandboxes ([`Manager::subscribe_events`]).
    events: tokio::sync::broadcast::Sender<crate::events::SandboxEvent>,
    /// Recipe builds running or failed, by template name.
    builds: Mutex<BTreeMap<String, recipes::BuildRecord>>,
    /// The warm pool ([`pool`]).
    pool: Mutex<pool::Pool>,
    /// Tenants' quotas by tenant name, as the server last gave them
    /// ([`Manager::set_tenant_quotas`]): checked where a call has no
    /// [`CallContext`] of its tenant, e.g. a hibernated sandbox resumed by
    /// any call.
    tenant_quotas: Mutex<BTreeMap<String, Arc<crate::limits::Quota>>>,
    /// Held while a sandbox record is written or removed
    /// ([`records`]).
    records: Mutex<()>,
    /// Where sandboxes' own disks come from ([`crate::disks`]).
    disk_plan: backend::DiskPlan,
    /// The sandboxes' disks' budget (MiB, [`disk_budget`]).
    disk_budget_mib: u64,
    /// Sandboxes given a VM ([`disk_sweep`]): their layers are kept.
    vms_with_disks: Mutex<Vec<std::sync::Weak<Sandbox>>>,
    /// The volumes ([`crate::volumes`], [`volumes`]).
    volumes: Arc<crate::volumes::VolumeStore>,
    /// This manager, for background work started from `&self` methods.
    me: std::sync::Weak<Manager>,
}

/// Milliseconds since the Unix epoch, now.
fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
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

impl Manager {
    /// Checks the images and limits, prepares `run_dir` (removing what a
    /// previous run left there) and returns the manager, which runs its
    /// sandboxes on KVM.
    ///
    /// Errors: [`SandboxError::Limits`], [`SandboxError::Io`] naming the
    /// missing image or the directory that cannot be made.
    pub fn new(config: ManagerConfig) -> Result<Arc<Self>, SandboxError> {
        Self::with_backend(config, Arc::new(kvm::KvmBackend))
    }

    /// As [`Manager::new`], with VMs from `backend`.
    fn with_backend(config: ManagerConfig, backend: Arc<dyn VmBackend>) -> Result<Arc<Self>, SandboxError> {
        Self::with_probe(config, backend, pressure::Watermark::host_probe())
    }

    /// As [`Manager::with_backend`], reading the host's available memory
    /// from `probe`.
    fn with_probe(
        config: ManagerConfig,
        backend: Arc<dyn VmBackend>,
        probe: pressure::Probe,
    ) -> Result<Arc<Self>, SandboxError> {
        config.limits.validate()?;
        for (what, p) in [("guest kernel", &config.kernel), ("root filesystem image", &config.rootfs)] {
            std::fs::metadata(p)
                .map_err(|source| SandboxError::Io { what: format!("{what} {}", p.display()), source })?;
        }
        let io = |what: String| move |source| SandboxError::Io { what, source };
        std::fs::create_dir_all(&config.run_dir).map_err(io(format!("create {}", config.run_dir.display())))?;
        std::fs::create_dir_all(&config.kept_dir).map_err(io(format!("create {}", config.kept_dir.display())))?;
        let entries = std::fs::read_dir(&config.run_dir).map_err(io(format!("read {}", config.run_dir.display())))?;
        for e in entries.flatten() {
            tracing::info!("removing {} left by an earlier run", e.path().display());
            remove_dir(&e.path());
        }
        let disks_dir = config.kept_dir.join(crate::disks::DISKS_DIR);
        let blank = match config.limits.default_disk_mib {
            0 => None,
            mib => Some(crate::disks::blank_base(&disks_dir, mib << 20).map_err(|e| SandboxError::Io {
                what: "set up sandbox disks".into(),
                source: std::io::Error::other(e),
            })?),
        };
        let disk_plan = backend::DiskPlan { dir: disks_dir, blank, max_frozen_layers: config.limits.max_disk_layers };
        let volumes = Arc::new(
            crate::volumes::VolumeStore::open(&config.kept_dir, config.limits.max_disk_layers)
                .map_err(|e| SandboxError::Io { what: "set up volumes".into(), source: std::io::Error::other(e) })?,
        );
        let memory = MemoryBudget::new(config.limits.memory_budget_mib());
        tracing::info!(
            "guest memory budget: {} MiB; host memory watermark: {} MiB available",
            memory.budget_mib(),
            config.limits.min_available_mib()
        );
        let templates = TemplateStore::new(config.templates_dir.clone(), config.kernel.clone(), config.rootfs.clone())?
            .with_budget(memory.clone())
            .with_guest_setup(format!(
                "machine {};{}{}",
                vmm::MACHINE_REVISION,
                config.network.as_ref().map(|n| n.fingerprint()).unwrap_or_default(),
                // Sandboxes with a disk of their own: templates made before
                // (their root's upper layer in memory) are rebuilt once.
                if disk_plan.blank.is_some() { ";disk" } else { "" }
            ));
        let manager = Arc::new_cyclic(|me| Manager {
            me: me.clone(),
            records: Mutex::new(()),
            templates,
            memory,
            watermark: pressure::Watermark::new(config.limits.min_available_mib(), probe),
            backend,
            default_build: lifecycle::DefaultBuild::default(),
            events: tokio::sync::broadcast::Sender::new(crate::events::EVENT_CAPACITY),
            sandboxes: Mutex::new(BTreeMap::new()),
            builds: Mutex::new(BTreeMap::new()),
            pool: Mutex::new(pool::Pool::default()),
            tenant_quotas: Mutex::new(BTreeMap::new()),
            shutting_down: AtomicBool::new(false),
            kills: lifecycle::Kills::default(),
            slots: slots::Slots::new(&config.limits),
            disk_budget_mib: disk_budget::budget_mib(config.limits.disk_budget_mib, &config.kept_dir),
            disk_plan,
            vms_with_disks: Mutex::new(Vec::new()),
            volumes,
            config,
        });
        manager.recover();
        manager.recover_volumes();
        manager.sweep_disks();
        Ok(manager)
    }

    /// A receiver of every [`crate::SandboxEvent`] from now on (ready,
    /// paused, resumed, killed, reaped, merged, stopped, crashed, create
    /// failed). The channel holds [`crate::events::EVENT_CAPACITY`] events
    /// for a slow receiver, which then loses the oldest
    /// (`RecvError::Lagged` says how many).
    pub fn subscribe_events(&self) -> tokio::sync::broadcast::Receiver<crate::events::SandboxEvent> {
        self.events.subscribe()
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.config.limits
    }

    /// The memory budget's size and use now.
    pub fn memory_use(&self) -> (u64, crate::memory::BudgetUse) {
        (self.memory.budget_mib(), self.memory.used())
    }

    /// Reserves `parts` of the memory budget for `what`, unloading
    /// templates nothing uses, then stopping pooled sandboxes, when they do
    /// not fit at first.
    ///
    /// Errors: [`SandboxError::OverBudget`], naming the budget and its use.
    fn admit(&self, what: &'static str, parts: &[(MemoryUse, u64)]) -> Result<Vec<Reservation>, SandboxError> {
        let mut r = self.memory.reserve(what, parts);
        // Unused templates go first, then pooled sandboxes, one at a time.
        if r.is_err() && self.templates.evict_unused(None) > 0 {
            r = self.memory.reserve(what, parts);
        }
        while r.is_err() && self.release_pooled_memory() {
            r = self.memory.reserve(what, parts);
        }
        Ok(r?)
    }

    fn get(&self, id: &str) -> Result<Arc<Sandbox>, SandboxError> {
        lock(&self.sandboxes).get(id).cloned().ok_or_else(|| SandboxError::NotFound(id.to_string()))
    }

    /// Whether a sandbox with this id exists (in any state).
    pub fn contains(&self, id: &str) -> bool {
        lock(&self.sandboxes).contains_key(id)
    }

    /// Replaces the tenants' quotas (by tenant name) that calls without a
    /// tenant's [`CallContext`] are held to: resuming a hibernated sandbox
    /// counts against its tenant's live sandboxes, vCPUs and memory. A
    /// tenant not in `quotas` is held to none there.
    pub fn set_tenant_quotas(&self, quotas: BTreeMap<String, Arc<crate::limits::Quota>>) {
        *lock(&self.tenant_quotas) = quotas;
    }

    /// The tenant sandbox `id` belongs to: `None` when there is no such
    /// sandbox, `Some(None)` for the server's own.
    pub fn tenant_of(&self, id: &str) -> Option<Option<String>> {
        lock(&self.sandboxes).get(id).map(|sb| sb.tenant())
    }

    /// How many sandboxes exist (in any state).
    pub fn len(&self) -> usize {
        lock(&self.sandboxes).len()
    }

    /// Whether there are no sandboxes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every sandbox whose labels include all of `labels`, oldest first
    /// (by creation time, then id).
    pub fn list(&self, labels: &BTreeMap<String, String>) -> Vec<SandboxInfo> {
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        let mut listed: Vec<SandboxInfo> = all
            .iter()
            .filter(|s| {
                let own = s.labels();
                labels.iter().all(|(k, v)| own.get(k) == Some(v))
            })
            .map(|s| s.info(None))
            .collect();
        listed.sort_by(|a, b| (a.created_at_ms, &a.sandbox_id).cmp(&(b.created_at_ms, &b.sandbox_id)));
        listed
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
        // Both read /proc (smaps grows with every mapping of the process).
        let vm_of = sb.clone();
        let me = self.me.upgrade();
        let (cpu, host_mem, disk) = tokio::task::spawn_blocking(move || {
            let (cpu, mem) = match lock(&vm_of.vm).vm.as_ref() {
                Some(vm) => (vm.cpu_time(), vm.resident_memory_bytes()),
                None => (Duration::ZERO, 0),
            };
            (cpu, mem, me.and_then(|m| m.sandbox_disk_use(&vm_of)))
        })
        .await
        .unwrap_or((Duration::ZERO, 0, None));
        // A paused guest cannot answer; its memory figures wait for resume.
        let guest = match sb.agent() {
            Some(a) => a.info(Duration::from_secs(10)).await.ok(),
            None => None,
        };
        let cpu_percent = {
            let now = std::time::Instant::now();
            let mut last = lock(&sb.last_cpu);
            let (since, before) = last.unwrap_or((sb.created, Duration::ZERO));
            *last = Some((now, cpu));
            let wall = now.saturating_duration_since(since).as_secs_f64();
            if wall > 0.0 {
                (cpu.saturating_sub(before).as_secs_f64() / wall * 1000.0).round() / 10.0
            } else {
                0.0
            }
        };
        Ok(sb.info(Some(Usage {
            cpu_time_ms: cpu.as_millis() as u64,
            cpu_percent,
            host_memory_bytes: host_mem,
            guest_memory_used_bytes: guest.as_ref().map(|g| g.mem_total.saturating_sub(g.mem_available)),
            guest_memory_total_bytes: guest.as_ref().map(|g| g.mem_total),
            disk_free_bytes: guest.as_ref().map(|g| g.disk_free),
            disk_size_bytes: disk.map(|d| d.0),
            disk_host_bytes: disk.map(|d| d.1),
            disk_layers: disk.map(|d| d.2),
        })))
    }

    /// Kills every sandbox, concurrently, and refuses new ones (for
    /// SIGTERM/SIGINT).
    pub async fn shutdown(self: &Arc<Self>) {
        self.shutting_down.store(true, Ordering::SeqCst);
        // Boots waiting for a slot give up at once.
        self.slots.close();
        self.shutdown_pool().await;
        let ids: Vec<SandboxId> = lock(&self.sandboxes).keys().cloned().collect();
        let mut kills = tokio::task::JoinSet::new();
        for id in ids {
            let me = self.clone();
            kills.spawn(async move { me.kill(&id).await });
        }
        while kills.join_next().await.is_some() {}
        // Kills started elsewhere (an MCP session that ended) finish too.
        loop {
            let done = self.kills.done.notified();
            if self.kills.in_progress.load(Ordering::SeqCst) == 0 {
                break;
            }
            done.await;
        }
        // A default-template build gives up at its next check; wait for it.
        let mut building = self.default_build.building.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(30), building.wait_for(|b| !*b)).await;
        // A boot still starting its VM when its sandbox was killed may have
        // made files after the kill removed its directory.
        if let Ok(entries) = std::fs::read_dir(&self.config.run_dir) {
            for e in entries.flatten() {
                tracing::warn!("removing {} left after shutdown", e.path().display());
                remove_dir(&e.path());
            }
        }
    }

    /// Starts the task that hibernates (or, with
    /// [`crate::IdleAction::Kill`], kills) sandboxes idle past their
    /// timeout, deletes hibernated ones past their retention and, while the
    /// host is below its memory watermark, hibernates the least recently
    /// used idle ones ([`pressure`]); a thread beside it measures what
    /// running sandboxes hold ([`Manager::measure_memory`]) and removes
    /// unused disk layers every few minutes ([`disk_sweep`]); they check
    /// every `period` and ends when the manager is dropped.
    pub fn spawn_reaper(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        // What running sandboxes hold is measured on a thread of its own
        // (blocking work every tick: on tokio's blocking pool it would keep
        // that pool's idle threads alive for ever).
        let weak = Arc::downgrade(self);
        // Disk layers nothing uses go too, now and then ([`disk_sweep`]).
        let measured = std::thread::Builder::new().name("tine-memory".into()).spawn(move || {
            let mut swept = std::time::Instant::now();
            loop {
                std::thread::sleep(period);
                let Some(me) = weak.upgrade() else { return };
                me.measure_memory();
                if swept.elapsed() >= disk_sweep::MIN_AGE {
                    me.sweep_disks();
                    swept = std::time::Instant::now();
                }
            }
        });
        if let Err(e) = measured {
            tracing::warn!("cannot start the memory measuring thread (sandboxes count by their size): {e}");
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { return };
                let now_ms = unix_ms();
                let expired: Vec<SandboxId> = lock(&me.sandboxes)
                    .values()
                    .filter(|s| lock(&s.hibernation).as_ref().is_some_and(|h| h.expires_at_ms <= now_ms))
                    .map(|s| s.id.clone())
                    .collect();
                for id in expired {
                    tracing::info!(sandbox = %id, "hibernated past its retention: deleting");
                    let _ = me.kill_with(&id, lifecycle::EndReason::Expired).await;
                }
                // The host below its memory watermark: idle sandboxes go to
                // disk before the kernel's OOM killer picks a process.
                me.relieve_pressure().await;
                let hibernate = me.config.limits.idle_action == crate::IdleAction::Hibernate;
                let idle: Vec<Arc<Sandbox>> = lock(&me.sandboxes)
                    .values()
                    .filter(|s| match s.state() {
                        SandboxState::Starting | SandboxState::Hibernated => false,
                        SandboxState::Running | SandboxState::Paused => true,
                        // Nothing to hibernate: a stopped or failed one goes,
                        // unless it keeps a hibernation (its retention
                        // applies: the files stay for the operator).
                        SandboxState::Stopped | SandboxState::Failed => lock(&s.hibernation).is_none(),
                    })
                    .filter(|s| s.busy.load(Ordering::SeqCst) == 0)
                    // Not while a pause, snapshot, branch or merge runs.
                    .filter(|s| s.control.try_lock().is_ok())
                    .filter(|s| s.idle() >= s.idle_timeout())
                    .cloned()
                    .collect();
                for sb in idle {
                    let idle_secs = sb.idle().as_secs();
                    if hibernate && matches!(sb.state(), SandboxState::Running | SandboxState::Paused) {
                        tracing::info!(sandbox = %sb.id, "idle timeout: hibernating");
                        if let Err(e) = me.hibernate_sandbox(&sb, hibernate::HibernateWhy::Idle).await {
                            // Kept running, not killed: nothing is lost.
                            // The next try is one idle timeout later.
                            tracing::warn!(sandbox = %sb.id, "idle hibernation failed, trying again later: {e}");
                            sb.touch();
                        }
                        continue;
                    }
                    tracing::info!(sandbox = %sb.id, "idle timeout: killing");
                    let _ = me.kill_with(&sb.id, lifecycle::EndReason::Reaped { idle_secs }).await;
                }
            }
        })
    }
}
