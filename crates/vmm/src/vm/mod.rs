//! A microVM: KVM VM and vCPUs, guest memory, kernel, legacy and virtio
//! devices. This module owns the public types and the errors; the parts:
//! [`config`] (what a VM is made of and its checks), [`builder`] (boot or
//! restore: [`build_for_boot`], [`build_from_snapshot`]), [`running`] (a
//! started VM's control: pause, resume, stop, wait), `capture` (its
//! state, for snapshots and branch points).

use std::time::Duration;

use crate::devices;
use crate::devices::virtio::block::BlockError;
use crate::devices::virtio::vsock::muxer::MuxerError;
use crate::devices::virtio::VirtioError;
use crate::event_loop::EventLoopError;
use crate::memory::MemoryError;
use crate::snapshot::SnapshotError;
use crate::vcpu::GuestFault;
use crate::vcpu_state::VcpuStateError;
use crate::x86_64::boot::BootError;
use crate::x86_64::mptable::MptableError;
use crate::x86_64::regs::RegsError;

pub mod builder;
mod capture;
pub mod config;
pub mod running;

pub use builder::{build_for_boot, build_from_snapshot};
pub use config::{base_cmdline, DiskConfig, VmConfig, VsockConfig, MAX_VIRTIO_DEVICES, VIRTIO_FIRST_IRQ};
pub use running::{ExitWatcher, RunningVm};

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
