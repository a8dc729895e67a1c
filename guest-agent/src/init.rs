//! PID 1 duties when the agent is the guest's init: set the environment
//! of a root login ([`crate::env::LOGIN_ENV`]), put a writable
//! overlay over the read-only root (when the image has `/overlay`), mount
//! the basic file systems, set up the network ([`crate::net`]), run the
//! agent in a child, reap every orphan, restart the agent if it dies.
//!
//! The overlay's upper layer is the sandbox's own disk, [`SANDBOX_DISK`]
//! (an ext4 file system the host made, on a copy-on-write disk that every
//! snapshot, branch and hibernation freezes at the instant it copies the
//! VM's memory), so a sandbox writes far more than its RAM and the image
//! stays shared. Without that disk (a VM given only the root), the upper
//! layer is a tmpfs: the files then live in guest memory. PID 1 keeps an
//! fd of the upper directory ([`upper_fd`]) for the agent's manifests:
//! after the switch to the overlay no path reaches it.

use std::ffi::CStr;
use std::sync::atomic::{AtomicI32, Ordering};

/// The overlay's upper directory (`/overlay/upper` before the chroot), an
/// `O_PATH` directory fd kept for the life of the process; -1 when the
/// root is not an overlay. Set once by PID 1 before it forks the agent: the
/// forked agent (which does not exec) inherits both the fd and this value,
/// and every agent restart is a new fork of PID 1, so it stays valid. It
/// is close-on-exec, so commands the agent runs do not get it.
static UPPER_FD: AtomicI32 = AtomicI32::new(-1);

/// The fd of the overlay's upper layer (see [`UPPER_FD`]), or `None` when
/// the root is not an overlay (or the agent is not the guest's init). Walk
/// it through `/proc/self/fd/<fd>`, or with `openat` on the fd.
pub fn upper_fd() -> Option<libc::c_int> {
    let fd = UPPER_FD.load(Ordering::Relaxed);
    (fd >= 0).then_some(fd)
}

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

/// The sandbox's own disk: the second virtio-blk device (the first is the
/// read-only root image), an ext4 file system made by the host.
pub const SANDBOX_DISK: &CStr = c"/dev/vdb";

/// What the overlay's upper layer is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upper {
    /// The sandbox's disk ([`SANDBOX_DISK`]).
    Disk,
    /// A tmpfs (no sandbox disk).
    Tmpfs,
}

