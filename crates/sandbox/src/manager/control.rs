//! Control of a live sandbox's VM: pause, resume and snapshot (into a
//! template). All async: the blocking VM work runs off the async threads,
//! under the sandbox's `control` lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::sandbox::Transition;
use super::{task_failed, unix_ms, Manager, Sandbox, SandboxError, SandboxInfo, SandboxState};
use crate::events::EventKind;
use crate::lock;
use crate::progress::{CallContext, ProgressSink};
use crate::templates::{TemplateError, TemplateInfo, TemplateMeta};

/// Longest wait for every vCPU to park.
pub(super) const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Steps of a snapshot's progress ([`Manager::snapshot_with`]).
const SNAPSHOT_STEPS: f64 = 4.0;

impl Manager {
    /// Pauses a running sandbox: its vCPUs stop (no CPU use), its memory,
    /// processes and files stay. Pausing a paused sandbox does nothing.
    /// Returns once every vCPU has parked (milliseconds; at most 5 s).
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`],
    /// [`SandboxError::Pause`].
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        // A pooled sandbox's reseed must reach running vCPUs first.
        sb.handed_out().await?;
        if sb.state() == super::SandboxState::Running {
            self.sync_volumes(&sb).await;
        }
        tokio::task::spawn_blocking(move || pause_blocking(&sb)).await.map_err(task_failed("pause task"))?
    }

    /// Resumes a paused sandbox. Resuming a running sandbox does nothing.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`].
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        sb.handed_out().await?;
        self.awake(&sb).await?;
        tokio::task::spawn_blocking(move || resume_blocking(&sb)).await.map_err(task_failed("resume task"))?
    }

    /// Every template, by name (see [`crate::templates::TemplateStore::list`]),
    /// and the recipe builds that run or failed (`state`).
    pub fn templates(&self) -> Vec<TemplateInfo> {
        let mut all = self.templates.list();
        // A rebuild lists the old template (ready) beside its build.
        all.extend(self.build_records());
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// Deletes template `name` (see [`crate::templates::TemplateStore::delete`]):
    /// sandboxes restored from it keep running. The server's own templates
    /// (`default`, `tine-*`) cannot be deleted here; `tine template build`
    /// remakes the default.
    ///
    /// Errors: [`SandboxError::Template`] ([`TemplateError::Reserved`],
    /// [`TemplateError::BadName`], [`TemplateError::NotFound`],
    /// [`TemplateError::Io`]).
    pub async fn template_delete(self: &Arc<Self>, name: &str) -> Result<(), SandboxError> {
        crate::templates::check_name(name)?;
        if crate::templates::is_reserved(name) {
            return Err(TemplateError::Reserved(name.to_string()).into());
        }
        let forgot = self.forget_build(name)?;
        let (me, name) = (self.clone(), name.to_string());
        let deleted = tokio::task::spawn_blocking(move || me.templates.delete(&name))
            .await
            .map_err(task_failed("template delete task"))?;
        match deleted {
            // A failed build's record was all there was.
            Err(TemplateError::NotFound(_)) if forgot => Ok(()),
            r => Ok(r?),
        }
    }

    /// Template `name`'s listing.
    pub(super) fn template_info(&self, name: &str) -> Result<TemplateInfo, SandboxError> {
        self.templates
            .list()
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| SandboxError::Template(TemplateError::NotFound(name.to_string())))
    }

    /// Makes template `name` from a running or paused sandbox: its memory,
    /// processes, files and vCPU state as they are now. The sandbox is
    /// paused while its memory is copied (about 0.1 s per 40 MiB the guest
    /// has touched here), then goes on.
    ///
    /// Names reserved for the server ([`crate::templates::is_reserved`]:
    /// `default`, `tine-*`) are refused; the template quotas
    /// ([`crate::Limits::max_templates`], [`crate::Limits::max_template_disk_mib`])
    /// are checked before the copy.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::BadState`],
    /// [`SandboxError::Template`] (bad, reserved or taken name, quota),
    /// [`SandboxError::Snapshot`], [`SandboxError::Io`].
    pub async fn snapshot(self: &Arc<Self>, id: &str, name: &str) -> Result<TemplateInfo, SandboxError> {
        self.snapshot_with(id, name, &CallContext::default()).await
    }

    /// As [`Manager::snapshot`], reporting its 4 steps to `cx.progress`
    /// (progress: the step, of 4): warming up Python, warming up the
    /// shell, pausing the sandbox and copying its memory, template written.
    ///
    /// Errors: as [`Manager::snapshot`].
    pub async fn snapshot_with(
        self: &Arc<Self>,
        id: &str,
        name: &str,
        cx: &CallContext,
    ) -> Result<TemplateInfo, SandboxError> {
        crate::templates::check_name(name)?;
        if crate::templates::is_reserved(name) {
            return Err(TemplateError::Reserved(name.to_string()).into());
        }
        let sb = self.get(id)?;
        if sb.state() == SandboxState::Starting {
            return Err(SandboxError::Starting(sb.id.clone()));
        }
        // The name and the quotas before the warm-up (checked again under
        // the sandbox's control, when the template is written): a refusal
        // does not wait seconds of warming up first.
        if self.templates.path(name).exists() {
            return Err(TemplateError::Exists(name.to_string()).into());
        }
        self.check_template_quota(name)?;
        self.check_template_claim(cx, false)?;
        // A template of a pooled sandbox carries its environment.
        sb.handed_out().await?;
        self.awake(&sb).await?;
        sb.touch();
        self.snapshot_sandbox(&sb, name, false, &cx.progress).await?;
        self.template_info(name)
    }

    /// Snapshots `sb`'s VM as template `name` (paused for the copy, then
    /// resumed unless it was paused already), off the async threads. A
    /// running sandbox's Python interpreter is started and warmed up first
    /// ([`warm_up_python`]), so sandboxes restored from the template have
    /// a ready one. Reports its steps to `progress` (of 4).
    pub(super) async fn snapshot_sandbox(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        name: &str,
        replace: bool,
        progress: &ProgressSink,
    ) -> Result<(), SandboxError> {
        warm_up_python(sb, progress).await;
        // The detach, the capture and the reattach under the sandbox's
        // control: no branch, hibernation or kill sees its slots emptied
        // for the capture.
        let _control = sb.control.lock().await;
        // A template never carries a volume: out of their slots for the
        // capture, back in after it.
        let detached = self.detach_volumes(sb).await?;
        if !detached.is_empty() {
            let names: Vec<String> = lock(&sb.volumes).iter().map(|v| v.name.clone()).collect();
            let names = names.join(", ");
            tracing::info!(sandbox = %sb.id, "volumes {names} detached for a snapshot: the template has none");
            progress.report(
                3.0,
                Some(SNAPSHOT_STEPS),
                format!("volumes {names} detached for the capture: the template records them detached"),
            );
        }
        progress.report(3.0, Some(SNAPSHOT_STEPS), format!("pausing {} and copying its memory", sb.id));
        let (me, s, name) = (self.clone(), sb.clone(), name.to_string());
        let shown = name.clone();
        let taken = tokio::task::spawn_blocking(move || me.snapshot_blocking(&s, &name, replace))
            .await
            .map_err(task_failed("snapshot task"));
        let reattached = self.reattach_volumes(sb, detached).await;
        taken??;
        reattached?;
        progress.report(SNAPSHOT_STEPS, Some(SNAPSHOT_STEPS), format!("template {shown} written"));
        Ok(())
    }

    /// Whether one more template `name` fits `max_templates` and
    /// `max_template_disk_mib`.
    ///
    /// Errors: [`TemplateError::Quota`].
    fn check_template_quota(&self, name: &str) -> Result<(), TemplateError> {
        let limits = &self.config.limits;
        self.templates.check_quota(name, limits.max_templates, limits.max_template_disk_mib.saturating_mul(1 << 20))
    }

    /// The capture of [`Manager::snapshot_sandbox`], whose caller holds
    /// `sb`'s `control`.
    fn snapshot_blocking(&self, sb: &Sandbox, name: &str, replace: bool) -> Result<(), SandboxError> {
        let state = sb.state();
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "a snapshot" });
        }
        self.check_template_quota(name)?;
        let tmp = self.templates.begin(name, replace)?;
        let (kernel, rootfs) = self.templates.images()?;
        let base = match &sb.rootfs {
            Some(path) => Some((
                path.clone(),
                crate::templates::FileIdentity::of(path)
                    .map_err(|e| TemplateError::Io { what: format!("stat {}", path.display()), source: e })?,
            )),
            None => None,
        };
        let taken = {
            let slot = lock(&sb.vm);
            match slot.vm.as_ref() {
                Some(vm) => {
                    let start = Instant::now();
                    let was_paused = vm.is_paused();
                    let r = vm.pause(PAUSE_TIMEOUT).and_then(|_| vm.snapshot(&tmp));
                    if !was_paused {
                        vm.resume();
                    }
                    Some(r.map(|_| start.elapsed()))
                }
                None => None,
            }
        };
        let took = match taken {
            Some(Ok(t)) => t,
            Some(Err(source)) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(SandboxError::Snapshot { id: sb.id.clone(), source });
            }
            None => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(SandboxError::BadState { id: sb.id.clone(), state: sb.state(), what: "a snapshot" });
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
            guest_setup: self.templates.guest_setup().to_string(),
            base,
        };
        if let Err(e) = self.templates.commit(&tmp, &meta, replace) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e.into());
        }
        tracing::info!(sandbox = %sb.id, template = name, "snapshot taken in {took:?} (the guest was paused for it)");
        Ok(())
    }
}

