//! A vCPU's saved state: what a snapshot keeps of each vCPU, read and
//! written with the KVM vCPU ioctls (kernel doc `Documentation/virt/kvm/api.rst`,
//! sections 4.x `KVM_GET_*`/`KVM_SET_*`). Saving and restoring happen on the
//! vCPU's own thread while the VM is paused (see `RunningVm::save_vcpu_states`).

use kvm_bindings::{
    kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, Msrs,
};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};

/// The state of one vCPU. Not `Clone` (KVM's xsave area is not); share
/// it in an `Arc`.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    /// The vCPU's index (its APIC ID).
    pub index: u8,
    /// General-purpose registers, RIP, RFLAGS.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers, EFER, APIC base.
    pub sregs: kvm_sregs,
    /// FPU, SSE and extended state (the 4 KiB `KVM_GET_XSAVE` area).
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    pub xcrs: kvm_xcrs,
    /// Every model-specific register KVM lists that could be read.
    pub msrs: Vec<kvm_msr_entry>,
    /// The local APIC's registers.
    pub lapic: kvm_lapic_state,
    /// Runnable, halted, waiting for SIPI, ...
    pub mp_state: kvm_mp_state,
    /// Pending exceptions, interrupts, NMIs and SMIs.
    pub events: kvm_vcpu_events,
    /// Debug registers DR0-DR3, DR6, DR7.
    pub debugregs: kvm_debugregs,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("index", &self.index)
            .field("rip", &format_args!("{:#x}", self.regs.rip))
            .field("cr3", &format_args!("{:#x}", self.sregs.cr3))
            .field("msrs", &self.msrs.len())
            .field("mp_state", &self.mp_state.mp_state)
            .finish()
    }
}

/// Errors of saving or restoring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    /// A KVM ioctl failed.
    #[error("vCPU {vcpu}: {ioctl} failed: {source}")]
    Ioctl {
        /// The vCPU.
        vcpu: u8,
        /// The ioctl.
        ioctl: &'static str,
        /// The error.
        source: kvm_ioctls::Error,
    },
    /// KVM wrote fewer MSRs than given.
    #[error("vCPU {vcpu}: KVM_SET_MSRS set {set} of {total} MSRs (first refused: {first:#x})")]
    Msrs {
        /// The vCPU.
        vcpu: u8,
        /// MSRs set.
        set: usize,
        /// MSRs given.
        total: usize,
        /// The MSR KVM stopped at.
        first: u32,
    },
    /// The vCPU thread did not answer (it ended, or the VM is not paused).
    #[error("vCPU {0} did not answer the request")]
    NoAnswer(u8),
}

/// Most MSRs per `KVM_GET_MSRS`/`KVM_SET_MSRS` call (the `Msrs` wrapper's limit).
const MSR_BATCH: usize = kvm_bindings::KVM_MAX_MSR_ENTRIES;

/// Reads the MSRs in `indices`, skipping any KVM refuses to read (it stops
/// at the first one it cannot; the rest are read on).
fn read_msrs(fd: &VcpuFd, vcpu: u8, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let ioctl_err = |source| VcpuStateError::Ioctl { vcpu, ioctl: "KVM_GET_MSRS", source };
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let batch = &rest[..rest.len().min(MSR_BATCH)];
        let entries: Vec<kvm_msr_entry> =
            batch.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| ioctl_err(kvm_ioctls::Error::new(libc::E2BIG)))?;
        let read = fd.get_msrs(&mut msrs).map_err(ioctl_err)?;
        out.extend_from_slice(&msrs.as_slice()[..read]);
        // Skip the MSR KVM stopped at, if it stopped early.
        let consumed = if read < batch.len() { read + 1 } else { read };
        if read < batch.len() {
            tracing::debug!(vcpu, "MSR {:#x} cannot be read; not saved", batch[read]);
        }
        rest = &rest[consumed..];
    }
    Ok(out)
}

/// Saves the state of a vCPU that is not running (its thread is parked or
/// it has not started).
///
/// Errors: [`VcpuStateError::Ioctl`].
pub fn save(fd: &VcpuFd, index: u8, msr_indices: &[u32]) -> Result<VcpuState, VcpuStateError> {
    let e = |ioctl: &'static str| move |source| VcpuStateError::Ioctl { vcpu: index, ioctl, source };
    // KVM_GET_MP_STATE first: it may process pending APIC events into the
    // state read below (api.rst 4.38 recommends it before the others).
    let mp_state = fd.get_mp_state().map_err(e("KVM_GET_MP_STATE"))?;
    Ok(VcpuState {
        index,
        mp_state,
        regs: fd.get_regs().map_err(e("KVM_GET_REGS"))?,
        sregs: fd.get_sregs().map_err(e("KVM_GET_SREGS"))?,
        xsave: fd.get_xsave().map_err(e("KVM_GET_XSAVE"))?,
        xcrs: fd.get_xcrs().map_err(e("KVM_GET_XCRS"))?,
        msrs: read_msrs(fd, index, msr_indices)?,
        lapic: fd.get_lapic().map_err(e("KVM_GET_LAPIC"))?,
        events: fd.get_vcpu_events().map_err(e("KVM_GET_VCPU_EVENTS"))?,
        debugregs: fd.get_debug_regs().map_err(e("KVM_GET_DEBUGREGS"))?,
    })
}

/// Writes `state` into a vCPU that is not running, in the order Firecracker
/// and QEMU use: MP state, registers, special registers, extended state,
/// XCRs, debug registers, LAPIC, MSRs, and last the pending events (which
/// depend on the rest).
///
/// Errors: [`VcpuStateError::Ioctl`], [`VcpuStateError::Msrs`].
pub fn restore(fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuStateError> {
    let vcpu = state.index;
    let e = |ioctl: &'static str| move |source| VcpuStateError::Ioctl { vcpu, ioctl, source };
    fd.set_mp_state(state.mp_state).map_err(e("KVM_SET_MP_STATE"))?;
    fd.set_regs(&state.regs).map_err(e("KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs).map_err(e("KVM_SET_SREGS"))?;
    // SAFETY: the area comes from KVM_GET_XSAVE of a vCPU of the same kind
    // (same CPUID), so its header describes only features this vCPU has and
    // its size is the 4 KiB that KVM_SET_XSAVE reads.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(e("KVM_SET_XSAVE"))?;
    fd.set_xcrs(&state.xcrs).map_err(e("KVM_SET_XCRS"))?;
    fd.set_debug_regs(&state.debugregs).map_err(e("KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&state.lapic).map_err(e("KVM_SET_LAPIC"))?;
    for batch in state.msrs.chunks(MSR_BATCH) {
        let msrs = Msrs::from_entries(batch).map_err(|_| e("KVM_SET_MSRS")(kvm_ioctls::Error::new(libc::E2BIG)))?;
        let set = fd.set_msrs(&msrs).map_err(e("KVM_SET_MSRS"))?;
        if set < batch.len() {
            return Err(VcpuStateError::Msrs { vcpu, set, total: batch.len(), first: batch[set].index });
        }
    }
    fd.set_vcpu_events(&state.events).map_err(e("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}
