//! Templates from OCI images: a recipe's `image` is pulled from its
//! registry (`tine_image::registry`) into `<images_dir>/oci/<repository>/`
//! and made a base image (`tine_image::build`: the layers applied, Tine's
//! agent, taken from the server's root filesystem, as init) in
//! `<images_dir>/bases/`, which the recipe's builder sandbox boots as its
//! root. A base image is named by the image's manifest digest and the
//! agent's identity, so a second template of the same image reuses it,
//! and a new agent (a rebuilt root filesystem) makes a new one. The
//! image's `Env` becomes the template's environment under the recipe's
//! own `env`.
//!
//! Only registry references come this way (a client's path on the
//! server's disk is refused): local layouts and archives are the
//! operator's, through `tine image build`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::Manager;
use crate::templates::FileIdentity;

/// `[images]` in the server's configuration.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct ImagesConfig {
    /// Registries (`host:port`) reached over plain HTTP instead of HTTPS
    /// (a registry on the host or the LAN); default none. Listed
    /// registries may be on private addresses.
    pub insecure_registries: Vec<String>,
    /// Registries (`host[:port]`) reached over HTTPS although their names
    /// resolve to loopback, private or link-local addresses (a registry
    /// inside the operator's network); default none. Any other registry
    /// on such an address is refused, so that a recipe cannot make the
    /// server fetch from its own network.
    pub private_registries: Vec<String>,
    /// Hosts other than the image's registry that a pull may reach: the
    /// token service a registry names and the blob storage it redirects
    /// to (`host`, `host:port` or `*.domain`; e.g. Docker Hub's
    /// `auth.docker.io` and `production.cloudflare.docker.com`); default
    /// none: only the registry's own `host:port`, so that a tenant's
    /// registry cannot send the server elsewhere. Their addresses are
    /// judged as a registry's (a host on a private address must be in
    /// `private_registries` too).
    pub allowed_hosts: Vec<String>,
    /// Credentials per registry (`[[images.auth]]`); a registry not listed
    /// is pulled from anonymously. Every tenant's recipes pull with them:
    /// list a registry here only if its images are for all tenants.
    pub auth: Vec<RegistryAuth>,
}

/// One `[[images.auth]]` entry: credentials for one registry, kept in
/// files (a systemd credential, or a file of mode 0600) and read at each
/// pull, so a rotated password needs no restart.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryAuth {
    /// The registry, as image references name it (`host[:port]`).
    pub registry: String,
    /// HTTP basic auth (distribution spec; the registry's token service
    /// gets it): the user, with `password_file`.
    pub username: Option<String>,
    /// The file holding the password (or an access token used as one).
    pub password_file: Option<PathBuf>,
    /// A bearer token sent as is, from this file (instead of a user).
    pub token_file: Option<PathBuf>,
}

impl RegistryAuth {
    /// Checks the entry's shape and reads its credential.
    ///
    /// Errors: [`ImageBuildError::Credentials`] for a missing or extra
    /// field, or a file that is missing, empty, or readable by group or
    /// others.
    pub fn load(&self) -> Result<tine_image::registry::Auth, ImageBuildError> {
        let bad = |reason: String| ImageBuildError::Credentials { registry: self.registry.clone(), reason };
        if self.registry.is_empty() || self.registry.contains('/') {
            return Err(bad("registry must be host[:port]".into()));
        }
        match (&self.username, &self.password_file, &self.token_file) {
            (Some(user), Some(f), None) => {
                Ok(tine_image::registry::Auth::Basic { user: user.clone(), password: read_secret(f).map_err(bad)? })
            }
            (None, None, Some(f)) => Ok(tine_image::registry::Auth::Bearer(read_secret(f).map_err(bad)?)),
            _ => Err(bad("give username with password_file, or token_file alone".into())),
        }
    }
}

/// A credential file's content, without its trailing newline.
///
/// Errors: the reason, for a file that cannot be read, is empty, or is
/// readable by group or others.
fn read_secret(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(format!("{} has mode {:04o}: chmod 600 it", path.display(), mode & 0o7777));
    }
    let s = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let s = s.trim_end_matches(['\r', '\n']).to_string();
    if s.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(s)
}

