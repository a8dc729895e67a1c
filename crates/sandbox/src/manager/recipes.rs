//! Templates built from a recipe ([`Recipe`]): start a sandbox from a
//! template (the default one unless named), give it the recipe's
//! environment, write its files, run its setup commands one after another
//! (each with its own deadline; the first that fails or times out stops
//! the build, reported with its output), then snapshot it as the named
//! template and kill the builder. A sandbox made from the template has the
//! files, the environment (it lives in the guest agent) and whatever the
//! commands installed.
//!
//! Builds run in the background ([`Manager::start_template_build`]); their
//! state (building with the current step, or failed with the reason) is
//! listed beside the ready templates ([`Manager::templates`]). A failed
//! build's record stays until the name is built again or deleted, or it is
//! among the oldest beyond [`MAX_FAILED_BUILDS`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;
use tine_protocol::{check_sandbox_env, AgentError, ExitStatus, ProcessDefaults, MAX_TIMEOUT_MS};

use super::calls::ExecRequest;
use super::{unix_ms, Manager, SandboxError, SandboxSpec};
use crate::lock;
use crate::progress::{cut, CallContext, ProgressSink};
use crate::templates::{TemplateError, TemplateInfo, TemplateState, DEFAULT_TEMPLATE};

/// The label a recipe's builder sandbox carries (its value: the template's
/// name).
pub(super) const BUILD_LABEL: &str = "tine.template-build";

/// Default deadline of one setup step (s).
pub const DEFAULT_STEP_TIMEOUT_SECS: u32 = 600;
/// Most setup steps of a recipe.
pub const MAX_STEPS: usize = 64;
/// Most files a recipe writes.
pub const MAX_FILES: usize = 256;
/// Most bytes of all the files of a recipe (8 MiB).
pub const MAX_FILE_BYTES: usize = 8 << 20;
/// Bytes of each stream of a failed step kept in its report (its end).
pub const FAILED_OUTPUT_BYTES: usize = 4096;
/// Failed builds' records kept (each up to about 9 KiB in `template_list`);
/// a new build evicts the oldest beyond this.
pub const MAX_FAILED_BUILDS: usize = 16;

/// One setup command: a bash script, or one with its own deadline.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum SetupStep {
    /// `bash -c` script, with the recipe's `step_timeout_secs`.
    Command(String),
    /// A script with its own deadline.
    Timed {
        /// `bash -c` script.
        command: String,
        /// Its deadline (s, at most 600).
        timeout_secs: u32,
    },
}

impl SetupStep {
    fn command(&self) -> &str {
        match self {
            SetupStep::Command(c) | SetupStep::Timed { command: c, .. } => c,
        }
    }
}

/// A template recipe, as `template_create` takes it and as a TOML file for
/// `tine template build --recipe FILE` (see `deploy/templates/`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The new template's name: 1-63 of `[a-z0-9_-]`, not `default` nor
    /// `tine-*`. An existing template of that name is replaced once the
    /// build succeeds.
    pub name: String,
    /// The template to start from (default: the default template).
    #[serde(default)]
    pub from: Option<String>,
    /// Build from this OCI image instead of a template: a registry
    /// reference (`registry.example:5000/team/app:tag` or `...@sha256:...`,
    /// linux/amd64), pulled and booted with Tine's agent; its `Env` is the
    /// template's environment under `env`; its `User` and `WorkingDir` are
    /// who the template's sandboxes run as and where. Not with `from`. The
    /// setup steps run as root (here and for a template `from` one made
    /// so) with the image's `bash`, or `sh` where it has none.
    #[serde(default)]
    pub image: Option<String>,
    /// vCPUs (default: `from`'s; another shape than the default
    /// template's boots a fresh sandbox).
    #[serde(default)]
    pub vcpus: Option<u64>,
    /// Guest memory (MiB; default: `from`'s).
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// The sandbox environment of the template (and of the setup steps).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Files to write first: absolute path -> UTF-8 content.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// Commands run in order after the files are written.
    #[serde(default)]
    pub setup: Vec<SetupStep>,
    /// Deadline of each step without its own (s; default 600, at most 600).
    #[serde(default)]
    pub step_timeout_secs: Option<u32>,
}

/// A build's record while it runs or after it failed.
#[derive(Clone, Debug)]
pub(super) struct BuildRecord {
    pub state: TemplateState,
    /// What it does now, or why it failed.
    pub detail: String,
    pub started_at_ms: u64,
    pub vcpus: u8,
    pub memory_mib: u64,
}

