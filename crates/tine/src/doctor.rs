//! `tine doctor`: checks what the server needs on this host and says how to
//! fix each missing piece.

use std::path::Path;
use std::process::ExitCode;

use vmm::HostProfile;

use crate::config::{self, ConfigError};

/// One check's outcome.
struct Check {
    name: &'static str,
    ok: bool,
    /// A failed advisory check prints `warn` and does not fail the run.
    advisory: bool,
    detail: String,
    fix: &'static str,
}

fn check_kvm() -> Check {
    let (ok, detail) = match kvm_ioctls::Kvm::new() {
        Ok(kvm) => (true, format!("API version {}, host profile {}", kvm.get_api_version(), HostProfile::detect())),
        Err(e) => (false, format!("cannot open /dev/kvm: {e}")),
    };
    Check {
        name: "KVM",
        ok,
        advisory: false,
        detail,
        fix: "enable virtualization in the firmware, load kvm_intel or kvm_amd, and add the server's user to the kvm group",
    }
}

fn check_userfaultfd() -> Check {
    let dev = Path::new("/dev/userfaultfd");
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let ok = std::fs::OpenOptions::new().read(true).write(true).open(dev).is_ok();
    Check {
        name: "userfaultfd",
        ok,
        advisory: false,
        detail: if ok {
            "/dev/userfaultfd opens".into()
        } else {
            format!("/dev/userfaultfd cannot be opened (vm.unprivileged_userfaultfd = {})", sysctl.trim())
        },
        fix: "give the server's user access to /dev/userfaultfd (Linux 6.1+; deploy/install.sh writes a udev rule for group \
              tine); lazy restores and live branches need it",
    }
}

/// The server needs no privileges: a dedicated user in the `kvm` group
/// (deploy/tine.service). Root works but is a failure here, so that a
/// service running as root gets noticed.
fn check_user() -> Check {
    // SAFETY: geteuid(2) has no arguments and cannot fail.
    let uid = unsafe { libc::geteuid() };
    Check {
        name: "user",
        ok: uid != 0,
        advisory: true,
        detail: if uid == 0 { "running as root".into() } else { format!("running as uid {uid}, not root") },
        fix: "run the server as a dedicated user in the kvm group with no capabilities (deploy/install.sh makes user \
              tine; deploy/tine.service runs as it)",
    }
}

/// Seccomp filters (`seccomp(2)`, filter mode) must be available: the VMM
/// confines its vCPU, device and userfaultfd threads with them. The
/// kernel shows support as the `Seccomp:` line of `/proc/self/status`
/// (proc(5)).
fn check_seccomp() -> Check {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mode = status.lines().find_map(|l| l.strip_prefix("Seccomp:")).map(str::trim);
    Check {
        name: "seccomp",
        ok: mode.is_some(),
        advisory: false,
        detail: match mode {
            Some(m) => format!("seccomp available (this process: mode {m})"),
            None => "the kernel has no seccomp (no Seccomp: line in /proc/self/status)".into(),
        },
        fix: "use a kernel built with CONFIG_SECCOMP_FILTER=y",
    }
}

fn check_image(name: &'static str, what: &'static str, path: &Path) -> Check {
    let (ok, detail) = match config::check_image(what, path) {
        Ok(len) => (true, format!("{} ({} MiB)", path.display(), len >> 20)),
        Err(ConfigError::MissingImage { reason, .. }) => (false, format!("{}: {reason}", path.display())),
        Err(e) => (false, e.to_string()),
    };
    Check { name, ok, advisory: false, detail, fix: config::IMAGE_FIX }
}

fn check_memory() -> Check {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let mib = avail_kib / 1024;
    Check {
        name: "free memory",
        ok: mib >= 1024,
        advisory: false,
        detail: format!("{mib} MiB available"),
        fix:
            "free memory or lower [limits] default_memory_mib and max_sandboxes; each sandbox uses up to its memory_mib",
    }
}

/// Runs every check, prints one line each (with the fix for failures) and
/// returns failure if any check failed.
pub fn run(kernel: &Path, rootfs: &Path) -> ExitCode {
    let checks = [
        check_user(),
        check_kvm(),
        check_userfaultfd(),
        check_seccomp(),
        check_image("guest kernel", config::KERNEL, kernel),
        check_image("root filesystem", config::ROOTFS, rootfs),
        check_memory(),
    ];
    let mut failed = 0;
    for c in &checks {
        if c.ok {
            println!("ok    {:<16} {}", c.name, c.detail);
        } else if c.advisory {
            println!("warn  {:<16} {}\n      fix: {}", c.name, c.detail, c.fix);
        } else {
            failed += 1;
            println!("FAIL  {:<16} {}\n      fix: {}", c.name, c.detail, c.fix);
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