/// Pauses `sb` (see [`Manager::pause`]). Blocking.
fn pause_blocking(sb: &Sandbox) -> Result<SandboxInfo, SandboxError> {
    let _control = sb.control.blocking_lock();
    match sb.state() {
        // A hibernated sandbox is paused on disk.
        SandboxState::Paused | SandboxState::Hibernated => return Ok(sb.info(None)),
        SandboxState::Running => {}
        state => return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "pause" }),
    }
    let paused = lock(&sb.vm).vm.as_ref().map(|vm| vm.pause(PAUSE_TIMEOUT));
    let took = match paused {
        Some(r) => r.map_err(|source| SandboxError::Pause { id: sb.id.clone(), source })?,
        None => return Err(SandboxError::BadState { id: sb.id.clone(), state: sb.state(), what: "pause" }),
    };
    if let Err(refused) = sb.transition(Transition::Pause) {
        // It ended (or was killed) while pausing.
        if let Some(vm) = lock(&sb.vm).vm.as_ref() {
            vm.resume();
        }
        return Err(SandboxError::BadState { id: sb.id.clone(), state: refused.state, what: "pause" });
    }
    sb.emit(EventKind::Paused);
    sb.touch();
    tracing::info!(sandbox = %sb.id, "paused in {took:?}");
    Ok(sb.info(None))
}

