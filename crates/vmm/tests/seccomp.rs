//! The VMM threads' seccomp filters (`vmm::seccomp`): a thread with a
//! filter installed that makes a call outside its allowlist takes the whole
//! process down with SIGSYS, while the calls the thread kind needs (a real
//! vCPU's ioctls, allocation, locks, logging, the thread's own end) go
//! through. Each case runs in a child process: this test binary re-executed
//! with [`CASE_ENV`] naming the case, running only the `child` test.
//!
//! The KVM test suites (snapshot, branch, agent, virtio_vsock, ...) run
//! with the filters on, which is what shows the allowlists are complete;
//! boot.rs finds a real VM's vCPU and device threads filtered.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

use common::threads::wait_filtered;
use vmm::seccomp::{self, Mode, ThreadKind};

/// The variable that makes this binary's `child` test run a case.
const CASE_ENV: &str = "TINE_SECCOMP_TEST_CASE";
/// What a child prints once the allowed calls went through.
const ALLOWED_OK: &str = "allowed calls ok";

/// Runs `case` in a child process and returns its output.
fn run_child(case: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CASE_ENV, case)
        .env_remove(seccomp::ENV_VAR)
        .output()
        .expect("the test binary re-executes")
}

fn assert_killed_by_sigsys(case: &str) {
    let out = run_child(case);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{case}: {:?}; stderr:\n{stderr}", out.status);
    assert!(stderr.contains(ALLOWED_OK), "{case}: the allowed calls did not all go through; stderr:\n{stderr}");
    assert!(!stderr.contains("survived"), "{case}: stderr:\n{stderr}");
}

/// Runs `f` on a new thread that installs `kind`'s filter first (as the VMM
/// threads do) and waits for it.
fn on_filtered_thread(kind: ThreadKind, mode: Mode, f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .name(format!("{kind:?}-test"))
        .spawn(move || {
            EVENTFD.with(|_| ());
            seccomp::install_with(kind, mode).expect("the filter installs");
            assert_eq!(seccomp::installed(), Some(kind));
            f()
        })
        .unwrap()
        .join()
        .unwrap();
}

/// What every VMM thread does: allocate and free (large and small, so both
/// brk/arenas and mmap), take locks, read the clock, sleep, signal an
/// eventfd.
fn everyday_calls() {
    let big = vec![7u8; 64 << 20];
    assert_eq!(big.iter().step_by(4096).map(|&b| u64::from(b)).sum::<u64>(), 7 * (64 << 20) / 4096);
    drop(big);
    let small: Vec<String> = (0..10_000).map(|i| i.to_string()).collect();
    let m = std::sync::Mutex::new(small.len());
    *m.lock().unwrap() += 1;
    let t = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_millis(1));
    assert!(t.elapsed().as_nanos() > 0);
    let map: std::collections::HashMap<u32, u32> = (0..100).map(|i| (i, i)).collect();
    assert_eq!(map.len(), 100);
    // An eventfd made before the filter (as the VMM's are): read, written,
    // closed.
    EVENTFD.with(|e| {
        e.write(1).unwrap();
        assert_eq!(e.read().unwrap(), 1);
    });
}

thread_local! {
    static EVENTFD: vmm_sys_util::eventfd::EventFd = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
}

/// A real VM and vCPU (no guest: nothing runs), made before any filter.
fn kvm_vcpu() -> (kvm_ioctls::VmFd, kvm_ioctls::VcpuFd) {
    let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm");
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    let vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    (vm, vcpu)
}

