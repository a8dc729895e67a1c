//! Per-thread seccomp filters for the VMM's threads (least privilege):
//! every vCPU thread, the per-VM device thread, the per-VM net thread and
//! the userfaultfd handler thread installs, as the first thing it does, a
//! filter that allows only the system calls that kind of thread makes. A
//! thread that makes any other call is the sign of a compromised VMM thread
//! (guest-controlled data drove it somewhere the code never goes): the
//! kernel kills the whole process (`SECCOMP_RET_KILL_PROCESS`, signal `SIGSYS`).
//!
//! Why the process and not the thread: the threads share one address
//! space, so a thread that got that far may already have written anywhere
//! in the daemon's memory; killing only it would leave the rest running on
//! memory it may have corrupted (and leave its locks held, so the VM would
//! hang rather than stop). Every sandbox goes down with the daemon; that is
//! the price of not running on after a compromise.
//!
//! The filters are built with rust-vmm's `seccompiler` (classic BPF,
//! `seccomp(2)` with `SECCOMP_SET_MODE_FILTER`; see the kernel's
//! `Documentation/userspace-api/seccomp_filter.rst`). The allowlists below
//! were found by tracing the VMM's KVM test suites (`strace -f -ff`, one
//! file per thread, grouped by thread name) and list each call with the
//! reason it is needed (the net thread's list was written from what the
//! user-space NAT needs, before a real guest ran with it, and is checked by
//! `tests/seccomp.rs` and `tests/net_device.rs`; `TINE_SECCOMP=trap` names
//! any call it lacks). `ioctl` is allowed only for the requests each
//! thread kind makes (KVM vCPU requests, `userfaultfd` requests, `FIONBIO`);
//! `mmap`/`mprotect` never with `PROT_EXEC`; `socket` on the device thread
//! only for `AF_UNIX`, on the net thread only for `AF_INET` and `AF_INET6`.
//!
//! Installing a filter needs no privilege: `seccompiler` sets the calling
//! thread's `PR_SET_NO_NEW_PRIVS` first. Filters are per thread and are
//! inherited by threads the filtered thread starts; the rest of the daemon
//! (tokio workers, the HTTP server) is not filtered.
//!
//! Debugging only: the environment variable `TINE_SECCOMP` (read once per
//! process) chooses the [`Mode`]: unset or `enforce` (the default),
//! `trap` (a forbidden call fails with `ENOSYS` and is reported on stderr
//! with its number and the thread's name; the process goes on), `log` (the
//! kernel allows the call and logs it to the audit log) or `off` (no
//! filter). Anything else is taken as `enforce`, with a warning.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};
/// The environment variable that chooses the [`Mode`] (debugging only).
pub const ENV_VAR: &str = "TINE_SECCOMP";

/// The kinds of VMM thread, each with its own allowlist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// A vCPU thread: `KVM_RUN` and vCPU state ioctls, legacy port I/O
    /// and MMIO device emulation (serial console output, virtio-mmio
    /// registers, device activation).
    Vcpu,
    /// The per-VM device thread (`event_loop`): virtqueue processing,
    /// virtio-blk file I/O, the vsock muxer's Unix sockets.
    Devices,
    /// The userfaultfd handler thread: reads pages from the memory file and
    /// copies them into guest RAM.
    Uffd,
    /// The per-VM net thread (a second `event_loop` over the virtio-net
    /// device only): virtqueue processing and the user-space NAT's
    /// non-blocking TCP and UDP host sockets; no files, no Unix sockets.
    Net,
}

impl ThreadKind {
    /// Every kind, for tests and reports.
    pub const ALL: [ThreadKind; 4] = [ThreadKind::Vcpu, ThreadKind::Devices, ThreadKind::Uffd, ThreadKind::Net];

    fn index(self) -> usize {
        match self {
            ThreadKind::Vcpu => 0,
            ThreadKind::Devices => 1,
            ThreadKind::Uffd => 2,
            ThreadKind::Net => 3,
        }
    }
}

