//! `tine doctor`: checks what the server needs on this host and says how to
//! fix each missing piece: KVM, userfaultfd, seccomp, least privilege (not
//! root, `/dev/kvm` through a group), the images, the token file's, the
//! tenants file's and the data directory's modes, free memory. Run it as
//! the user the server runs as (`sudo -u tine tine doctor --config
//! /etc/tine/tine.toml` for the systemd service).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::ExitCode;

use vmm::seccomp::{self, Mode, ThreadKind};
use vmm::HostProfile;

use crate::config::{self, ConfigError};

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    /// Fine.
    Ok,
    /// Works, but weaker or slower than it should be.
    Warn,
    /// The server cannot work (or not safely) until this is fixed.
    Fail,
}

/// One check's outcome.
struct Check {
    name: &'static str,
    level: Level,
    detail: String,
    fix: String,
}

impl Check {
    fn new(name: &'static str, level: Level, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Check { name, level, detail: detail.into(), fix: fix.into() }
    }
}

/// The service's user (deploy/install.sh creates it).
const SERVICE_USER: &str = "tine";

fn euid() -> u32 {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}

/// The name of group `gid` from /etc/group, if listed.
fn group_name(gid: u32) -> Option<String> {
    let groups = std::fs::read_to_string("/etc/group").ok()?;
    groups.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        let _ = f.next();
        (f.next()?.parse::<u32>().ok()? == gid).then(|| name.to_string())
    })
}

fn check_user() -> Check {
    if euid() == 0 {
        Check::new(
            "least privilege",
            Level::Warn,
            "running as root: a guest that escaped the VMM would own the host",
            format!(
                "run the server as the unprivileged user '{SERVICE_USER}' in the kvm group (deploy/install.sh \
                 creates it; deploy/tine.service runs it with no capabilities); check it with \
                 'sudo -u {SERVICE_USER} tine doctor'"
            ),
        )
    } else {
        Check::new("least privilege", Level::Ok, format!("not root (uid {})", euid()), "")
    }
}

fn check_kvm() -> Check {
    let dev = Path::new("/dev/kvm");
    let owner = std::fs::metadata(dev).ok().map(|m| {
        let group = group_name(m.gid()).unwrap_or_else(|| m.gid().to_string());
        (group, m.permissions().mode() & 0o777)
    });
    let shape = owner.as_ref().map(|(g, m)| format!("group {g}, mode {m:04o}")).unwrap_or_else(|| "missing".into());
    match kvm_ioctls::Kvm::new() {
        Ok(kvm) => {
            let detail = format!(
                "API version {}, host profile {}, /dev/kvm {shape}",
                kvm.get_api_version(),
                HostProfile::detect()
            );
            // Root opens it anyway; the service user (once installed)
            // needs group access.
            let group_rw = owner.as_ref().is_some_and(|(_, m)| m & 0o060 == 0o060);
            let service_user = matches!(nix::unistd::User::from_name(SERVICE_USER), Ok(Some(_)));
            if euid() == 0 && !group_rw && service_user {
                return Check::new(
                    "KVM",
                    Level::Warn,
                    format!("{detail}: only root can open it, not the service user"),
                    "give the kvm group read-write access: a udev rule KERNEL==\"kvm\", GROUP=\"kvm\", MODE=\"0660\" \
                     (deploy/install.sh installs one), then 'udevadm trigger /dev/kvm'",
                );
            }
            Check::new("KVM", Level::Ok, detail, "")
        }
        Err(e) if e.errno() == libc::EACCES || e.errno() == libc::EPERM => Check::new(
            "KVM",
            Level::Fail,
            format!("cannot open /dev/kvm ({shape}): {e}"),
            format!(
                "add this user to the group that owns /dev/kvm ('usermod -aG {} {SERVICE_USER}', then log in again), \
                 with that group given read-write access (udev rule KERNEL==\"kvm\", GROUP=\"kvm\", MODE=\"0660\")",
                owner.map(|(g, _)| g).unwrap_or_else(|| "kvm".into())
            ),
        ),
        Err(e) => Check::new(
            "KVM",
            Level::Fail,
            format!("cannot open /dev/kvm: {e}"),
            "enable virtualization in the firmware and load kvm_intel or kvm_amd",
        ),
    }
}

