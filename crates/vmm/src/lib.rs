//! Tine's virtual machine monitor: x86_64 KVM microVMs built on the
//! rust-vmm crates.
//!
//! A VM is guest memory in one memfd ([`memory`]), vCPUs set up for the
//! Linux 64-bit boot protocol ([`x86_64`]), each on its own thread
//! ([`vcpu`]), and legacy port I/O devices ([`devices`]). [`vm::build_for_boot`]
//! boots one; [`host::HostProfile`] adapts the guest to the host's KVM.

#![deny(missing_docs)]

pub mod branch;
pub mod devices;
pub mod event_loop;
pub mod host;
pub mod log_limit;
pub mod memory;
pub mod pagefile;
pub mod seccomp;
pub mod snapshot;
pub mod sync;
pub mod uffd;
pub mod vcpu;
pub mod vcpu_state;
pub mod vm;
pub mod vm_state;
pub mod working_set;
pub mod x86_64;

pub use branch::{BranchMode, BranchReport, PauseSteps};
pub use host::HostProfile;
pub use memory::MemoryBacking;
pub use snapshot::{Snapshot, SnapshotError, SnapshotMemory};
pub use vm::{
    build_for_boot, build_from_snapshot, BuildError, ControlError, DiskConfig, DiskImage, ExitWatcher, GuestError,
    NetConfig, RunningVm, VmConfig, VmOutcome, VsockConfig,
};
pub use working_set::{PrefetchStats, WorkingSet};

/// The revision of the machine this VMM presents to a guest (CPUID, boot
/// tables, devices), bumped whenever a change would make a snapshot taken
/// before it fail to restore or behave differently. Stores of snapshots
/// (templates) record it and treat snapshots of another revision as stale.
/// 2: x2APIC and the TSC-deadline timer kept for the pvm host profile.
pub const MACHINE_REVISION: u32 = 2;
