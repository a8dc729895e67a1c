//! Building a VM: [`build_for_boot`] (load a kernel and boot it) and
//! [`build_from_snapshot`] (go on from a saved state). Both share the KVM
//! VM set-up, the attachment of the virtio-mmio and legacy devices, vCPU
//! creation (CPUID) and the start of the vCPU threads; they differ only in
//! where guest RAM, device state and registers come from.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvm_bindings::{kvm_pit_config, CpuId, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuFd, VmFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::block::{Block, BlockError};
use crate::devices::virtio::mmio::{reg, MmioTransport, TransportArgs, MMIO_WINDOW};
use crate::devices::virtio::net::Net;
use crate::devices::virtio::vsock::muxer::MuxerError;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{Interrupt, VirtioDevice, VirtioError};
use crate::devices::{self, Console, LegacyDevices, LegacyState, Persist, SerialArgs};
use crate::event_loop::{EventLoop, EventLoopError};
use crate::log_limit::LogLimiter;
use crate::memory::{GuestRam, MemoryBacking, MemoryError, MMIO_GAP_START};
use crate::seccomp::ThreadKind;
use crate::snapshot::{CpuidLeaf, Snapshot, SnapshotError};
use crate::sync::lock;
use crate::vcpu::{install_kick_handler, PauseState, Vcpu, VcpuShared};
use crate::vcpu_state::VcpuStateError;
use crate::vm::config::VIRTIO_FIRST_IRQ;
use crate::vm::running::{MmioSlot, RunningVm};
use crate::vm::VmConfig;
use crate::x86_64::boot::{load_kernel, BootError};
use crate::x86_64::cpuid::{filter_cpuid, VcpuTopology};
use crate::x86_64::mptable::{self, MptableError};
use crate::x86_64::regs::{self, RegsError};
use crate::x86_64::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS};