fn check_userfaultfd() -> Check {
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    // What the VMM itself asks for: a userfaultfd that also sees the
    // kernel's (KVM's) faults, which UFFD_USER_MODE_ONLY would not.
    match vmm::uffd::create_wp_uffd() {
        Ok(_) => Check::new("userfaultfd", Level::Ok, "available, kernel faults included", ""),
        Err(e) => Check::new(
            "userfaultfd",
            Level::Warn,
            format!("{e} (vm.unprivileged_userfaultfd = {})", sysctl.trim()),
            format!(
                "optional: without it branches copy guest memory while the VM is paused and memory_backing = \
                 \"userfaultfd\" falls back to \"private\". Give the service user /dev/userfaultfd (Linux 6.1+): a \
                 udev rule KERNEL==\"userfaultfd\", GROUP=\"{SERVICE_USER}\", MODE=\"0660\" (deploy/install.sh \
                 installs it). User-mode-only userfaultfds do not see KVM's faults, so they cannot \
                 serve guest memory"
            ),
        ),
    }
}

fn check_seccomp() -> Check {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if !status.lines().any(|l| l.starts_with("Seccomp:")) {
        return Check::new(
            "seccomp",
            Level::Fail,
            "this kernel has no seccomp (no Seccomp: line in /proc/self/status)",
            "use a kernel built with CONFIG_SECCOMP and CONFIG_SECCOMP_FILTER; the VMM threads' filters need it",
        );
    }
    // Install a VMM thread's filter on a throwaway thread: the real test of
    // filter support. The thread ends; no other thread is filtered.
    let installed = std::thread::spawn(|| seccomp::install_with(ThreadKind::Devices, Mode::Enforce))
        .join()
        .unwrap_or_else(|_| Err(seccomp::SeccompError::Install { kind: ThreadKind::Devices, reason: "panic".into() }));
    match (installed, seccomp::mode()) {
        (Err(e), _) => Check::new(
            "seccomp",
            Level::Fail,
            e.to_string(),
            "use a kernel built with CONFIG_SECCOMP_FILTER; the VMM threads' filters need it",
        ),
        (Ok(()), Mode::Enforce) => Check::new(
            "seccomp",
            Level::Ok,
            format!(
                "filters install; {} / {} / {} / {} system calls allowed on vCPU / device / network / userfaultfd \
                 threads",
                seccomp::allowlist_len(ThreadKind::Vcpu),
                seccomp::allowlist_len(ThreadKind::Devices),
                seccomp::allowlist_len(ThreadKind::Net),
                seccomp::allowlist_len(ThreadKind::Uffd)
            ),
            "",
        ),
        (Ok(()), mode) => Check::new(
            "seccomp",
            Level::Warn,
            format!("{}={mode:?}: VMM threads are not held to their allowlists", seccomp::ENV_VAR),
            format!("unset {} (it is for debugging only)", seccomp::ENV_VAR),
        ),
    }
}

/// A token file must be its owner's only: the token lets anyone run code
/// in every sandbox.
fn check_token_file(path: &Path) -> Check {
    match std::fs::metadata(path) {
        Err(e) => Check::new(
            "token file",
            Level::Fail,
            format!("{}: {e}", path.display()),
            "create it with 'tine server keygen --out FILE' (mode 0600)",
        ),
        Ok(m) if m.permissions().mode() & 0o077 != 0 => Check::new(
            "token file",
            Level::Fail,
            format!(
                "{} has mode {:04o}: group or others can read the token",
                path.display(),
                m.permissions().mode() & 0o7777
            ),
            format!("chmod 600 {}", path.display()),
        ),
        Ok(m) => Check::new(
            "token file",
            Level::Ok,
            format!("{} (mode {:04o})", path.display(), m.permissions().mode() & 0o7777),
            "",
        ),
    }
}

