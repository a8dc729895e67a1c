//! The guest's CPUID: `KVM_GET_SUPPORTED_CPUID` filtered through the mask
//! documented here, then set per vCPU with `KVM_SET_CPUID2`.
//!
//! Leaf and bit numbers: Intel SDM vol. 2A, "CPUID"; the KVM leaves:
//! Documentation/virt/kvm/x86/cpuid.rst.
//!
//! The mask, for every host profile:
//! - leaf 0x1 EBX[31:24] (initial APIC ID) = the vCPU index; EBX[23:16]
//!   (addressable logical processors) = the vCPU count; EDX[28] (HTT) set
//!   when there is more than one vCPU.
//! - leaf 0x1 ECX[31] (hypervisor) set: the guest knows it is a VM and
//!   uses the KVM paravirtual leaves.
//! - leaf 0x1 ECX[5] (VMX) clear: no nested virtualisation.
//! - leaf 0x1 ECX[3] (MONITOR/MWAIT) clear: an idle vCPU uses `hlt`, which
//!   KVM handles; `mwait` would spin on the host CPU.
//! - leaf 0x4 EAX[31:26] (cores per package - 1) = vCPU count - 1.
//! - leaf 0x6 (thermal and power management) all zero: not emulated.
//! - leaf 0xA (architectural PMU) all zero: no virtual PMU.
//! - leaves 0xB and 0x1F (extended topology): one thread per core, one
//!   core per vCPU, EDX = x2APIC ID = the vCPU index.
//!
//! And for [`HostProfile::Pvm`], the leaf 0x1 ECX bit that this host's
//! `KVM_SET_CPUID2` can clear and whose use breaks the guest there:
//! CX16 (bit 13, `cmpxchg16b` is not emulated). x2APIC (bit 21) and the
//! TSC-deadline timer (bit 24) stay: with them the guest programs its
//! APIC and timer through MSR writes instead of xAPIC MMIO, which this
//! host emulates instruction by instruction (boot to init 1.5% faster,
//! docs/hosts.md). Every other unusable feature is cleared on the
//! guest command line instead ([`crate::host::PVM_CMDLINE`]). And the KVM
//! paravirtual features that work through hypercalls (`vmcall`/`vmmcall`
//! never complete there: a vCPU sending a PV IPI spins in
//! `kvm_hypercall4` for ever), in leaf 0x40000001 EAX: PV_UNHALT (bit 7,
//! PV spinlock kicks), PV_SEND_IPI (bit 11), PV_SCHED_YIELD (bit 13) and
//! HC_MAP_GPA_RANGE (bit 16).

use kvm_bindings::kvm_cpuid_entry2;

use crate::host::HostProfile;

/// Leaf 1 ECX: MONITOR/MWAIT.
pub const LEAF1_ECX_MONITOR: u32 = 1 << 3;
/// Leaf 1 ECX: VMX.
pub const LEAF1_ECX_VMX: u32 = 1 << 5;
/// Leaf 1 ECX: CMPXCHG16B.
pub const LEAF1_ECX_CX16: u32 = 1 << 13;
/// Leaf 1 ECX: x2APIC.
pub const LEAF1_ECX_X2APIC: u32 = 1 << 21;
/// Leaf 1 ECX: TSC-deadline timer.
pub const LEAF1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// Leaf 1 ECX: running under a hypervisor.
pub const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX: hyper-threading (more than one logical processor).
pub const LEAF1_EDX_HTT: u32 = 1 << 28;

/// The KVM paravirtual features leaf (Documentation/virt/kvm/x86/cpuid.rst).
pub const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
/// KVM_FEATURE_PV_UNHALT: PV spinlocks kick halted vCPUs by hypercall.
pub const KVM_FEATURE_PV_UNHALT: u32 = 1 << 7;
/// KVM_FEATURE_PV_SEND_IPI: IPIs by hypercall.
pub const KVM_FEATURE_PV_SEND_IPI: u32 = 1 << 11;
/// KVM_FEATURE_PV_SCHED_YIELD: yield to a preempted vCPU by hypercall.
pub const KVM_FEATURE_PV_SCHED_YIELD: u32 = 1 << 13;
/// KVM_FEATURE_HC_MAP_GPA_RANGE: the MAP_GPA_RANGE hypercall.
pub const KVM_FEATURE_HC_MAP_GPA_RANGE: u32 = 1 << 16;
/// The KVM features that need a working hypercall instruction.
pub const KVM_HYPERCALL_FEATURES: u32 =
    KVM_FEATURE_PV_UNHALT | KVM_FEATURE_PV_SEND_IPI | KVM_FEATURE_PV_SCHED_YIELD | KVM_FEATURE_HC_MAP_GPA_RANGE;

/// Where a vCPU sits in the VM.
#[derive(Clone, Copy, Debug)]
pub struct VcpuTopology {
    /// This vCPU's index, which is also its APIC ID.
    pub index: u8,
    /// The number of vCPUs in the VM (1..=255).
    pub count: u8,
}