impl BuildRecord {
    fn info(&self, name: &str) -> TemplateInfo {
        let failed = self.state == TemplateState::Failed;
        TemplateInfo {
            name: name.to_string(),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            created_at_ms: self.started_at_ms,
            source_sandbox: None,
            disk_bytes: 0,
            error: failed.then(|| self.detail.clone()),
            state: self.state,
            step: (!failed).then(|| self.detail.clone()),
            prefetch: false,
        }
    }
}

/// Drops the oldest failed records until at most `keep` remain.
fn evict_failed(builds: &mut BTreeMap<String, BuildRecord>, keep: usize) {
    loop {
        let failed = builds.iter().filter(|(_, r)| r.state == TemplateState::Failed);
        if failed.clone().count() <= keep {
            return;
        }
        let Some(oldest) = failed.min_by_key(|(_, r)| r.started_at_ms).map(|(n, _)| n.clone()) else { return };
        builds.remove(&oldest);
    }
}

/// The end of `bytes` as text (invalid UTF-8 replaced), at most
/// [`FAILED_OUTPUT_BYTES`], on a character boundary.
fn tail(bytes: &[u8]) -> String {
    crate::events::keep_end(&String::from_utf8_lossy(bytes), FAILED_OUTPUT_BYTES)
}

impl Recipe {
    /// Checks the recipe against the limits before anything starts.
    ///
    /// Errors: [`SandboxError::Template`] (`BadName`, `Reserved`,
    /// `BadRecipe`), [`SandboxError::Agent`] for the environment.
    pub fn check(&self) -> Result<(), SandboxError> {
        crate::templates::check_name(&self.name)?;
        if crate::templates::is_reserved(&self.name) {
            return Err(TemplateError::Reserved(self.name.clone()).into());
        }
        let bad = |why: String| SandboxError::Template(TemplateError::BadRecipe(why));
        check_sandbox_env(&super::settings::env_vars(&self.env))?;
        if let Some(image) = &self.image {
            super::images::check_reference(image)?;
            if self.from.is_some() {
                return Err(bad("give `image` or `from`, not both".into()));
            }
        }
        if self.setup.len() > MAX_STEPS {
            return Err(bad(format!("{} setup steps: at most {MAX_STEPS}", self.setup.len())));
        }
        if self.files.len() > MAX_FILES {
            return Err(bad(format!("{} files: at most {MAX_FILES}", self.files.len())));
        }
        let bytes: usize = self.files.values().map(String::len).sum();
        if bytes > MAX_FILE_BYTES {
            return Err(bad(format!("the files hold {bytes} bytes: at most {MAX_FILE_BYTES}")));
        }
        if let Some(p) = self.files.keys().find(|p| !p.starts_with('/') || p.contains('\0')) {
            return Err(bad(format!("file path {:?} is not absolute", cut(p, 200))));
        }
        let max_secs = MAX_TIMEOUT_MS / 1000;
        let timeouts = self.setup.iter().filter_map(|s| match s {
            SetupStep::Timed { timeout_secs, .. } => Some(*timeout_secs),
            SetupStep::Command(_) => None,
        });
        if let Some(t) = timeouts.chain(self.step_timeout_secs).find(|t| !(1..=max_secs).contains(t)) {
            return Err(bad(format!("a step's timeout of {t} s: use 1..={max_secs}")));
        }
        if let Some(i) = self.setup.iter().position(|s| s.command().trim().is_empty()) {
            return Err(bad(format!("setup step {} is empty", i + 1)));
        }
        Ok(())
    }
}

impl Manager {
    /// [`Recipe::check`], and the recipe's vCPUs and memory within this
    /// server's limits, before the build's record is made.
    ///
    /// Errors: as [`Recipe::check`]; [`SandboxError::Limits`].
    fn check_recipe(&self, recipe: &Recipe) -> Result<(), SandboxError> {
        recipe.check()?;
        self.config.limits.vcpus(recipe.vcpus)?;
        self.config.limits.memory_mib(recipe.memory_mib)?;
        Ok(())
    }

    /// Template `name`'s build record, if one runs or failed.
    pub(super) fn build_records(&self) -> Vec<TemplateInfo> {
        lock(&self.builds).iter().map(|(name, r)| r.info(name)).collect()
    }

