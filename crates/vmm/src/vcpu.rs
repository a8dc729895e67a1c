//! vCPU threads: each runs `KVM_RUN` in a loop, dispatches port I/O to the
//! legacy devices and turns every exit that ends the VM into a
//! [`GuestStop`].

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use kvm_bindings::{kvm_run, KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::{LegacyDevices, PioEvent};
use crate::sync::{lock, wait, wait_timeout};
use crate::vcpu_state::{self, VcpuState, VcpuStateError};
use crate::x86_64::paging::{translate, PagingState};

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

thread_local! {
    /// The `kvm_run` structure of the vCPU this thread runs (null on other
    /// threads and once the vCPU's run loop has ended). Const-initialized
    /// and without a destructor, so reading it from a signal handler
    /// neither allocates nor can find it destroyed.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// The kick: runs on the vCPU thread the signal was sent to and sets its
/// `kvm_run.immediate_exit`, so a vCPU about to enter `KVM_RUN` returns
/// with `EINTR` at once instead of running the guest (a vCPU already
/// inside it leaves with `EINTR` because of the signal itself). The flag is
/// cleared after that `EINTR`. One signal per kick is thus enough: it
/// cannot land between the run loop's check of its flags and `KVM_RUN`
/// and be lost (see the kernel's `Documentation/virt/kvm/api.rst`,
/// `immediate_exit`).
extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.try_with(Cell::get).unwrap_or(std::ptr::null_mut());
    if !run.is_null() {
        // SAFETY: a non-null `KVM_RUN` is the mmap'ed `kvm_run` of the vCPU
        // owned by this very thread, set by its run loop and cleared (by
        // `KvmRunGuard`) before the vCPU fd and its mapping are dropped, so
        // the pointer is valid. The handler interrupts this thread only, and
        // the run loop touches `immediate_exit` only through this raw pointer
        // with volatile writes (`set_immediate_exit`), never through a
        // reference, so no `&mut` to the byte is live across the write. The
        // interrupted code may hold a reference into other fields of
        // `kvm_run` (an exit's data); writing one `u8` through a raw pointer
        // does not touch them. The write is volatile because KVM reads the
        // byte.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

/// Sets this thread's vCPU's `kvm_run.immediate_exit` to `value` through the
/// same raw pointer the kick handler writes through (a no-op on a thread
/// that runs no vCPU).
fn set_immediate_exit(value: u8) {
    let run = KVM_RUN.with(Cell::get);
    if !run.is_null() {
        // SAFETY: as in `kick_handler`: the pointer is this thread's live
        // `kvm_run` mapping, and the byte is only ever written through it.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(value) };
    }
}

/// Ends a vCPU's run loop, also on unwinding: clears the thread's
/// [`KVM_RUN`] pointer before the vCPU fd that owns the mapping is dropped,
/// then counts the vCPU as exited, so `pause` and `stop` never wait for a
/// vCPU whose thread panicked.
struct KvmRunGuard(Arc<VcpuShared>);

impl Drop for KvmRunGuard {
    fn drop(&mut self) {
        let _ = KVM_RUN.try_with(|r| r.set(std::ptr::null_mut()));
        let mut p = lock(&self.0.pause);
        p.exited += 1;
        self.0.pause_changed.notify_all();
    }
}

/// Installs the handler for [`kick_signal`] once per process, so the signal
/// interrupts `KVM_RUN` with `EINTR` (and sets `immediate_exit`) instead of
/// killing the process.
pub fn install_kick_handler() -> Result<(), vmm_sys_util::errno::Error> {
    // Every caller gets the outcome of the one attempt, not only the first.
    static INSTALLED: OnceLock<Result<(), vmm_sys_util::errno::Error>> = OnceLock::new();
    *INSTALLED.get_or_init(|| vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler))
}

/// Registers and instruction bytes at the point a guest failed.
#[derive(Clone, Debug, Default)]
pub struct FaultContext {
    /// The vCPU that failed.
    pub vcpu: u8,
    /// RIP (guest linear address, with CS base 0 in long mode).
    pub rip: u64,
    /// Up to 15 bytes read at RIP (fewer if RIP is not mapped).
    pub insn: Vec<u8>,
    /// Why the bytes could not be read, if they could not.
    pub insn_error: Option<String>,
    /// CR0, CR3, CR4 and EFER.
    pub paging: PagingState,
    /// RSP.
    pub rsp: u64,
}

impl std::fmt::Display for FaultContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vCPU {} RIP {:#x} RSP {:#x} instruction bytes [", self.vcpu, self.rip, self.rsp)?;
        for (i, b) in self.insn.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{b:02x}")?;
        }
        f.write_str("]")?;
        if let Some(e) = &self.insn_error {
            write!(f, " ({e})")?;
        }
        write!(
            f,
            " CR0 {:#x} CR3 {:#x} CR4 {:#x} EFER {:#x}",
            self.paging.cr0, self.paging.cr3, self.paging.cr4, self.paging.efer
        )
    }
}