/// The child side: runs the case [`CASE_ENV`] names, then exits; does
/// nothing in a normal test run.
#[test]
fn child() {
    let Ok(case) = std::env::var(CASE_ENV) else { return };
    match case.as_str() {
        // A vCPU thread reads its vCPU's registers and state, then opens a
        // network socket: no vCPU thread ever does.
        "vcpu-socket" => {
            let (_vm, vcpu) = kvm_vcpu();
            on_filtered_thread(ThreadKind::Vcpu, Mode::Enforce, move || {
                everyday_calls();
                vcpu.get_regs().expect("KVM_GET_REGS is allowed");
                vcpu.get_sregs().expect("KVM_GET_SREGS is allowed");
                eprintln!("{ALLOWED_OK}");
                // SAFETY: a plain socket(2) call; the fd is closed if it
                // (wrongly) is made.
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
                eprintln!("survived socket(): {fd}");
            });
        }
        // A vCPU thread makes a KVM ioctl it has no business making (a new
        // vCPU on the VM fd): ioctl is allowed only for the vCPU requests.
        "vcpu-ioctl" => {
            let (vm, vcpu) = kvm_vcpu();
            on_filtered_thread(ThreadKind::Vcpu, Mode::Enforce, move || {
                vcpu.get_regs().expect("KVM_GET_REGS is allowed");
                eprintln!("{ALLOWED_OK}");
                let r = vm.create_vcpu(1);
                eprintln!("survived KVM_CREATE_VCPU: {:?}", r.is_ok());
            });
        }
        // A vCPU thread tries to run a program.
        "vcpu-execve" => {
            on_filtered_thread(ThreadKind::Vcpu, Mode::Enforce, || {
                everyday_calls();
                eprintln!("{ALLOWED_OK}");
                let err = std::os::unix::process::CommandExt::exec(&mut Command::new("/bin/true"));
                eprintln!("survived exec: {err}");
            });
        }
        // The device thread may make Unix sockets (vsock's host side) but
        // not network sockets.
        "devices-inet" => {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("host.sock_1024");
            let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
            on_filtered_thread(ThreadKind::Devices, Mode::Enforce, move || {
                everyday_calls();
                let a = std::os::unix::net::UnixStream::connect(&path).expect("AF_UNIX is allowed");
                let (b, _) = listener.accept().expect("accept4 is allowed");
                a.set_nonblocking(true).expect("FIONBIO is allowed");
                drop((a, b));
                std::fs::remove_file(&path).expect("unlink is allowed");
                eprintln!("{ALLOWED_OK}");
                let r = std::net::TcpListener::bind("127.0.0.1:0");
                eprintln!("survived a TCP socket: {:?}", r.is_ok());
            });
        }
        // The net thread makes IPv4 and IPv6 sockets (the NAT's host side:
        // TCP connections, UDP flows on the loopback here) but no Unix
        // socket.
        "net-unix" => {
            use std::io::Write;
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let tcp_addr = listener.local_addr().unwrap();
            let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let udp_addr = peer.local_addr().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("host.sock");
            let _unix = std::os::unix::net::UnixListener::bind(&path).unwrap();
            on_filtered_thread(ThreadKind::Net, Mode::Enforce, move || {
                everyday_calls();
                let mut s = std::net::TcpStream::connect(tcp_addr).expect("an AF_INET TCP connect is allowed");
                s.set_nodelay(true).expect("setsockopt is allowed");
                s.set_nonblocking(true).expect("FIONBIO is allowed");
                assert_eq!(s.peer_addr().expect("getpeername is allowed"), tcp_addr);
                s.local_addr().expect("getsockname is allowed");
                assert!(s.take_error().expect("getsockopt is allowed").is_none());
                s.write_all(b"guest bytes").expect("writing a socket is allowed");
                s.shutdown(std::net::Shutdown::Write).expect("shutdown is allowed");
                let u = std::net::UdpSocket::bind("127.0.0.1:0").expect("an AF_INET UDP socket is allowed");
                u.send_to(b"query", udp_addr).expect("sendto is allowed");
                let mut buf = [0u8; 16];
                let (n, from) = peer.recv_from(&mut buf).expect("recvfrom is allowed");
                assert_eq!((&buf[..n], from), (&b"query"[..], u.local_addr().unwrap()));
                // IPv6 may be off on the host: the socket may fail, but
                // with an errno, not a kill.
                // SAFETY: a plain socket(2) call; the fd is closed below.
                let fd6 = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
                if fd6 >= 0 {
                    // SAFETY: closing the fd just made.
                    unsafe { libc::close(fd6) };
                }
                drop((s, u, listener));
                eprintln!("{ALLOWED_OK}");
                let r = std::os::unix::net::UnixStream::connect(&path);
                eprintln!("survived an AF_UNIX socket: {:?}", r.is_ok());
            });
        }
        // The net thread reads no files.
        "net-file" => {
            let file = tempfile::tempfile().unwrap();
            file.set_len(4096).unwrap();
            on_filtered_thread(ThreadKind::Net, Mode::Enforce, move || {
                everyday_calls();
                eprintln!("{ALLOWED_OK}");
                let mut page = [1u8; 16];
                let r = std::os::unix::fs::FileExt::read_at(&file, &mut page, 0);
                eprintln!("survived a pread: {:?}", r.is_ok());
            });
        }
        // The userfaultfd thread reads its memory file; it opens nothing
        // (a read-only open fails, a write open kills).
        "uffd-open" => {
            let file = tempfile::tempfile().unwrap();
            file.set_len(4096).unwrap();
            on_filtered_thread(ThreadKind::Uffd, Mode::Enforce, move || {
                everyday_calls();
                let mut page = [1u8; 4096];
                std::os::unix::fs::FileExt::read_exact_at(&file, &mut page, 0).expect("pread is allowed");
                assert!(page.iter().all(|&b| b == 0));
                let e = std::fs::File::open("/etc/hostname").expect_err("a read-only open fails");
                assert_eq!(e.raw_os_error(), Some(libc::EACCES));
                eprintln!("{ALLOWED_OK}");
                let r = std::fs::OpenOptions::new().append(true).open("/tmp/tine-seccomp-test");
                eprintln!("survived an open for writing: {:?}", r.is_ok());
            });
        }
        // Every filter lets its thread do the everyday calls and end: the
        // process exits normally.
        "all-allowed" => {
            for kind in ThreadKind::ALL {
                on_filtered_thread(kind, Mode::Enforce, everyday_calls);
            }
            let (_vm, vcpu) = kvm_vcpu();
            let fd = vcpu.as_raw_fd();
            on_filtered_thread(ThreadKind::Vcpu, Mode::Enforce, move || {
                assert!(fd >= 0);
                vcpu.get_regs().unwrap();
                vcpu.get_mp_state().unwrap();
                vcpu.get_vcpu_events().unwrap();
                // The thread ends here: its fd is closed and its stack freed
                // under the filter.
            });
            eprintln!("{ALLOWED_OK}");
        }
        // Trap mode (debugging): the forbidden call fails with ENOSYS and
        // is reported; the process goes on.
        "vcpu-trap" => {
            on_filtered_thread(ThreadKind::Vcpu, Mode::Trap, || {
                // SAFETY: a plain socket(2) call.
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
                let errno = std::io::Error::last_os_error().raw_os_error();
                assert_eq!((fd, errno), (-1, Some(libc::ENOSYS)));
                eprintln!("{ALLOWED_OK}");
            });
        }
        other => panic!("unknown case {other}"),
    }
    std::process::exit(0);
}

