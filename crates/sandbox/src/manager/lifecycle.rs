//! A sandbox's life: where it comes from ([`SandboxSpec`], template or
//! boot), the one reservation that counts live sandboxes and mints ids,
//! the start (VM, agent, reseed), taking a sandbox out of the map before
//! [`Sandbox::retire`] (a failed create, kill, discarded branch children
//! and the default template's build), and the default template.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tine_agent_client::{AgentClient, AGENT_PORT};
use tine_protocol::Reseed;

use super::backend::{Base, ExitWatch, VmSource, VmSpec};
use super::sandbox::{SandboxSetup, Transition, CONSOLE_TAIL_LINES};
use super::settings::env_vars;
use super::spec::SandboxSpec;
use super::{task_failed, Manager, Sandbox, SandboxError, SandboxId, SandboxInfo, SandboxState};
use crate::events::EventKind;
use crate::lock;
use crate::memory::{MemoryUse, Reservation};
use crate::progress::{cut, CallContext, ProgressSink};
use crate::templates::{Template, TemplateError, TemplateInfo, DEFAULT_TEMPLATE};

/// How often the log says what the default template's build is doing.
const BUILD_LOG_PERIOD: Duration = Duration::from_secs(10);

/// Pauses between attempts to reach a new guest's agent: the first, then
/// doubled each time up to the last. A restored guest's agent answers
/// within milliseconds of its VM starting; a booting one's in seconds.
const AGENT_RETRY_FIRST: Duration = Duration::from_millis(5);
/// The longest pause between attempts to reach a new guest's agent.
const AGENT_RETRY: Duration = Duration::from_millis(250);
/// Longest wait for a booting guest's agent to answer the first ping of
/// a connection.
const PING_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout of the reseed call.
const RESEED_TIMEOUT: Duration = Duration::from_secs(60);
/// Entropy handed to each new guest (bytes).
const SEED_BYTES: usize = 64;
/// Longest Unix socket path (`sun_path` is 108 bytes with its NUL).
const MAX_UDS_PATH: usize = 107;
/// Interval of the progress reports of a wait (for the default template,
/// for a booting guest's agent).
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// Most bytes of the console line a boot's progress message quotes.
const CONSOLE_LINE_BYTES: usize = 160;

/// Why a sandbox is killed ([`Manager::kill_with`]): says which event it
/// emits.
#[derive(Clone, Copy, Debug)]
pub(super) enum EndReason {
    /// On request: [`EventKind::Killed`].
    Killed,
    /// Idle past its timeout: [`EventKind::Reaped`].
    Reaped {
        /// How long it was idle (s).
        idle_secs: u64,
    },
    /// Hibernated past its retention: [`EventKind::Expired`].
    Expired,
}

/// Seconds since `t0`, as a progress value.
fn secs(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

/// The default template's build, as creates waiting for it see it.
pub(super) struct DefaultBuild {
    /// Whether it runs now.
    pub(super) building: tokio::sync::watch::Sender<bool>,
    /// What it does now (one line).
    pub(super) status: tokio::sync::watch::Sender<String>,
}

impl Default for DefaultBuild {
    fn default() -> Self {
        DefaultBuild {
            building: tokio::sync::watch::Sender::new(false),
            status: tokio::sync::watch::Sender::new(String::from("not started")),
        }
    }
}

/// Kills in progress, whose sandboxes already left the map: shutdown
/// waits until `in_progress` is 0 (`done` wakes it at each end).
#[derive(Default)]
pub(super) struct Kills {
    /// Kills running now.
    pub(super) in_progress: std::sync::atomic::AtomicU64,
    /// Notified when one ends.
    pub(super) done: tokio::sync::Notify,
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

/// Stops a background task when dropped (the build's log heartbeat, also
/// when the build's future is dropped half-way).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Counts a kill in progress for as long as it lives.
struct Dying<'a>(&'a Manager);

impl Drop for Dying<'_> {
    fn drop(&mut self) {
        self.0.kills.in_progress.fetch_sub(1, Ordering::SeqCst);
        self.0.kills.done.notify_waiters();
    }
}