/// Why a vCPU stopped the VM.
#[derive(Debug)]
pub enum GuestStop {
    /// The guest powered off (power-off port or KVM system event).
    PowerOff,
    /// The guest reset itself (i8042 reset or KVM system event).
    Reset,
    /// The VMM asked the vCPUs to stop.
    Requested,
    /// The guest failed; see [`GuestFault`].
    Fault(GuestFault),
}

/// A guest failure that ends the VM.
#[derive(Debug, thiserror::Error)]
pub enum GuestFault {
    /// `KVM_EXIT_SHUTDOWN`: the vCPU triple-faulted.
    #[error("guest triple fault (KVM_EXIT_SHUTDOWN): {0}")]
    TripleFault(FaultContext),
    /// `KVM_EXIT_INTERNAL_ERROR`.
    #[error("KVM internal error, suberror {suberror} ({}): {ctx}", internal_error_name(*.suberror))]
    Internal {
        /// `kvm_run.internal.suberror`.
        suberror: u32,
        /// `kvm_run.internal.data[..ndata]`.
        data: Vec<u64>,
        /// Where.
        ctx: FaultContext,
    },
    /// `KVM_EXIT_FAIL_ENTRY`.
    #[error("KVM entry failed, hardware reason {reason:#x}: {ctx}")]
    FailEntry {
        /// `hardware_entry_failure_reason`.
        reason: u64,
        /// Where.
        ctx: FaultContext,
    },
    /// `KVM_SYSTEM_EVENT_CRASH`.
    #[error("guest reported a crash (KVM_SYSTEM_EVENT_CRASH): {0}")]
    Crash(FaultContext),
    /// An exit this VMM does not handle.
    #[error("unhandled KVM exit {exit}: {ctx}")]
    UnhandledExit {
        /// The exit, as kvm-ioctls names it.
        exit: String,
        /// Where.
        ctx: FaultContext,
    },
    /// `KVM_RUN` itself failed.
    #[error("KVM_RUN failed on vCPU {vcpu}: {source}")]
    Run {
        /// The vCPU.
        vcpu: u8,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// The name of a `KVM_INTERNAL_ERROR_*` suberror.
pub fn internal_error_name(suberror: u32) -> &'static str {
    match suberror {
        kvm_bindings::KVM_INTERNAL_ERROR_EMULATION => "emulation failure",
        kvm_bindings::KVM_INTERNAL_ERROR_SIMUL_EX => "exception while delivering an exception",
        kvm_bindings::KVM_INTERNAL_ERROR_DELIVERY_EV => "event delivery failed",
        kvm_bindings::KVM_INTERNAL_ERROR_UNEXPECTED_EXIT_REASON => "unexpected exit reason",
        _ => "unknown",
    }
}

/// State shared by the vCPUs of one VM.
pub struct VcpuShared {
    /// Set when the VM must stop; vCPUs check it after every exit.
    pub stop: AtomicBool,
    /// The first reason any vCPU stopped for.
    pub outcome: Mutex<Option<GuestStop>>,
    /// Signalled when `stop` is set.
    pub stopped: Condvar,
    /// The port I/O devices.
    pub devices: Mutex<LegacyDevices>,
    /// The virtio-mmio devices: `(base GPA, window size, transport)`.
    pub mmio: Vec<(u64, u64, Arc<Mutex<MmioTransport>>)>,
    /// Guest memory, for reading instruction bytes.
    pub memory: GuestMemoryMmap,
    /// Where each vCPU was when it left its run loop (index = vCPU).
    pub final_rips: Mutex<Vec<Option<u64>>>,
    /// Pause requests and how many vCPUs are parked.
    pub pause: Mutex<PauseState>,
    /// Signalled when `pause` changes or the VM stops.
    pub pause_changed: Condvar,
    /// The MSRs KVM lists (`KVM_GET_MSR_INDEX_LIST`), saved with each vCPU.
    pub msr_indices: Vec<u32>,
}

/// Pause bookkeeping: while `requested`, vCPUs park between exits from
/// `KVM_RUN` (so none is inside it) until it is cleared or the VM stops.
/// Parked vCPUs also do the [`VcpuWork`] left for them, on their own
/// thread, and put the answer in `done`.
#[derive(Debug, Default)]
pub struct PauseState {
    /// A pause is asked for.
    pub requested: bool,
    /// vCPUs parked now.
    pub parked: usize,
    /// vCPUs whose run loop has ended (signalled on `pause_changed`).
    pub exited: usize,
    /// Work for each parked vCPU, by index.
    pub work: Vec<Option<VcpuWork>>,
    /// Each vCPU's answer to its last work, by index.
    pub done: Vec<Option<Result<Option<VcpuState>, VcpuStateError>>>,
}

impl PauseState {
    /// No pause, for `vcpus` vCPUs.
    pub fn new(vcpus: usize) -> Self {
        PauseState {
            requested: false,
            parked: 0,
            exited: 0,
            work: (0..vcpus).map(|_| None).collect(),
            done: (0..vcpus).map(|_| None).collect(),
        }
    }
}

/// What a parked vCPU can be asked to do.
#[derive(Debug)]
pub enum VcpuWork {
    /// Save its state (answer: `Some(state)`).
    Save,
    /// Load this state (answer: `None`).
    Restore(Arc<VcpuState>),
}

impl VcpuShared {
    /// Records `why` unless a reason was recorded already, and asks every
    /// vCPU to stop.
    pub fn finish(&self, why: GuestStop) {
        let mut o = lock(&self.outcome);
        if o.is_none() {
            *o = Some(why);
        }
        self.stop.store(true, Ordering::SeqCst);
        drop(o);
        self.stopped.notify_all();
        // Parked vCPUs wake up and leave their run loops.
        let _p = lock(&self.pause);
        self.pause_changed.notify_all();
    }