/// A host that reaches peers (`[cluster] peers`, `peer_url` or
/// `peer_dns`) needs a peer key of its own, readable as a token and not the
/// operator's: the server does not start otherwise
/// ([`crate::cluster::ClusterError::NoPeerKey`]).
fn check_peer_key(cluster: &crate::cluster::ClusterConfig, token_file: Option<&Path>) -> Check {
    const NAME: &str = "peer key";
    let make = "make one with 'tine server keygen --out /etc/tine/peer-key', copy the same file to every host \
                (mode 0600) and set [cluster] peer_key_file to it";
    let Some(path) = &cluster.peer_key_file else {
        return Check::new(NAME, Level::Fail, "[cluster] names other hosts but sets no peer_key_file", make);
    };
    let key = match config::load_token(Some(path)) {
        Ok(Some(k)) => k,
        Ok(None) => return Check::new(NAME, Level::Fail, format!("{}: no key", path.display()), make),
        Err(e) => return Check::new(NAME, Level::Fail, e.to_string(), make),
    };
    if token_file.and_then(|t| config::load_token(Some(t)).ok().flatten()).is_some_and(|t| t == key) {
        return Check::new(NAME, Level::Fail, format!("{} holds the operator's token", path.display()), make);
    }
    Check::new(NAME, Level::Ok, format!("{} (its owner's only, not the operator's token)", path.display()), "")
}

/// The tenants file ([`crate::auth::tenants`]) must be its owner's only
/// and readable as one: the server refuses it otherwise. A missing file
/// is fine (no tenants).
fn check_tenants_file(path: &Path) -> Check {
    match crate::auth::tenants::TenantsFile::load(path) {
        Err(crate::auth::tenants::TenantsError::Open { mode, .. }) => Check::new(
            "tenants file",
            Level::Fail,
            format!("{} has mode {mode:04o}: group or others can read the tenants' key hashes", path.display()),
            format!("chmod 600 {}", path.display()),
        ),
        Err(e) => Check::new("tenants file", Level::Fail, e.to_string(), "fix or remove the file (tine tenant list)"),
        Ok(_) if !path.exists() => {
            Check::new("tenants file", Level::Ok, format!("{} (none yet: tine tenant add)", path.display()), "")
        }
        Ok(f) => Check::new(
            "tenants file",
            Level::Ok,
            format!("{} ({} tenants, mode 0600)", path.display(), f.tenant.values().filter(|t| !t.removed).count()),
            "",
        ),
    }
}

/// The data directory (guest memory, snapshots, templates, sockets) must
/// be the server's only.
fn check_data_dir(dir: &Path) -> Check {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Check::new("data directory", Level::Ok, format!("{} (made with mode 0700 at start)", dir.display()), "")
        }
        Err(e) => Check::new(
            "data directory",
            Level::Fail,
            format!("{}: {e}", dir.display()),
            format!(
                "make it reachable for the server's user, e.g. 'install -d -m 0700 -o {SERVICE_USER} {}'",
                dir.display()
            ),
        ),
        Ok(m) if m.uid() != euid() => Check::new(
            "data directory",
            Level::Fail,
            format!("{} belongs to uid {}, not to this user (uid {})", dir.display(), m.uid(), euid()),
            format!("chown -R {SERVICE_USER}: {} (or run doctor as the server's user)", dir.display()),
        ),
        Ok(m) if m.permissions().mode() & 0o077 != 0 => Check::new(
            "data directory",
            Level::Fail,
            format!(
                "{} has mode {:04o}: others can reach guest memory and sockets",
                dir.display(),
                m.permissions().mode() & 0o7777
            ),
            format!("chmod 700 {}", dir.display()),
        ),
        Ok(_) => Check::new("data directory", Level::Ok, format!("{} (mode 0700)", dir.display()), ""),
    }
}

