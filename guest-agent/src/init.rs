//! PID 1 duties when the agent is the guest's init: put a writable
//! overlay over the read-only root (when the image has `/overlay`), mount
//! the basic file systems, run the agent in a child, reap every orphan,
//! restart the agent if it dies.
//!
//! The overlay's upper layer is a tmpfs: every file the sandbox changes
//! lives in guest memory, so a copy of the VM's memory (snapshot, branch)
//! is a copy of its file system too, and the image stays shared.

use std::ffi::CStr;

fn mount(source: &CStr, target: &CStr, fstype: &CStr, flags: libc::c_ulong) {
    let _ = std::fs::create_dir_all(target.to_str().unwrap_or("/"));
    // SAFETY: all arguments are valid C strings; no data argument.
    let r = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, std::ptr::null()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        // devtmpfs is mounted by the kernel already (CONFIG_DEVTMPFS_MOUNT).
        if e.raw_os_error() != Some(libc::EBUSY) {
            eprintln!("tine-agent init: mount {target:?}: {e}");
        }
    }
}

fn check(what: &str, r: libc::c_int) -> Result<(), String> {
    if r < 0 {
        Err(format!("{what}: {}", std::io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

/// Mounts `lowerdir=/` with a tmpfs upper layer at /overlay/root and makes
/// it the root (as switch_root does: move it onto `/`, then chroot).
fn overlay_root() -> Result<(), String> {
    // SAFETY (all calls below): arguments are valid C strings or null, as
    // mount(2), chdir(2) and chroot(2) take them.
    check("mount tmpfs on /overlay", unsafe {
        libc::mount(c"tmpfs".as_ptr(), c"/overlay".as_ptr(), c"tmpfs".as_ptr(), 0, c"mode=0755".as_ptr().cast())
    })?;
    for d in ["/overlay/upper", "/overlay/work", "/overlay/root"] {
        std::fs::create_dir(d).map_err(|e| format!("mkdir {d}: {e}"))?;
    }
    check("mount overlay", unsafe {
        libc::mount(
            c"overlay".as_ptr(),
            c"/overlay/root".as_ptr(),
            c"overlay".as_ptr(),
            0,
            c"lowerdir=/,upperdir=/overlay/upper,workdir=/overlay/work".as_ptr().cast(),
        )
    })?;
    check("chdir /overlay/root", unsafe { libc::chdir(c"/overlay/root".as_ptr()) })?;
    check("move the overlay onto /", unsafe {
        libc::mount(c".".as_ptr(), c"/".as_ptr(), std::ptr::null(), libc::MS_MOVE, std::ptr::null())
    })?;
    check("chroot", unsafe { libc::chroot(c".".as_ptr()) })?;
    check("chdir /", unsafe { libc::chdir(c"/".as_ptr()) })?;
    Ok(())
}

/// Never returns in the parent (PID 1); returns in the child, which then
/// runs the agent.
pub fn run_as_pid1() {
    if std::path::Path::new("/overlay").is_dir() {
        match overlay_root() {
            Ok(()) => println!("tine-agent init: root is an overlay (tmpfs upper) on the read-only image"),
            Err(e) => eprintln!("tine-agent init: no overlay ({e}); the root stays as mounted"),
        }
    }
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(c"proc", c"/proc", c"proc", nosuid);
    mount(c"sysfs", c"/sys", c"sysfs", nosuid);
    mount(c"devtmpfs", c"/dev", c"devtmpfs", libc::MS_NOSUID);
    mount(c"tmpfs", c"/tmp", c"tmpfs", libc::MS_NOSUID | libc::MS_NODEV);
    mount(c"tmpfs", c"/run", c"tmpfs", libc::MS_NOSUID | libc::MS_NODEV);
    loop {
        // SAFETY: PID 1 is single-threaded here, so fork is safe.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            return;
        }
        if pid < 0 {
            eprintln!("tine-agent init: fork: {}", std::io::Error::last_os_error());
            std::thread::sleep(std::time::Duration::from_secs(1));
            continue;
        }
        // Reap until the agent itself exits.
        loop {
            let mut status = 0;
            // SAFETY: waitpid with a valid out pointer.
            let r = unsafe { libc::waitpid(-1, &mut status, 0) };
            if r == pid {
                eprintln!("tine-agent init: the agent exited (status {status:#x}); restarting it");
                std::thread::sleep(std::time::Duration::from_secs(1));
                break;
            }
            if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
                break;
            }
        }
    }
}