impl ImagesConfig {
    /// Checks the configuration at the server's start: each credential
    /// entry well formed and its file readable (see [`RegistryAuth::load`]),
    /// no registry listed twice.
    ///
    /// Errors: [`ImageBuildError::Credentials`].
    pub fn check(&self) -> Result<(), ImageBuildError> {
        for (i, a) in self.auth.iter().enumerate() {
            a.load()?;
            if self.auth[..i].iter().any(|b| b.registry == a.registry) {
                return Err(ImageBuildError::Credentials {
                    registry: a.registry.clone(),
                    reason: "listed twice in [[images.auth]]".into(),
                });
            }
        }
        Ok(())
    }

    /// The credentials for `reference`'s registry (anonymous if none;
    /// `docker.io` names Docker Hub's `index.docker.io`).
    ///
    /// Errors: as [`RegistryAuth::load`]; [`ImageBuildError::Pull`] for a
    /// reference that does not parse.
    pub fn auth_for(&self, reference: &str) -> Result<tine_image::registry::Auth, ImageBuildError> {
        let registry = tine_image::registry::registry_of(reference)?;
        let listed =
            |a: &&RegistryAuth| a.registry == registry || (a.registry == "docker.io" && registry == "index.docker.io");
        match self.auth.iter().find(listed) {
            Some(a) => a.load(),
            None => Ok(tine_image::registry::Auth::Anonymous),
        }
    }
}

/// The longest image reference taken, bytes (the distribution spec's
/// name is at most 255; a tag 128; a digest 71).
pub const MAX_REFERENCE_BYTES: usize = 512;

/// Bumped when what a base image holds besides the image changes (so that
/// old ones are not reused).
const BASE_FORMAT: u32 = 1;