/// What a filter does with a call outside its allowlist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Kill the process with `SIGSYS` (the default).
    Enforce,
    /// Fail the call with `ENOSYS` and report it on stderr (debugging).
    Trap,
    /// Allow the call and have the kernel log it to the audit log
    /// (debugging; needs audit, `SECCOMP_RET_LOG`).
    Log,
    /// Install no filter (debugging).
    Off,
}

/// Errors of building or installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// seccompiler refused the rules or could not compile them (a bug).
    #[error("cannot build the {kind:?} thread's seccomp filter: {reason}")]
    Build {
        /// The thread kind.
        kind: ThreadKind,
        /// seccompiler's error.
        reason: String,
    },
    /// The kernel refused the filter (`prctl(PR_SET_NO_NEW_PRIVS)` or
    /// `seccomp(2)` failed: a kernel without `CONFIG_SECCOMP_FILTER`).
    #[error("cannot install the {kind:?} thread's seccomp filter: {reason} (TINE_SECCOMP=off runs without it)")]
    Install {
        /// The thread kind.
        kind: ThreadKind,
        /// seccompiler's error.
        reason: String,
    },
}

/// The mode this process runs in, from [`ENV_VAR`] (read once).
pub fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var(ENV_VAR).as_deref() {
        Err(_) | Ok("") | Ok("enforce") => Mode::Enforce,
        Ok("trap") => Mode::Trap,
        Ok("log") => Mode::Log,
        Ok("off") => {
            tracing::warn!("{ENV_VAR}=off: VMM threads run without seccomp filters (debugging only)");
            Mode::Off
        }
        Ok(other) => {
            tracing::warn!("{ENV_VAR}={other:?} is not one of enforce, trap, log, off; enforcing");
            Mode::Enforce
        }
    })
}

/// Installs `kind`'s filter on the calling thread in this process's
/// [`mode`]; a no-op in [`Mode::Off`]. Each VMM thread calls this first.
///
/// Errors: [`SeccompError`].
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    install_with(kind, mode())
}

/// [`install`], logging a failure instead of returning it: for the first
/// line of a VMM thread, which then runs unfiltered (`tine doctor` checks
/// that the kernel has seccomp filters, so this happens only on kernels
/// it flags).
pub fn install_or_log(kind: ThreadKind) {
    if let Err(e) = install(kind) {
        tracing::error!("{e}; the thread runs without a filter");
    }
}

/// Installs `kind`'s filter on the calling thread with `mode`.
///
/// Errors: [`SeccompError`].
pub fn install_with(kind: ThreadKind, mode: Mode) -> Result<(), SeccompError> {
    static PROGRAMS: [OnceLock<Result<BpfProgram, String>>; 4] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let action = match mode {
        Mode::Off => return Ok(()),
        Mode::Enforce => SeccompAction::KillProcess,
        Mode::Trap => {
            install_sigsys_reporter();
            SeccompAction::Trap
        }
        Mode::Log => SeccompAction::Log,
    };
    let program = if mode == Mode::Enforce {
        PROGRAMS[kind.index()].get_or_init(|| compile(kind, action.clone())).clone()
    } else {
        compile(kind, action)
    };
    let program = program.map_err(|reason| SeccompError::Build { kind, reason })?;
    let refuse_opens = compile_refused_opens().map_err(|reason| SeccompError::Build { kind, reason })?;
    // The kernel runs both and takes the stricter answer (kill before
    // errno before allow), so a read-only open fails with EACCES.
    for p in [&refuse_opens, &program] {
        seccompiler::apply_filter(p).map_err(|e| SeccompError::Install { kind, reason: e.to_string() })?;
    }
    FILTERED.with(|f| f.set(kind.index() as u8 + 1));
    Ok(())
}

thread_local! {
    /// The filter this thread installed: 0 none, else [`ThreadKind`]'s
    /// index + 1. Const-initialized without destructor, so the trap mode's
    /// signal handler can read it.
    static FILTERED: Cell<u8> = const { Cell::new(0) };
}

/// The kind of filter the calling thread installed through this module,
/// if any.
pub fn installed() -> Option<ThreadKind> {
    match FILTERED.with(Cell::get) {
        0 => None,
        i => ThreadKind::ALL.get(usize::from(i) - 1).copied(),
    }
}

