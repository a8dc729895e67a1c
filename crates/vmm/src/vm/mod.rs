//! A microVM: KVM VM and vCPUs, guest memory, kernel, legacy and virtio
//! devices. This module re-exports the public types; the parts:
//! [`config`] (what a VM is made of and its checks), [`builder`] (boot or
//! restore: [`build_for_boot`], [`build_from_snapshot`]), [`running`] (a
//! started VM's control: pause, resume, stop, wait), [`outcome`] (how a VM
//! ended), `capture` (its state, for snapshots and branch points).

pub mod builder;
mod capture;
pub mod config;
mod hibernate;
pub mod outcome;
pub mod running;

pub use builder::{build_for_boot, build_from_snapshot, BuildError};
pub use config::{
    base_cmdline, DiskConfig, DiskImage, NetConfig, VmConfig, VsockConfig, MAX_VIRTIO_DEVICES, VIRTIO_FIRST_IRQ,
};
pub use hibernate::HibernateReport;
pub use outcome::{GuestError, VmOutcome};
pub use running::{ControlError, ExitWatcher, RunningVm};