#[test]
fn a_vcpu_thread_opening_a_socket_kills_the_process() {
    if !testkit::kvm_available("seccomp") {
        return;
    }
    assert_killed_by_sigsys("vcpu-socket");
}

#[test]
fn a_vcpu_thread_making_a_vm_ioctl_kills_the_process() {
    if !testkit::kvm_available("seccomp") {
        return;
    }
    assert_killed_by_sigsys("vcpu-ioctl");
}

#[test]
fn a_vcpu_thread_running_a_program_kills_the_process() {
    assert_killed_by_sigsys("vcpu-execve");
}

#[test]
fn the_device_thread_opening_a_network_socket_kills_the_process() {
    assert_killed_by_sigsys("devices-inet");
}

#[test]
fn the_net_thread_opening_a_unix_socket_kills_the_process() {
    assert_killed_by_sigsys("net-unix");
}

#[test]
fn the_net_thread_reading_a_file_kills_the_process() {
    assert_killed_by_sigsys("net-file");
}

#[test]
fn the_userfaultfd_thread_opening_a_file_kills_the_process() {
    assert_killed_by_sigsys("uffd-open");
}

#[test]
fn the_allowed_calls_and_a_thread_end_go_through() {
    if !testkit::kvm_available("seccomp") {
        return;
    }
    let out = run_child("all-allowed");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}; stderr:\n{stderr}", out.status);
    assert!(stderr.contains(ALLOWED_OK), "stderr:\n{stderr}");
}

#[test]
fn trap_mode_reports_the_call_and_goes_on() {
    let out = run_child("vcpu-trap");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}; stderr:\n{stderr}", out.status);
    assert!(stderr.contains(&format!("blocked syscall {} on a vCPU thread", libc::SYS_socket)), "stderr:\n{stderr}");
    assert!(stderr.contains(ALLOWED_OK), "stderr:\n{stderr}");
}

#[test]
fn each_thread_kind_has_a_documented_allowlist() {
    for kind in ThreadKind::ALL {
        let n = seccomp::allowlist_len(kind);
        eprintln!("{kind:?}: {n} system calls allowed");
        assert!((20..80).contains(&n), "{kind:?}: {n}");
    }
}

/// A real userfaultfd restore: the userfaultfd handler runs with a
/// filter, the rest of the process (the test's own thread) without. The
/// threads of a real VM (vCPUs, devices) are found filtered on a guest that
/// boot.rs boots anyway (`a_virtio_blk_root_guest_writes_a_disk_exchanges_vsock_bytes_and_runs_filtered`,
/// which took in this binary's `a_real_vms_threads_run_filtered`).
#[test]
fn a_userfaultfd_restores_thread_runs_filtered() {
    if !testkit::kvm_available("seccomp") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Lazy restore of a 2 MiB memory file through userfaultfd.
    let mem = dir.path().join("memory");
    std::fs::write(&mem, vec![0u8; 2 << 20]).unwrap();
    match vmm::memory::GuestRam::from_snapshot(
        "sc-uffd",
        &vmm::SnapshotMemory::File(mem),
        2 << 20,
        vmm::MemoryBacking::Userfaultfd,
    ) {
        Ok(ram) => {
            assert_eq!(wait_filtered("uffd-sc-uffd"), vec![2]);
            drop(ram);
        }
        Err(e) => eprintln!("SKIP the userfaultfd part: {e}"),
    }

    let me = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    assert!(me.contains("Seccomp:\t0"), "the test's own thread is not filtered");
}