/// How many system calls `kind`'s allowlist names (some only with
/// argument conditions).
pub fn allowlist_len(kind: ThreadKind) -> usize {
    rules(kind).len()
}

fn compile(kind: ThreadKind, mismatch: SeccompAction) -> Result<BpfProgram, String> {
    let filter = SeccompFilter::new(rules(kind), mismatch, SeccompAction::Allow, arch()).map_err(|e| e.to_string())?;
    filter.try_into().map_err(|e: seccompiler::BackendError| e.to_string())
}

/// The VMM is x86_64 only (see `x86_64`); the syscall numbers below are
/// that architecture's.
/// The second filter: opens the allowlist lets through only so that they
/// can fail softly get `EACCES`: every read-only open (glibc's malloc
/// opens `/proc/sys/vm/overcommit_memory` once per process when it first
/// shrinks a thread's arena, which may happen on any thread, and takes a
/// failed open as "no"). Write-only opens, which only the vCPU thread
/// may make (the console log), pass.
fn compile_refused_opens() -> Result<BpfProgram, String> {
    let mut rules = Rules::new();
    rules.insert(libc::SYS_openat, vec![rule(vec![accmode_is(libc::O_RDONLY)])]);
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EACCES as u32), arch())
        .map_err(|e| e.to_string())?;
    filter.try_into().map_err(|e: seccompiler::BackendError| e.to_string())
}

/// `openat`'s flags (argument 2) open for `accmode` (`O_RDONLY`,
/// `O_WRONLY` or `O_RDWR`).
fn accmode_is(accmode: libc::c_int) -> SeccompCondition {
    cond(2, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(libc::O_ACCMODE as u64), accmode as u64)
}

fn arch() -> TargetArch {
    TargetArch::x86_64
}

// --- ioctl requests (kernel include/uapi/linux/kvm.h, userfaultfd.h) ---

/// The KVM vCPU ioctl requests, as vmm-sys-util's macros compute them.
mod kvm_nr {
    #![allow(missing_docs)]
    use kvm_bindings::{
        kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msrs, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
        kvm_xsave,
    };
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

    const KVMIO: u32 = 0xAE;
    ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
    ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
    ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
    ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
    ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
    ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
    ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
    ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
    ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
    ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
    ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
}
use kvm_nr::*;

/// `UFFDIO_WAKE`: `_IOR(0xAA, 0x02, struct uffdio_range)`.
const UFFDIO_WAKE: u64 = 0x8010_aa02;
/// `UFFDIO_COPY`: `_IOWR(0xAA, 0x03, struct uffdio_copy)`.
const UFFDIO_COPY: u64 = 0xc028_aa03;
/// `UFFDIO_ZEROPAGE`: `_IOWR(0xAA, 0x04, struct uffdio_zeropage)`.
const UFFDIO_ZEROPAGE: u64 = 0xc020_aa04;
/// `FIONBIO` (asm-generic/ioctls.h): what Rust's `set_nonblocking` on a
/// socket uses.
const FIONBIO: u64 = 0x5421;
/// `FIONREAD` (asm-generic/ioctls.h): bytes waiting on a socket (the size
/// of a UDP datagram before it is read).
const FIONREAD: u64 = 0x541b;
/// `TIOCOUTQ` (also `SIOCOUTQ` on sockets, tcp(7)): bytes not yet sent or
/// acknowledged.
const TIOCOUTQ: u64 = 0x5411;

/// The vCPU ioctls a vCPU thread makes: `KVM_RUN`, and the state it saves
/// and restores while parked for a snapshot or a branch (`vcpu_state`),
/// and the registers it reads to describe a fault. `KVM_GET_XSAVE2` is
/// what kvm-ioctls may use for XSAVE on hosts with AMX.
fn vcpu_ioctls() -> [u64; 20] {
    [
        KVM_RUN(),
        KVM_GET_REGS(),
        KVM_SET_REGS(),
        KVM_GET_SREGS(),
        KVM_SET_SREGS(),
        KVM_GET_MSRS(),
        KVM_SET_MSRS(),
        KVM_GET_LAPIC(),
        KVM_SET_LAPIC(),
        KVM_GET_MP_STATE(),
        KVM_SET_MP_STATE(),
        KVM_GET_VCPU_EVENTS(),
        KVM_SET_VCPU_EVENTS(),
        KVM_GET_DEBUGREGS(),
        KVM_SET_DEBUGREGS(),
        KVM_GET_XSAVE(),
        KVM_SET_XSAVE(),
        KVM_GET_XCRS(),
        KVM_SET_XCRS(),
        KVM_GET_XSAVE2(),
    ]
}

