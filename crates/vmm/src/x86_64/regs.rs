//! Initial vCPU state for the 64-bit boot protocol: general registers,
//! segment and control registers, FPU, MSRs and the local APIC.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, Msrs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::gdt::{boot_gdt, kvm_segment_from_gdt, BOOT_CS_INDEX, BOOT_DS_INDEX, BOOT_TSS_INDEX};
use super::paging::{self, CR0_ET, CR0_PE, CR0_PG, CR4_PAE, EFER_LMA, EFER_LME};
use super::{BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, ZERO_PAGE_START};

/// Errors of vCPU register set-up.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    /// A KVM register ioctl failed.
    #[error("{what} failed: {source}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// KVM accepted fewer MSRs than given.
    #[error("KVM_SET_MSRS set {set} of {wanted} boot MSRs (first refused: {first_refused:#x})")]
    Msrs {
        /// MSRs set.
        set: usize,
        /// MSRs given.
        wanted: usize,
        /// Index of the first MSR not set.
        first_refused: u32,
    },
    /// Writing the GDT, IDT or page tables to guest memory failed.
    #[error("cannot write boot tables to guest memory: {0}")]
    Memory(String),
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> RegsError {
    move |source| RegsError::Kvm { what, source }
}

/// MSR indices (Intel SDM vol. 4).
pub mod msr {
    /// IA32_TSC.
    pub const IA32_TSC: u32 = 0x10;
    /// IA32_SYSENTER_CS.
    pub const IA32_SYSENTER_CS: u32 = 0x174;
    /// IA32_SYSENTER_ESP.
    pub const IA32_SYSENTER_ESP: u32 = 0x175;
    /// IA32_SYSENTER_EIP.
    pub const IA32_SYSENTER_EIP: u32 = 0x176;
    /// IA32_MISC_ENABLE.
    pub const IA32_MISC_ENABLE: u32 = 0x1a0;
    /// IA32_MTRR_DEF_TYPE.
    pub const IA32_MTRR_DEF_TYPE: u32 = 0x2ff;
    /// STAR.
    pub const STAR: u32 = 0xc000_0081;
    /// LSTAR.
    pub const LSTAR: u32 = 0xc000_0082;
    /// CSTAR.
    pub const CSTAR: u32 = 0xc000_0083;
    /// SFMASK.
    pub const SYSCALL_MASK: u32 = 0xc000_0084;
    /// KERNEL_GS_BASE.
    pub const KERNEL_GS_BASE: u32 = 0xc000_0102;
    /// IA32_MISC_ENABLE bit 0: fast string operations.
    pub const MISC_ENABLE_FAST_STRING: u64 = 1;
    /// IA32_MTRR_DEF_TYPE: MTRRs enabled (bit 11), default type write-back (6).
    pub const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;
}

/// The MSRs set at boot: `(index, value)`.
pub fn boot_msrs() -> Vec<(u32, u64)> {
    use msr::*;
    vec![
        (IA32_SYSENTER_CS, 0),
        (IA32_SYSENTER_ESP, 0),
        (IA32_SYSENTER_EIP, 0),
        (STAR, 0),
        (CSTAR, 0),
        (KERNEL_GS_BASE, 0),
        (SYSCALL_MASK, 0),
        (LSTAR, 0),
        (IA32_TSC, 0),
        (IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (IA32_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
}

/// Sets the boot MSRs ([`boot_msrs`]).
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let list = boot_msrs();
    let entries: Vec<kvm_msr_entry> =
        list.iter().map(|&(index, data)| kvm_msr_entry { index, data, ..Default::default() }).collect();
    let msrs = Msrs::from_entries(&entries).map_err(|e| RegsError::Memory(format!("MSR list: {e:?}")))?;
    let set = vcpu.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
    if set != list.len() {
        return Err(RegsError::Msrs { set, wanted: list.len(), first_refused: list[set].0 });
    }
    Ok(())
}

/// Sets the x87 control word and MXCSR to their reset values.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() };
    vcpu.set_fpu(&fpu).map_err(kvm("KVM_SET_FPU"))
}

/// The general registers at kernel entry: RIP at `entry`, RSI at the zero
/// page, a boot stack, RFLAGS with only the reserved bit 1.
pub fn boot_regs(entry: GuestAddress) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry.0,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// Writes the boot GDT, an empty IDT and the identity-map page tables to
/// guest memory, and puts the vCPU in 64-bit mode on them.
pub fn setup_sregs<M: GuestMemoryBackend>(mem: &M, vcpu: &VcpuFd) -> Result<(), RegsError> {
    let gdt = boot_gdt();
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + i as u64 * 8)).map_err(|e| RegsError::Memory(e.to_string()))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START)).map_err(|e| RegsError::Memory(e.to_string()))?;
    let cr3 = paging::write_identity_map(mem).map_err(|e| RegsError::Memory(e.to_string()))?;

    let mut sregs = vcpu.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    let code = kvm_segment_from_gdt(gdt[BOOT_CS_INDEX as usize], BOOT_CS_INDEX);
    let data = kvm_segment_from_gdt(gdt[BOOT_DS_INDEX as usize], BOOT_DS_INDEX);
    let tss = kvm_segment_from_gdt(gdt[BOOT_TSS_INDEX as usize], BOOT_TSS_INDEX);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = cr3;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
    vcpu.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))
}

/// Offset of the LVT LINT0 register in the local APIC page.
const APIC_LVT0: usize = 0x350;
/// Offset of the LVT LINT1 register.
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(state: &kvm_lapic_state, offset: usize) -> u32 {
    let b = &state.regs[offset..offset + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(state: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        state.regs[offset + i] = *b as _;
    }
}

fn set_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// Wires LINT0 to ExtINT (the PIC) and LINT1 to NMI, as the MP table says.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut state = vcpu.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
    let lvt0 = lapic_reg(&state, APIC_LVT0);
    set_lapic_reg(&mut state, APIC_LVT0, set_delivery_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(&state, APIC_LVT1);
    set_lapic_reg(&mut state, APIC_LVT1, set_delivery_mode(lvt1, APIC_MODE_NMI));
    vcpu.set_lapic(&state).map_err(kvm("KVM_SET_LAPIC"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_mode_bits() {
        assert_eq!(set_delivery_mode(0x0001_0000, APIC_MODE_EXTINT), 0x0001_0700);
        assert_eq!(set_delivery_mode(0x0000_0700, APIC_MODE_NMI), 0x0000_0400);
    }

    #[test]
    fn lapic_register_round_trip() {
        let mut s = kvm_lapic_state::default();
        set_lapic_reg(&mut s, APIC_LVT1, 0xdead_beef);
        assert_eq!(lapic_reg(&s, APIC_LVT1), 0xdead_beef);
        assert_eq!(lapic_reg(&s, APIC_LVT0), 0);
    }

    #[test]
    fn boot_regs_follow_the_protocol() {
        let r = boot_regs(GuestAddress(0x100_0000));
        assert_eq!((r.rip, r.rsi, r.rflags), (0x100_0000, ZERO_PAGE_START, 2));
    }
}