/// Filters the supported CPUID entries `entries` in place for one vCPU.
pub fn filter_cpuid(entries: &mut [kvm_cpuid_entry2], topo: VcpuTopology, profile: HostProfile) {
    let count = u32::from(topo.count.max(1));
    let index = u32::from(topo.index);
    // Bits of x2APIC ID that select the core: ceil(log2(count)).
    let core_bits = 32 - (count - 1).leading_zeros();
    for e in entries.iter_mut() {
        match e.function {
            0x1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (index << 24) | (count << 16);
                e.ecx |= LEAF1_ECX_HYPERVISOR;
                e.ecx &= !(LEAF1_ECX_VMX | LEAF1_ECX_MONITOR);
                if profile == HostProfile::Pvm {
                    e.ecx &= !LEAF1_ECX_CX16;
                }
                if count > 1 {
                    e.edx |= LEAF1_EDX_HTT;
                } else {
                    e.edx &= !LEAF1_EDX_HTT;
                }
            }
            0x4 => {
                e.eax = (e.eax & 0x03ff_ffff) | ((count - 1) << 26);
            }
            0x6 | 0xa => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            0xb | 0x1f => {
                e.edx = index;
                match e.index {
                    0 => {
                        // SMT level: one thread per core.
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (1 << 8) | e.index;
                    }
                    1 => {
                        // Core level: `count` cores in the package.
                        e.eax = core_bits;
                        e.ebx = count;
                        e.ecx = (2 << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            KVM_CPUID_FEATURES if profile == HostProfile::Pvm => {
                e.eax &= !KVM_HYPERCALL_FEATURES;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, flags: 0, eax, ebx, ecx, edx, ..Default::default() }
    }

    fn host_like() -> Vec<kvm_cpuid_entry2> {
        vec![
            entry(0x1, 0, 0x806f8, 0xff00_0800, 0xfffa_3223 | LEAF1_ECX_VMX | LEAF1_ECX_MONITOR, 0x178b_fbff),
            entry(0x4, 0, 0xfc00_4121, 0, 0, 0),
            entry(0x6, 0, 0x77, 2, 9, 0),
            entry(0xa, 0, 0x0703_0302, 0, 0, 0x603),
            entry(0xb, 0, 1, 2, 0x100, 7),
            entry(0xb, 1, 7, 64, 0x201, 7),
            entry(0xb, 2, 0, 0, 2, 7),
            entry(0x8000_0001, 0, 0, 0, 0x121, 0x2c10_0800),
            entry(KVM_CPUID_FEATURES, 0, 0x0100_7afb, 0, 0, 0),
        ]
    }

    #[test]
    fn leaf1_gets_topology_and_hypervisor_bit() {
        let mut e = host_like();
        filter_cpuid(&mut e, VcpuTopology { index: 3, count: 4 }, HostProfile::BareMetal);
        let l1 = e[0];
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800, "CLFLUSH size kept");
        assert_ne!(l1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_eq!(l1.ecx & (LEAF1_ECX_VMX | LEAF1_ECX_MONITOR), 0);
        assert_ne!(l1.edx & LEAF1_EDX_HTT, 0);
        // Bare metal keeps cx16, x2apic, tsc-deadline.
        assert_eq!(l1.ecx & LEAF1_ECX_CX16, LEAF1_ECX_CX16);
        assert_eq!(l1.ecx & LEAF1_ECX_X2APIC, LEAF1_ECX_X2APIC);
    }

    #[test]
    fn pvm_clears_what_the_emulator_lacks() {
        let mut e = host_like();
        filter_cpuid(&mut e, VcpuTopology { index: 0, count: 1 }, HostProfile::Pvm);
        assert_eq!(e[0].ecx & LEAF1_ECX_CX16, 0);
        // x2APIC and the TSC-deadline timer work here and cut boot time
        // (MSR writes instead of emulated xAPIC MMIO).
        let kept = LEAF1_ECX_X2APIC | LEAF1_ECX_TSC_DEADLINE;
        assert_eq!(e[0].ecx & kept, host_like()[0].ecx & kept);
        assert_eq!(e[0].edx & LEAF1_EDX_HTT, 0, "one vCPU: no HTT");
        assert_eq!(e[8].eax, 0x0100_7afb & !KVM_HYPERCALL_FEATURES);
        assert_eq!(e[8].eax & KVM_HYPERCALL_FEATURES, 0);
        let mut bare = host_like();
        filter_cpuid(&mut bare, VcpuTopology { index: 0, count: 1 }, HostProfile::BareMetal);
        assert_eq!(bare[8].eax, 0x0100_7afb, "bare metal keeps PV features");
    }

    #[test]
    fn pmu_and_thermal_leaves_are_zeroed() {
        let mut e = host_like();
        filter_cpuid(&mut e, VcpuTopology { index: 0, count: 2 }, HostProfile::BareMetal);
        for l in [&e[2], &e[3]] {
            assert_eq!((l.eax, l.ebx, l.ecx, l.edx), (0, 0, 0, 0));
        }
        // Other leaves untouched.
        assert_eq!(e[7].edx, 0x2c10_0800);
    }

    #[test]
    fn extended_topology_describes_one_core_per_vcpu() {
        let mut e = host_like();
        filter_cpuid(&mut e, VcpuTopology { index: 5, count: 6 }, HostProfile::BareMetal);
        assert_eq!(e[1].eax >> 26, 5);
        let (smt, core, inval) = (e[4], e[5], e[6]);
        assert_eq!((smt.eax, smt.ebx, smt.ecx >> 8, smt.edx), (0, 1, 1, 5));
        assert_eq!((core.eax, core.ebx, core.ecx >> 8, core.edx), (3, 6, 2, 5));
        assert_eq!((inval.eax, inval.ebx, inval.ecx >> 8), (0, 0, 0));
    }
}
