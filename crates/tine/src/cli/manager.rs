//! The sandbox manager of the commands that run sandboxes (`tine server
//! start`, `tine template`): the images checked, the data directory made
//! private and locked, then the [`tine_sandbox::Manager`] on it.

use std::sync::Arc;

use vmm::HostProfile;

use super::Resolved;
use crate::config;

/// Checks the images, locks the data directory and makes the sandbox
/// manager on it for host `profile`, with a warm pool of `pool_size`
/// sandboxes (0 for commands other than the server) and `host` in its
/// sandbox ids.
pub(super) fn open_manager(
    r: &Resolved,
    profile: HostProfile,
    pool_size: usize,
    host: Option<&str>,
    secrets: Option<tine_sandbox::secrets::SecretsSetup>,
) -> anyhow::Result<(Arc<tine_sandbox::Manager>, std::fs::File)> {
    config::check_image(config::KERNEL, &r.kernel)?;
    config::check_image(config::ROOTFS, &r.rootfs)?;
    if r.file.memory.huge_pages && !r.file.limits.default_memory_mib.is_multiple_of(2) {
        anyhow::bail!("[memory] huge_pages needs an even [limits] default_memory_mib (whole 2 MiB pages)");
    }
    if r.file.memory.huge_pages && r.file.templates.memory_backing == vmm::MemoryBacking::Userfaultfd {
        anyhow::bail!(
            "[memory] huge_pages restores by copying into huge pages: it does not go with \
             [templates] memory_backing = \"userfaultfd\"; drop one of them"
        );
    }
    private_files();
    make_private_dir(&r.data_dir)?;
    let lock = lock_data_dir(&r.data_dir)?;
    let manager = tine_sandbox::Manager::new(tine_sandbox::ManagerConfig {
        kernel: r.kernel.clone(),
        rootfs: r.rootfs.clone(),
        run_dir: r.data_dir.join("sandboxes"),
        kept_dir: r.data_dir.join("kept"),
        templates_dir: r.data_dir.join("templates"),
        memory_backing: r.file.templates.memory_backing,
        prefetch: r.file.templates.prefetch,
        profile,
        limits: r.file.limits.clone(),
        network: match r.file.network.enabled {
            true => {
                let mut setup = tine_sandbox::network::NetworkSetup::new(r.file.network.clone())?;
                // Guests trust the broker's CA (installed at every start
                // and restore).
                if let Some(s) = &secrets {
                    setup.trust_also(s.broker.ca_pem());
                }
                Some(setup)
            }
            false => None,
        },
        pool_size,
        huge_pages: r.file.memory.huge_pages,
        host_name: host.map(str::to_string),
        images: r.file.images.clone(),
        images_dir: r.data_dir.join("images"),
        secrets,
    })?;
    Ok((manager, lock))
}

/// Sets the process umask to 0077: every file and directory the server
/// makes (guest memory, snapshots, templates, sockets, logs) is its
/// owner's only (0600 / 0700).
fn private_files() {
    // SAFETY: umask(2) only sets the process's file mode creation mask.
    unsafe { libc::umask(0o077) };
}

/// Creates the data directory `dir` (and missing parents) with mode 0700,
/// or narrows an existing one that group or others can use to 0700.
fn make_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| anyhow::anyhow!("cannot create the data directory {}: {e}", dir.display()))?;
    let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            anyhow::anyhow!("the data directory {} has mode {mode:04o} and cannot be made 0700: {e}", dir.display())
        })?;
        tracing::info!("data directory {}: mode {mode:04o} narrowed to 0700", dir.display());
    }
    Ok(())
}

/// Takes an exclusive `flock(2)` on `DATA_DIR/tine.lock` so two servers
/// never share (and clean up) one data directory. Held until exit.
fn lock_data_dir(dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = dir.join("tine.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    // SAFETY: flock on an fd we own; no memory is passed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        anyhow::bail!(
            "another tine server uses the data directory {} (its lock {} is held); stop it or pass --data-dir",
            dir.display(),
            path.display()
        );
    }
    Ok(f)
}
