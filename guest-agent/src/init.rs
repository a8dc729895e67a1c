//! PID 1 duties when the agent is the guest's init: mount the basic file
//! systems, run the agent in a child, reap every orphan, restart the agent
//! if it dies.

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

/// Never returns in the parent (PID 1); returns in the child, which then
/// runs the agent.
pub fn run_as_pid1() {
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