impl Manager {
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
        self.create_with(spec, &CallContext::default()).await
    }

    /// As [`Manager::create`], for the caller `cx.owner` (recorded as the
    /// sandbox's owner in its events), reporting progress to
    /// `cx.progress` (progress: seconds since the call): the wait for the
    /// default template's build (every 2 s, with what the build is doing),
    /// the wait for a boot slot, the boot or restore, the wait for the
    /// agent (every 2 s, with the console's last line), the reseed.
    ///
    /// Errors: as [`Manager::create`].
    pub async fn create_with(
        self: &Arc<Self>,
        spec: SandboxSpec,
        cx: &CallContext,
    ) -> Result<SandboxInfo, SandboxError> {
        // Secrets that cannot be bound, and a name that cannot be given,
        // are refused before any VM starts.
        let secrets = spec.secrets.clone();
        self.bind_secrets(cx.tenant.as_deref(), &[], &secrets)?;
        let name = spec.name.clone();
        if let Some(n) = &name {
            self.check_new_name(cx.tenant.as_deref(), n)?;
        }
        let (me, cx) = (self.clone(), cx.clone());
        let info = match tokio::spawn(async move { me.create_inner(spec, cx).await }).await {
            Ok(r) => r?,
            Err(e) => return Err(task_failed("sandbox creation task")(e)),
        };
        if let Some(n) = &name {
            if let Err(e) = self.give_name(&info.sandbox_id, n) {
                if let Err(k) = self.kill(&info.sandbox_id).await {
                    tracing::warn!(sandbox = %info.sandbox_id, "{k}");
                }
                return Err(e);
            }
        }
        let info = SandboxInfo { name: name.clone(), ..info };
        if secrets.is_empty() {
            return Ok(info);
        }
        match self.set_secrets(&info.sandbox_id, &secrets).await {
            Ok(bindings) => Ok(SandboxInfo { secrets: bindings, ..info }),
            Err(e) => {
                tracing::warn!(sandbox = %info.sandbox_id, "binding its secrets failed: {e}");
                if let Err(k) = self.kill(&info.sandbox_id).await {
                    tracing::warn!(sandbox = %info.sandbox_id, "{k}");
                }
                Err(e)
            }
        }
    }

    /// Template `name`, loaded (and checked) off the async threads.
    pub(super) async fn load_template(self: &Arc<Self>, name: String) -> Result<Arc<Template>, SandboxError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.templates.load(&name))
            .await
            .map_err(task_failed("template load task"))?
            .map_err(SandboxError::Template)
    }

    /// Where a sandbox of `spec` comes from, and its vCPUs, memory (MiB)
    /// and disk (MiB): the named template, else the default template when
    /// it fits the requested shape and disk (waiting for it if it is being
    /// built), else a boot.
    async fn origin(
        self: &Arc<Self>,
        spec: &SandboxSpec,
        progress: &ProgressSink,
        t0: Instant,
    ) -> Result<(VmSource, u8, u64, u64), SandboxError> {
        let limits = &self.config.limits;
        let disk_mib = limits.disk_mib(spec.disk_mib)?;
        if spec.base.is_some() {
            // A base image (a template's build from an OCI image) boots.
            let (vcpus, memory_mib) = (limits.vcpus(spec.vcpus)?, limits.memory_mib(spec.memory_mib)?);
            if self.config.huge_pages && !memory_mib.is_multiple_of(2) {
                return Err(crate::limits::LimitsError::HugePageMemory { got: memory_mib }.into());
            }
            return Ok((VmSource::Boot, vcpus, memory_mib, disk_mib));
        }
        if let Some(name) = &spec.template {
            let t = self.load_template(name.clone()).await?;
            let (vcpus, memory_mib) = (t.meta.vcpus, t.meta.memory_mib);
            let differs =
                spec.vcpus.is_some_and(|v| v != u64::from(vcpus)) || spec.memory_mib.is_some_and(|m| m != memory_mib);
            if differs {
                return Err(SandboxError::TemplateShape { name: name.clone(), vcpus, memory_mib });
            }
            let its_disk = crate::disks::size_mib(t.disk.as_ref());
            if spec.disk_mib.is_some_and(|d| d != its_disk) {
                return Err(SandboxError::TemplateDisk { name: name.clone(), disk_mib: its_disk });
            }
            return Ok((VmSource::Template(t), vcpus, memory_mib, its_disk));
        }
        let vcpus = limits.vcpus(spec.vcpus)?;
        let memory_mib = limits.memory_mib(spec.memory_mib)?;
        if self.config.huge_pages && !memory_mib.is_multiple_of(2) {
            return Err(crate::limits::LimitsError::HugePageMemory { got: memory_mib }.into());
        }
        if vcpus == limits.default_vcpus && memory_mib == limits.default_memory_mib && disk_mib == self.boot_disk_mib()
        {
            self.wait_for_default_build(progress, t0).await;
            match self.load_template(DEFAULT_TEMPLATE.into()).await {
                Ok(t)
                    if t.meta.vcpus == vcpus
                        && t.meta.memory_mib == memory_mib
                        && crate::disks::size_mib(t.disk.as_ref()) == disk_mib =>
                {
                    return Ok((VmSource::Template(t), vcpus, memory_mib, disk_mib))
                }
                Ok(_) => {
                    tracing::info!("the default template has another shape or disk than the limits' defaults; booting")
                }
                Err(e) => tracing::info!("booting instead of restoring: {e}"),
            }
        }
        Ok((VmSource::Boot, vcpus, memory_mib, disk_mib))
    }

    /// Waits until the default template is not being built, reporting
    /// every 2 s what the build does.
    async fn wait_for_default_build(&self, progress: &ProgressSink, t0: Instant) {
        let mut building = self.default_build.building.subscribe();
        if !progress.is_active() {
            let _ = building.wait_for(|b| !*b).await;
            return;
        }
        loop {
            if !*building.borrow_and_update() {
                return;
            }
            let status = self.default_build.status.borrow().clone();
            progress.report(
                secs(t0),
                None,
                format!("waiting for the default template (built at server start: {status})"),
            );
            let done = async { building.wait_for(|b| !*b).await.is_ok() };
            tokio::select! {
                _ = done => return,
                () = tokio::time::sleep(PROGRESS_EVERY) => {}
            }
        }
    }

    async fn create_inner(self: Arc<Self>, spec: SandboxSpec, cx: CallContext) -> Result<SandboxInfo, SandboxError> {
        let t0 = Instant::now();
        let limits = &self.config.limits;
        let idle_timeout = limits.idle_timeout(spec.idle_timeout_secs)?;
        limits.check_labels(&spec.labels)?;
        let env = env_vars(&spec.env);
        tine_protocol::check_sandbox_env(&env)?;
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(SandboxError::ShuttingDown);
        }
        self.check_kept(1)?;
        // The quota before anything is hibernated to make room (`reserve`
        // checks again with the shape the template gives).
        let vcpus = spec.vcpus.map_or(limits.default_vcpus, |v| u8::try_from(v).unwrap_or(u8::MAX));
        let memory_mib = spec.memory_mib.unwrap_or(limits.default_memory_mib);
        let disk_mib = spec.disk_mib.unwrap_or(self.boot_disk_mib());
        let claim = super::quota::Claim::of(&cx, vcpus, memory_mib, disk_mib);
        self.check_fits(&lock(&self.sandboxes), 1, disk_mib, claim.as_ref())?;
        self.make_room(1).await;
        let net = self.net_control(spec.network.as_ref(), cx.ceiling.as_ref())?;
        // Volumes that cannot be attached, before anything starts.
        crate::volumes::check_requests(&spec.volumes, limits.volume_slots).map_err(SandboxError::Volumes)?;
        for v in &spec.volumes {
            self.volumes.check(cx.tenant.as_deref(), &v.name, v.read_only)?;
        }
        let poolable = self.poolable(&spec) && spec.volumes.is_empty();
        if poolable {
            if let Some(sb) = self.take_pooled() {
                return self.hand_out(sb, spec, env, idle_timeout, &cx).await;
            }
        }
        let (source, vcpus, memory_mib, disk_mib) = self.origin(&spec, &cx.progress, t0).await?;
        let template = match &source {
            VmSource::Template(t) => Some(t.meta.name.clone()),
            VmSource::Boot | VmSource::Branch(_) | VmSource::Hibernated { .. } => None,
        };
        let rootfs = match &source {
            VmSource::Template(t) => t.meta.base.as_ref().map(|(path, _)| path.clone()),
            _ => spec.base.clone(),
        };
        let from = template.as_ref().map_or_else(|| "boot".to_string(), |t| format!("template:{t}"));
        // Admission: its memory is reserved before anything starts.
        let charge = match source {
            VmSource::Template(_) => self.restored_charge_mib(memory_mib, 0),
            _ => memory_mib,
        };
        let memory = self.admit_or_hibernate("create", &[(MemoryUse::Sandbox, charge)]).await?.pop();
        let mut labels = Some(spec.labels);
        let sandbox = self
            .reserve(1, disk_mib, super::quota::Claim::of(&cx, vcpus, memory_mib, disk_mib).as_ref(), |id, dir| {
                let setup = SandboxSetup {
                    labels: labels.take().unwrap_or_default(),
                    template: template.clone(),
                    idle_timeout,
                    owner: cx.owner,
                    tenant: cx.tenant.clone(),
                    events: Some(self.events.clone()),
                    disk_mib,
                    rootfs: rootfs.clone(),
                };
                let sb = Sandbox::new(id, dir, vcpus, memory_mib, setup);
                *lock(&sb.net) = net.clone();
                sb
            })?
            .swap_remove(0);
        lock(&sandbox.memory).own = memory;
        let started = match self.start(&sandbox, source, &cx.progress, t0).await {
            Ok(()) if !env.is_empty() => self.set_env(&sandbox.id, env).await,
            started => started,
        };
        let started = match (started, spec.working_dir) {
            (Ok(()), Some(dir)) => self.set_working_dir(&sandbox.id, dir).await,
            (started, _) => started,
        };
        let started = match started {
            Ok(()) if !spec.volumes.is_empty() => {
                cx.progress.report(secs(t0), None, format!("{}: attaching {} volumes", sandbox.id, spec.volumes.len()));
                self.attach_volumes(&sandbox, cx.tenant.as_deref(), &spec.volumes).await
            }
            started => started,
        };
        if poolable {
            // The pool was empty (memory it gave away, fills that failed):
            // try again now that this create is done.
            self.fill_pool();
        }
        match started {
            Ok(()) => {
                ready_event(&sandbox, from);
                self.record_in_background(&sandbox);
                Ok(sandbox.info(None))
            }
            Err(e) => {
                tracing::warn!(sandbox = %sandbox.id, "creation failed: {e}");
                self.teardown(&sandbox, Some(format!("creation failed: {e}"))).await;
                sandbox.emit(EventKind::CreateFailed { error: e.to_string() });
                Err(e)
            }
        }
    }

    /// Makes pooled sandbox `sb` the caller's: into the map (within the
    /// live-sandbox cap; over it, `sb` goes back to the pool), with the
    /// spec's labels, idle timeout, owner and network policy, and returns.
    /// The reseed (fresh entropy, the host's clock) and the spec's
    /// environment go to the guest in the background: every agent call on
    /// the sandbox waits for them ([`Sandbox::handed_out`]), so no command
    /// runs before the reseed, and the create does not wait for a guest
    /// round trip. A failed hand-out tears the sandbox down; the calls
    /// waiting for it get its error.
    ///
    /// Errors: as [`Manager::create`].
    async fn hand_out(
        self: &Arc<Self>,
        sb: Arc<Sandbox>,
        spec: SandboxSpec,
        env: Vec<(String, String)>,
        idle_timeout: Duration,
        cx: &CallContext,
    ) -> Result<SandboxInfo, SandboxError> {
        let seed = match reseed_request() {
            Ok(seed) => seed,
            Err(e) => {
                self.return_pooled(sb);
                return Err(e);
            }
        };
        // The tenant's ceiling before anything of the caller's runs in it.
        let net = lock(&sb.net).clone();
        if let (Some(ceiling), Some(net)) = (&cx.ceiling, net) {
            if let Err(e) = net.set_ceiling(Some(ceiling)) {
                self.return_pooled(sb);
                return Err(e.into());
            }
        }
        let (done, handout) = tokio::sync::watch::channel(None);
        *lock(&sb.handout) = Some(handout);
        {
            let mut map = lock(&self.sandboxes);
            let live = live_in(&map);
            let max = self.config.limits.max_sandboxes;
            if self.shutting_down.load(Ordering::SeqCst) {
                drop(map);
                sb.retire_in_background(Some("the server is shutting down".into()));
                return Err(SandboxError::ShuttingDown);
            }
            let (kept, max_kept) = (map.len(), self.config.limits.max_kept_sandboxes);
            if live >= max || kept >= max_kept {
                drop(map);
                *lock(&sb.handout) = None;
                self.return_pooled(sb);
                self.fill_pool();
                return Err(if live >= max {
                    SandboxError::TooMany { live, max }
                } else {
                    SandboxError::TooManyKept { kept, max: max_kept }
                });
            }
            let claim = super::quota::Claim::of(cx, sb.vcpus, sb.memory_mib, sb.disk_mib);
            if let Err(e) = self.check_fits(&map, 1, sb.disk_mib, claim.as_ref()) {
                drop(map);
                *lock(&sb.handout) = None;
                self.return_pooled(sb);
                return Err(e);
            }
            // Its settings before anyone can see it in the map (the
            // sandbox's setting locks are leaves: see the lock order).
            sb.set_labels(spec.labels);
            sb.set_idle_timeout(idle_timeout);
            sb.set_owner(cx.owner);
            sb.set_tenant(cx.tenant.clone());
            sb.from_pool.store(true, Ordering::SeqCst);
            sb.touch();
            map.insert(sb.id.clone(), sb.clone());
        }
        let id = sb.id.clone();
        if let Some(policy) = &spec.network {
            if let Err(e) = self.set_network_policy(&id, policy) {
                done.send_replace(Some(Err(e.to_string())));
                self.teardown(&sb, Some(format!("creation failed: {e}"))).await;
                self.fill_pool();
                return Err(e);
            }
        }
        ready_event(&sb, format!("pool:{DEFAULT_TEMPLATE}"));
        self.record_in_background(&sb);
        let info = sb.info(None);
        let me = self.clone();
        let working_dir = spec.working_dir;
        tokio::spawn(async move {
            let agent = lock(&sb.status).agent.clone();
            let r = match agent {
                None => Err(sb.gone()),
                Some(agent) => hand_out_in_guest(&agent, &id, seed, env, working_dir).await,
            };
            match r {
                Ok(()) => {
                    done.send_replace(Some(Ok(())));
                    tracing::info!(sandbox = %id, "sandbox handed out from the warm pool");
                }
                Err(e) => {
                    done.send_replace(Some(Err(format!("its hand-out from the warm pool failed: {e}"))));
                    // Killed (or reaped) meanwhile: its kill said it all.
                    let ours = lock(&me.sandboxes).get(&id).is_some_and(|s| Arc::ptr_eq(s, &sb));
                    if ours {
                        tracing::warn!(sandbox = %id, "hand-out from the pool failed: {e}");
                        me.teardown(&sb, Some(format!("hand-out from the warm pool failed: {e}"))).await;
                        sb.emit(EventKind::CreateFailed { error: e.to_string() });
                    }
                }
            }
            me.fill_pool();
        });
        Ok(info)
    }

    /// A sandbox kept out of the map (a default-template build, a
    /// working-set recording, a pooled sandbox): id `<prefix>-<n>`, its
    /// directory in the run directory, holding `memory`, with the server's
    /// default network policy. Not started.
    ///
    /// Errors: [`SandboxError::Network`] from the network's set-up.
    pub(super) fn unlisted_sandbox(
        &self,
        prefix: &str,
        (vcpus, memory_mib): (u8, u64),
        setup: SandboxSetup,
        memory: Option<Reservation>,
    ) -> Result<Arc<Sandbox>, SandboxError> {
        let id = crate::ids::mint(prefix)?;
        let sb = Arc::new(Sandbox::new(id.clone(), self.config.run_dir.join(&id), vcpus, memory_mib, setup));
        lock(&sb.memory).own = memory;
        *lock(&sb.net) = self.net_control(None, None)?;
        Ok(sb)
    }

    /// The prefix of sandbox ids: `sb-<host>` with a host name
    /// ([`super::ManagerConfig::host_name`]), else `sb`.
    pub(super) fn sandbox_prefix(&self) -> String {
        crate::ids::sandbox_prefix(self.config.host_name.as_deref())
    }

    /// Reserves `n` sandboxes with disks of `disk_mib` each (new ids
    /// `sb-[<host>-]<random>` ([`crate::ids`]), none of them in the map;
    /// made by `make` from the id and its directory) in the map, as
    /// `starting`, within the live-sandbox cap, the tenant's quota
    /// (`claim`) and the disk budget: the one place live sandboxes are
    /// counted.
    ///
    /// Errors: [`SandboxError::ShuttingDown`], [`SandboxError::TooMany`]
    /// (`n` is 0 or would pass the cap), [`SandboxError::TooManyKept`],
    /// [`SandboxError::Quota`], [`SandboxError::DiskBudget`].
    pub(super) fn reserve(
        &self,
        n: usize,
        disk_mib: u64,
        claim: Option<&super::quota::Claim<'_>>,
        mut make: impl FnMut(SandboxId, PathBuf) -> Sandbox,
    ) -> Result<Vec<Arc<Sandbox>>, SandboxError> {
        let mut map = lock(&self.sandboxes);
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(SandboxError::ShuttingDown);
        }
        let live = live_in(&map);
        let max = self.config.limits.max_sandboxes;
        // Not `live + n > max`: a client's n near usize::MAX would wrap.
        if n == 0 || n > max.saturating_sub(live) {
            return Err(SandboxError::TooMany { live, max });
        }
        let (kept, max_kept) = (map.len(), self.config.limits.max_kept_sandboxes);
        if n > max_kept.saturating_sub(kept) {
            return Err(SandboxError::TooManyKept { kept, max: max_kept });
        }
        self.check_fits(&map, n, disk_mib, claim)?;
        let mut made = Vec::with_capacity(n);
        let prefix = self.sandbox_prefix();
        for _ in 0..n {
            // 80 random bits: a repeat is not expected, but one would
            // replace a live sandbox in the map.
            let mut id = crate::ids::mint(&prefix)?;
            while map.contains_key(&id) {
                id = crate::ids::mint(&prefix)?;
            }
            let sb = Arc::new(make(id.clone(), self.config.run_dir.join(&id)));
            map.insert(id, sb.clone());
            made.push(sb);
        }
        Ok(made)
    }

    /// Live sandboxes (starting, running or paused) now.
    /// Whether `n` more sandboxes fit under `max_kept_sandboxes`, checked
    /// before an idle sandbox is hibernated to make room for them (and
    /// again when they are added to the map).
    ///
    /// Errors: [`SandboxError::TooManyKept`].
    pub(super) fn check_kept(&self, n: usize) -> Result<(), SandboxError> {
        let (kept, max) = (self.len(), self.config.limits.max_kept_sandboxes);
        if n > max.saturating_sub(kept) {
            return Err(SandboxError::TooManyKept { kept, max });
        }
        Ok(())
    }

    pub(super) fn live_count(&self) -> usize {
        live_in(&lock(&self.sandboxes))
    }

    /// Takes `sb` down: forgets it (if the map still holds it), then
    /// [`Sandbox::retire`]s it with `reason`.
    pub(super) async fn teardown(&self, sb: &Arc<Sandbox>, reason: Option<String>) {
        {
            let mut map = lock(&self.sandboxes);
            if map.get(&sb.id).is_some_and(|s| Arc::ptr_eq(s, sb)) {
                map.remove(&sb.id);
            }
        }
        // Its volumes' writes out of the guest's page cache first.
        self.unmount_volumes(sb).await;
        sb.retire(reason).await;
        // Its volumes, its record and hibernations, if it had any, then
        // the disk layers only it used.
        if let Some(me) = self.me.upgrade() {
            let (id, s) = (sb.id.clone(), sb.clone());
            let _ = tokio::task::spawn_blocking(move || {
                me.release_volumes(&s);
                me.remove_record(&id);
                me.sweep_disks();
            })
            .await;
        }
    }

    /// Starts `sb`'s VM from `source` and waits until its agent answers,
    /// then reseeds the guest; `sb` is `running` after. Reports its steps
    /// to `progress` (progress: seconds since `t0`). Emits no event: the
    /// caller knows whether the sandbox is kept.
    pub(super) async fn start(
        &self,
        sb: &Arc<Sandbox>,
        source: VmSource,
        progress: &ProgressSink,
        t0: Instant,
    ) -> Result<(), SandboxError> {
        let io = |what: String| move |source| SandboxError::Io { what, source };
        let dir = sb.dir();
        // A sandbox resumed from disk keeps its directory (console log).
        std::fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
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
        let slots = match source {
            VmSource::Boot => &self.slots.boots,
            VmSource::Template(_) | VmSource::Branch(_) | VmSource::Hibernated { .. } => &self.slots.restores,
        };
        let _slot = match slots.try_acquire() {
            Ok(slot) => slot,
            Err(_) => {
                let waited = Instant::now();
                progress.report(secs(t0), None, format!("{}: waiting for a boot slot", sb.id));
                tracing::info!(sandbox = %sb.id, "waiting for a boot/restore slot (the host runs as many as it can serve)");
                let slot = slots.acquire().await.map_err(|_| SandboxError::ShuttingDown)?;
                tracing::info!(sandbox = %sb.id, "start admitted after {} ms", waited.elapsed().as_millis());
                slot
            }
        };
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(SandboxError::ShuttingDown);
        }
        let spec = VmSpec {
            name: sb.id.clone(),
            kernel: self.config.kernel.clone(),
            rootfs: sb.rootfs.clone().unwrap_or_else(|| self.config.rootfs.clone()),
            vcpus: sb.vcpus,
            memory_mib: sb.memory_mib,
            profile: self.config.profile,
            memory_backing: self.config.memory_backing,
            prefetch: self.config.prefetch,
            huge_pages: self.config.huge_pages,
            console_log: dir.join("console.log"),
            agent_socket: uds,
            net: self
                .config
                .network
                .as_ref()
                .zip(lock(&sb.net).clone())
                .map(|(n, control)| vmm::NetConfig { stack: n.stack.clone(), control }),
            disk: self.disk_plan.clone(),
            own_disk: sb.disk_mib > 0,
            slots: super::backend::SlotPlan {
                boot_slots: self.config.limits.volume_slots,
                keep: {
                    let attached = lock(&sb.volumes);
                    let mut keep = vec![false; attached.iter().map(|v| v.slot + 1).max().unwrap_or(0)];
                    for v in attached.iter() {
                        keep[v.slot] = true;
                    }
                    keep
                },
            },
        };
        let booted = matches!(source, VmSource::Boot);
        let fresh = matches!(source, VmSource::Boot | VmSource::Template(_));
        // A boot's disk starts as the blank file system of its size (made
        // once per size).
        let blank_mib = if booted { sb.disk_mib } else { 0 };
        progress.report(
            secs(t0),
            None,
            match &source {
                VmSource::Boot => format!("booting {}", sb.id),
                VmSource::Template(t) => format!("restoring {} from template {}", sb.id, t.meta.name),
                VmSource::Branch(_) => format!("restoring {} from a branch point", sb.id),
                VmSource::Hibernated { .. } => format!("resuming {} from disk", sb.id),
            },
        );
        *lock(&sb.base) = Base::of(&source);
        let backend = self.backend.clone();
        let vm = tokio::task::spawn_blocking(move || {
            let mut spec = spec;
            spec.disk.blank = match blank_mib {
                0 => None,
                mib => Some(crate::disks::blank_base(&spec.disk.dir, mib << 20).map_err(|e| SandboxError::Io {
                    what: format!("make a {mib} MiB disk"),
                    source: std::io::Error::other(e),
                })?),
            };
            backend.start(&spec, &source).map_err(SandboxError::Start)
        })
        .await
        .map_err(task_failed("VM start task"))??;
        let started = vm.started();
        let uds = vm.agent_socket().to_path_buf();
        let watch = vm.exit_watch();
        sb.attach_vm(vm).map_err(io("spawn the monitor thread".into()))?;
        self.note_vm(sb);
        // A resumed writer's volumes have new tops.
        self.note_volume_chains(sb).await;

        // Its secrets' hand-over (a recovered sandbox's is made here).
        self.attach_handoff(sb);
        let agent = self.wait_for_agent(sb, &*watch, &uds, progress, t0).await?;
        let agent_ms = started.elapsed().as_millis() as u64;
        progress.report(secs(t0), None, format!("{}: agent ready; reseeding", sb.id));
        reseed(sb, &agent).await?;
        let reseed_ms = started.elapsed().as_millis() as u64 - agent_ms;
        // A boot's or a template's guest: the server's CA certificates (a
        // branch child's and a hibernated one's memory has them already).
        if fresh {
            self.install_trust(sb, &agent).await?;
        }
        let boot_ms = started.elapsed().as_millis() as u64;
        sb.transition(Transition::Ready { agent: Arc::new(agent), boot_ms }).map_err(|r| SandboxError::NotRunning {
            id: sb.id.clone(),
            state: r.state,
            reason: r.error.unwrap_or_default(),
        })?;
        sb.touch();
        tracing::info!(sandbox = %sb.id, vcpus = sb.vcpus, memory_mib = sb.memory_mib, template = ?sb.template,
            agent_ms, reseed_ms, "sandbox ready in {boot_ms} ms");
        Ok(())
    }

    /// Connects to the agent of `sb`'s new VM through `uds`, retrying until
    /// it answers a ping, the VM ends or the boot timeout passes.
    async fn wait_for_agent(
        &self,
        sb: &Arc<Sandbox>,
        watch: &dyn ExitWatch,
        uds: &std::path::Path,
        progress: &ProgressSink,
        t0: Instant,
    ) -> Result<AgentClient, SandboxError> {
        let since = Instant::now();
        let deadline = since + Duration::from_secs(self.config.limits.boot_timeout_secs);
        let mut last_error = String::from("no attempt yet");
        let mut next_report = since + PROGRESS_EVERY;
        let mut retry = AGENT_RETRY_FIRST;
        loop {
            if progress.is_active() && Instant::now() >= next_report {
                next_report += PROGRESS_EVERY;
                let console = lock(&sb.vm).vm.as_ref().map(|vm| vm.console_tail(1)).unwrap_or_default();
                let console = cut(console.trim(), CONSOLE_LINE_BYTES);
                progress.report(
                    secs(t0),
                    None,
                    format!(
                        "booting {}: {} s of at most {} s; console: {console}",
                        sb.id,
                        since.elapsed().as_secs(),
                        self.config.limits.boot_timeout_secs
                    ),
                );
            }
            if watch.is_stopped() {
                // The monitor records the reason; give it a moment.
                let m = lock(&sb.vm).monitor.take();
                if let Some(m) = m {
                    let _ = tokio::task::spawn_blocking(move || m.join()).await;
                }
                let reason = lock(&sb.status).error.clone().unwrap_or_else(|| "the VM stopped during boot".into());
                return Err(SandboxError::NotRunning { id: sb.id.clone(), state: SandboxState::Failed, reason });
            }
            if Instant::now() >= deadline || self.shutting_down.load(Ordering::SeqCst) {
                let console =
                    lock(&sb.vm).vm.as_ref().map(|vm| vm.console_tail(CONSOLE_TAIL_LINES)).unwrap_or_default();
                return Err(SandboxError::Boot {
                    secs: self.config.limits.boot_timeout_secs,
                    reason: last_error,
                    console,
                });
            }
            match AgentClient::connect(uds, AGENT_PORT).await {
                Ok(client) => match client.handshake(PING_TIMEOUT).await {
                    Ok(_) => return Ok(client),
                    Err(e) => last_error = e.to_string(),
                },
                Err(e) => last_error = e.to_string(),
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(AGENT_RETRY);
        }
    }

    /// Stops a sandbox's VM, removes its files and forgets it. Waits for a
    /// pause, resume, snapshot, branch point or merge of it in progress
    /// (its `control` lock), so those finish first.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::Gone`] (killed
    /// or merged away while this kill waited).
    pub async fn kill(&self, id: &str) -> Result<(), SandboxError> {
        self.kill_with(id, EndReason::Killed).await
    }

    /// As [`Manager::kill`]; the event emitted says why (killed on
    /// request, or reaped).
    pub(super) async fn kill_with(&self, id: &str, why: EndReason) -> Result<(), SandboxError> {
        let sb = self.get(id)?;
        let _control = sb.control.lock().await;
        {
            let mut map = lock(&self.sandboxes);
            if !map.get(id).is_some_and(|s| Arc::ptr_eq(s, &sb)) {
                drop(map);
                return Err(sb.gone());
            }
            map.remove(id);
            self.kills.in_progress.fetch_add(1, Ordering::SeqCst);
        }
        let _dying = Dying(self);
        self.leave_parent(&sb);
        self.teardown(&sb, Some("killed".into())).await;
        tracing::info!(sandbox = %id, "sandbox killed");
        // Its memory may be what a refill of the pool was missing.
        self.fill_pool();
        sb.emit(match why {
            EndReason::Killed => EventKind::Killed,
            EndReason::Reaped { idle_secs } => EventKind::Reaped { idle_secs },
            EndReason::Expired => EventKind::Expired,
        });
        Ok(())
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
                Ok(t) if super::kvm::slots_of(&t).is_some_and(|n| n != self.config.limits.volume_slots) => {
                    tracing::info!(
                        "rebuilding the default template: it has {:?} volume slots, limits.volume_slots is {}",
                        super::kvm::slots_of(&t),
                        self.config.limits.volume_slots
                    );
                }
                Ok(_) => {
                    self.fill_pool();
                    return self.template_info(DEFAULT_TEMPLATE);
                }
                Err(SandboxError::Template(TemplateError::NotFound(_))) => {}
                Err(e) => tracing::warn!("rebuilding the default template: {e}"),
            }
        }
        let _building = BuildFlag::set(&self.default_build.building);
        let drained = self.drain_pool("the default template is being rebuilt");
        if drained > 0 {
            tracing::info!("stopped {drained} pooled sandboxes of the old default template");
        }
        let limits = &self.config.limits;
        let (vcpus, memory_mib) = (limits.vcpus(None)?, limits.memory_mib(None)?);
        // Its VM counts in the memory budget like any sandbox's.
        let memory = self.admit("default template build", &[(MemoryUse::Sandbox, memory_mib)])?.pop();
        let setup = SandboxSetup {
            labels: BTreeMap::new(),
            template: None,
            idle_timeout: Duration::MAX,
            owner: None,
            tenant: None,
            events: None,
            disk_mib: self.boot_disk_mib(),
            rootfs: None,
        };
        let sb = self.unlisted_sandbox("template", (vcpus, memory_mib), setup, memory)?;
        tracing::info!("building the default template (a cold boot)");
        // Creates waiting for the build quote what it is doing.
        let status = self.default_build.status.clone();
        status.send_replace("starting a cold boot".into());
        let steps = ProgressSink::new(move |u| {
            status.send_replace(u.message);
        });
        // The log says what the build is doing every 10 s: a cold boot
        // takes a minute or more on slow hosts.
        let started = Instant::now();
        let mut watch = self.default_build.status.subscribe();
        let heartbeat = AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval(BUILD_LOG_PERIOD);
            tick.tick().await;
            loop {
                tick.tick().await;
                let now = watch.borrow_and_update().clone();
                tracing::info!("default template build: {now}, {} s so far", started.elapsed().as_secs());
            }
        }));
        let r = match self.start(&sb, VmSource::Boot, &steps, Instant::now()).await {
            Ok(()) => self.snapshot_sandbox(&sb, DEFAULT_TEMPLATE, true, &steps).await,
            Err(e) => Err(e),
        };
        if r.is_ok() {
            // Before the build VM goes: the build ends (its `template-`
            // directory gone) once the working set is stored too.
            self.default_build.status.send_replace("recording its working set".into());
            self.record_working_set(DEFAULT_TEMPLATE).await;
        }
        drop(heartbeat);
        self.default_build.status.send_replace("finished".into());
        self.teardown(&sb, None).await;
        match r {
            Ok(()) => {
                tracing::info!("the default template is ready, built in {} s", started.elapsed().as_secs());
                // Fills wait for the end of the build (a fill that began
                // before it finds the pool's generation changed).
                drop(_building);
                self.fill_pool();
                self.template_info(DEFAULT_TEMPLATE)
            }
            Err(e) => {
                tracing::error!("cannot build the default template: {e}; sandboxes will boot instead");
                Err(e)
            }
        }
    }
}

