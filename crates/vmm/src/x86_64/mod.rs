//! x86_64 guest set-up: the boot-time memory layout, CPUID, segment and
//! page tables, vCPU registers, the MP table, and kernel loading.
//!
//! The layout follows the Linux x86 boot protocol
//! (Documentation/arch/x86/boot.rst, "64-bit Boot Protocol"): the VMM
//! enters the kernel in long mode with paging on, RSI pointing at the
//! zero page (`struct boot_params`).

pub mod boot;
pub mod cpuid;
pub mod gdt;
pub mod mptable;
pub mod paging;
pub mod regs;

/// GPA of the boot GDT.
pub const BOOT_GDT_START: u64 = 0x500;
/// GPA of the boot IDT (empty: any exception before the kernel loads its
/// own IDT triple-faults, which the VMM reports).
pub const BOOT_IDT_START: u64 = 0x520;
/// GPA of the zero page (`struct boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer (GPA) at kernel entry.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// GPA of the boot page map level 4 table.
pub const PML4_START: u64 = 0x9000;
/// GPA of the boot page directory pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// GPA of the boot page directory (2 MiB pages, identity map of 1 GiB).
pub const PDE_START: u64 = 0xb000;
/// GPA of the kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Largest kernel command line, bytes with the NUL (x86 COMMAND_LINE_SIZE).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area, where the MP table goes; RAM
/// below it is reported usable in the e820 map.
pub const EBDA_START: u64 = 0x9fc00;
/// Start of high memory (1 MiB): the lowest GPA a kernel is loaded at.
pub const HIMEM_START: u64 = 0x10_0000;
/// GPA of the IOAPIC's MMIO window.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// GPA of the local APICs' MMIO window.
pub const APIC_START: u64 = 0xfee0_0000;
/// Address KVM uses for the TSS it needs for real mode (3 pages below the
/// IOAPIC's hole; see KVM_SET_TSS_ADDR in Documentation/virt/kvm/api.rst).
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// Address of KVM's identity map page (one page below the TSS).
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;
