//! A VM's own saved state beside its vCPUs': the in-kernel interrupt
//! controllers (both 8259 PICs and the IOAPIC), the 8254 PIT and the KVM
//! clock (kernel doc `Documentation/virt/kvm/api.rst`: `KVM_GET_IRQCHIP`,
//! `KVM_GET_PIT2`, `KVM_GET_CLOCK` and their `SET` twins). Saved and
//! restored while the VM is paused.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

/// The VM-wide state.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    /// The master 8259.
    pub pic_master: kvm_irqchip,
    /// The slave 8259.
    pub pic_slave: kvm_irqchip,
    /// The IOAPIC (its redirection table routes the virtio and serial GSIs).
    pub ioapic: kvm_irqchip,
    /// The PIT's channels.
    pub pit: kvm_pit_state2,
    /// The KVM clock (ns) at save time.
    pub clock: kvm_clock_data,
}

impl std::fmt::Debug for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmState").field("clock_ns", &self.clock.clock).finish_non_exhaustive()
    }
}

/// Errors of saving or restoring VM state.
#[derive(Debug, thiserror::Error)]
#[error("{ioctl} failed: {source}")]
pub struct VmStateError {
    /// The ioctl.
    pub ioctl: &'static str,
    /// The error.
    #[source]
    pub source: kvm_ioctls::Error,
}

fn chip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, VmStateError> {
    let mut c = kvm_irqchip { chip_id, ..Default::default() };
    vm.get_irqchip(&mut c).map_err(|source| VmStateError { ioctl: "KVM_GET_IRQCHIP", source })?;
    Ok(c)
}

/// Saves the VM-wide state (the vCPUs must not be running).
///
/// Errors: [`VmStateError`].
pub fn save(vm: &VmFd) -> Result<VmState, VmStateError> {
    Ok(VmState {
        pic_master: chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: chip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: vm.get_pit2().map_err(|source| VmStateError { ioctl: "KVM_GET_PIT2", source })?,
        clock: vm.get_clock().map_err(|source| VmStateError { ioctl: "KVM_GET_CLOCK", source })?,
    })
}

/// Writes `state` into a VM whose vCPUs are not running. The clock is set
/// without the flags `KVM_GET_CLOCK` reports (`KVM_SET_CLOCK` refuses
/// them), as Firecracker does.
///
/// Errors: [`VmStateError`].
pub fn restore(vm: &VmFd, state: &VmState) -> Result<(), VmStateError> {
    let set = |ioctl: &'static str| move |source| VmStateError { ioctl, source };
    vm.set_irqchip(&state.pic_master).map_err(set("KVM_SET_IRQCHIP"))?;
    vm.set_irqchip(&state.pic_slave).map_err(set("KVM_SET_IRQCHIP"))?;
    vm.set_irqchip(&state.ioapic).map_err(set("KVM_SET_IRQCHIP"))?;
    vm.set_pit2(&state.pit).map_err(set("KVM_SET_PIT2"))?;
    let clock = kvm_clock_data { clock: state.clock.clock, ..Default::default() };
    vm.set_clock(&clock).map_err(set("KVM_SET_CLOCK"))?;
    Ok(())
}
