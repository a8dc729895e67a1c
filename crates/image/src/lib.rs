//! OCI and Docker images to Tine base images.
//!
//! [`build`] takes an image from an OCI image layout directory, an OCI
//! archive or a `docker save` archive ([`source`]), checks every blob
//! against its digest, applies the layers with their whiteouts into a
//! tree held in memory ([`layers`]), adds what a Tine guest needs (the
//! agent as init at [`AGENT_PATH`], the mount points it uses, the
//! sandbox network's `/etc/resolv.conf` and `/etc/hosts`) and writes a
//! read-only ext4 image whose owners, modes, extended attributes and
//! device nodes are the tar headers' ([`ext4`]), also when the daemon
//! has no privileges. The image's run configuration ([`RunConfig`]:
//! `Env`, `WorkingDir`, `User`, `Entrypoint`, `Cmd`) comes back for the
//! sandbox's commands and REPLs to honour.

pub mod ext4;
pub mod layers;
pub mod registry;
pub mod source;

use std::path::{Path, PathBuf};

use oci_spec::image::ImageConfiguration;
use serde::{Deserialize, Serialize};

pub use layers::{Limits, Meta, Node, Tree};
pub use source::{Image, LayerBlob};

/// Where the guest agent is installed in an image built here (the same
/// path as in Tine's default root filesystem, rootfs/build-rootfs.sh).
pub const AGENT_PATH: &str = "/usr/local/sbin/tine-agent";

