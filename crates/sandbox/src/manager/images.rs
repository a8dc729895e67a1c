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
    let server =
        netstack::policy::ServerNetPolicy { permit_ranges: Vec::new(), host_addrs: netstack::policy::host_addresses() };
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
        let dir = self.config.images_dir.clone();
        let layout = dir.join("oci").join(tine_image::layout_dir_name(reference));
        let lock = layout_lock(&layout);
        let _turn = lock.lock().await;
        report(format!("pulling {reference}"));
        // The pull's steps come back through a channel: `report` is not
        // `Send`-able into the pull's future.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let request = tine_image::registry::PullRequest {
            reference,
            auth: tine_image::registry::Auth::Anonymous,
            insecure: &self.config.images.insecure_registries,
            layout: &layout,
        };
        let mut send = move |step: &str| {
            let _ = tx.send(step.to_string());
        };
        let pulled = {
            let pull = tine_image::registry::pull(&request, &mut send);
            tokio::pin!(pull);
            loop {
                tokio::select! {
                    r = &mut pull => break r?,
                    Some(step) = rx.recv() => report(format!("pulling {reference}: {step}")),
                }
            }
        };
        tracing::info!(
            image = reference,
            digest = pulled.digest,
            "pulled: {} blobs fetched ({} bytes), {} already here",
            pulled.fetched,
            pulled.bytes,
            pulled.reused
        );
        let rootfs = self.config.rootfs.clone();
        let agent_id =
            FileIdentity::of(&rootfs).map_err(|e| ImageBuildError::Host(format!("stat {}: {e}", rootfs.display())))?;
        let key = {
            let mut h = Sha256::new();
            h.update(format!("{BASE_FORMAT}\n{}\n", pulled.digest));
            h.update(serde_json::to_vec(&agent_id).unwrap_or_default());
            h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect::<String>()
        };
        let bases = dir.join("bases");
        let path = bases.join(format!("{key}.ext4"));
        let run_path = bases.join(format!("{key}.json"));
        if let (true, Ok(text)) = (path.exists(), std::fs::read(&run_path)) {
            if let Ok(run) = serde_json::from_slice(&text) {
                report(format!("base image of {reference} already built"));
                return Ok(Base { path, run });
            }
        }
        report(format!("making {reference} a base image"));
        let reference = reference.to_string();
        let task =
            tokio::task::spawn_blocking(move || build_base(&reference, &layout, &rootfs, &bases, &path, &run_path));
        task.await.map_err(|e| ImageBuildError::Host(format!("the image build task failed: {e}")))?
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
            limits: tine_image::Limits::default(),
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

    #[tokio::test]
    async fn registries_on_private_addresses_need_the_operator() {
        let config = ImagesConfig {
            insecure_registries: vec!["127.0.0.1:5000".into()],
            private_registries: vec!["10.0.0.7:443".into()],
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