// --- rule helpers ---

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, value: u64) -> SeccompCondition {
    // The arguments are constants below 6 and the operators valid, so
    // seccompiler cannot refuse them.
    SeccompCondition::new(arg, len, op, value).expect("a valid seccomp condition")
}

fn rule(conditions: Vec<SeccompCondition>) -> SeccompRule {
    SeccompRule::new(conditions).expect("a non-empty seccomp rule")
}

/// `ioctl(fd, request, ...)` with `request` (a 32-bit `unsigned int` in
/// the kernel) one of `requests`.
fn ioctl_rules(requests: &[u64]) -> Vec<SeccompRule> {
    requests.iter().map(|&r| rule(vec![cond(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, r)])).collect()
}

/// Argument `arg` without any of the bits in `bits`.
fn without_bits(arg: u8, bits: u64) -> Vec<SeccompRule> {
    vec![rule(vec![cond(arg, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(bits), 0)])]
}

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

fn allow(rules: &mut Rules, syscalls: &[libc::c_long]) {
    for &s in syscalls {
        rules.insert(s, Vec::new());
    }
}

/// What every VMM thread needs: the Rust runtime, the allocator, locks,
/// time, logging and its own end.
fn common() -> Rules {
    let mut r = Rules::new();
    // Read-only opens, only to fail with EACCES (the second filter, see
    // `compile_refused_opens`); the vCPU thread's rule replaces this.
    r.insert(libc::SYS_openat, vec![rule(vec![accmode_is(libc::O_RDONLY)])]);
    allow(
        &mut r,
        &[
            // Reading and writing fds the thread already has: eventfds
            // (irqfd, queue notifications, stop), logging to stderr.
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_writev,
            // Dropping fds (a connection, a cloned eventfd, a file).
            libc::SYS_close,
            // Mutexes, condition variables, thread joins, once-cells.
            libc::SYS_futex,
            // The allocator (glibc malloc: brk, mmap'd chunks and arenas,
            // trimming with madvise) and freeing of big buffers.
            libc::SYS_brk,
            libc::SYS_munmap,
            libc::SYS_mremap,
            libc::SYS_madvise,
            // Time: Instant/SystemTime (vDSO, but a syscall when the
            // clocksource is not vDSO-capable, as under nested KVM),
            // sleeps in retry loops.
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
            libc::SYS_sched_yield,
            // The kernel's restart of a call a signal interrupted (the
            // vCPU kick signal lands on these threads' sleeps too).
            libc::SYS_restart_syscall,
            // Signal handling: return from the kick handler; the masks
            // glibc sets around thread exit and abort; Rust's stack
            // overflow guard (alternate signal stack, set up and torn down
            // per thread).
            libc::SYS_rt_sigreturn,
            libc::SYS_rt_sigprocmask,
            libc::SYS_sigaltstack,
            // HashMap's random keys (once per thread).
            libc::SYS_getrandom,
            // Thread ids (logging, glibc's abort and pthread_kill).
            libc::SYS_gettid,
            libc::SYS_getpid,
            // A thread's end; exit_group for a process exit from a VMM
            // thread (abort falls back to it).
            libc::SYS_exit,
            libc::SYS_exit_group,
            // Rust's stack overflow guard reads the thread's stack bounds.
            libc::SYS_sched_getaffinity,
        ],
    );
    // The allocator's mappings and glibc's arena growth: never executable.
    r.insert(libc::SYS_mmap, without_bits(2, libc::PROT_EXEC as u64));
    r.insert(libc::SYS_mprotect, without_bits(2, libc::PROT_EXEC as u64));
    // abort() (a panic with panic=abort, a failed invariant) raises
    // SIGABRT on the calling thread; the vCPU kick is the other signal a
    // VMM thread may send (pausing or stopping the other vCPUs).
    r.insert(
        libc::SYS_tgkill,
        vec![
            rule(vec![cond(2, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::SIGABRT as u64)]),
            rule(vec![cond(2, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, crate::vcpu::kick_signal() as u64)]),
        ],
    );
    r
}

