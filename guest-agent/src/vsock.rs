//! AF_VSOCK stream sockets (vsock(7)) through libc.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Listens on `port` for any CID.
pub fn listen(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new socket this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_port = port;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    // SAFETY: `addr` is a valid sockaddr_vm and the length is its size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_vm as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a bound socket.
    if unsafe { libc::listen(fd.as_raw_fd(), 16) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Accepts one connection.
pub fn accept(listener: &OwnedFd) -> io::Result<File> {
    loop {
        // SAFETY: `listener` is a listening socket; no address is asked for.
        let fd = unsafe {
            libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
        };
        if fd >= 0 {
            // SAFETY: `fd` is a new connection this function owns.
            return Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