/// Directories the agent mounts on or uses at boot (guest-agent
/// `init.rs`): made where the image lacks them, with their modes.
pub const MOUNT_POINTS: &[(&str, u32)] =
    &[("overlay", 0o755), ("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("run", 0o755)];

/// The sandbox network's resolver (crates/netstack: the gateway's DNS at
/// 10.0.2.3), written over the image's `/etc/resolv.conf` as a container
/// runtime's bind mount would be.
pub const RESOLV_CONF: &str = "nameserver 10.0.2.3\n";
/// `/etc/hosts` of a sandbox (as the default root filesystem's).
pub const HOSTS: &str = "127.0.0.1\tlocalhost\n127.0.1.1\ttine\n::1\tlocalhost ip6-localhost ip6-loopback\n";

/// How an image asks its processes to run (OCI image-spec "config.md",
/// the `config` object): kept with the template and applied to the
/// sandbox's commands and REPLs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunConfig {
    /// `NAME=value` entries, in the image's order.
    pub env: Vec<String>,
    /// The working directory, absolute (`None`: `/`).
    pub working_dir: Option<String>,
    /// `user`, `uid`, `user:group` or `uid:gid` (`None`: root).
    pub user: Option<String>,
    /// The image's entrypoint (informational: a sandbox has no main
    /// process).
    pub entrypoint: Vec<String>,
    /// The image's default command (informational, as `entrypoint`).
    pub cmd: Vec<String>,
}

impl RunConfig {
    /// The run configuration of an image configuration.
    pub fn from_oci(config: &ImageConfiguration) -> Self {
        let Some(c) = config.config() else { return RunConfig::default() };
        RunConfig {
            env: c.env().clone().unwrap_or_default(),
            working_dir: c.working_dir().clone().filter(|w| !w.is_empty()),
            user: c.user().clone().filter(|u| !u.is_empty()),
            entrypoint: c.entrypoint().clone().unwrap_or_default(),
            cmd: c.cmd().clone().unwrap_or_default(),
        }
    }
}

/// Errors of building a base image, one per stage.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Reading the layout or archive, its index, manifest or configuration.
    #[error(transparent)]
    Source(#[from] source::SourceError),
    /// Applying a layer.
    #[error(transparent)]
    Layer(#[from] layers::LayerError),
    /// Writing the ext4 image.
    #[error(transparent)]
    Ext4(#[from] ext4::Ext4Error),
    /// No agent to install: the root filesystem to take it from is
    /// missing or holds none.
    #[error("{0}")]
    Agent(String),
    /// The work directory or the output could not be made.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// What [`build`] needs.
#[derive(Debug, Clone)]
pub struct BuildRequest<'a> {
    /// An OCI layout directory, or an OCI or `docker save` archive.
    pub image: &'a Path,
    /// Which image, when the layout or archive holds several.
    pub reference: Option<&'a str>,
    /// The static guest agent to install at [`AGENT_PATH`].
    pub agent: &'a Path,
    /// The ext4 image to write (replaced only when the build succeeds).
    pub out: &'a Path,
    /// A directory on the filesystem of `out` for the build's temporary
    /// files (the staged layers: up to the image's unpacked size).
    pub work: &'a Path,
    /// Bounds on the image's paths and bytes.
    pub limits: Limits,
}

/// What [`build`] made.
#[derive(Debug, Clone)]
pub struct Built {
    /// The image's identity (`sha256:` of its manifest or configuration).
    pub id: String,
    /// How the image asks its processes to run.
    pub run: RunConfig,
    /// Layers applied.
    pub layers: usize,
    /// Paths in the root filesystem.
    pub paths: usize,
    /// Bytes of regular files in it.
    pub file_bytes: u64,
    /// The ext4 image.
    pub written: ext4::Written,
}

/// Builds the base image `req.out` from `req.image` (see the crate's
/// documentation); `progress` hears each stage as it starts ("layer 2 of
/// 5", "writing the image").
pub fn build(req: &BuildRequest<'_>, progress: &mut dyn FnMut(&str)) -> Result<Built, ImageError> {
    std::fs::create_dir_all(req.work).map_err(|source| ImageError::Io {
        path: req.work.to_path_buf(),
        op: "make directory",
        source,
    })?;
    let tmp = tempfile::Builder::new()
        .prefix("image-build.")
        .tempdir_in(req.work)
        .map_err(|source| ImageError::Io { path: req.work.to_path_buf(), op: "make a directory in", source })?;
    progress("reading the image");
    let image = source::open(req.image, req.reference, tmp.path())?;
    let mut tree = Tree::new(&tmp.path().join("staging"), req.limits)?;
    for (i, layer) in image.layers.iter().enumerate() {
        progress(&format!("layer {} of {}", i + 1, image.layers.len()));
        tree.apply_blob(i, layer)?;
    }
    add_tine_files(&mut tree, req.agent, tmp.path())?;
    progress("writing the image");
    // Written in the work directory (on the output's file system) and
    // renamed: builds of one output at once do not meet.
    let partial = tmp.path().join("image.ext4");
    let written = ext4::write(&tree, &tmp.path().join("ext4"), &partial, "tine-root")?;
    std::fs::rename(&partial, req.out).map_err(|source| ImageError::Io {
        path: req.out.to_path_buf(),
        op: "rename the image to",
        source,
    })?;
    Ok(Built {
        id: image.id.clone(),
        run: image.run.clone(),
        layers: image.layers.len(),
        paths: tree.len(),
        file_bytes: tree.file_bytes(),
        written,
    })
}

/// A directory name for a registry reference's pulled layout: the
/// repository without its tag or digest, characters outside
/// `[A-Za-z0-9._-]` made `_`, and a leading `.` too (one path component,
/// never `..`). Pulls of one repository share its blobs; reading the
/// layout checks them by digest.
pub fn layout_dir_name(reference: &str) -> String {
    let name = reference.split('@').next().unwrap_or(reference);
    let last = name.rfind('/').map_or(0, |i| i + 1);
    let name = match name[last..].find(':') {
        Some(i) => &name[..last + i],
        None => name,
    };
    let mut safe: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    if safe.is_empty() || safe.starts_with('.') {
        safe.insert(0, '_');
    }
    safe
}

/// Copies the agent out of a root filesystem image made by
/// `rootfs/build-rootfs.sh` (or by [`build`]): the file at [`AGENT_PATH`],
/// with `debugfs dump`, to `out`.
///
/// Errors: [`ImageError::Agent`] when `rootfs` is missing or holds no
/// agent, or debugfs cannot run.
pub fn agent_from_rootfs(rootfs: &Path, out: &Path) -> Result<(), ImageError> {
    if !rootfs.exists() {
        return Err(ImageError::Agent(format!("no root filesystem at {} to take the agent from", rootfs.display())));
    }
    let status = std::process::Command::new("debugfs")
        .arg("-R")
        // Quoted: the data directory may hold spaces (debugfs splits its
        // request into words; a `"` in the path is not taken).
        .arg(format!("dump -p {AGENT_PATH} \"{}\"", out.display()))
        .arg(rootfs)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| ImageError::Agent(format!("cannot run debugfs (e2fsprogs): {e}")))?;
    if !status.success() || out.metadata().map(|m| m.len() == 0).unwrap_or(true) {
        return Err(ImageError::Agent(format!("{} holds no agent at {AGENT_PATH}", rootfs.display())));
    }
    Ok(())
}

/// Adds the agent, its mount points and the network's files to `tree`.
fn add_tine_files(tree: &mut Tree, agent: &Path, tmp: &Path) -> Result<(), ImageError> {
    for (dir, mode) in MOUNT_POINTS {
        tree.add_dir(dir, *mode);
    }
    tree.add_file(AGENT_PATH, agent, Meta::root(0o755))?;
    for (path, text) in [("etc/resolv.conf", RESOLV_CONF), ("etc/hosts", HOSTS), ("etc/hostname", "tine\n")] {
        let host = tmp.join(path.replace('/', "_"));
        std::fs::write(&host, text).map_err(|source| ImageError::Io { path: host.clone(), op: "write", source })?;
        tree.add_file(path, &host, Meta::root(0o644))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_dir_names_are_one_safe_path_component() {
        assert_eq!(layout_dir_name("127.0.0.1:5000/team/app:1"), "127.0.0.1_5000_team_app");
        assert_eq!(layout_dir_name("registry.example/team/app@sha256:abc"), "registry.example_team_app");
        assert_eq!(layout_dir_name("debian:trixie"), "debian");
        assert_eq!(layout_dir_name(".."), "_..");
        assert_eq!(layout_dir_name("../../etc"), "_.._.._etc");
    }
}