/// `kind`'s allowlist: [`common`] plus its own calls.
fn rules(kind: ThreadKind) -> Rules {
    let mut r = common();
    match kind {
        ThreadKind::Vcpu => {
            r.insert(libc::SYS_ioctl, ioctl_rules(&vcpu_ioctls()));
            allow(
                &mut r,
                &[
                    // Console log rotation (the serial port's output, on the
                    // vCPU that writes the UART): the log's size, renaming it
                    // to `.1`, seeking an appended file.
                    libc::SYS_fstat,
                    libc::SYS_newfstatat,
                    libc::SYS_statx,
                    libc::SYS_lseek,
                    libc::SYS_rename,
                    libc::SYS_renameat,
                    libc::SYS_renameat2,
                    libc::SYS_fsync,
                    libc::SYS_fdatasync,
                    // Device activation (a guest's virtio status write is
                    // handled on the vCPU that makes it): duplicating the
                    // queue eventfds, a muxer's epoll registrations and
                    // timer.
                    libc::SYS_fcntl,
                    libc::SYS_epoll_ctl,
                    libc::SYS_timerfd_settime,
                ],
            );
            // Re-opening the rotated console log: write-only opens; and
            // read-only opens, which the second filter turns into EACCES
            // (see `compile_refused_opens`). Read-write opens kill.
            r.insert(
                libc::SYS_openat,
                vec![rule(vec![accmode_is(libc::O_WRONLY)]), rule(vec![accmode_is(libc::O_RDONLY)])],
            );
        }
        ThreadKind::Devices => {
            // Sockets set non-blocking (Rust's set_nonblocking).
            r.insert(libc::SYS_ioctl, ioctl_rules(&[FIONBIO]));
            // virtio-blk DISCARD and WRITE_ZEROES: punching holes in the
            // disk's top layer, no other fallocate mode.
            r.insert(
                libc::SYS_fallocate,
                vec![rule(vec![cond(
                    1,
                    SeccompCmpArgLen::Dword,
                    SeccompCmpOp::Eq,
                    (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u64,
                )])],
            );
            // vsock: connections the guest opens to host port P go to the
            // Unix socket `<uds>_P`; no other address family.
            r.insert(
                libc::SYS_socket,
                vec![rule(vec![cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::AF_UNIX as u64)])],
            );
            allow(
                &mut r,
                &[
                    // The event loop and the vsock muxer's own epoll set.
                    libc::SYS_epoll_wait,
                    libc::SYS_epoll_pwait,
                    libc::SYS_epoll_ctl,
                    // vsock: host clients connecting, guest connections to
                    // host sockets, data both ways, half-close, errors.
                    libc::SYS_accept4,
                    libc::SYS_connect,
                    libc::SYS_recvfrom,
                    libc::SYS_sendto,
                    libc::SYS_recvmsg,
                    libc::SYS_sendmsg,
                    libc::SYS_shutdown,
                    libc::SYS_getsockopt,
                    libc::SYS_fcntl,
                    // vsock timeouts (a timerfd that ticks while needed).
                    libc::SYS_timerfd_settime,
                    libc::SYS_timerfd_gettime,
                    // virtio-blk: reads, writes and flushes of the image.
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_preadv,
                    libc::SYS_pwritev,
                    libc::SYS_fsync,
                    libc::SYS_fdatasync,
                    libc::SYS_lseek,
                    libc::SYS_fstat,
                    libc::SYS_statx,
                    libc::SYS_newfstatat,
                    // The vsock device, dropped on this thread when the VM
                    // ends, removes its listening socket's path.
                    libc::SYS_unlink,
                    libc::SYS_unlinkat,
                ],
            );
        }
        ThreadKind::Net => {
            // Sockets set non-blocking (Rust's set_nonblocking), the bytes
            // waiting on one, and the bytes not yet sent (the buffers'
            // report to the memory budget, netstack's `buffered_bytes`).
            r.insert(libc::SYS_ioctl, ioctl_rules(&[FIONBIO, FIONREAD, TIOCOUTQ]));
            // The secret broker's hand-over: a Unix stream pair takes the
            // host connection's place in the splice.
            r.insert(
                libc::SYS_socketpair,
                vec![rule(vec![cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::AF_UNIX as u64)])],
            );
            // The NAT's host side: TCP connections and UDP flows (DNS
            // forwarding included) to IPv4 and IPv6 hosts; no Unix sockets,
            // no netlink, no packet sockets.
            r.insert(
                libc::SYS_socket,
                vec![
                    rule(vec![cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::AF_INET as u64)]),
                    rule(vec![cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::AF_INET6 as u64)]),
                ],
            );
            allow(
                &mut r,
                &[
                    // The event loop's epoll set and the NAT's own (its
                    // sockets' interest changes with its buffers).
                    libc::SYS_epoll_wait,
                    libc::SYS_epoll_pwait,
                    libc::SYS_epoll_ctl,
                    // Host connections: non-blocking connect, its result
                    // (SO_ERROR), socket options (TCP_NODELAY, buffer sizes),
                    // a UDP flow's local port, addresses for the log.
                    libc::SYS_connect,
                    libc::SYS_bind,
                    libc::SYS_getsockopt,
                    libc::SYS_setsockopt,
                    libc::SYS_getsockname,
                    libc::SYS_getpeername,
                    // Data both ways (TCP and UDP), half-close.
                    libc::SYS_sendto,
                    libc::SYS_recvfrom,
                    libc::SYS_sendmsg,
                    libc::SYS_recvmsg,
                    libc::SYS_readv,
                    libc::SYS_shutdown,
                    // Sockets' flags (O_NONBLOCK through fcntl, as some
                    // socket libraries set it).
                    libc::SYS_fcntl,
                    // The NAT's timers (TCP retransmission, DNS timeouts): a
                    // timerfd in its epoll set.
                    libc::SYS_timerfd_settime,
                    libc::SYS_timerfd_gettime,
                ],
            );
        }
        ThreadKind::Uffd => {
            // Filling pages: copy from the buffer, zero pages, wake
            // threads waiting on a page another fill brought in.
            r.insert(libc::SYS_ioctl, ioctl_rules(&[UFFDIO_COPY, UFFDIO_ZEROPAGE, UFFDIO_WAKE]));
            // Rust's debug builds check that an fd is still open
            // (`fcntl(fd, F_GETFD)`) when they drop it (the thread's
            // userfaultfd and memory file at its end); nothing else.
            r.insert(
                libc::SYS_fcntl,
                vec![rule(vec![cond(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::F_GETFD as u64)])],
            );
            allow(
                &mut r,
                &[
                    // Waiting on the userfaultfd and the stop eventfd.
                    libc::SYS_poll,
                    libc::SYS_ppoll,
                    // Reading pages from the snapshot's memory file.
                    libc::SYS_pread64,
                ],
            );
        }
    }
    r
}

