//! Set-up shared by the sandbox manager's real-guest tests: a manager on
//! the test kernel and rootfs, and a default template kept between runs.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_sandbox::{Limits, Manager, ManagerConfig};

/// Where the default template of these tests is kept: in the target's
/// test scratch directory, so it is built (a cold boot) once and only
/// rebuilt when it no longer loads (its kernel or rootfs changed).
pub fn shared_templates_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("sandbox-tests-templates")
}

/// A manager with its run directory in `dir` and the shared templates
/// directory ([`shared_templates_dir`]), with `limits`; the default
/// template exists (built if needed) when this returns.
pub async fn manager_with_default_template(dir: &Path, limits: Limits) -> Arc<Manager> {
    manager_on(dir, shared_templates_dir(), limits).await
}

/// Like [`manager_with_default_template`], for tests that make templates
/// of their own: its templates directory is `dir/templates`, holding a
/// copy of the shared default template (built first if needed), so what
/// the test makes stays out of the shared directory.
pub async fn manager_with_own_templates(dir: &Path, limits: Limits) -> Arc<Manager> {
    manager_with_default_template(&dir.join("seed"), limits.clone()).await.shutdown().await;
    let templates = dir.join("templates");
    std::fs::create_dir_all(&templates).expect("a templates directory");
    {
        let _lock = testkit::lock_file(&shared_templates_dir().with_extension("lock"));
        let copied = std::process::Command::new("cp")
            .args(["-a", "--sparse=always"])
            .arg(shared_templates_dir().join("default"))
            .arg(templates.join("default"))
            .status();
        assert!(copied.is_ok_and(|s| s.success()), "copy the shared default template");
    }
    manager_on(dir, templates, limits).await
}

/// A manager on the test kernel and rootfs with `templates_dir`; its
/// default template is loaded (or built, under the shared directory's
/// lock) before it is returned.
async fn manager_on(dir: &Path, templates_dir: PathBuf, limits: Limits) -> Arc<Manager> {
    let manager = Manager::new(ManagerConfig {
        kernel: testkit::kernel(),
        rootfs: testkit::rootfs(),
        run_dir: dir.join("sandboxes"),
        kept_dir: dir.join("kept"),
        templates_dir,
        memory_backing: vmm::MemoryBacking::Private,
        profile: vmm::HostProfile::detect(),
        limits: Limits { boot_timeout_secs: 900, ..limits },
        network: None,
        pool_size: 0,
        huge_pages: false,
        host_name: None,
        images: Default::default(),
        images_dir: dir.join("images"),
        prefetch: false,
    })
    .expect("a manager");
    let t = Instant::now();
    // The test binaries run at the same time: one builds, the others wait
    // and load its template.
    let _lock = testkit::lock_file(&shared_templates_dir().with_extension("lock"));
    manager.ensure_default_template(false).await.expect("the default template");
    eprintln!("default template ready in {} ms", t.elapsed().as_millis());
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