    /// The virtio-mmio device whose window holds `addr`, with its base.
    pub fn mmio_device(&self, addr: u64) -> Option<(u64, &Arc<Mutex<MmioTransport>>)> {
        self.mmio.iter().find(|(base, len, _)| addr >= *base && addr - *base < *len).map(|(base, _, dev)| (*base, dev))
    }

    /// Blocks until `stop` is set or `deadline` passes; returns whether
    /// the VM stopped.
    pub fn wait_stopped(&self, deadline: Option<Instant>) -> bool {
        let mut o = lock(&self.outcome);
        while !self.stop.load(Ordering::SeqCst) {
            match deadline {
                None => o = wait(&self.stopped, o),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return false;
                    }
                    o = wait_timeout(&self.stopped, o, d - now);
                }
            }
        }
        true
    }
}

enum Next {
    Continue,
    Stop(GuestStop),
    Fault(fn(FaultContext) -> GuestFault),
    Internal,
    FailEntry(u64),
    Unhandled(String),
}

/// One vCPU and its run loop.
pub struct Vcpu {
    /// The KVM vCPU.
    pub fd: VcpuFd,
    /// Its index (and APIC ID).
    pub index: u8,
    /// What it shares with the other vCPUs.
    pub shared: Arc<VcpuShared>,
}

