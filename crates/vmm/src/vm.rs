//! A microVM: KVM VM and vCPUs, guest memory, kernel, legacy devices;
//! started with [`Vm::start`], ended by the guest or by [`RunningVm::stop`].

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, Kvm, VmFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::Killable;

use crate::branch::{BranchMode, BranchReport, WriteProtection};
use crate::devices::virtio::block::{Block, BlockError};
use crate::devices::virtio::mmio::{reg, MmioTransport, TransportArgs, MMIO_WINDOW};
use crate::devices::virtio::vsock::muxer::MuxerError;
use crate::devices::virtio::vsock::{Vsock, MIN_GUEST_CID};
use crate::devices::virtio::{Interrupt, VirtioDevice, VirtioError};
use crate::devices::{self, Console, ConsoleTail, LegacyDevices, Persist};
use crate::event_loop::{EventLoop, EventLoopError};
use crate::host::HostProfile;
use crate::memory::{GuestRam, MemoryBacking, MemoryError, PageCopier, MMIO_GAP_START};
use crate::snapshot::{file_crc32, CpuidLeaf, Snapshot, SnapshotError, SnapshotMemory, MEMORY_FILE};
use crate::vcpu::{install_kick_handler, kick_signal, GuestFault, GuestStop, PauseState, Vcpu, VcpuShared, VcpuWork};
use crate::vcpu_state::{VcpuState, VcpuStateError};
use crate::x86_64::boot::{load_kernel, BootError};
use crate::x86_64::cpuid::{filter_cpuid, VcpuTopology};
use crate::x86_64::mptable::{self, MptableError, MAX_VCPUS};
use crate::x86_64::regs::{self, RegsError};
use crate::x86_64::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS};

/// The command line every guest gets before the profile's and the user's:
/// serial console, reset through the i8042 (`reboot=k`), reboot at once on
/// panic (the VMM sees the reset and reports the panic from the console),
/// and the power-off port.
pub fn base_cmdline() -> String {
    format!("console=ttyS0 reboot=k panic=-1 tine_poweroff={:#x}", devices::POWER_OFF_PORT)
}

/// First GSI given to virtio-mmio devices (below: legacy ISA lines).
pub const VIRTIO_FIRST_IRQ: u32 = 5;
/// Most virtio-mmio devices per VM (GSIs 5..=23 of the IOAPIC).
pub const MAX_VIRTIO_DEVICES: usize = 19;

/// A disk: a raw image attached as virtio-blk.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// The image file.
    pub path: PathBuf,
    /// Attach read-only (shared images must be).
    pub read_only: bool,
    /// Serial the guest reads with GET_ID (at most 20 bytes are used).
    pub id: String,
}

/// A virtio-vsock device: the guest's CID and the host's Unix socket.
#[derive(Clone, Debug)]
pub struct VsockConfig {
    /// The guest's context ID (3 or more).
    pub cid: u64,
    /// The Unix socket host clients connect to (`CONNECT <port>\n`);
    /// guest connections to host port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
}

/// What a VM is made of.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// A name for logs and the memfd.
    pub name: String,
    /// The kernel: ELF vmlinux or bzImage.
    pub kernel: PathBuf,
    /// An optional initramfs (uncompressed cpio).
    pub initrd: Option<PathBuf>,
    /// Extra kernel command line, after [`base_cmdline`] and the host
    /// profile's parameters.
    pub cmdline: String,
    /// Guest RAM in MiB.
    pub mem_mib: u64,
    /// vCPUs, 1..=[`MAX_VCPUS`].
    pub vcpus: u8,
    /// Where the serial console is logged.
    pub console_log: Option<PathBuf>,
    /// Also copy the console to this process's stdout.
    pub console_stdout: bool,
    /// The host profile (see [`HostProfile::detect`]).
    pub profile: HostProfile,
    /// Disks, in order: the first is `/dev/vda` in the guest.
    pub disks: Vec<DiskConfig>,
    /// An optional vsock device.
    pub vsock: Option<VsockConfig>,
}

impl VmConfig {
    /// A configuration with 1 vCPU, 256 MiB, no initramfs, no log, and the
    /// detected host profile.
    pub fn new(name: impl Into<String>, kernel: impl Into<PathBuf>) -> Self {
        VmConfig {
            name: name.into(),
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            mem_mib: 256,
            vcpus: 1,
            console_log: None,
            console_stdout: false,
            profile: HostProfile::detect(),
            disks: Vec::new(),
            vsock: None,
        }
    }