// --- trap mode's reporter ---

/// Installs (once) a `SIGSYS` handler that reports the blocked call.
fn install_sigsys_reporter() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: `sigsys_reporter` is async-signal-safe (it formats into a
        // stack buffer and calls write(2) only); the sigaction struct is
        // zero-initialized and then filled in before use.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = sigsys_reporter as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                tracing::warn!("cannot install the SIGSYS reporter: {}", std::io::Error::last_os_error());
            }
        }
    });
}

/// `siginfo_t` for `SIGSYS` (kernel `include/uapi/asm-generic/siginfo.h`,
/// `_sigsys`): after the three ints and padding, the call address, the
/// syscall number and the audit arch.
#[repr(C)]
struct SigsysInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    call_addr: usize,
    syscall: i32,
    arch: u32,
}

extern "C" fn sigsys_reporter(_: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // The blocked call returns what the handler leaves in RAX: -ENOSYS.
    // SAFETY: for an SA_SIGINFO handler the kernel passes the interrupted
    // context as a valid `ucontext_t`, restored on return.
    unsafe {
        (*(ctx as *mut libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::ENOSYS as i64);
    }
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers;
    // for SIGSYS its union holds `_sigsys`, laid out as `SigsysInfo`.
    let nr = unsafe { (*(info as *const SigsysInfo)).syscall };
    let mut buf = [0u8; 96];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        for &b in bytes {
            if len < buf.len() {
                buf[len] = b;
                len += 1;
            }
        }
    };
    put(b"seccomp (TINE_SECCOMP=trap): blocked syscall ");
    let mut digits = [0u8; 12];
    let mut n = i64::from(nr).unsigned_abs();
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    put(&digits[i..]);
    // Only calls the filter allows may be made here: the thread's kind
    // comes from a const-initialized thread-local, not from prctl.
    put(match FILTERED.try_with(Cell::get).unwrap_or(0) {
        1 => b" on a vCPU thread\n",
        2 => b" on a device thread\n",
        3 => b" on a userfaultfd thread\n",
        4 => b" on a net thread\n",
        _ => b" on an unfiltered thread\n",
    });
    // SAFETY: write(2) of a live buffer; async-signal-safe.
    unsafe { libc::write(2, buf.as_ptr().cast(), len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request numbers match the kernel's (values from `strace -X raw`
    /// and the uapi headers).
    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(KVM_RUN(), 0xae80);
        assert_eq!(KVM_GET_REGS(), 0x8090_ae81);
        assert_eq!(KVM_SET_REGS(), 0x4090_ae82);
        assert_eq!(KVM_GET_SREGS(), 0x8138_ae83);
        assert_eq!(KVM_GET_MSRS(), 0xc008_ae88);
        assert_eq!(KVM_GET_LAPIC(), 0x8400_ae8e);
        assert_eq!(KVM_GET_MP_STATE(), 0x8004_ae98);
        assert_eq!(KVM_GET_VCPU_EVENTS(), 0x8040_ae9f);
        assert_eq!(KVM_GET_DEBUGREGS(), 0x8080_aea1);
        assert_eq!(KVM_GET_XSAVE(), 0x9000_aea4);
        assert_eq!(KVM_GET_XCRS(), 0x8188_aea6);
    }

    #[test]
    fn every_filter_compiles() {
        for kind in ThreadKind::ALL {
            let p = compile(kind, SeccompAction::KillProcess).unwrap();
            assert!(!p.is_empty() && p.len() < 4096, "{kind:?}: {} instructions", p.len());
            assert!(allowlist_len(kind) > 20);
        }
        // The device thread may make sockets of one family only (a rule
        // with a condition), the others none; opens are conditional
        // everywhere; nobody runs programs or forks.
        assert_eq!(rules(ThreadKind::Devices)[&libc::SYS_socket].len(), 1);
        assert!(!rules(ThreadKind::Vcpu).contains_key(&libc::SYS_socket));
        assert!(!rules(ThreadKind::Uffd).contains_key(&libc::SYS_socket));
        // The net thread: sockets of the two IP families; no files, no
        // Unix sockets' accept, no listening.
        let net = rules(ThreadKind::Net);
        assert_eq!(net[&libc::SYS_socket].len(), 2);
        for s in [libc::SYS_pread64, libc::SYS_pwrite64, libc::SYS_unlink, libc::SYS_accept4, libc::SYS_listen] {
            assert!(!net.contains_key(&s), "the net thread allows syscall {s}");
        }
        for kind in ThreadKind::ALL {
            let r = rules(kind);
            assert!(!r[&libc::SYS_openat].is_empty() && !r[&libc::SYS_ioctl].is_empty(), "{kind:?}");
            for s in [libc::SYS_execve, libc::SYS_fork, libc::SYS_clone, libc::SYS_clone3, libc::SYS_ptrace] {
                assert!(!r.contains_key(&s), "{kind:?} allows syscall {s}");
            }
        }
    }
}