/// The kept sandboxes' disk use (`<data>/kept`: records, hibernations,
/// pinned template files) and the free space of its file system: a warning
/// below 5% free, where hibernations start to fail with ENOSPC.
fn check_kept(data_dir: &Path) -> Check {
    let kept = data_dir.join("kept");
    let sandboxes = std::fs::read_dir(&kept)
        .map(|d| d.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
        .unwrap_or(0);
    let used = tine_sandbox::store::disk_use(&kept);
    let at = if kept.exists() {
        kept.clone()
    } else {
        data_dir.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/")).to_path_buf()
    };
    let Ok(fs) = nix::sys::statvfs::statvfs(&at) else {
        return Check::new(
            "kept sandboxes",
            Level::Warn,
            format!("cannot statvfs {}", at.display()),
            "check the data directory",
        );
    };
    let block = fs.fragment_size();
    let (free, total) = (fs.blocks_available() * block, fs.blocks() * block);
    let detail = format!(
        "{sandboxes} in {} use {} MiB; {} MiB of {} MiB free on its file system",
        kept.display(),
        used >> 20,
        free >> 20,
        total >> 20
    );
    if total > 0 && free * 20 < total {
        return Check::new(
            "kept sandboxes",
            Level::Warn,
            detail,
            "free disk space, or kill hibernated sandboxes you no longer need: hibernations fail on a full disk",
        );
    }
    Check::new("kept sandboxes", Level::Ok, detail, "")
}

/// The image at `path` and, when `build-inputs` beside it (written by
/// `scripts/setup.sh`) names it, the hash of its build inputs and where it
/// was built.
fn check_image(name: &'static str, what: &'static str, path: &Path) -> Check {
    let (level, detail) = match config::check_image(what, path) {
        Ok(len) => {
            let inputs = match build_inputs(path) {
                Some((hash, built)) => format!("build inputs {hash}, built as {built}"),
                None => "build inputs unknown: no build-inputs line for it beside it (scripts/setup.sh writes one)"
                    .to_string(),
            };
            (Level::Ok, format!("{} ({} MiB; {inputs})", path.display(), len >> 20))
        }
        Err(ConfigError::MissingImage { reason, .. }) => (Level::Fail, format!("{}: {reason}", path.display())),
        Err(e) => (Level::Fail, e.to_string()),
    };
    Check::new(name, level, detail, config::IMAGE_FIX)
}

/// The line for `image` in the `build-inputs` file of its directory
/// (`<file name> <inputs hash> <path it was built at>` per line): its
/// hash and path.
fn build_inputs(image: &Path) -> Option<(String, String)> {
    let file_name = image.file_name()?.to_str()?;
    let text = std::fs::read_to_string(image.parent()?.join("build-inputs")).ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.splitn(3, ' ');
        (fields.next()? == file_name).then_some(())?;
        Some((fields.next()?.to_string(), fields.next().unwrap_or("?").to_string()))
    })
}

fn check_memory() -> Check {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let mib = avail_kib / 1024;
    Check::new(
        "free memory",
        if mib >= 1024 { Level::Ok } else { Level::Fail },
        format!("{mib} MiB available"),
        "free memory or lower [limits] default_memory_mib and max_sandboxes; each sandbox uses up to its memory_mib",
    )
}

/// The warm pool as configured: how many sandboxes and how much of the
/// memory budget they hold (it is filled once the server runs; its level
/// is in `/healthz`).
fn check_pool(file: &config::FileConfig) -> Check {
    let (size, mib) = (file.pool.size, file.limits.default_memory_mib);
    if size == 0 {
        return Check::new("warm pool", Level::Ok, "off ([pool] size = 0): creates restore on demand", "");
    }
    let detail = format!(
        "{size} sandbox(es) of {mib} MiB kept ready ({} MiB of the {} MiB memory budget); level in /healthz",
        size as u64 * mib,
        file.limits.memory_budget_mib()
    );
    if size > config::MAX_POOL_SIZE {
        return Check::new(
            "warm pool",
            Level::Fail,
            detail,
            format!("set [pool] size to at most {}", config::MAX_POOL_SIZE),
        );
    }
    Check::new("warm pool", Level::Ok, detail, "")
}