/// Errors of building a VM ([`build_for_boot`], [`build_from_snapshot`]);
/// nothing is left running after one.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
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
    /// The network device's backend (the user-space NAT) could not be set up.
    #[error(transparent)]
    Net(#[from] netstack::stack::StackError),
    /// A virtio device could not be set up.
    #[error(transparent)]
    Virtio(#[from] VirtioError),
    /// The device event loop could not start.
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    /// A vCPU thread could not be started.
    #[error("cannot start a vCPU thread: {0}")]
    Thread(#[source] std::io::Error),
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
}

fn setup(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> BuildError {
    move |source| BuildError::KvmSetup { what, source }
}

/// Creates the VM, loads the kernel and starts every vCPU thread.
///
/// Errors: any [`BuildError`] set-up variant; nothing is left running on error.
pub fn build_for_boot(config: &VmConfig) -> Result<RunningVm, BuildError> {
    let b = Builder::new(config)?;
    let ram = if config.huge_pages {
        GuestRam::new_huge(&config.name, config.memory_bytes()?)?
    } else {
        GuestRam::new(&config.name, config.memory_bytes()?)?
    };
    ram.register(&b.vm)?;
    let mut cmdline = config.full_cmdline();
    let mmio = b.attach_virtio(&ram, &mut cmdline, |_, dev, memory, interrupt| {
        Ok(MmioTransport::new(dev, memory, interrupt)?)
    })?;
    let kernel = load_kernel(&ram.memory, ram.size, &config.kernel, config.initrd.as_deref(), &cmdline)?;
    mptable::write(&ram.memory, config.vcpus)?;
    let vcpus = b.create_vcpus(&ram, &mmio, None, |index, fd, _| {
        let regs_err = |source| BuildError::Regs { vcpu: index, source };
        regs::setup_msrs(fd).map_err(regs_err)?;
        regs::setup_fpu(fd).map_err(regs_err)?;
        regs::setup_lapic(fd).map_err(regs_err)?;
        if index == 0 {
            fd.set_regs(&regs::boot_regs(kernel.entry)).map_err(setup("KVM_SET_REGS"))?;
            regs::setup_sregs(&ram.memory, fd).map_err(regs_err)?;
        }
        Ok(())
    })?;
    b.start(ram, mmio, vcpus)
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
/// Errors: as [`build_for_boot`], plus [`BuildError::Config`] for a snapshot
/// that does not fit the configuration and [`BuildError::Restore`].
pub fn build_from_snapshot(
    config: &VmConfig,
    snapshot: &Snapshot,
    backing: MemoryBacking,
) -> Result<RunningVm, BuildError> {
    let b = Builder::new(config)?;
    config.check_fits(snapshot)?;
    let ram = if config.huge_pages {
        GuestRam::from_snapshot_huge(&config.name, &snapshot.memory, config.memory_bytes()?)?
    } else {
        GuestRam::from_snapshot(&config.name, &snapshot.memory, config.memory_bytes()?, backing)?
    };
    ram.register(&b.vm)?;
    if let Some(ws) = config.prefetch.as_ref().filter(|_| !config.huge_pages) {
        prefetch(&config.name, &ram, ws);
    }
    let mut cmdline = config.full_cmdline();
    let mmio = b.attach_virtio(&ram, &mut cmdline, |i, dev, memory, interrupt| {
        Ok(MmioTransport::restore(TransportArgs { device: dev, mem: memory, interrupt }, &snapshot.transports[i])?)
    })?;
    crate::vm_state::restore(&b.vm, &snapshot.vm)?;
    let vcpus = b.create_vcpus(&ram, &mmio, Some(&snapshot.legacy), |index, fd, cpuid| {
        snapshot.check_cpuid(usize::from(index), cpuid.as_slice())?;
        Ok(crate::vcpu_state::restore(fd, &snapshot.vcpus[usize::from(index)])?)
    })?;
    // The transports (and the serial port) raised their interrupts while
    // being restored, before the IOAPIC and the LAPICs got their saved
    // state back, which can drop them (seen: a guest that never looked at
    // the vsock event queue until other traffic arrived). Again, now.
    for (_, _, t) in &mmio {
        lock(t).reassert_interrupt();
    }
    lock(&vcpus.shared.devices).reassert_interrupt();
    b.start(ram, mmio, vcpus)
}

/// Populates `ws`'s pages of restored RAM `ram` before its vCPUs run (see
/// [`crate::working_set`]), logging what it did; a set that does not fit
/// `ram` is skipped with a warning.
fn prefetch(name: &str, ram: &GuestRam, ws: &crate::WorkingSet) {
    if !ws.fits(ram.size) {
        tracing::warn!(name, "the working set does not fit this VM's memory; not prefetching");
        return;
    }
    let t = Instant::now();
    let stats = ram.prefetch(ws);
    tracing::info!(
        name,
        read_kib = stats.read_bytes >> 10,
        written_kib = stats.written_bytes >> 10,
        failed_ranges = stats.failed_ranges,
        "working set prefetched in {:?}",
        t.elapsed()
    );
}

/// The parts every VM is built from, before its vCPUs run.
struct Builder<'a> {
    config: &'a VmConfig,
    kvm: Kvm,
    vm: VmFd,
    started: Instant,
    /// The VM's limiter of guest-triggered log lines, shared by its devices.
    log: Arc<LogLimiter>,
}

impl<'a> Builder<'a> {
    /// Checks `config` and creates the KVM VM with its in-kernel
    /// interrupt controllers and PIT.
    fn new(config: &'a VmConfig) -> Result<Self, BuildError> {
        config.validate()?;
        let started = Instant::now();
        let kvm = Kvm::new().map_err(BuildError::Kvm)?;
        let vm = kvm.create_vm().map_err(setup("KVM_CREATE_VM"))?;
        vm.set_tss_address(KVM_TSS_ADDRESS as usize).map_err(setup("KVM_SET_TSS_ADDR"))?;
        vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS).map_err(setup("KVM_SET_IDENTITY_MAP_ADDR"))?;
        vm.create_irq_chip().map_err(setup("KVM_CREATE_IRQCHIP"))?;
        vm.create_pit2(kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() })
            .map_err(setup("KVM_CREATE_PIT2"))?;
        Ok(Builder { config, kvm, vm, started, log: Arc::new(LogLimiter::new(config.name.clone())) })
    }

    /// Opens the configured disks, vsock device and network device (last,
    /// so that the others keep their windows and GSIs; its backend is a new
    /// [`netstack::stack::NetStack`]) and puts each behind a virtio-mmio
    /// transport made by `transport(index, device, memory,
    /// interrupt)`: window `i` at [`MMIO_GAP_START`] + `i` windows, GSI
    /// [`VIRTIO_FIRST_IRQ`] + `i`, an irqfd, and one ioeventfd per queue.
    /// Appends each device to `cmdline` (`virtio_mmio.device=`).
    fn attach_virtio(
        &self,
        ram: &GuestRam,
        cmdline: &mut String,
        mut transport: impl FnMut(
            usize,
            Box<dyn VirtioDevice>,
            GuestMemoryMmap,
            Arc<Interrupt>,
        ) -> Result<MmioTransport, BuildError>,
    ) -> Result<Vec<MmioSlot>, BuildError> {
        let mut virtio: Vec<Box<dyn VirtioDevice>> = Vec::new();
        for d in &self.config.disks {
            virtio.push(Box::new(Block::open_config(d)?));
        }
        if let Some(v) = &self.config.vsock {
            virtio.push(Box::new(Vsock::new(v.cid, &v.uds_path)?));
        }
        if let Some(n) = &self.config.net {
            let stack = netstack::stack::NetStack::new(n.stack.clone(), n.control.clone())?;
            virtio.push(Box::new(Net::new(Box::new(stack))));
        }
        let mut mmio = Vec::with_capacity(virtio.len());
        for (i, dev) in virtio.into_iter().enumerate() {
            let base = MMIO_GAP_START + i as u64 * MMIO_WINDOW;
            let irq = VIRTIO_FIRST_IRQ + i as u32;
            let irqfd =
                EventFd::new(libc::EFD_NONBLOCK).map_err(|e| BuildError::Device(devices::DeviceError::EventFd(e)))?;
            self.vm.register_irqfd(&irqfd, irq).map_err(setup("KVM_IRQFD"))?;
            let interrupt = Arc::new(Interrupt::new(irqfd));
            let mut t = transport(i, dev, ram.memory.clone(), interrupt)?;
            t.set_log_limiter(self.log.clone());
            for (q, evt) in t.queue_evts().iter().enumerate() {
                self.vm
                    .register_ioevent(evt, &IoEventAddress::Mmio(base + reg::QUEUE_NOTIFY), q as u32)
                    .map_err(setup("KVM_IOEVENTFD"))?;
            }
            cmdline.push_str(&format!(" virtio_mmio.device=4K@{base:#x}:{irq}"));
            mmio.push((base, MMIO_WINDOW, Arc::new(Mutex::new(t))));
        }
        Ok(mmio)
    }

    /// Attaches the legacy devices (serial console on COM1, i8042, power
    /// off port; restored from `legacy` if given, else fresh) and creates
    /// every vCPU with its CPUID, then has `setup_vcpu(index, fd, cpuid)`
    /// load its registers.
    fn create_vcpus(
        &self,
        ram: &GuestRam,
        mmio: &[MmioSlot],
        legacy: Option<&LegacyState>,
        mut setup_vcpu: impl FnMut(u8, &VcpuFd, &CpuId) -> Result<(), BuildError>,
    ) -> Result<Vcpus, BuildError> {
        let config = self.config;
        let serial_irq =
            EventFd::new(libc::EFD_NONBLOCK).map_err(|e| BuildError::Device(devices::DeviceError::EventFd(e)))?;
        self.vm.register_irqfd(&serial_irq, devices::COM1_IRQ).map_err(setup("KVM_IRQFD"))?;
        let console =
            Console::with_limit(config.console_log.as_deref(), config.console_stdout, config.console_log_max_bytes)?;
        let mut devices = match legacy {
            None => LegacyDevices::new(serial_irq, console),
            Some(state) => LegacyDevices::restore(SerialArgs { irq: serial_irq, console }, state)?,
        };
        devices.set_log_limiter(self.log.clone());

        let shared = Arc::new(VcpuShared {
            stop: Default::default(),
            outcome: Mutex::new(None),
            stopped: Default::default(),
            devices: Mutex::new(devices),
            mmio: mmio.to_vec(),
            memory: ram.memory.clone(),
            final_rips: Mutex::new(vec![None; config.vcpus as usize]),
            pause: Mutex::new(PauseState::new(usize::from(config.vcpus))),
            pause_changed: Default::default(),
            msr_indices: self.kvm.get_msr_index_list().map_err(setup("KVM_GET_MSR_INDEX_LIST"))?.as_slice().to_vec(),
        });

        let supported =
            self.kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(setup("KVM_GET_SUPPORTED_CPUID"))?;
        let mut vcpus = Vec::with_capacity(config.vcpus as usize);
        let mut cpuids = Vec::with_capacity(config.vcpus as usize);
        for index in 0..config.vcpus {
            let fd = self.vm.create_vcpu(u64::from(index)).map_err(setup("KVM_CREATE_VCPU"))?;
            let mut cpuid = supported.clone();
            filter_cpuid(cpuid.as_mut_slice(), VcpuTopology { index, count: config.vcpus }, config.profile);
            fd.set_cpuid2(&cpuid).map_err(setup("KVM_SET_CPUID2"))?;
            setup_vcpu(index, &fd, &cpuid)?;
            cpuids.push(cpuid.as_slice().iter().map(CpuidLeaf::from).collect());
            vcpus.push(Vcpu { fd, index, shared: shared.clone() });
        }
        Ok(Vcpus { vcpus, cpuids, shared })
    }

    /// Starts the device event loop, the net thread's (over the network
    /// device alone, attached last, when the VM has one) and one thread
    /// per vCPU.
    fn start(self, ram: GuestRam, mmio: Vec<MmioSlot>, vcpus: Vcpus) -> Result<RunningVm, BuildError> {
        let config = self.config;
        let mut devices: Vec<_> = mmio.into_iter().map(|(_, _, d)| d).collect();
        let net = if config.net.is_some() { devices.pop() } else { None };
        let event_loop = EventLoop::spawn(&config.name, devices, ThreadKind::Devices)?;
        let net_loop = match net {
            Some(n) => Some(EventLoop::spawn(&config.name, vec![n], ThreadKind::Net)?),
            None => None,
        };
        install_kick_handler().map_err(|e| BuildError::Thread(std::io::Error::from_raw_os_error(e.errno())))?;
        let Vcpus { vcpus, cpuids, shared } = vcpus;
        let console_tail = lock(&shared.devices).console_tail();
        let mut running = RunningVm {
            vm: self.vm,
            ram,
            shared,
            threads: Vec::with_capacity(vcpus.len()),
            console_tail,
            started: self.started,
            cpuid: cpuids,
            name: config.name.clone(),
            _event_loop: event_loop,
            _net_loop: net_loop,
        };
        for vcpu in vcpus {
            let name = format!("vcpu{}-{}", vcpu.index, config.name);
            match std::thread::Builder::new().name(name).spawn(move || {
                crate::seccomp::install_or_log(ThreadKind::Vcpu);
                vcpu.run()
            }) {
                Ok(t) => running.threads.push(t),
                Err(e) => {
                    let _ = running.stop();
                    return Err(BuildError::Thread(e));
                }
            }
        }
        tracing::info!(name = %config.name, vcpus = config.vcpus, memory_mib = config.memory_mib, profile = %config.profile,
            "VM started in {:?}", self.started.elapsed());
        Ok(running)
    }
}

/// Created vCPUs, not yet running, with the CPUID each was given.
struct Vcpus {
    vcpus: Vec<Vcpu>,
    cpuids: Vec<Vec<CpuidLeaf>>,
    shared: Arc<VcpuShared>,
}