    /// Forgets a failed build's record (on `template_delete`); whether
    /// there was one. Errors: [`TemplateError::Building`] while it runs.
    pub(super) fn forget_build(&self, name: &str) -> Result<bool, SandboxError> {
        let mut builds = lock(&self.builds);
        match builds.get(name).map(|r| r.state) {
            Some(TemplateState::Building) => Err(TemplateError::Building(name.to_string()).into()),
            Some(_) => Ok(builds.remove(name).is_some()),
            None => Ok(false),
        }
    }

    /// Starts building `recipe` in the background and returns its record
    /// (`building`). Follow it with [`Manager::templates`] or
    /// [`Manager::wait_template_build`].
    ///
    /// The builder sandbox is the caller's like any other: it belongs to
    /// `cx.owner` and `cx.tenant`, counts against `cx.quota` and runs under
    /// `cx.ceiling` (every setup step with it).
    ///
    /// Errors: as [`Recipe::check`]; [`SandboxError::Limits`] for vCPUs or
    /// memory out of range; [`TemplateError::Building`] when a build of
    /// that name runs; [`SandboxError::Quota`].
    pub fn start_template_build(
        self: &Arc<Self>,
        recipe: Recipe,
        cx: &CallContext,
    ) -> Result<TemplateInfo, SandboxError> {
        self.check_recipe(&recipe)?;
        self.check_template_claim(cx, true)?;
        let record = BuildRecord {
            state: TemplateState::Building,
            detail: "starting the builder sandbox".into(),
            started_at_ms: unix_ms(),
            vcpus: recipe.vcpus.and_then(|v| u8::try_from(v).ok()).unwrap_or(0),
            memory_mib: recipe.memory_mib.unwrap_or(0),
        };
        {
            let mut builds = lock(&self.builds);
            if builds.get(&recipe.name).is_some_and(|r| r.state == TemplateState::Building) {
                return Err(TemplateError::Building(recipe.name.clone()).into());
            }
            builds.insert(recipe.name.clone(), record.clone());
            evict_failed(&mut builds, MAX_FAILED_BUILDS);
        }
        let info = record.info(&recipe.name);
        let me = self.clone();
        let name = recipe.name.clone();
        // The build runs on after the call returns: the caller's whole
        // context but its progress (the build's record instead) and its
        // cancellation (the call's end is not the build's).
        let caller = CallContext { progress: ProgressSink::none(), cancel: Default::default(), ..cx.clone() };
        tokio::spawn(async move {
            let progress = {
                let (me, name) = (me.clone(), name.clone());
                ProgressSink::new(move |u| {
                    if let Some(r) = lock(&me.builds).get_mut(&name) {
                        if r.state == TemplateState::Building {
                            r.detail = u.message;
                        }
                    }
                })
            };
            let cx = CallContext { progress, ..caller };
            match me.build_template(&recipe, &cx).await {
                Ok(_) => {
                    lock(&me.builds).remove(&name);
                }
                Err(e) => {
                    tracing::warn!(template = name, "template build failed: {e}");
                    if let Some(r) = lock(&me.builds).get_mut(&name) {
                        r.state = TemplateState::Failed;
                        r.detail = e.to_string();
                    }
                }
            }
        });
        Ok(info)
    }