/// `[memory] huge_pages`: the host's hugetlbfs pool must hold the warm
/// pool and at least one more sandbox of the default size.
fn check_huge_pages(file: &config::FileConfig) -> Check {
    let vmm::memory::HugePagePool { total, available: free } = vmm::memory::HugePagePool::read().unwrap_or_default();
    let need_mib = (file.pool.size as u64 + 1) * file.limits.default_memory_mib;
    let detail = format!(
        "{free} of {total} huge pages of 2 MiB available ({} MiB); the pool and one sandbox need {need_mib} MiB",
        free * 2
    );
    if free * 2 < need_mib {
        return Check::new(
            "huge pages",
            Level::Fail,
            detail,
            format!(
                "reserve more: sysctl vm.nr_hugepages={} (and in /etc/sysctl.d to keep it)",
                total + need_mib.div_ceil(2) - free
            ),
        );
    }
    Check::new("huge pages", Level::Ok, detail, "")
}

/// Runs every check, prints one line each (with the fix for warnings and
/// failures) and returns failure if any check failed.
pub(super) fn run(r: &super::Resolved) -> ExitCode {
    let mut checks = vec![check_user(), check_kvm(), check_userfaultfd(), check_seccomp()];
    checks.push(check_image("guest kernel", config::KERNEL, &r.kernel));
    checks.push(check_image("root filesystem", config::ROOTFS, &r.rootfs));
    checks.push(check_data_dir(&r.data_dir));
    checks.push(check_kept(&r.data_dir));
    if let Some(token) = &r.file.token_file {
        checks.push(check_token_file(token));
    }
    checks.push(check_tenants_file(&r.file.auth.tenants_file(&r.data_dir)));
    if r.file.cluster.reaches_peers() {
        checks.push(check_peer_key(&r.file.cluster, r.file.token_file.as_deref()));
    }
    checks.push(check_memory());
    checks.push(check_pool(&r.file));
    if r.file.memory.huge_pages {
        checks.push(check_huge_pages(&r.file));
    }
    let mut failed = 0;
    for c in &checks {
        match c.level {
            Level::Ok => println!("ok    {:<16} {}", c.name, c.detail),
            Level::Warn => println!("warn  {:<16} {}\n      fix: {}", c.name, c.detail, c.fix),
            Level::Fail => {
                failed += 1;
                println!("FAIL  {:<16} {}\n      fix: {}", c.name, c.detail, c.fix);
            }
        }
    }
    if failed == 0 {
        println!("all checks passed");
        ExitCode::SUCCESS
    } else {
        println!("{failed} check(s) failed");
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_report_their_build_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"k").unwrap();
        let missing = check_image("guest kernel", config::KERNEL, &kernel);
        assert!(missing.detail.contains("build inputs unknown"), "{}", missing.detail);
        std::fs::write(
            dir.path().join("build-inputs"),
            "rootfs.ext4 aaaa /c/rootfs-aaaa.ext4\nvmlinux 09d1571b1996d62a /c/kernel/vmlinux-pvm-09d1571b1996d62a\n",
        )
        .unwrap();
        let c = check_image("guest kernel", config::KERNEL, &kernel);
        assert!(matches!(c.level, Level::Ok), "{}", c.detail);
        assert!(
            c.detail.contains("build inputs 09d1571b1996d62a, built as /c/kernel/vmlinux-pvm-09d1571b1996d62a"),
            "{}",
            c.detail
        );
    }

    fn set_mode(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_token_file_others_can_read_fails_with_the_chmod() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "secret").unwrap();
        set_mode(&token, 0o644);
        let c = check_token_file(&token);
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("mode 0644"), "{}", c.detail);
        assert_eq!(c.fix, format!("chmod 600 {}", token.display()));
        set_mode(&token, 0o600);
        assert_eq!(check_token_file(&token).level, Level::Ok);
        assert_eq!(check_token_file(&dir.path().join("missing")).level, Level::Fail);
    }

    #[test]
    fn a_cluster_without_its_own_peer_key_fails_with_how_to_make_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut cluster =
            crate::cluster::ClusterConfig { peer_url: Some("http://{host}.peers:5555".into()), ..Default::default() };
        let c = check_peer_key(&cluster, None);
        assert_eq!(c.level, Level::Fail);
        assert!(c.fix.contains("tine server keygen") && c.fix.contains("peer_key_file"), "{}", c.fix);
        let token = dir.path().join("token");
        std::fs::write(&token, "t".repeat(40)).unwrap();
        set_mode(&token, 0o600);
        cluster.peer_key_file = Some(token.clone());
        let c = check_peer_key(&cluster, Some(&token));
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("operator's token"), "{}", c.detail);
        let key = dir.path().join("peer-key");
        std::fs::write(&key, "k".repeat(40)).unwrap();
        set_mode(&key, 0o644);
        cluster.peer_key_file = Some(key.clone());
        assert_eq!(check_peer_key(&cluster, Some(&token)).level, Level::Fail, "others can read it");
        set_mode(&key, 0o600);
        assert_eq!(check_peer_key(&cluster, Some(&token)).level, Level::Ok);
    }

    #[test]
    fn a_tenants_file_others_can_read_fails_with_the_chmod() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        assert_eq!(check_tenants_file(&path).level, Level::Ok, "none yet");
        let mut f = crate::auth::tenants::TenantsFile::default();
        f.add("acme", Default::default(), &path).unwrap();
        f.save(&path).unwrap();
        let c = check_tenants_file(&path);
        assert!(c.level == Level::Ok && c.detail.contains("1 tenants"), "{}", c.detail);
        set_mode(&path, 0o640);
        let c = check_tenants_file(&path);
        assert_eq!(c.level, Level::Fail);
        assert_eq!(c.fix, format!("chmod 600 {}", path.display()));
    }

    #[test]
    fn a_data_dir_others_can_enter_fails_with_the_chmod() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        assert_eq!(check_data_dir(&data).level, Level::Ok, "a missing one is made 0700");
        std::fs::create_dir(&data).unwrap();
        set_mode(&data, 0o755);
        let c = check_data_dir(&data);
        assert_eq!(c.level, Level::Fail);
        assert_eq!(c.fix, format!("chmod 700 {}", data.display()));
        set_mode(&data, 0o700);
        assert_eq!(check_data_dir(&data).level, Level::Ok);
    }

    #[test]
    fn kept_sandboxes_disk_use_counts_hard_links_once() {
        let dir = tempfile::tempdir().unwrap();
        let kept = dir.path().join("kept");
        std::fs::create_dir_all(kept.join("sb-1/hib-1")).unwrap();
        std::fs::create_dir_all(kept.join(".bases/t-x")).unwrap();
        std::fs::write(kept.join("sb-1/hib-1/pages"), vec![1u8; 1 << 20]).unwrap();
        std::fs::hard_link(kept.join("sb-1/hib-1/pages"), kept.join(".bases/t-x/memory")).unwrap();
        let c = check_kept(dir.path());
        assert!(c.detail.starts_with("1 in ") && c.detail.contains("use 1 MiB"), "{}", c.detail);
    }

    #[test]
    fn seccomp_filters_install_here() {
        let c = check_seccomp();
        assert_eq!(c.level, Level::Ok, "{}: {}", c.detail, c.fix);
        // The check's thread ended; this one is not filtered.
        assert_eq!(seccomp::installed(), None);
        assert!(std::fs::read_to_string("/proc/self/status").unwrap().contains("Seccomp:\t0"));
    }

    #[test]
    fn root_is_warned_about() {
        let c = check_user();
        if euid() == 0 {
            assert_eq!(c.level, Level::Warn);
            assert!(c.fix.contains("sudo -u tine tine doctor"));
        } else {
            assert_eq!(c.level, Level::Ok);
        }
    }
}