impl Vcpu {
    /// Parks this vCPU's thread while a pause is requested, doing the work
    /// left for it meanwhile.
    fn park_while_paused(&self) {
        let shared = &self.shared;

        let mut p = lock(&shared.pause);
        if !p.requested {
            return;
        }
        let i = usize::from(self.index);
        p.parked += 1;
        shared.pause_changed.notify_all();
        while p.requested && !shared.stop.load(Ordering::SeqCst) {
            if let Some(work) = p.work.get_mut(i).and_then(Option::take) {
                drop(p);
                let answer = match work {
                    VcpuWork::Save => vcpu_state::save(&self.fd, self.index, &shared.msr_indices).map(Some),
                    VcpuWork::Restore(state) => vcpu_state::restore(&self.fd, &state).map(|()| None),
                };
                p = lock(&shared.pause);
                if let Some(slot) = p.done.get_mut(i) {
                    *slot = Some(answer);
                }
                shared.pause_changed.notify_all();
                continue;
            }
            p = wait(&shared.pause_changed, p);
        }
        p.parked -= 1;
        shared.pause_changed.notify_all();
    }

    fn fault_context(&self) -> FaultContext {
        let mut ctx = FaultContext { vcpu: self.index, ..Default::default() };
        match (self.fd.get_regs(), self.fd.get_sregs()) {
            (Ok(regs), Ok(sregs)) => {
                ctx.rip = regs.rip;
                ctx.rsp = regs.rsp;
                ctx.paging = PagingState { cr0: sregs.cr0, cr3: sregs.cr3, cr4: sregs.cr4, efer: sregs.efer };
                let linear = sregs.cs.base.wrapping_add(regs.rip);
                let mem = &self.shared.memory;
                let mut read = 0;
                while read < 15 {
                    let gpa = match translate(mem, &ctx.paging, linear.wrapping_add(read as u64)) {
                        Ok(g) => g,
                        Err(e) => {
                            ctx.insn_error = Some(e.to_string());
                            break;
                        }
                    };
                    match mem.read_obj::<u8>(GuestAddress(gpa)) {
                        Ok(b) => ctx.insn.push(b),
                        Err(e) => {
                            ctx.insn_error = Some(format!("GPA {gpa:#x}: {e}"));
                            break;
                        }
                    }
                    read += 1;
                }
            }
            (Err(e), _) | (_, Err(e)) => ctx.insn_error = Some(format!("cannot read registers: {e}")),
        }
        ctx
    }

