//! Set-up shared by the sandbox manager's real-guest tests: a manager on
//! the test kernel and rootfs, with the default template that the run's
//! seeded `tine` servers share (one build per run for both crates).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_sandbox::network::{Egress, NetworkConfig, NetworkSetup};
use tine_sandbox::{Limits, Manager, ManagerConfig};

/// Where cargo puts the `tine` binary of this build: beside the `deps`
/// directory holding this test executable. Its identity is part of the
/// key of the run's default template copies
/// ([`testkit::mcp::default_template_seed`]), as in crate tine's tests.
fn tine_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps").join("tine")
}

/// A manager with its run directory in `dir` and its own templates
/// directory (`dir/templates`), with `limits` but for the sandbox disk's
/// size, which is the run's shared one; its default template exists when
/// this returns: the run's copy, if there is one, put in its templates
/// directory (and loaded: checked for the kernel, rootfs, guest set-up and
/// checksums, rebuilt if stale), else built (a cold boot), which then
/// becomes the run's copy.
///
/// The copy is the one crate tine's seeded servers use
/// (`TineServer::start_with_default_template`): this manager has their
/// guest set-up (a network device, the run's disk
/// size, [`testkit::mcp::shared_setup`]). Test binaries run at the same
/// time: the copy's lock file is held from the look until the copy is
/// kept, so one of them builds while the others wait for its copy.
pub async fn manager_with_default_template(dir: &Path, limits: Limits) -> Arc<Manager> {
    let seed = testkit::mcp::default_template_seed(&tine_binary(), &testkit::mcp::shared_setup(""));
    let t = Instant::now();
    let _lock = testkit::lock_file(&testkit::mcp::seed_lock(&seed));
    let templates = dir.join("templates");
    std::fs::create_dir_all(&templates).expect("a templates directory");
    let default = templates.join("default");
    let seeded = seed.join("template.json").exists();
    if seeded {
        assert!(testkit::mcp::copy_dir(&seed, &default), "copy the default template from {}", seed.display());
    }
    let network = NetworkSetup::new(NetworkConfig {
        // The tests need no egress; the policy is not part of the guest.
        egress: Egress::Deny,
        ..NetworkConfig::default()
    })
    .expect("the network set-up");
    let manager = Manager::new(ManagerConfig {
        kernel: testkit::kernel(),
        rootfs: testkit::rootfs(),
        run_dir: dir.join("sandboxes"),
        kept_dir: dir.join("kept"),
        templates_dir: templates,
        memory_backing: vmm::MemoryBacking::Private,
        profile: vmm::HostProfile::detect(),
        limits: Limits { boot_timeout_secs: 900, default_disk_mib: testkit::mcp::shared_disk_mib(), ..limits },
        network: Some(network),
        pool_size: 0,
        huge_pages: false,
        host_name: None,
        images: Default::default(),
        images_dir: dir.join("images"),
        secrets: None,
        prefetch: false,
    })
    .expect("a manager");
    let meta = |d: &Path| std::fs::read(d.join("template.json")).ok();
    let before = meta(&default);
    manager.ensure_default_template(false).await.expect("the default template");
    // Built here (there was no copy, or it was stale): the run's copy now.
    let built = !seeded || meta(&default) != before;
    if built {
        testkit::mcp::keep_seed(&default, &seed);
    }
    let how = if built { "built" } else { "copied from the run's" };
    eprintln!("default template ready in {} ms ({how})", t.elapsed().as_millis());
    manager
}

/// Threads of this process that belong to VMs or their monitors (vCPU,
/// device, userfaultfd and monitor threads), by name.
pub fn vm_threads() -> Vec<String> {
    let mut names = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task").flatten() {
        let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) else { continue };
        let comm = comm.trim().to_string();
        if ["vcpu", "devices-", "uffd-", "mon-"].iter().any(|p| comm.starts_with(p)) {
            names.push(comm);
        }
    }
    names
}

/// The entries of `dir` (a run directory: one per sandbox with files).
pub fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Waits up to `limit` for `cond`, checking every 100 ms; panics naming
/// `what` if it does not hold by then.
pub async fn eventually(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