/// Mounts `lowerdir=/` with an upper layer on the sandbox's disk (or a
/// tmpfs without one) at /overlay/root and makes it the root (as
/// switch_root does: move it onto `/`, then chroot). On success,
/// [`UPPER_FD`] holds the upper directory: after the chroot no path
/// reaches it.
fn overlay_root() -> Result<Upper, String> {
    let upper_on = if std::path::Path::new(SANDBOX_DISK.to_str().unwrap_or_default()).exists() {
        check(
            "mount the sandbox disk on /overlay",
            // SAFETY: valid NUL-terminated C strings, as mount(2) takes them.
            // `noinit_itable`: the host made the file system on a sparse
            // disk whose inode tables read as zeros already, so the
            // kernel's background zeroing would only write zeros.
            unsafe {
                libc::mount(
                    SANDBOX_DISK.as_ptr(),
                    c"/overlay".as_ptr(),
                    c"ext4".as_ptr(),
                    libc::MS_NOATIME,
                    c"noinit_itable".as_ptr().cast(),
                )
            },
        )?;
        Upper::Disk
    } else {
        check(
            "mount tmpfs on /overlay",
            // SAFETY: valid NUL-terminated C strings, as mount(2) takes them.
            unsafe {
                libc::mount(c"tmpfs".as_ptr(), c"/overlay".as_ptr(), c"tmpfs".as_ptr(), 0, c"mode=0755".as_ptr().cast())
            },
        )?;
        Upper::Tmpfs
    };
    for d in ["/overlay/upper", "/overlay/work", "/overlay/root"] {
        match std::fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("mkdir {d}: {e}")),
        }
    }
    check(
        "mount overlay",
        // SAFETY: valid NUL-terminated C strings, as mount(2) takes them.
        unsafe {
            libc::mount(
                c"overlay".as_ptr(),
                c"/overlay/root".as_ptr(),
                c"overlay".as_ptr(),
                0,
                c"lowerdir=/,upperdir=/overlay/upper,workdir=/overlay/work".as_ptr().cast(),
            )
        },
    )?;
    // SAFETY: a valid C string and open(2) flags; the fd is owned below.
    let upper = unsafe { libc::open(c"/overlay/upper".as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if let Err(e) = check("open /overlay/upper", upper) {
        // The overlay still works; only the manifest (diff) will not.
        eprintln!("tine-agent init: {e}; manifests (sandbox_diff) will not work");
    }
    let moved = switch_root();
    if upper >= 0 {
        match moved {
            Ok(()) => UPPER_FD.store(upper, Ordering::Relaxed),
            // SAFETY: `upper` is the fd opened above, used nowhere else.
            Err(_) => unsafe {
                libc::close(upper);
            },
        }
    }
    moved.map(|()| upper_on)
}

/// Makes the overlay at /overlay/root the root: moves it onto `/`, then
/// chroots into it.
fn switch_root() -> Result<(), String> {
    // SAFETY: a valid NUL-terminated C string, as chdir(2) takes it.
    check("chdir /overlay/root", unsafe { libc::chdir(c"/overlay/root".as_ptr()) })?;
    check(
        "move the overlay onto /",
        // SAFETY: valid C strings or null, as mount(2) takes them for MS_MOVE.
        unsafe { libc::mount(c".".as_ptr(), c"/".as_ptr(), std::ptr::null(), libc::MS_MOVE, std::ptr::null()) },
    )?;
    // SAFETY: a valid NUL-terminated C string, as chroot(2) takes it.
    check("chroot", unsafe { libc::chroot(c".".as_ptr()) })?;
    // SAFETY: a valid NUL-terminated C string, as chdir(2) takes it.
    check("chdir /", unsafe { libc::chdir(c"/".as_ptr()) })?;
    Ok(())
}

/// Never returns in the parent (PID 1); returns in the child, which then
/// runs the agent.
pub fn run_as_pid1() {
    // First, while PID 1 is the only thread: everything inherits it.
    crate::env::set_login_defaults();
    if std::path::Path::new("/overlay").is_dir() {
        match overlay_root() {
            Ok(Upper::Disk) => {
                println!("tine-agent init: root is an overlay on the read-only image, upper on the sandbox disk")
            }
            Ok(Upper::Tmpfs) => println!("tine-agent init: root is an overlay (tmpfs upper) on the read-only image"),
            Err(e) => eprintln!("tine-agent init: no overlay ({e}); the root stays as mounted"),
        }
    }
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(c"proc", c"/proc", c"proc", nosuid);
    mount(c"sysfs", c"/sys", c"sysfs", nosuid);
    mount(c"devtmpfs", c"/dev", c"devtmpfs", libc::MS_NOSUID);
    // What udev or a container runtime would make (runc's default
    // symlinks): programs write to /dev/stdout or read /dev/fd/N.
    let links = [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ];
    for (link, target) in links {
        match std::os::unix::fs::symlink(target, link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => eprintln!("tine-agent init: {link}: {e}"),
        }
    }
    mount(c"tmpfs", c"/tmp", c"tmpfs", libc::MS_NOSUID | libc::MS_NODEV);
    mount(c"tmpfs", c"/run", c"tmpfs", libc::MS_NOSUID | libc::MS_NODEV);
    // Once per boot, before the agent: a restored snapshot or a branch child
    // keeps the kernel's interface state, so no agent restart redoes it.
    match crate::net::set_up() {
        Ok(crate::net::NetSetup::Configured) => println!(
            "tine-agent init: network: {} {}/{} via {}, dns {}",
            crate::net::NIC,
            crate::net::GUEST_ADDR,
            crate::net::PREFIX_LEN,
            crate::net::GATEWAY_ADDR,
            crate::net::DNS_ADDR
        ),
        Ok(crate::net::NetSetup::LoopbackOnly) => println!("tine-agent init: network: no NIC, loopback only"),
        Err(e) => eprintln!("tine-agent init: network: {e}"),
    }
    loop {
        // SAFETY: PID 1 is single-threaded here, so fork is safe.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            exec_override();
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

/// A replacement agent in the guest's `/run` (a tmpfs, gone at the next
/// boot): when it exists, the agent child runs it instead of this binary.
/// Tests use it to run an agent of another protocol version (the
/// `protocol-v4` build) in a running sandbox, then kill the agent so that
/// this loop starts the replacement. It gives the guest nothing it did not
/// have (root in the guest can replace the agent anyway; the host trusts
/// no answer of it).
const AGENT_OVERRIDE: &std::ffi::CStr = c"/run/tine-agent-override";

/// In the forked agent child: execs [`AGENT_OVERRIDE`] when it exists;
/// returns (to run this binary's agent) when it does not or the exec fails.
fn exec_override() {
    let Ok(path) = AGENT_OVERRIDE.to_str() else { return };
    if !std::path::Path::new(path).exists() {
        return;
    }
    println!("tine-agent init: running the agent in {path}");
    let argv = [AGENT_OVERRIDE.as_ptr(), std::ptr::null()];
    // SAFETY: a NUL-terminated path and a NULL-terminated argv of
    // NUL-terminated strings that outlive the call; execv returns only on
    // failure.
    unsafe { libc::execv(AGENT_OVERRIDE.as_ptr(), argv.as_ptr()) };
    eprintln!("tine-agent init: exec {path}: {}; running the image's agent", std::io::Error::last_os_error());
}