/// A pooled sandbox's hand-out in its guest, in this order: the reseed
/// (fresh entropy, the host's clock), the spec's environment, its working
/// directory. The pool's sandboxes are the default template's (root, no
/// working directory of their own), so the working directory goes with
/// no user.
///
/// Errors: [`SandboxError::Connection`] naming the step that failed.
async fn hand_out_in_guest(
    agent: &AgentClient,
    id: &str,
    seed: Reseed,
    env: Vec<(String, String)>,
    working_dir: Option<String>,
) -> Result<(), SandboxError> {
    let failed = |step: &str, e: tine_agent_client::ClientError| SandboxError::Connection {
        id: id.to_string(),
        reason: format!("{step}: {e}"),
    };
    agent.reseed(seed, RESEED_TIMEOUT).await.map_err(|e| failed("reseed", e))?;
    if !env.is_empty() {
        agent.set_env(env, RESEED_TIMEOUT).await.map_err(|e| failed("set the environment", e))?;
    }
    if let Some(dir) = working_dir {
        let defaults = tine_protocol::ProcessDefaults { user: None, working_dir: Some(dir) };
        agent
            .set_process_defaults(defaults, RESEED_TIMEOUT)
            .await
            .map_err(|e| failed("set the working directory", e))?;
    }
    Ok(())
}

