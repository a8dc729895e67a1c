//! What a client asks for when it creates a sandbox ([`SandboxSpec`]):
//! shape, labels, idle timeout, template, egress policy and environment.
//! Its own file so that the lifecycle and the warm pool both use it
//! without importing each other.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// What to create.
#[derive(Clone, Debug, Default)]
pub struct SandboxSpec {
    /// vCPUs (`None`: the default).
    pub vcpus: Option<u64>,
    /// Guest memory in MiB (`None`: the default).
    pub memory_mib: Option<u64>,
    /// The size of its own disk in MiB (`None`: its template's, or
    /// `default_disk_mib` for the default template and a boot). A size
    /// other than the default template's boots the sandbox.
    pub disk_mib: Option<u64>,
    /// Free-form labels, for `list` filters.
    pub labels: BTreeMap<String, String>,
    /// Idle timeout in seconds (`None`: the default).
    pub idle_timeout_secs: Option<u64>,
    /// Restore from this template instead of booting (`None`: the default
    /// template, when it exists and has the requested shape).
    pub template: Option<String>,
    /// The egress policy (`None`: the server's default).
    pub network: Option<netstack::policy::NetworkPolicy>,
    /// The sandbox environment: variables every exec, background process
    /// and Python cell gets (see [`Manager::set_env`](super::Manager::set_env)); empty: none beyond
    /// a template's own.
    pub env: BTreeMap<String, String>,
    /// Boot this read-only root filesystem image instead of the server's
    /// (a base image `tine_image` built from an OCI image; set by a
    /// template's build from an image, never from a client's path):
    /// `template` is then ignored and the sandbox boots.
    pub base: Option<PathBuf>,
    /// Volumes to attach ([`crate::volumes`]), in the device slots of its
    /// template, in order. A create with volumes does not take a pooled
    /// sandbox.
    pub volumes: Vec<crate::volumes::VolumeRequest>,
    /// Secrets to bind ([`crate::secrets`]): environment variable →
    /// secret name; the variable holds a placeholder the broker swaps.
    pub secrets: Vec<(String, String)>,
    /// Its name ([`super::names`]), unique within its tenant on this host.
    pub name: Option<String>,
    /// The absolute directory its commands without a `cwd` and its
    /// interpreters start in, made if missing (`Op::SetProcessDefaults`'s
    /// `working_dir`, kept with the template's user); `None`: the
    /// template's (`/` for commands, the user's home for interpreters).
    pub working_dir: Option<String>,
}
