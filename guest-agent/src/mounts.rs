//! Volumes: file systems on disks the host puts in the VM's device slots
//! while it runs (`Op::Mount`, `Op::Unmount`).
//!
//! The host inserts the disk and raises a configuration change interrupt;
//! the kernel's virtio-blk driver then reads the new capacity in a work
//! item of its own, so a mount waits until `/sys/block/<dev>/size` is not
//! 0. The disk is found by its serial (GET_ID, the `serial` attribute of
//! virtio-blk disks in sysfs), not by its name: names follow probe order.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_protocol::{AgentError, Mount, MAX_WORKING_DIR_BYTES, MOUNT_WAIT_MS};

/// How often the wait for a disk's capacity looks again.
const POLL: Duration = Duration::from_millis(10);

fn invalid(reason: String) -> AgentError {
    AgentError::InvalidRequest { reason }
}

fn io(message: String) -> AgentError {
    AgentError::Io { message }
}

/// Checks a mount point: absolute, not `/`, at most
/// [`MAX_WORKING_DIR_BYTES`] bytes, no NUL.
fn mount_point(path: &str) -> Result<CString, AgentError> {
    if !path.starts_with('/') || path.trim_end_matches('/').is_empty() || path.len() > MAX_WORKING_DIR_BYTES {
        return Err(invalid(format!("mount point {path:?}: an absolute directory other than / is needed")));
    }
    CString::new(path).map_err(|_| invalid(format!("mount point {path:?} holds a NUL byte")))
}

/// The `/dev` node of the virtio-blk disk whose serial is `serial`, with
/// its sysfs directory.
fn disk_by_serial(sys_block: &Path, serial: &str) -> Option<(PathBuf, PathBuf)> {
    let entries = std::fs::read_dir(sys_block).ok()?;
    entries.flatten().find_map(|e| {
        let dir = e.path();
        let theirs = std::fs::read_to_string(dir.join("serial")).ok()?;
        (theirs.trim_end_matches(['\n', '\0']) == serial).then(|| (Path::new("/dev").join(e.file_name()), dir))
    })
}

/// Mounts the disk of `m.serial` at `m.path` (`Op::Mount`).
///
/// Errors: as `Op::Mount` says.
pub fn mount(m: &Mount) -> Result<(), AgentError> {
    let target = mount_point(&m.path)?;
    let (dev, sys) = disk_by_serial(Path::new("/sys/block"), &m.serial)
        .ok_or_else(|| invalid(format!("no disk with serial {:?} in this sandbox", m.serial)))?;
    let deadline = Instant::now() + Duration::from_millis(MOUNT_WAIT_MS);
    loop {
        let sectors = std::fs::read_to_string(sys.join("size")).ok().and_then(|s| s.trim().parse::<u64>().ok());
        if sectors.is_some_and(|s| s > 0) {
            break;
        }
        if Instant::now() >= deadline {
            return Err(io(format!("{} shows no capacity after {MOUNT_WAIT_MS} ms", dev.display())));
        }
        std::thread::sleep(POLL);
    }
    std::fs::create_dir_all(&m.path).map_err(|e| io(format!("cannot make the mount point {}: {e}", m.path)))?;
    let source = CString::new(dev.as_os_str().as_encoded_bytes()).map_err(|_| invalid("device name".into()))?;
    let mut flags = libc::MS_NOATIME | libc::MS_NOSUID | libc::MS_NODEV;
    if m.read_only {
        flags |= libc::MS_RDONLY;
    }
    // `noinit_itable`: the host made the file system on a sparse file
    // whose inode tables read as zeros already.
    let data = if m.read_only { c"" } else { c"noinit_itable" };
    // SAFETY: NUL-terminated C strings that outlive the call, as mount(2)
    // takes them.
    let r = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), c"ext4".as_ptr(), flags, data.as_ptr().cast()) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(io(format!("mount {} on {}: {e}", dev.display(), m.path)));
    }
    Ok(())
}

/// Writes out and unmounts the file system at `path` (`Op::Unmount`);
/// nothing mounted there is success.
///
/// Errors: as `Op::Unmount` says.
pub fn unmount(path: &str) -> Result<(), AgentError> {
    let target = mount_point(path)?;
    if let Ok(dir) = std::fs::File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: `dir` is an open descriptor for the call's length.
        unsafe { libc::syncfs(dir.as_raw_fd()) };
    }
    // SAFETY: a NUL-terminated C string that outlives the call.
    if unsafe { libc::umount2(target.as_ptr(), 0) } != 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            // Not a mount point, or no such directory: nothing to do.
            Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(()),
            _ => Err(io(format!("unmount {path}: {e}"))),
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_absolute_directories_other_than_the_root() {
        assert!(mount_point("/data").is_ok());
        assert!(mount_point("/mnt/vol/").is_ok());
        for bad in ["", "/", "//", "data", "/a\0b"] {
            assert!(matches!(mount_point(bad), Err(AgentError::InvalidRequest { .. })), "{bad:?}");
        }
        assert!(mount_point(&format!("/{}", "a".repeat(MAX_WORKING_DIR_BYTES))).is_err());
    }

    #[test]
    fn a_disk_is_found_by_its_serial() {
        let sys = tempfile_dir();
        for (dev, serial) in [("vda", "root"), ("vdc", "tine-slot-0\n"), ("vdd", "tine-slot-1")] {
            std::fs::create_dir_all(sys.join(dev)).unwrap();
            std::fs::write(sys.join(dev).join("serial"), serial).unwrap();
        }
        std::fs::create_dir_all(sys.join("loop0")).unwrap();
        let (dev, dir) = disk_by_serial(&sys, "tine-slot-0").unwrap();
        assert_eq!(dev, Path::new("/dev/vdc"));
        assert_eq!(dir, sys.join("vdc"));
        assert_eq!(disk_by_serial(&sys, "tine-slot-1").unwrap().0, Path::new("/dev/vdd"));
        assert!(disk_by_serial(&sys, "tine-slot-2").is_none());
        std::fs::remove_dir_all(&sys).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("tine-agent-mounts-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