    /// The full guest command line.
    pub fn full_cmdline(&self) -> String {
        [base_cmdline().as_str(), self.profile.guest_cmdline(), self.cmdline.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Errors of VM set-up and of a guest's end.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The configuration is invalid.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// /dev/kvm cannot be opened.
    #[error("cannot open /dev/kvm ({0}); is KVM available and are you in the kvm group (or root)?")]
    Kvm(#[source] kvm_ioctls::Error),
    /// A KVM set-up ioctl failed.
    #[error("{what} failed: {source}")]
    KvmSetup {
        /// The ioctl.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// Guest memory set-up failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Kernel loading failed.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// The MP table cannot be written.
    #[error(transparent)]
    Mptable(#[from] MptableError),
    /// vCPU register set-up failed.
    #[error("vCPU {vcpu}: {source}")]
    Regs {
        /// The vCPU.
        vcpu: u8,
        /// What failed.
        source: RegsError,
    },
    /// A device could not be created.
    #[error(transparent)]
    Device(#[from] devices::DeviceError),
    /// A disk could not be opened.
    #[error(transparent)]
    Disk(#[from] BlockError),
    /// The vsock device could not be set up.
    #[error(transparent)]
    Vsock(#[from] MuxerError),
    /// A virtio device could not be set up.
    #[error(transparent)]
    Virtio(#[from] VirtioError),
    /// The device event loop could not start.
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    /// A vCPU thread could not be started.
    #[error("cannot start a vCPU thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The vCPUs did not all leave `KVM_RUN` in time for a pause.
    #[error("the vCPUs did not stop within {0:?} for a pause")]
    PauseTimeout(Duration),
    /// The VM has stopped.
    #[error("the VM has stopped")]
    Stopped,
    /// The operation needs a paused VM.
    #[error("the VM must be paused first")]
    NotPaused,
    /// Saving or restoring a vCPU failed.
    #[error(transparent)]
    VcpuState(#[from] VcpuStateError),
    /// Saving or restoring the VM-wide state failed.
    #[error(transparent)]
    VmState(#[from] crate::vm_state::VmStateError),
    /// A snapshot could not be written, read, or does not fit this host.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// A device's saved state does not fit it.
    #[error(transparent)]
    Restore(#[from] crate::devices::virtio::mmio::RestoreError),
    /// The guest failed; the console tail is attached.
    #[error("{fault}\nlast console lines:\n{console}")]
    Guest {
        /// What KVM reported (boxed: it carries instruction bytes).
        fault: Box<GuestFault>,
        /// The last console lines.
        console: String,
    },
    /// The guest kernel panicked (seen on the console before its reset).
    #[error("guest kernel panic: {line}\nlast console lines:\n{console}")]
    GuestPanic {
        /// The panic line.
        line: String,
        /// The last console lines.
        console: String,
    },
}

fn setup(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::KvmSetup { what, source }
}

/// How a VM ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest powered off.
    PowerOff,
    /// The guest reset itself (a microVM does not reboot; the VM ends).
    Reset,
    /// [`RunningVm::stop`] ended it.
    Stopped,
}

/// Lines of console kept in error reports.
const CONSOLE_LINES_IN_ERRORS: usize = 30;

/// A microVM being built.
pub struct Vm;

impl Vm {
    /// Creates the VM, loads the kernel and starts every vCPU thread.
    ///
    /// Errors: any [`VmError`] set-up variant; nothing is left running on error.
    pub fn start(config: &VmConfig) -> Result<RunningVm, VmError> {
        Self::launch(config, None)
    }

    /// Starts a VM from `snapshot` instead of booting: guest RAM is the
    /// snapshot's memory file mapped copy-on-write, devices go on from their
    /// saved virtqueue state (vsock connections are reset and the guest is
    /// told with `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`), vCPUs and the VM's
    /// interrupt controllers, PIT and clock from their saved state.
    /// `config` gives the name, the console, the disks and the vsock socket
    /// of the new VM; its vCPU count and memory size must match the
    /// snapshot's. The kernel is not loaded.
    ///
    /// Errors: as [`Vm::start`], plus [`VmError::Config`] for a snapshot
    /// that does not fit the configuration and [`VmError::Restore`].
    pub fn restore(config: &VmConfig, snapshot: &Snapshot, backing: MemoryBacking) -> Result<RunningVm, VmError> {
        Self::launch(config, Some((snapshot, backing)))
    }

    fn launch(config: &VmConfig, snap: Option<(&Snapshot, MemoryBacking)>) -> Result<RunningVm, VmError> {
        if config.vcpus == 0 || config.vcpus > MAX_VCPUS {
            return Err(VmError::Config(format!("vcpus must be 1..={MAX_VCPUS}, got {}", config.vcpus)));
        }
        let started = Instant::now();
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let vm = kvm.create_vm().map_err(setup("KVM_CREATE_VM"))?;
        vm.set_tss_address(KVM_TSS_ADDRESS as usize).map_err(setup("KVM_SET_TSS_ADDR"))?;
        vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS).map_err(setup("KVM_SET_IDENTITY_MAP_ADDR"))?;
        vm.create_irq_chip().map_err(setup("KVM_CREATE_IRQCHIP"))?;
        vm.create_pit2(kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() })
            .map_err(setup("KVM_CREATE_PIT2"))?;

        let mem_bytes =
            config.mem_mib.checked_mul(1 << 20).ok_or_else(|| VmError::Config("mem_mib overflows".into()))?;
        let ram = match snap {
            None => GuestRam::new(&config.name, mem_bytes)?,
            Some((sn, backing)) => {
                if sn.mem_bytes != mem_bytes || sn.vcpus.len() != usize::from(config.vcpus) {
                    return Err(VmError::Config(format!(
                        "the snapshot has {} vCPUs and {} MiB; the configuration asks for {} and {} MiB",
                        sn.vcpus.len(),
                        sn.mem_bytes >> 20,
                        config.vcpus,
                        config.mem_mib
                    )));
                }
                GuestRam::from_snapshot(&config.name, &sn.memory, mem_bytes, backing)?
            }
        };
        ram.register(&vm)?;

        let ndev = config.disks.len() + usize::from(config.vsock.is_some());
        if ndev > MAX_VIRTIO_DEVICES {
            return Err(VmError::Config(format!("at most {MAX_VIRTIO_DEVICES} virtio devices, got {ndev}")));
        }
        let mut virtio: Vec<Box<dyn VirtioDevice>> = Vec::new();
        for d in &config.disks {
            virtio.push(Box::new(Block::open(&d.path, d.read_only, &d.id)?));
        }
        if let Some(v) = &config.vsock {
            if v.cid < MIN_GUEST_CID || v.cid > u64::from(u32::MAX) {
                return Err(VmError::Config(format!(
                    "vsock CID {} is reserved or too large: use 3..=4294967295",
                    v.cid
                )));
            }
            virtio.push(Box::new(Vsock::new(v.cid, &v.uds_path)?));
        }
        let mut cmdline = config.full_cmdline();
        let mut mmio = Vec::new();
        for (i, dev) in virtio.into_iter().enumerate() {
            let base = MMIO_GAP_START + i as u64 * MMIO_WINDOW;
            let irq = VIRTIO_FIRST_IRQ + i as u32;
            let irqfd =
                EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmError::Device(devices::DeviceError::EventFd(e)))?;
            vm.register_irqfd(&irqfd, irq).map_err(setup("KVM_IRQFD"))?;
            let interrupt = Arc::new(Interrupt::new(irqfd));
            let transport = match snap {
                None => MmioTransport::new(dev, ram.memory.clone(), interrupt)?,
                Some((sn, _)) => {
                    let state = sn.transports.get(i).ok_or_else(|| {
                        VmError::Config(format!(
                            "the snapshot has {} virtio devices, fewer than configured",
                            sn.transports.len()
                        ))
                    })?;
                    MmioTransport::restore(TransportArgs { device: dev, mem: ram.memory.clone(), interrupt }, state)?
                }
            };
            for (q, evt) in transport.queue_evts().iter().enumerate() {
                vm.register_ioevent(evt, &IoEventAddress::Mmio(base + reg::QUEUE_NOTIFY), q as u32)
                    .map_err(setup("KVM_IOEVENTFD"))?;
            }
            cmdline.push_str(&format!(" virtio_mmio.device=4K@{base:#x}:{irq}"));
            mmio.push((base, MMIO_WINDOW, Arc::new(Mutex::new(transport))));
        }
        let entry = match snap {
            None => {
                let kernel = load_kernel(&ram.memory, ram.size, &config.kernel, config.initrd.as_deref(), &cmdline)?;
                mptable::write(&ram.memory, config.vcpus)?;
                Some(kernel.entry)
            }
            Some((sn, _)) => {
                if sn.transports.len() != mmio.len() {
                    return Err(VmError::Config(format!(
                        "the snapshot has {} virtio devices, the configuration {}",
                        sn.transports.len(),
                        mmio.len()
                    )));
                }
                crate::vm_state::restore(&vm, &sn.vm)?;
                None
            }
        };

        let serial_irq =
            EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmError::Device(devices::DeviceError::EventFd(e)))?;
        vm.register_irqfd(&serial_irq, devices::COM1_IRQ).map_err(setup("KVM_IRQFD"))?;
        let console = Console::new(config.console_log.as_deref(), config.console_stdout)?;
        let devices = match snap {
            None => LegacyDevices::new(serial_irq, console),
            Some((sn, _)) => LegacyDevices::restore(devices::SerialArgs { irq: serial_irq, console }, &sn.legacy)?,
        };
        let console_tail = devices.console_tail();

        let shared = Arc::new(VcpuShared {
            stop: Default::default(),
            outcome: Mutex::new(None),
            stopped: Default::default(),
            devices: Mutex::new(devices),
            mmio: mmio.clone(),
            memory: ram.memory.clone(),
            final_rips: Mutex::new(vec![None; config.vcpus as usize]),
            pause: Mutex::new(PauseState::new(usize::from(config.vcpus))),
            pause_changed: Default::default(),
            msr_indices: kvm.get_msr_index_list().map_err(setup("KVM_GET_MSR_INDEX_LIST"))?.as_slice().to_vec(),
        });

        let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(setup("KVM_GET_SUPPORTED_CPUID"))?;
        let mut vcpus = Vec::with_capacity(config.vcpus as usize);
        let mut cpuids = Vec::with_capacity(config.vcpus as usize);
        for index in 0..config.vcpus {
            let fd = vm.create_vcpu(u64::from(index)).map_err(setup("KVM_CREATE_VCPU"))?;
            let mut cpuid = supported.clone();
            filter_cpuid(cpuid.as_mut_slice(), VcpuTopology { index, count: config.vcpus }, config.profile);
            if let Some((sn, _)) = snap {
                sn.check_cpuid(usize::from(index), cpuid.as_slice())?;
            }
            fd.set_cpuid2(&cpuid).map_err(setup("KVM_SET_CPUID2"))?;
            cpuids.push(cpuid.as_slice().iter().map(CpuidLeaf::from).collect());
            let regs_err = |source| VmError::Regs { vcpu: index, source };
            match (snap, entry) {
                (Some((sn, _)), _) => crate::vcpu_state::restore(&fd, &sn.vcpus[usize::from(index)])?,
                (None, entry) => {
                    regs::setup_msrs(&fd).map_err(regs_err)?;
                    regs::setup_fpu(&fd).map_err(regs_err)?;
                    regs::setup_lapic(&fd).map_err(regs_err)?;
                    if let (0, Some(entry)) = (index, entry) {
                        fd.set_regs(&regs::boot_regs(entry)).map_err(setup("KVM_SET_REGS"))?;
                        regs::setup_sregs(&ram.memory, &fd).map_err(regs_err)?;
                    }
                }
            }
            vcpus.push(Vcpu { fd, index, shared: shared.clone() });
        }

        if snap.is_some() {
            // The transports raised their interrupts while being restored,
            // before the IOAPIC and the LAPICs got their saved state back,
            // which can drop them (seen: a guest that never looked at the
            // vsock event queue until other traffic arrived). Again, now.
            for (_, _, t) in &mmio {
                t.lock().unwrap_or_else(|e| e.into_inner()).reassert_interrupt();
            }
        }
        let event_loop = EventLoop::spawn(&config.name, mmio.into_iter().map(|(_, _, d)| d).collect())?;
        install_kick_handler().map_err(|e| VmError::Thread(std::io::Error::from_raw_os_error(e.errno())))?;
        let mut threads = Vec::with_capacity(vcpus.len());
        for vcpu in vcpus {
            let name = format!("vcpu{}-{}", vcpu.index, config.name);
            match std::thread::Builder::new().name(name).spawn(move || vcpu.run()) {
                Ok(t) => threads.push(t),
                Err(e) => {
                    let mut running = RunningVm {
                        vm,
                        _ram: ram,
                        shared,
                        threads,
                        console_tail,
                        started,
                        cpuid: cpuids,
                        name: config.name.clone(),
                        _event_loop: event_loop,
                    };
                    let _ = running.stop();
                    return Err(VmError::Thread(e));
                }
            }
        }
        tracing::info!(name = %config.name, vcpus = config.vcpus, mem_mib = config.mem_mib, profile = %config.profile,
            "VM started in {:?}", started.elapsed());
        Ok(RunningVm {
            vm,
            _ram: ram,
            shared,
            threads,
            console_tail,
            started,
            cpuid: cpuids,
            name: config.name.clone(),
            _event_loop: event_loop,
        })
    }
}

/// Waits for a VM's end from any thread (see [`RunningVm::exit_watcher`]).
#[derive(Clone)]
pub struct ExitWatcher(Arc<VcpuShared>);

impl ExitWatcher {
    /// Blocks until the VM stops (guest power-off, reset, fault, or a
    /// stop request), or until `timeout` passes; true if it stopped.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        self.0.wait_stopped(timeout.map(|t| Instant::now() + t))
    }

    /// Whether the VM has stopped.
    pub fn is_stopped(&self) -> bool {
        self.0.stop.load(Ordering::SeqCst)
    }
}

/// A started VM. Dropping it stops it.
pub struct RunningVm {
    vm: VmFd,
    _ram: GuestRam,
    shared: Arc<VcpuShared>,
    threads: Vec<JoinHandle<()>>,
    console_tail: ConsoleTail,
    started: Instant,
    /// The CPUID each vCPU was given (kept for snapshots).
    cpuid: Vec<Vec<CpuidLeaf>>,
    /// The VM's name (logs, thread and memfd names).
    name: String,
    // Declared after the vCPU threads' owner: dropped once they are joined
    // (RunningVm's Drop joins them first).
    _event_loop: EventLoop,
}

impl RunningVm {
    /// The console's last bytes (shared; grows as the guest writes).
    pub fn console(&self) -> &ConsoleTail {
        &self.console_tail
    }

    /// When [`Vm::start`] began.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Where each vCPU's RIP was when it stopped (`None` while running or
    /// if its registers could not be read), by vCPU index. Filled once the
    /// VM has ended; for a VM stopped by timeout it says where the guest was.
    pub fn final_rips(&self) -> Vec<Option<u64>> {
        self.shared.final_rips.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the VM has stopped (a vCPU recorded an outcome).
    pub fn is_stopped(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
    }

    /// A handle that waits for the VM to stop without borrowing it, so
    /// one thread can watch for the guest's end while another owns the VM.
    pub fn exit_watcher(&self) -> ExitWatcher {
        ExitWatcher(self.shared.clone())
    }

    /// CPU time the vCPU threads have used so far (user + system), read
    /// from each thread's CPU-time clock (`pthread_getcpuclockid(3)`).
    /// Threads that have ended count nothing.
    pub fn vcpu_cpu_time(&self) -> Duration {
        use std::os::unix::thread::JoinHandleExt;
        let mut total = Duration::ZERO;
        for t in self.threads.iter().filter(|t| !t.is_finished()) {
            let mut clock: libc::clockid_t = 0;
            // SAFETY: the pthread_t comes from a JoinHandle we hold and have
            // not joined, so the thread's id is valid; `clock` is a valid
            // out pointer.
            if unsafe { libc::pthread_getcpuclockid(t.as_pthread_t(), &mut clock) } != 0 {
                continue;
            }
            let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: `clock` was just returned for a live thread; `ts` is
            // a valid out pointer.
            if unsafe { libc::clock_gettime(clock, &mut ts) } == 0 {
                total += Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32);
            }
        }
        total
    }

    /// Host memory (bytes) that backs guest RAM right now: the resident
    /// pages of its mappings (`Rss` in `/proc/self/smaps`), not the
    /// configured size. For a VM restored copy-on-write this counts the
    /// template's page-cache pages it shares with others; see
    /// [`RunningVm::memory_usage`] for the proportional and private shares.
    pub fn resident_memory_bytes(&self) -> u64 {
        self.memory_usage().map(|u| u.rss_bytes).unwrap_or(0)
    }

    /// Resident, proportional (PSS) and private bytes of guest RAM's
    /// mappings, from `/proc/self/smaps` (kernel doc
    /// `Documentation/filesystems/proc.rst`).
    ///
    /// Errors: reading `/proc/self/smaps`.
    pub fn memory_usage(&self) -> std::io::Result<crate::memory::MemoryUsage> {
        self._ram.memory_usage()
    }

    /// Pauses the guest: every vCPU leaves `KVM_RUN` and parks until
    /// [`RunningVm::resume`]. Returns how long it took. Devices keep
    /// serving the host side (a paused guest simply does not run); the
    /// guest's clock goes on, so it sees the pause as lost time.
    ///
    /// Errors: [`VmError::Stopped`] if the VM has ended,
    /// [`VmError::PauseTimeout`] if a vCPU did not park within `timeout`
    /// (the pause is then withdrawn).
    pub fn pause(&self, timeout: Duration) -> Result<Duration, VmError> {
        let start = Instant::now();
        let lock = || self.shared.pause.lock().unwrap_or_else(|e| e.into_inner());
        lock().requested = true;
        loop {
            if self.is_stopped() {
                self.resume();
                return Err(VmError::Stopped);
            }
            let running: Vec<_> = self.threads.iter().filter(|t| !t.is_finished()).collect();
            let p = lock();
            if p.parked >= running.len() {
                return Ok(start.elapsed());
            }
            if start.elapsed() >= timeout {
                drop(p);
                self.resume();
                return Err(VmError::PauseTimeout(timeout));
            }
            // A kick can land just before a vCPU enters KVM_RUN and be
            // lost, so kick again until every vCPU is parked.
            for t in &running {
                let _ = t.kill(kick_signal());
            }
            let _ = self.shared.pause_changed.wait_timeout(p, Duration::from_millis(2));
        }
    }

    /// Has every parked vCPU do `work(index)` on its own thread and
    /// returns the answers by vCPU index.
    fn on_parked_vcpus(&self, work: impl Fn(usize) -> VcpuWork) -> Result<Vec<Option<VcpuState>>, VmError> {
        const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
        let n = self.threads.len();
        let mut p = self.paused_state()?;
        for i in 0..n {
            p.done[i] = None;
            p.work[i] = Some(work(i));
        }
        self.shared.pause_changed.notify_all();
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        while p.done.iter().any(Option::is_none) {
            let now = Instant::now();
            if now >= deadline || self.is_stopped() {
                let missing = p.done.iter().position(Option::is_none).unwrap_or(0);
                p.work.iter_mut().for_each(|w| *w = None);
                return Err(VcpuStateError::NoAnswer(missing as u8).into());
            }
            p = self.shared.pause_changed.wait_timeout(p, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        p.done.iter_mut().map(|d| d.take().unwrap_or(Ok(None)).map_err(VmError::from)).collect()
    }

    /// Saves every vCPU's state (the VM must be paused), by vCPU index.
    ///
    /// Errors: [`VmError::NotPaused`], [`VmError::VcpuState`].
    pub fn save_vcpu_states(&self) -> Result<Vec<VcpuState>, VmError> {
        let answers = self.on_parked_vcpus(|_| VcpuWork::Save)?;
        answers.into_iter().enumerate().map(|(i, a)| a.ok_or(VcpuStateError::NoAnswer(i as u8).into())).collect()
    }

    /// Loads `states` (one per vCPU, by index) into the paused vCPUs.
    ///
    /// Errors: [`VmError::NotPaused`], [`VmError::VcpuState`],
    /// [`VmError::Config`] if the count differs from the vCPU count.
    pub fn restore_vcpu_states(&self, states: &[Arc<VcpuState>]) -> Result<(), VmError> {
        if states.len() != self.threads.len() {
            return Err(VmError::Config(format!("{} vCPU states for {} vCPUs", states.len(), self.threads.len())));
        }
        self.on_parked_vcpus(|i| VcpuWork::Restore(states[i].clone()))?;
        Ok(())
    }

    /// The pause state, locked, if every vCPU is parked (none has ended).
    fn paused_state(&self) -> Result<std::sync::MutexGuard<'_, PauseState>, VmError> {
        let p = self.shared.pause.lock().unwrap_or_else(|e| e.into_inner());
        if !p.requested || p.parked < self.threads.len() || self.threads.iter().any(|t| t.is_finished()) {
            return Err(VmError::NotPaused);
        }
        Ok(p)
    }

    fn require_paused(&self) -> Result<(), VmError> {
        self.paused_state().map(drop)
    }

    /// Saves the VM-wide state: interrupt controllers, PIT, clock (the VM
    /// must be paused).
    ///
    /// Errors: [`VmError::NotPaused`], [`VmError::VmState`].
    pub fn save_vm_state(&self) -> Result<crate::vm_state::VmState, VmError> {
        self.require_paused()?;
        Ok(crate::vm_state::save(&self.vm)?)
    }

    /// Loads VM-wide state into the paused VM.
    ///
    /// Errors: [`VmError::NotPaused`], [`VmError::VmState`].
    pub fn restore_vm_state(&self, state: &crate::vm_state::VmState) -> Result<(), VmError> {
        self.require_paused()?;
        Ok(crate::vm_state::restore(&self.vm, state)?)
    }

    /// Takes a snapshot of the paused VM into the directory `dir` (which
    /// must exist): guest RAM to `dir/memory`, then the state file (see
    /// [`crate::snapshot`] for the format). Every virtio transport is locked
    /// for the whole snapshot, so no device touches guest memory or its
    /// virtqueues meanwhile. The VM stays paused; resume or stop it
    /// afterwards.
    ///
    /// Errors: [`VmError::NotPaused`], [`VmError::VcpuState`],
    /// [`VmError::VmState`], [`VmError::Memory`], [`VmError::Snapshot`].
    pub fn snapshot(&self, dir: &std::path::Path) -> Result<Snapshot, VmError> {
        self.require_paused()?;
        let guards: Vec<_> =
            self.shared.mmio.iter().map(|(_, _, t)| t.lock().unwrap_or_else(|e| e.into_inner())).collect();
        let transports = guards.iter().map(|t| t.save()).collect();
        let legacy = self.shared.devices.lock().unwrap_or_else(|e| e.into_inner()).save();
        let vcpus = self.save_vcpu_states()?.into_iter().map(Arc::new).collect();
        let vm = crate::vm_state::save(&self.vm)?;
        let memory_file = dir.join(MEMORY_FILE);
        self._ram.write_to(&memory_file)?;
        drop(guards);
        let io = |source| SnapshotError::Io { path: memory_file.clone(), source };
        let memory_crc32 = file_crc32(&std::fs::File::open(&memory_file).map_err(io)?, self._ram.size).map_err(io)?;
        let snapshot = Snapshot {
            vcpus,
            vm,
            transports,
            legacy,
            cpuid: self.cpuid.clone(),
            mem_bytes: self._ram.size,
            memory_crc32,
            memory: SnapshotMemory::File(memory_file),
        };
        snapshot.write_state(dir)?;
        Ok(snapshot)
    }

    /// Takes a branch point: a consistent copy of the VM's whole state at
    /// one instant, held in memory, to restore any number of VMs from
    /// ([`Vm::restore`] with the returned snapshot; its memory is a memfd,
    /// [`crate::snapshot::SnapshotMemory::Shared`]).
    ///
    /// The VM is paused (within `pause_timeout`), its vCPU, VM and device
    /// state saved, the pages of guest RAM that hold data write-protected,
    /// and the VM resumed; the memory is then copied while it runs, each
    /// page before its first write (see [`crate::branch`]). Where write
    /// protection is not available, or the VM was paused already, the
    /// memory is copied while paused instead, and the report says so. A VM
    /// paused before the call stays paused. Blocks until the copy is
    /// complete.
    ///
    /// Errors: [`VmError::Stopped`], [`VmError::PauseTimeout`],
    /// [`VmError::VcpuState`], [`VmError::VmState`], [`VmError::Memory`].
    pub fn branch(&self, pause_timeout: Duration) -> Result<(Snapshot, BranchReport), VmError> {
        let start = Instant::now();
        let was_paused = self.is_paused();
        if !was_paused {
            self.pause(pause_timeout)?;
        }
        let ram = &self._ram;
        let taken = (|| {
            let memfd = crate::memory::new_memfd(&format!("tine-branch-{}", self.name), ram.size)
                .map_err(MemoryError::Memfd)?;
            let guards: Vec<_> =
                self.shared.mmio.iter().map(|(_, _, t)| t.lock().unwrap_or_else(|e| e.into_inner())).collect();
            let transports: Vec<_> = guards.iter().map(|t| t.save()).collect();
            let legacy = self.shared.devices.lock().unwrap_or_else(|e| e.into_inner()).save();
            let vcpus: Vec<_> = self.save_vcpu_states()?.into_iter().map(Arc::new).collect();
            let vm = crate::vm_state::save(&self.vm)?;
            let ranges = ram.content_ranges()?;
            let protection = if was_paused {
                Err("the VM was paused already, so its memory was copied as it stood".to_string())
            } else {
                // SAFETY: the regions are guest RAM's mappings, owned by
                // `self._ram`, which outlives this call (and the returned
                // protection, dropped within it); the vCPUs are paused and
                // every transport is locked until after this returns.
                unsafe { WriteProtection::start(&ram.regions(), &ranges) }
            };
            let mut copier = PageCopier::new(ram, &memfd);
            if protection.is_err() {
                for &(s, e) in &ranges {
                    copier.copy(s, e)?;
                }
            }
            let bytes_written = copier.bytes_written;
            drop(guards);
            Ok::<_, VmError>((memfd, transports, legacy, vcpus, vm, ranges, protection, bytes_written))
        })();
        if !was_paused {
            self.resume();
        }
        let pause = start.elapsed();
        let (memfd, transports, legacy, vcpus, vm, ranges, protection, mut bytes_written) = taken?;
        let bytes_examined = ranges.iter().map(|(s, e)| e - s).sum();
        let (mode, fallback_reason, pages_copied_before_write, write_faults) = match protection {
            Ok(wp) => {
                let mut copier = PageCopier::new(ram, &memfd);
                let (early, faults) = wp.copy(&ranges, &mut copier)?;
                bytes_written = copier.bytes_written;
                (BranchMode::WriteProtect, None, early, faults)
            }
            Err(reason) => (BranchMode::CopyWhilePaused, Some(reason), 0, 0),
        };
        let report = BranchReport {
            mode,
            fallback_reason,
            pause,
            total: start.elapsed(),
            bytes_examined,
            bytes_written,
            pages_copied_before_write,
            write_faults,
        };
        tracing::info!(name = %self.name, ?mode, "branch point taken: paused {:?}, copied {} MiB in {:?}, {} pages copied before a write",
            report.pause, report.bytes_written >> 20, report.total, report.pages_copied_before_write);
        let snapshot = Snapshot {
            vcpus,
            vm,
            transports,
            legacy,
            cpuid: self.cpuid.clone(),
            mem_bytes: ram.size,
            memory_crc32: 0,
            memory: SnapshotMemory::Shared(Arc::new(memfd)),
        };
        Ok((snapshot, report))
    }

    /// Guest RAM. For tests and benchmarks: writing to memory the guest
    /// uses corrupts it.
    pub fn ram(&self) -> &GuestRam {
        &self._ram
    }

    /// Lets paused vCPUs run again (nothing happens if none is paused).
    pub fn resume(&self) {
        let mut p = self.shared.pause.lock().unwrap_or_else(|e| e.into_inner());
        p.requested = false;
        self.shared.pause_changed.notify_all();
    }

    /// Whether a pause is in force.
    pub fn is_paused(&self) -> bool {
        self.shared.pause.lock().unwrap_or_else(|e| e.into_inner()).requested
    }

    fn kick_and_join(&mut self) {
        // A kick can land just before a vCPU enters KVM_RUN and be lost, so
        // keep kicking until every thread has seen the stop flag.
        while self.threads.iter().any(|t| !t.is_finished()) {
            for t in self.threads.iter().filter(|t| !t.is_finished()) {
                let _ = t.kill(kick_signal());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    fn outcome(&mut self) -> Result<VmExit, VmError> {
        self.kick_and_join();
        let why = self.shared.outcome.lock().unwrap_or_else(|e| e.into_inner()).take();
        let console = || self.console_tail.last_lines(CONSOLE_LINES_IN_ERRORS);
        match why {
            Some(GuestStop::PowerOff) => Ok(VmExit::PowerOff),
            Some(GuestStop::Reset) => {
                let text = self.console_tail.text();
                match text.lines().rev().find(|l| l.contains("Kernel panic - not syncing")) {
                    Some(line) => Err(VmError::GuestPanic { line: line.trim().to_string(), console: console() }),
                    None => Ok(VmExit::Reset),
                }
            }
            Some(GuestStop::Requested) | None => Ok(VmExit::Stopped),
            Some(GuestStop::Fault(fault)) => Err(VmError::Guest { fault: Box::new(fault), console: console() }),
        }
    }

    /// Waits until the guest ends the VM.
    pub fn wait(&mut self) -> Result<VmExit, VmError> {
        self.shared.wait_stopped(None);
        self.outcome()
    }

    /// Waits up to `timeout` for the guest to end the VM; on timeout the
    /// VM is stopped and `Ok(VmExit::Stopped)` returned.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<VmExit, VmError> {
        self.shared.wait_stopped(Some(Instant::now() + timeout));
        self.shared.finish(GuestStop::Requested);
        self.outcome()
    }

    /// Stops the VM now and waits for its vCPU threads.
    pub fn stop(&mut self) -> Result<VmExit, VmError> {
        self.shared.finish(GuestStop::Requested);
        self.outcome()
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.shared.finish(GuestStop::Requested);
            self.kick_and_join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_order() {
        let mut c = VmConfig::new("t", "/nonexistent");
        c.profile = HostProfile::Pvm;
        c.cmdline = "quiet".into();
        let full = c.full_cmdline();
        assert!(full.starts_with("console=ttyS0 reboot=k panic=-1 tine_poweroff=0xf4 tine_pvm "), "{full}");
        assert!(full.ends_with(" quiet"));
        c.profile = HostProfile::BareMetal;
        c.cmdline.clear();
        assert_eq!(c.full_cmdline(), base_cmdline());
    }
}