/// Errors of making a template's base image.
#[derive(Debug, thiserror::Error)]
pub enum ImageBuildError {
    /// Not a registry reference (a path, empty, too long, whitespace).
    #[error(
        "image {0:?}: give a registry reference (registry.example:5000/team/app:tag); local layouts and \
         archives are built by the operator with `tine image build`"
    )]
    NotAReference(String),
    /// The registry is on an address the server does not fetch from.
    #[error(
        "registry {registry} resolves to {address} ({range}); the operator may list it in [images] \
         private_registries (HTTPS) or insecure_registries (HTTP)"
    )]
    PrivateRegistry {
        /// `host[:port]`.
        registry: String,
        /// The address found.
        address: std::net::IpAddr,
        /// The range it is in.
        range: String,
    },
    /// The registry's name does not resolve.
    #[error("registry {registry}: cannot resolve its name: {reason}")]
    Resolve {
        /// `host[:port]`.
        registry: String,
        /// Why.
        reason: String,
    },
    /// The image's `Env` holds a variable a sandbox cannot take.
    #[error("image {image}: its Env is not usable as a sandbox environment: {reason}")]
    Env {
        /// The reference.
        image: String,
        /// Why.
        reason: String,
    },
    /// The image's `User` or `WorkingDir` cannot be applied in its root
    /// filesystem (e.g. a user its `/etc/passwd` lacks).
    #[error("image {image}: its User or WorkingDir cannot be applied: {reason}")]
    RunAs {
        /// The reference.
        image: String,
        /// Why (the agent's answer).
        reason: String,
    },
    /// An `[[images.auth]]` entry is wrong or its file unreadable.
    #[error("[[images.auth]] for registry {registry:?}: {reason}")]
    Credentials {
        /// The entry's registry.
        registry: String,
        /// Why.
        reason: String,
    },
    /// The pull failed.
    #[error(transparent)]
    Pull(#[from] tine_image::registry::RegistryError),
    /// The base image could not be built.
    #[error(transparent)]
    Build(#[from] tine_image::ImageError),
    /// The agent could not be taken from the root filesystem, or the
    /// image directory written.
    #[error("{0}")]
    Host(String),
}

/// Checks a recipe's `image` before anything starts.
///
/// Errors: [`ImageBuildError::NotAReference`].
pub fn check_reference(reference: &str) -> Result<(), ImageBuildError> {
    let bad = reference.is_empty()
        || reference.len() > MAX_REFERENCE_BYTES
        || reference.starts_with(['/', '.', '~'])
        || reference.chars().any(|c| c.is_whitespace() || c.is_control());
    if bad {
        return Err(ImageBuildError::NotAReference(reference.chars().take(200).collect()));
    }
    Ok(())
}

/// The environment an image's `Env` (`NAME=value` entries) gives; entries
/// without `=` are skipped.
pub fn image_env(run: &tine_image::RunConfig) -> BTreeMap<String, String> {
    run.env.iter().filter_map(|e| e.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A base image and the image's run configuration.
pub(super) struct Base {
    /// The ext4 image.
    pub path: PathBuf,
    /// `Env`, `WorkingDir`, `User`, ...
    pub run: tine_image::RunConfig,
}

/// Held while an image's layout is pulled and built from: two builds of
/// one repository (its layout directory is shared) take turns, so one
/// never reads the index the other wrote.
static LAYOUT_LOCKS: std::sync::Mutex<BTreeMap<PathBuf, std::sync::Weak<tokio::sync::Mutex<()>>>> =
    std::sync::Mutex::new(BTreeMap::new());

fn layout_lock(layout: &Path) -> std::sync::Arc<tokio::sync::Mutex<()>> {
    let mut locks = crate::lock(&LAYOUT_LOCKS);
    locks.retain(|_, l| l.strong_count() > 0);
    if let Some(l) = locks.get(layout).and_then(std::sync::Weak::upgrade) {
        return l;
    }
    let l = std::sync::Arc::new(tokio::sync::Mutex::new(()));
    locks.insert(layout.to_path_buf(), std::sync::Arc::downgrade(&l));
    l
}

/// The sandboxes' always-refused addresses as netstack judges them
/// ([`netstack::policy::BLOCKED_RANGES`] and this host's own addresses,
/// IPv4-mapped and NAT64 forms included), with nothing permitted: the
/// registries the server itself fetches from meet the same rule.
fn address_policy() -> netstack::policy::CompiledPolicy {
    let server = netstack::policy::ServerNetPolicy {
        permit_ranges: Vec::new(),
        host_addrs: netstack::policy::HostAddrs::system(),
    };
    netstack::policy::CompiledPolicy::new(&netstack::policy::NetworkPolicy::default(), &server)
        .expect("a policy without rules compiles")
}

/// Why `policy` ([`address_policy`]) refuses `ip`, if it does: the
/// blocked range's description, or "this host's own address".
fn blocked_range(policy: &netstack::policy::CompiledPolicy, ip: std::net::IpAddr) -> Option<String> {
    let verdict = policy.check_addr(ip, 443, &[]);
    if verdict.allowed {
        return None;
    }
    let range = verdict.rule.strip_prefix("blocked-range:").unwrap_or(&verdict.rule);
    let why = netstack::policy::BLOCKED_RANGES.iter().find(|(cidr, _)| *cidr == range).map(|(_, why)| *why);
    Some(match (why, range) {
        (Some(why), _) => why.to_string(),
        (None, "host-address") => "this host's own address".to_string(),
        (None, _) => verdict.rule.clone(),
    })
}

/// Refuses a registry whose name resolves to a blocked address unless the
/// operator listed it.
async fn check_registry(reference: &str, config: &ImagesConfig) -> Result<(), ImageBuildError> {
    let registry = tine_image::registry::registry_of(reference)?;
    if config.insecure_registries.contains(&registry) || config.private_registries.contains(&registry) {
        return Ok(());
    }
    let with_port =
        if registry.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) && !registry.ends_with(']') {
            registry.clone()
        } else {
            format!("{registry}:443")
        };
    let addresses = tokio::net::lookup_host(&with_port)
        .await
        .map_err(|e| ImageBuildError::Resolve { registry: registry.clone(), reason: e.to_string() })?;
    let policy = address_policy();
    for a in addresses {
        if let Some(range) = blocked_range(&policy, a.ip()) {
            return Err(ImageBuildError::PrivateRegistry { registry, address: a.ip(), range });
        }
    }
    Ok(())
}

impl Manager {
    /// The base image of `reference` (pulled and built unless a base of
    /// that manifest and this server's agent exists), reporting each step
    /// to `report`.
    ///
    /// Errors: [`ImageBuildError`].
    pub(super) async fn base_image(
        &self,
        reference: &str,
        report: &(dyn Fn(String) + Sync),
    ) -> Result<Base, ImageBuildError> {
        check_reference(reference)?;
        check_registry(reference, &self.config.images).await?;
        let images = &self.config.images;
        let dir = self.config.images_dir.clone();
        let oci = dir.join("oci");
        let lock = layout_lock(&oci.join(tine_image::layout_dir_name(reference)));
        let _turn = lock.lock().await;
        let hosts = pull_hosts(images);
        let (limits, build_limits) = self.stage_limits();
        report(format!("pulling {reference}"));
        std::fs::create_dir_all(&oci).map_err(|e| ImageBuildError::Host(format!("make {}: {e}", oci.display())))?;
        // This build's own layout, removed when the build ends (the
        // guard, and `Staged`), whatever happens.
        let staging = tempfile::Builder::new()
            .prefix(".pull.")
            .tempdir_in(&oci)
            .map_err(|e| ImageBuildError::Host(format!("make a directory in {}: {e}", oci.display())))?;
        let layout = staging.path().join("layout");
        let request = tine_image::registry::PullRequest {
            reference,
            auth: images.auth_for(reference)?,
            insecure: &images.insecure_registries,
            layout: &layout,
            hosts: &hosts,
            limits,
        };
        let rootfs = self.config.rootfs.clone();
        let agent_id =
            FileIdentity::of(&rootfs).map_err(|e| ImageBuildError::Host(format!("stat {}: {e}", rootfs.display())))?;
        let bases = dir.join("bases");
        let built_for = |digest: &str| {
            let mut h = Sha256::new();
            h.update(format!("{BASE_FORMAT}\n{digest}\n"));
            h.update(serde_json::to_vec(&agent_id).unwrap_or_default());
            let key = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect::<String>();
            let path = bases.join(format!("{key}.ext4"));
            let run_path = bases.join(format!("{key}.json"));
            let run = match (path.exists(), std::fs::read(&run_path)) {
                (true, Ok(text)) => serde_json::from_slice::<tine_image::RunConfig>(&text).ok(),
                _ => None,
            };
            (path, run_path, run)
        };
        // The manifest's digest first: a base built from it already
        // needs no blob.
        let digest = tine_image::registry::resolve(&request).await?;
        if let (path, _, Some(run)) = built_for(&digest) {
            report(format!("base image of {reference} already built"));
            return Ok(Base { path, run });
        }
        // The pull's steps come back through a channel: `report` is not
        // `Send`-able into the pull's future.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let mut send = move |step: &str| {
            let _ = tx.send(step.to_string());
        };
        let staged = {
            let pull = tine_image::registry::pull_staged(&request, &mut send);
            tokio::pin!(pull);
            loop {
                tokio::select! {
                    r = &mut pull => break r?,
                    Some(step) = rx.recv() => report(format!("pulling {reference}: {step}")),
                }
            }
        };
        let pulled = &staged.pulled;
        tracing::info!(
            image = reference,
            digest = pulled.digest,
            "pulled: {} blobs fetched ({} bytes), {} already here",
            pulled.fetched,
            pulled.bytes,
            pulled.reused
        );
        let (path, run_path, run) = built_for(&pulled.digest);
        if let Some(run) = run {
            report(format!("base image of {reference} already built"));
            return Ok(Base { path, run });
        }
        report(format!("making {reference} a base image"));
        let reference = reference.to_string();
        let task = tokio::task::spawn_blocking(move || {
            // The staged layout (and its directory) go when the build ends.
            let _staging = staging;
            build_base(&reference, staged.layout(), &rootfs, &bases, &path, &run_path, build_limits)
        });
        task.await.map_err(|e| ImageBuildError::Host(format!("the image build task failed: {e}")))?
    }

    /// The bounds of a pull and of the build from it: the defaults of
    /// [`tine_image::registry::PullLimits`] and [`tine_image::Limits`],
    /// the bytes staged by each at most what the templates' disk quota
    /// (`max_template_disk_mib`) has left.
    fn stage_limits(&self) -> (tine_image::registry::PullLimits, tine_image::Limits) {
        let quota = self.config.limits.max_template_disk_mib.saturating_mul(1 << 20);
        let used: u64 = self.templates.list().iter().map(|t| t.disk_bytes).sum();
        let left = quota.saturating_sub(used);
        let pull = tine_image::registry::PullLimits::default();
        let build = tine_image::Limits::default();
        (
            tine_image::registry::PullLimits {
                max_blob_bytes: pull.max_blob_bytes.min(left),
                max_total_bytes: pull.max_total_bytes.min(left),
                ..pull
            },
            tine_image::Limits { max_file_bytes: build.max_file_bytes.min(left), ..build },
        )
    }
}

/// The hosts a pull for a tenant may reach: the registry, the operator's
/// `allowed_hosts`; addresses judged by [`address_policy`] unless the
/// host is one of the operator's registries (`insecure_registries`,
/// `private_registries`).
fn pull_hosts(config: &ImagesConfig) -> tine_image::registry::HostPolicy {
    let policy = std::sync::Arc::new(address_policy());
    tine_image::registry::HostPolicy {
        allowed_hosts: config.allowed_hosts.clone(),
        private_hosts: config.insecure_registries.iter().chain(&config.private_registries).cloned().collect(),
        refuse_address: Some(std::sync::Arc::new(move |ip| blocked_range(&policy, ip))),
        any_host: false,
    }
}

/// Builds the base image at `path` (its run configuration at `run_path`)
/// from the pulled layout, with the agent of `rootfs`. Blocking.
fn build_base(
    reference: &str,
    layout: &Path,
    rootfs: &Path,
    bases: &Path,
    path: &Path,
    run_path: &Path,
    limits: tine_image::Limits,
) -> Result<Base, ImageBuildError> {
    let host = |what: &str, e: &dyn std::fmt::Display| ImageBuildError::Host(format!("{what}: {e}"));
    std::fs::create_dir_all(bases).map_err(|e| host(&format!("make {}", bases.display()), &e))?;
    // Removed when dropped, whatever happens.
    let work = tempfile::Builder::new()
        .prefix(".build.")
        .tempdir_in(bases)
        .map_err(|e| host(&format!("make a directory in {}", bases.display()), &e))?;
    let agent = work.path().join("tine-agent");
    tine_image::agent_from_rootfs(rootfs, &agent)?;
    let built = tine_image::build(
        &tine_image::BuildRequest {
            image: layout,
            reference: Some(reference),
            agent: &agent,
            out: path,
            work: work.path(),
            limits,
        },
        &mut |step| tracing::info!(image = reference, "base image: {step}"),
    )?;
    let text = serde_json::to_vec(&built.run).expect("JSON of a run configuration");
    let partial = work.path().join("run.json");
    std::fs::write(&partial, text).map_err(|e| host(&format!("write {}", partial.display()), &e))?;
    std::fs::rename(&partial, run_path).map_err(|e| host(&format!("write {}", run_path.display()), &e))?;
    tracing::info!(
        image = reference,
        "base image {}: {} layers, {} paths, {} bytes of files",
        path.display(),
        built.layers,
        built.paths,
        built.file_bytes
    );
    Ok(Base { path: path.to_path_buf(), run: built.run })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Credentials come from files of mode 0600, per registry; a wrong
    /// entry or file is refused saying which, a registry not listed pulls
    /// anonymously.
    #[test]
    fn registry_credentials_from_files() {
        use std::os::unix::fs::PermissionsExt;
        use tine_image::registry::Auth;
        let dir = tempfile::tempdir().unwrap();
        let secret = |name: &str, text: &str, mode: u32| {
            let f = dir.path().join(name);
            std::fs::write(&f, text).unwrap();
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            Some(f)
        };
        let basic = RegistryAuth {
            registry: "registry.example:5000".into(),
            username: Some("bot".into()),
            password_file: secret("pw", "s3cret\n", 0o600),
            token_file: None,
        };
        let bearer = RegistryAuth {
            registry: "docker.io".into(),
            token_file: secret("token", "tok", 0o400),
            ..RegistryAuth::default()
        };
        let config = ImagesConfig { auth: vec![basic.clone(), bearer.clone()], ..ImagesConfig::default() };
        config.check().unwrap();
        assert_eq!(
            config.auth_for("registry.example:5000/team/app:1").unwrap(),
            Auth::Basic { user: "bot".into(), password: "s3cret".into() }
        );
        assert_eq!(config.auth_for("library/busybox:1").unwrap(), Auth::Bearer("tok".into()), "Docker Hub");
        assert_eq!(config.auth_for("other.example/app:1").unwrap(), Auth::Anonymous);

        let bad = [
            (RegistryAuth { password_file: secret("open", "pw", 0o644), ..basic.clone() }, "chmod 600"),
            (RegistryAuth { password_file: secret("empty", "\n", 0o600), ..basic.clone() }, "is empty"),
            (RegistryAuth { password_file: Some(dir.path().join("missing")), ..basic.clone() }, "missing"),
            (RegistryAuth { token_file: bearer.token_file.clone(), ..basic.clone() }, "token_file alone"),
            (RegistryAuth { username: None, ..basic.clone() }, "give username"),
            (RegistryAuth { registry: "a/b".into(), ..basic.clone() }, "host[:port]"),
        ];
        for (entry, says) in bad {
            let e = ImagesConfig { auth: vec![entry], ..ImagesConfig::default() }.check().unwrap_err().to_string();
            assert!(e.contains(says) && e.starts_with("[[images.auth]] for registry"), "{says}: {e}");
        }
        let twice = ImagesConfig { auth: vec![basic.clone(), basic], ..ImagesConfig::default() };
        assert!(twice.check().unwrap_err().to_string().contains("listed twice"));
    }

    #[tokio::test]
    async fn registries_on_private_addresses_need_the_operator() {
        let config = ImagesConfig {
            insecure_registries: vec!["127.0.0.1:5000".into()],
            private_registries: vec!["10.0.0.7:443".into()],
            ..ImagesConfig::default()
        };
        check_registry("127.0.0.1:5000/team/app:1", &config).await.unwrap();
        check_registry("10.0.0.7:443/team/app:1", &config).await.unwrap();
        for (reference, range) in [
            ("10.1.2.3:5000/team/app:1", "RFC 1918"),
            ("169.254.169.254/latest/meta-data:1", "link-local"),
            ("localhost:5000/x:1", "loopback"),
            ("127.0.0.2:5000/x:1", "loopback"),
        ] {
            let e = check_registry(reference, &config)
                .await
                .err()
                .unwrap_or_else(|| panic!("{reference} passed"))
                .to_string();
            assert!(e.contains(range) && e.contains("private_registries"), "{reference}: {e}");
        }
        let e = check_registry("[::1]:5000/x:1", &config).await.unwrap_err().to_string();
        assert!(e.contains("not an image reference"), "{e}");
        let policy = address_policy();
        assert_eq!(
            blocked_range(&policy, "::ffff:192.168.1.1".parse().unwrap()).as_deref(),
            Some("RFC 1918 §3: private")
        );
        assert_eq!(blocked_range(&policy, "93.184.216.34".parse().unwrap()), None);
    }

    #[test]
    fn references_are_checked_and_env_is_parsed() {
        for ok in ["127.0.0.1:5000/team/app:1", "debian:trixie", "ghcr.io/a/b@sha256:00"] {
            check_reference(ok).unwrap();
        }
        for bad in ["", "/var/lib/tine/x.tar", "./layout", "~/img", "a b", &"x".repeat(513)] {
            assert!(check_reference(bad).is_err(), "{bad}");
        }
        let run = tine_image::RunConfig {
            env: vec!["PATH=/usr/bin:/bin".into(), "EMPTY=".into(), "NOEQUALS".into(), "A=b=c".into()],
            ..Default::default()
        };
        let env = image_env(&run);
        assert_eq!(env["PATH"], "/usr/bin:/bin");
        assert_eq!(env["EMPTY"], "");
        assert_eq!(env["A"], "b=c");
        assert!(!env.contains_key("NOEQUALS"));
    }
}