    /// Builds `recipe` now (see the module doc), reporting each step to
    /// `cx.progress`; returns the new template's listing.
    ///
    /// Errors: as [`Recipe::check`]; the builder's creation's; for a step
    /// that fails or times out [`TemplateError::SetupFailed`] with its
    /// number, command, exit and output's end; the snapshot's.
    pub async fn build_template(
        self: &Arc<Self>,
        recipe: &Recipe,
        cx: &CallContext,
    ) -> Result<TemplateInfo, SandboxError> {
        self.check_recipe(recipe)?;
        let t0 = Instant::now();
        let steps = recipe.setup.len() as f64 + 2.0;
        let report = |step: f64, message: String| cx.progress.report(step, Some(steps), message);
        // From an OCI image: its base image boots, its Env under the
        // recipe's.
        let (base, mut env, run_as) = match &recipe.image {
            Some(image) => {
                let base = self.base_image(image, &|m| report(0.0, m)).await?;
                let env = super::images::image_env(&base.run);
                check_sandbox_env(&super::settings::env_vars(&env))
                    .map_err(|e| super::images::ImageBuildError::Env { image: image.clone(), reason: e.to_string() })?;
                let run_as = ProcessDefaults { user: base.run.user.clone(), working_dir: base.run.working_dir.clone() };
                (Some(base.path), env, Some((image, run_as)).filter(|(_, d)| *d != ProcessDefaults::default()))
            }
            None => (None, BTreeMap::new(), None),
        };
        env.extend(recipe.env.clone());
        report(
            0.0,
            match &recipe.image {
                Some(image) => format!("booting the builder sandbox from image {image}"),
                None => {
                    format!("starting the builder sandbox from {}", recipe.from.as_deref().unwrap_or(DEFAULT_TEMPLATE))
                }
            },
        );
        let spec = SandboxSpec {
            vcpus: recipe.vcpus,
            memory_mib: recipe.memory_mib,
            labels: BTreeMap::from([(BUILD_LABEL.to_string(), recipe.name.clone())]),
            template: recipe.from.clone(),
            env,
            base,
            ..SandboxSpec::default()
        };
        // The builder is the caller's sandbox like any other: its owner,
        // tenant, quota and network ceiling (a recipe step is a command of
        // the caller's), with no progress of its own.
        let builder = CallContext { progress: ProgressSink::none(), ..cx.clone() };
        let id = self.create_with(spec, &builder).await?.sandbox_id;
        let built = self.run_recipe_as_root(&id, recipe, run_as, &report).await;
        let built = match built {
            Ok(()) => {
                report(steps - 1.0, format!("snapshotting {id} as template {}", recipe.name));
                match self.get(&id) {
                    Ok(sb) => self.snapshot_sandbox(&sb, &recipe.name, true, &ProgressSink::none()).await,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        let _ = self.kill(&id).await;
        built?;
        report(steps - 0.5, format!("recording the working set of template {}", recipe.name));
        self.record_working_set(&recipe.name).await;
        tracing::info!(template = recipe.name, "built from its recipe in {:?}", t0.elapsed());
        report(steps, format!("template {} ready", recipe.name));
        self.template_info(&recipe.name)
    }

    /// Runs the recipe in sandbox `id` as root (its steps install
    /// software), also in a builder restored from a template whose
    /// sandboxes run as an image's user; then sets who the template's
    /// sandboxes run as: `image`'s `User` and `WorkingDir` where given,
    /// else what the builder had.
    ///
    /// Errors: as [`Manager::run_recipe`]; [`ImageBuildError::RunAs`] for
    /// an image's user its files lack.
    async fn run_recipe_as_root(
        &self,
        id: &str,
        recipe: &Recipe,
        image: Option<(&String, ProcessDefaults)>,
        report: &(dyn Fn(f64, String) + Sync),
    ) -> Result<(), SandboxError> {
        let before = match self.set_process_defaults(id, ProcessDefaults::default()).await {
            Ok(before) => before,
            // An agent older than the operation runs everything as root.
            Err(SandboxError::Agent(AgentError::Unsupported { .. })) => ProcessDefaults::default(),
            Err(e) => return Err(e),
        };
        self.run_recipe(id, recipe, report).await?;
        match image {
            Some((image, run_as)) => self.set_process_defaults(id, run_as).await.map(drop).map_err(|e| match e {
                SandboxError::Agent(e) => {
                    super::images::ImageBuildError::RunAs { image: image.clone(), reason: e.to_string() }.into()
                }
                e => e,
            }),
            None if before != ProcessDefaults::default() => self.set_process_defaults(id, before).await.map(drop),
            None => Ok(()),
        }
    }

    /// Writes the recipe's files and runs its steps in sandbox `id`.
    async fn run_recipe(
        &self,
        id: &str,
        recipe: &Recipe,
        report: &(dyn Fn(f64, String) + Sync),
    ) -> Result<(), SandboxError> {
        if !recipe.files.is_empty() {
            report(0.5, format!("writing {} files", recipe.files.len()));
        }
        for (path, content) in &recipe.files {
            self.write_file(id, path.clone(), content.clone().into_bytes(), None, false).await?;
        }
        let n = recipe.setup.len();
        let default_secs = recipe.step_timeout_secs.unwrap_or(DEFAULT_STEP_TIMEOUT_SECS);
        for (i, step) in recipe.setup.iter().enumerate() {
            let (command, secs) = match step {
                SetupStep::Command(c) => (c.clone(), default_secs),
                SetupStep::Timed { command, timeout_secs } => (command.clone(), *timeout_secs),
            };
            report(i as f64 + 1.0, format!("step {}/{n}: {}", i + 1, cut(&command, 200)));
            let req = ExecRequest { command: command.clone(), timeout_ms: secs * 1000, ..ExecRequest::default() };
            let x = self.exec(id, req).await?;
            let exit = match x.status {
                ExitStatus::Code(0) => continue,
                ExitStatus::Code(c) => format!("exit code {c}"),
                ExitStatus::Signal(s) => format!("signal {s}"),
                ExitStatus::TimedOut => format!("timed out after {secs} s"),
            };
            return Err(TemplateError::SetupFailed {
                step: i + 1,
                command: cut(&command, 500),
                exit,
                stdout: tail(&x.stdout.data),
                stderr: tail(&x.stderr.data),
            }
            .into());
        }
        Ok(())
    }

    /// Waits until build `name` is no longer running, at most `timeout`,
    /// reporting its step to `progress`; returns its listing (ready,
    /// failed, or still building at the timeout).
    ///
    /// Errors: [`TemplateError::NotFound`] when there is neither a build
    /// nor a template of that name.
    pub async fn wait_template_build(
        &self,
        name: &str,
        timeout: std::time::Duration,
        progress: &ProgressSink,
    ) -> Result<TemplateInfo, SandboxError> {
        let t0 = Instant::now();
        loop {
            let record = lock(&self.builds).get(name).cloned();
            match record {
                Some(r) if r.state == TemplateState::Building && t0.elapsed() < timeout => {
                    progress.report(t0.elapsed().as_secs_f64(), None, r.detail.clone());
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                Some(r) => return Ok(r.info(name)),
                None => return self.template_info(name),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipes_parse_from_toml_and_are_checked() {
        let r: Recipe = toml::from_str(
            r#"
            name = "python-data"
            memory_mib = 1024
            env = { MPLBACKEND = "Agg" }
            setup = ["pip install numpy", { command = "python3 -c 'import numpy'", timeout_secs = 60 }]
            [files]
            "/etc/motd" = "hello"
            "#,
        )
        .unwrap();
        assert_eq!(r.setup[1], SetupStep::Timed { command: "python3 -c 'import numpy'".into(), timeout_secs: 60 });
        assert_eq!(r.files["/etc/motd"], "hello");
        assert!(r.check().is_ok());
        let bad = |f: &dyn Fn(&mut Recipe)| {
            let mut b = r.clone();
            f(&mut b);
            b.check().unwrap_err().to_string()
        };
        assert!(bad(&|b| b.name = "default".into()).contains("default"));
        assert!(bad(&|b| b.name = "Bad Name".into()).contains("Bad Name"));
        assert!(bad(&|b| b.setup.push(SetupStep::Command(" ".into()))).contains("step 3 is empty"));
        assert!(bad(&|b| b.step_timeout_secs = Some(601)).contains("601"));
        assert!(bad(&|b| {
            b.files.insert("rel/path".into(), String::new());
        })
        .contains("not absolute"));
        assert!(bad(&|b| {
            b.env.insert("A=B".into(), String::new());
        })
        .contains("A=B"));
        assert!(toml::from_str::<Recipe>("name = \"x\"\nsetpu = []").is_err(), "unknown keys are refused");
    }

    #[test]
    fn only_the_newest_failed_builds_are_kept() {
        let record = |state, started_at_ms| BuildRecord {
            state,
            detail: String::new(),
            started_at_ms,
            vcpus: 1,
            memory_mib: 512,
        };
        let mut builds: BTreeMap<String, BuildRecord> =
            (0..5).map(|i| (format!("f{i}"), record(TemplateState::Failed, 100 - i))).collect();
        builds.insert("running".into(), record(TemplateState::Building, 0));
        evict_failed(&mut builds, 3);
        let names: Vec<&str> = builds.keys().map(String::as_str).collect();
        assert_eq!(names, ["f0", "f1", "f2", "running"], "the two oldest failed ones went; a running one stays");
    }

    #[test]
    fn the_shipped_example_recipe_is_valid() {
        let r: Recipe = toml::from_str(include_str!("../../../../deploy/templates/python-data.toml")).unwrap();
        r.check().unwrap();
        assert_eq!((r.name.as_str(), r.setup.len(), r.env["MPLBACKEND"].as_str()), ("python-data", 2, "Agg"));
    }

    #[test]
    fn the_tail_of_a_long_output_is_kept_on_a_character_boundary() {
        let long = format!("{}é{}", "a".repeat(10), "b".repeat(FAILED_OUTPUT_BYTES - 1));
        let t = tail(long.as_bytes());
        assert!(t.len() <= FAILED_OUTPUT_BYTES && t.ends_with('b') && !t.contains('a'), "{}", t.len());
    }
}