/// Resumes `sb` (see [`Manager::resume`]). Blocking.
fn resume_blocking(sb: &Sandbox) -> Result<SandboxInfo, SandboxError> {
    let _control = sb.control.blocking_lock();
    match sb.state() {
        SandboxState::Running => {}
        SandboxState::Paused => {
            if let Some(vm) = lock(&sb.vm).vm.as_ref() {
                vm.resume();
            }
            sb.transition(Transition::Resume).map_err(|r| SandboxError::BadState {
                id: sb.id.clone(),
                state: r.state,
                what: "resume",
            })?;
            sb.emit(EventKind::Resumed);
            tracing::info!(sandbox = %sb.id, "resumed");
        }
        state => return Err(SandboxError::BadState { id: sb.id.clone(), state, what: "resume" }),
    }
    sb.touch();
    Ok(sb.info(None))
}

/// Longest wait for the Python warm-up before a snapshot: the interpreter's
/// start deadline plus the warm-up cell.
const WARM_UP_TIMEOUT: Duration = Duration::from_millis(tine_protocol::PYTHON_START_TIMEOUT_MS as u64 * 2 + 30_000);

/// Starts `sb`'s Python interpreter if it is not running and runs the
/// agent's warm-up in it (the cells' namespace stays empty), when `sb` is
/// running. A failure (no python3 in the image, ...) is logged: the
/// snapshot is still good, its sandboxes start Python on their first cell.
async fn warm_up_python(sb: &Sandbox, progress: &ProgressSink) {
    progress.report(1.0, Some(SNAPSHOT_STEPS), "warming up Python");
    let agent = {
        let st = lock(&sb.status);
        match st.state {
            SandboxState::Running => st.agent.clone(),
            _ => None,
        }
    };
    let Some(agent) = agent else { return };
    let _busy = sb.mark_busy();
    match agent.warm_up_python(WARM_UP_TIMEOUT).await {
        Ok(Some(ms)) => {
            tracing::info!(sandbox = %sb.id, "Python interpreter started ({ms} ms) and warmed up for a snapshot")
        }
        Ok(None) => tracing::info!(sandbox = %sb.id, "Python interpreter warmed up for a snapshot"),
        Err(e) => tracing::warn!(sandbox = %sb.id, "no warmed-up Python interpreter in the snapshot: {e}"),
    }
    // The shell too: a command run through `bash -c` once pages bash and
    // the C library into the guest's page cache, which the snapshot keeps,
    // so restored sandboxes' first commands do not read them from disk. A
    // sandbox restored from a template (or a branch child of one) has them
    // there already: that template's build ran this warm-up before its
    // snapshot, and the page cache came back with the guest's memory. A
    // process start is seconds on hosts that emulate the guest's kernel
    // (docs/hosts.md).
    if sb.template.is_some() {
        return;
    }
    progress.report(2.0, Some(SNAPSHOT_STEPS), "warming up the shell");
    match agent.exec("ls / >/dev/null", 60_000, 1024).await {
        Ok(_) => tracing::info!(sandbox = %sb.id, "shell warmed up for a snapshot"),
        Err(e) => tracing::warn!(sandbox = %sb.id, "shell warm-up before a snapshot failed: {e}"),
    }
}