    /// Runs the vCPU until the VM stops. Never panics on guest behaviour:
    /// every exit either continues or records a [`GuestStop`].
    pub fn run(mut self) {
        KVM_RUN.with(|r| r.set(self.fd.get_kvm_run()));
        let kvm_run_guard = KvmRunGuard(self.shared.clone());
        // Whether the last exit was port I/O or MMIO. KVM completes such an
        // instruction (advances RIP; for a read, loads the value) only when
        // `KVM_RUN` is entered again, so a vCPU parked right after one would
        // be saved halfway through it and every VM restored from that state
        // would do the access twice. So the vCPU re-enters `KVM_RUN` first:
        // if a pause is pending, the kick has set `immediate_exit`, and KVM
        // completes the access and returns `EINTR` without running the guest
        // further (kernel `Documentation/virt/kvm/api.rst`, `KVM_EXIT_IO`'s
        // note, and `immediate_exit`). (A kick that comes once the vCPU is
        // in the guest again interrupts it as usual.)
        let mut io_pending = false;
        while !self.shared.stop.load(Ordering::SeqCst) {
            if !io_pending {
                self.park_while_paused();
            }
            if self.shared.stop.load(Ordering::SeqCst) {
                break;
            }
            let exit = self.fd.run();
            io_pending = matches!(
                exit,
                Ok(VcpuExit::IoIn(..) | VcpuExit::IoOut(..) | VcpuExit::MmioRead(..) | VcpuExit::MmioWrite(..))
            );
            let next = match exit {
                Ok(VcpuExit::IoIn(port, data)) => {
                    lock(&self.shared.devices).pio_read(port, data);
                    Next::Continue
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    let ev = lock(&self.shared.devices).pio_write(port, data);
                    match ev {
                        Some(PioEvent::PowerOff) => Next::Stop(GuestStop::PowerOff),
                        Some(PioEvent::Reset) => Next::Stop(GuestStop::Reset),
                        None => Next::Continue,
                    }
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    match self.shared.mmio_device(addr) {
                        Some((base, dev)) => lock(dev).read(addr - base, data),
                        None => {
                            tracing::debug!(
                                vcpu = self.index,
                                "MMIO read of {} bytes at unmapped GPA {addr:#x}",
                                data.len()
                            );
                            data.fill(0xff);
                        }
                    }
                    Next::Continue
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    match self.shared.mmio_device(addr) {
                        Some((base, dev)) => lock(dev).write(addr - base, data),
                        None => tracing::debug!(
                            vcpu = self.index,
                            "MMIO write of {} bytes to unmapped GPA {addr:#x}",
                            data.len()
                        ),
                    }
                    Next::Continue
                }
                Ok(VcpuExit::Shutdown) => Next::Fault(GuestFault::TripleFault),
                Ok(VcpuExit::InternalError) => Next::Internal,
                Ok(VcpuExit::FailEntry(reason, _cpu)) => Next::FailEntry(reason),
                Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                    KVM_SYSTEM_EVENT_SHUTDOWN => Next::Stop(GuestStop::PowerOff),
                    KVM_SYSTEM_EVENT_RESET => Next::Stop(GuestStop::Reset),
                    KVM_SYSTEM_EVENT_CRASH => Next::Fault(GuestFault::Crash),
                    other => Next::Unhandled(format!("SystemEvent({other})")),
                },
                // A halted vCPU with an in-kernel LAPIC never exits here;
                // without one, `hlt` with nothing to wake it is a stop.
                Ok(VcpuExit::Hlt) => Next::Stop(GuestStop::PowerOff),
                Ok(VcpuExit::Intr) => Next::Continue,
                Ok(other) => Next::Unhandled(format!("{other:?}")),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    // A kick: clear `immediate_exit` (set by `kick_handler`)
                    // so the next `KVM_RUN` runs the guest again.
                    set_immediate_exit(0);
                    Next::Continue
                }
                Err(source) => Next::Stop(GuestStop::Fault(GuestFault::Run { vcpu: self.index, source })),
            };
            match next {
                Next::Continue => {}
                Next::Stop(why) => self.shared.finish(why),
                Next::Fault(make) => {
                    let ctx = self.fault_context();
                    self.shared.finish(GuestStop::Fault(make(ctx)));
                }
                Next::Internal => {
                    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so
                    // `internal` is the union member KVM filled in.
                    let internal = unsafe { self.fd.get_kvm_run().__bindgen_anon_1.internal };
                    let n = (internal.ndata as usize).min(internal.data.len());
                    let data = internal.data[..n].to_vec();
                    let ctx = self.fault_context();
                    self.shared.finish(GuestStop::Fault(GuestFault::Internal {
                        suberror: internal.suberror,
                        data,
                        ctx,
                    }));
                }
                Next::FailEntry(reason) => {
                    let ctx = self.fault_context();
                    self.shared.finish(GuestStop::Fault(GuestFault::FailEntry { reason, ctx }));
                }
                Next::Unhandled(exit) => {
                    let ctx = self.fault_context();
                    self.shared.finish(GuestStop::Fault(GuestFault::UnhandledExit { exit, ctx }));
                }
            }
        }
        if let Ok(regs) = self.fd.get_regs() {
            let mut rips = lock(&self.shared.final_rips);
            if let Some(slot) = rips.get_mut(self.index as usize) {
                *slot = Some(regs.rip);
            }
        }
        drop(kvm_run_guard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_context_renders_bytes() {
        let ctx = FaultContext { vcpu: 1, rip: 0x1000, insn: vec![0x0f, 0x0b], ..Default::default() };
        let s = ctx.to_string();
        assert!(s.contains("vCPU 1 RIP 0x1000"), "{s}");
        assert!(s.contains("[0f 0b]"), "{s}");
        assert_eq!(internal_error_name(1), "emulation failure");
    }
}
