//! A sandbox's settings after its creation: the sandbox environment, its
//! labels, idle timeout and network policy ([`Manager::update`]).
//!
//! The environment lives in the guest agent (`Op::SetEnv`), so snapshots,
//! templates and branch children carry it with the rest of the guest's
//! memory; labels and the idle timeout live here and are copied to branch
//! children.

use std::collections::BTreeMap;

use netstack::policy::NetworkPolicy;
use tine_protocol::{check_sandbox_env, ProcessDefaults};

use super::calls::SHORT_CALL;
use super::{Manager, SandboxError, SandboxInfo};

/// What [`Manager::update`] changes; `None` leaves a setting as it is.
#[derive(Clone, Debug, Default)]
pub struct SandboxUpdate {
    /// New labels (replace the old ones).
    pub labels: Option<BTreeMap<String, String>>,
    /// New idle timeout (s), within the server's limits; the time already
    /// idle counts toward it.
    pub idle_timeout_secs: Option<u64>,
    /// A new sandbox environment (replaces the old one; empty clears it).
    pub env: Option<BTreeMap<String, String>>,
    /// A new egress policy.
    pub network: Option<NetworkPolicy>,
    /// New secret bindings (environment variable → secret name), in place
    /// of the old ones (empty: detach all); a pair bound already keeps its
    /// placeholder.
    pub secrets: Option<Vec<(String, String)>>,
}

/// A map of variables as the protocol carries them (sorted by name).
pub(super) fn env_vars(env: &BTreeMap<String, String>) -> Vec<(String, String)> {
    env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

impl Manager {
    /// Replaces sandbox `id`'s environment: every later exec, background
    /// process and Python cell gets `env` (a call's own `env` wins);
    /// processes already running keep theirs. A paused sandbox is resumed.
    ///
    /// Errors: [`SandboxError::Agent`] with `InvalidRequest` for a variable
    /// the protocol refuses (see `check_sandbox_env`: names of
    /// `[A-Za-z0-9_]`, at most 256 variables and 64 KiB), before anything
    /// is sent; as [`Manager::exec`] otherwise.
    pub async fn set_env(&self, id: &str, env: Vec<(String, String)>) -> Result<(), SandboxError> {
        check_sandbox_env(&env)?;
        self.with_agent(id, |a| async move { a.set_env(env, SHORT_CALL).await }).await
    }

    /// Sets who sandbox `id`'s later commands and interpreters run as,
    /// and where (an OCI image's `User` and `WorkingDir`; see
    /// `Op::SetProcessDefaults`); returns the ones it replaced. The agent
    /// keeps them, so snapshots, templates and branch children carry them.
    ///
    /// Errors: [`SandboxError::Agent`] with `InvalidRequest` for a user or
    /// group the guest's `/etc/passwd` or `/etc/group` lacks, `Unsupported`
    /// from an agent older than the operation; as [`Manager::exec`]
    /// otherwise.
    pub async fn set_process_defaults(
        &self,
        id: &str,
        defaults: ProcessDefaults,
    ) -> Result<ProcessDefaults, SandboxError> {
        self.with_agent(id, |a| async move { a.set_process_defaults(defaults, SHORT_CALL).await }).await
    }

    /// Makes `dir` (absolute) the directory sandbox `id`'s later commands
    /// without a `cwd` and its interpreters start in, keeping who they run
    /// as (see [`Manager::set_process_defaults`]; a running interpreter is
    /// replaced at its next cell).
    ///
    /// Errors: as [`Manager::set_process_defaults`] (`InvalidRequest` for a
    /// relative or too long `dir`).
    pub async fn set_working_dir(&self, id: &str, dir: String) -> Result<(), SandboxError> {
        let before = self.set_process_defaults(id, ProcessDefaults::default()).await?;
        let defaults = ProcessDefaults { user: before.user, working_dir: Some(dir) };
        self.set_process_defaults(id, defaults).await.map(drop)
    }

    /// Changes sandbox `id`'s settings and returns its info. Everything is
    /// checked first, so a refused value changes nothing; then the network
    /// policy, the environment, the labels and the idle timeout are set in
    /// that order (only a failure to reach the guest can leave the network
    /// policy changed and the rest not).
    ///
    /// Errors: [`SandboxError::NotFound`]; the limits' errors for labels
    /// and the idle timeout; [`SandboxError::NoNetwork`] and
    /// [`SandboxError::Network`] for the policy; as [`Manager::set_env`].
    pub async fn update(&self, id: &str, update: SandboxUpdate) -> Result<SandboxInfo, SandboxError> {
        let sb = self.get(id)?;
        let limits = &self.config.limits;
        let idle_timeout = update.idle_timeout_secs.map(|s| limits.idle_timeout(Some(s))).transpose()?;
        if let Some(labels) = &update.labels {
            limits.check_labels(labels)?;
        }
        let env = update.env.as_ref().map(env_vars);
        if let Some(env) = &env {
            check_sandbox_env(env)?;
        }
        if let Some(requests) = &update.secrets {
            self.bind_secrets(sb.tenant().as_deref(), &crate::lock(&sb.secrets).clone(), requests)?;
        }
        if let Some(policy) = &update.network {
            self.set_network_policy(id, policy)?;
        }
        if let Some(requests) = &update.secrets {
            self.set_secrets(id, requests).await?;
        }
        if let Some(env) = env {
            self.set_env(id, env).await?;
        }
        if let Some(labels) = update.labels {
            sb.set_labels(labels);
        }
        if let Some(t) = idle_timeout {
            sb.set_idle_timeout(t);
        }
        self.record_in_background(&sb);
        sb.touch();
        self.info(id).await
    }
}