/// Emits `sb`'s [`EventKind::Ready`], its VM from `source` (`boot`,
/// `template:<t>`, `branch:<parent>`).
pub(super) fn ready_event(sb: &Sandbox, source: String) {
    let boot_ms = lock(&sb.status).boot_ms.unwrap_or_default();
    sb.emit(EventKind::Ready { boot_ms, source });
}

/// Hands a new guest host entropy and the host's clock: a restored one
/// must not go on with its template's RNG state and old clock.
async fn reseed(sb: &Sandbox, agent: &AgentClient) -> Result<(), SandboxError> {
    agent
        .reseed(reseed_request()?, RESEED_TIMEOUT)
        .await
        .map_err(|e| SandboxError::Connection { id: sb.id.clone(), reason: format!("reseed: {e}") })
}

/// A reseed: [`SEED_BYTES`] of the host's entropy and its clock now.
///
/// Errors: [`SandboxError::Io`] when `/dev/urandom` cannot be read.
fn reseed_request() -> Result<Reseed, SandboxError> {
    let mut entropy = vec![0u8; SEED_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut entropy))
        .map_err(|source| SandboxError::Io { what: "read /dev/urandom".into(), source })?;
    let unix_time_ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    Ok(Reseed { entropy, unix_time_ns })
}

/// Live sandboxes (those [`SandboxState::is_live`] counts) in `map`.
fn live_in(map: &BTreeMap<SandboxId, Arc<Sandbox>>) -> usize {
    map.values().filter(|s| s.state().is_live()).count()
}
