//! Long-mode page tables: the boot identity map, and a software walk of
//! the guest's own tables (to read the instruction bytes at a faulting RIP).
//!
//! Entry formats: Intel SDM vol. 3A, section 4.5 (4-level paging).

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::{PDE_START, PDPTE_START, PML4_START};

const PRESENT: u64 = 1 << 0;
const WRITABLE: u64 = 1 << 1;
/// The PS ("page size") flag of a PDPTE or PDE: the entry maps a 1 GiB or
/// 2 MiB page instead of pointing to a table.
const LARGE_PAGE: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// CR0.PE: protected mode.
pub const CR0_PE: u64 = 1 << 0;
/// CR0.ET: extension type (always 1 on modern CPUs).
pub const CR0_ET: u64 = 1 << 4;
/// CR0.PG: paging.
pub const CR0_PG: u64 = 1 << 31;
/// CR4.PAE: physical address extension (required for long mode).
pub const CR4_PAE: u64 = 1 << 5;
/// CR4.LA57: 5-level paging.
pub const CR4_LA57: u64 = 1 << 12;
/// EFER.LME: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER.LMA: long mode active.
pub const EFER_LMA: u64 = 1 << 10;

/// Errors of page table set-up and walks.
#[derive(Debug, thiserror::Error)]
pub enum PagingError {
    /// Writing the boot tables to guest memory failed.
    #[error("cannot write the boot page tables to guest memory: {0}")]
    Write(#[source] vm_memory::GuestMemoryError),
    /// A table entry on the walk is not present.
    #[error("guest virtual address {gva:#x} is not mapped (level {level} entry not present)")]
    NotMapped {
        /// The address walked.
        gva: u64,
        /// 4 for the PML4 entry, down to 1 for the page table entry.
        level: u8,
    },
    /// A table on the walk lies outside guest memory.
    #[error("page table at GPA {0:#x} is outside guest memory")]
    TableOutsideMemory(u64),
    /// The guest uses a paging mode this walk does not implement.
    #[error("guest paging mode not supported by the walk (32-bit or 5-level paging)")]
    UnsupportedMode,
}

/// Writes the boot page tables: an identity map of the first 1 GiB of GPA
/// space with 2 MiB pages (PML4 -> one PDPT -> one PD of 512 entries).
/// Returns the value for CR3.
pub fn write_identity_map<M: GuestMemoryBackend>(mem: &M) -> Result<u64, PagingError> {
    mem.write_obj(PDPTE_START | PRESENT | WRITABLE, GuestAddress(PML4_START)).map_err(PagingError::Write)?;
    mem.write_obj(PDE_START | PRESENT | WRITABLE, GuestAddress(PDPTE_START)).map_err(PagingError::Write)?;
    for i in 0..512u64 {
        mem.write_obj((i << 21) | PRESENT | WRITABLE | LARGE_PAGE, GuestAddress(PDE_START + i * 8))
            .map_err(PagingError::Write)?;
    }
    Ok(PML4_START)
}

/// The paging state a walk needs, from `kvm_sregs`.
#[derive(Clone, Copy, Debug, Default)]
pub struct PagingState {
    /// CR0.
    pub cr0: u64,
    /// CR3.
    pub cr3: u64,
    /// CR4.
    pub cr4: u64,
    /// IA32_EFER.
    pub efer: u64,
}

/// Translates a guest linear address to a GPA by walking the guest's page
/// tables. Without paging the address is the GPA. Supports 4-level long
/// mode paging with 1 GiB, 2 MiB and 4 KiB pages.
///
/// Errors: [`PagingError::NotMapped`], [`PagingError::TableOutsideMemory`],
/// [`PagingError::UnsupportedMode`].
pub fn translate<M: GuestMemoryBackend>(mem: &M, state: &PagingState, gva: u64) -> Result<u64, PagingError> {
    if state.cr0 & CR0_PG == 0 {
        return Ok(gva);
    }
    if state.efer & EFER_LMA == 0 || state.cr4 & CR4_LA57 != 0 {
        return Err(PagingError::UnsupportedMode);
    }
    let mut table = state.cr3 & ADDR_MASK;
    for level in (1..=4u8).rev() {
        let shift = 12 + 9 * (u32::from(level) - 1);
        let index = (gva >> shift) & 0x1ff;
        let entry: u64 =
            mem.read_obj(GuestAddress(table + index * 8)).map_err(|_| PagingError::TableOutsideMemory(table))?;
        if entry & PRESENT == 0 {
            return Err(PagingError::NotMapped { gva, level });
        }
        let large = entry & LARGE_PAGE != 0 && (level == 2 || level == 3);
        if large || level == 1 {
            let offset_mask = (1u64 << shift) - 1;
            return Ok((entry & ADDR_MASK & !offset_mask) | (gva & offset_mask));
        }
        table = entry & ADDR_MASK;
    }
    unreachable!("the level 1 entry always returns")
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap()
    }

    fn long_mode(cr3: u64) -> PagingState {
        PagingState { cr0: CR0_PE | CR0_PG | CR0_ET, cr3, cr4: CR4_PAE, efer: EFER_LME | EFER_LMA }
    }

    #[test]
    fn identity_map_covers_the_first_gib() {
        let m = mem();
        let cr3 = write_identity_map(&m).unwrap();
        let st = long_mode(cr3);
        for gva in [0u64, 0x1000, 0x1234_5678, (1 << 30) - 1] {
            assert_eq!(translate(&m, &st, gva).unwrap(), gva);
        }
        assert!(matches!(translate(&m, &st, 1 << 30), Err(PagingError::NotMapped { level: 3, .. })));
    }

    #[test]
    fn walks_4k_pages_of_a_higher_half_mapping() {
        let m = mem();
        // Map GVA 0xffffffff81000000 -> GPA 0x200000 with 4 KiB pages.
        let gva: u64 = 0xffff_ffff_8100_0123;
        let (pml4, pdpt, pd, pt) = (0x10_0000u64, 0x10_1000u64, 0x10_2000u64, 0x10_3000u64);
        let idx = |l: u32| (gva >> (12 + 9 * (l - 1))) & 0x1ff;
        m.write_obj(pdpt | 3, GuestAddress(pml4 + idx(4) * 8)).unwrap();
        m.write_obj(pd | 3, GuestAddress(pdpt + idx(3) * 8)).unwrap();
        m.write_obj(pt | 3, GuestAddress(pd + idx(2) * 8)).unwrap();
        m.write_obj(0x20_0000u64 | 3, GuestAddress(pt + idx(1) * 8)).unwrap();
        assert_eq!(translate(&m, &long_mode(pml4), gva).unwrap(), 0x20_0123);
        // The next page is not mapped.
        assert!(matches!(translate(&m, &long_mode(pml4), gva + 0x1000), Err(PagingError::NotMapped { level: 1, .. })));
    }

    #[test]
    fn no_paging_is_identity_and_32_bit_is_refused() {
        let m = mem();
        let real = PagingState::default();
        assert_eq!(translate(&m, &real, 0xffff0).unwrap(), 0xffff0);
        let pae32 = PagingState { cr0: CR0_PE | CR0_PG, cr3: 0, cr4: CR4_PAE, efer: 0 };
        assert!(matches!(translate(&m, &pae32, 0x1000), Err(PagingError::UnsupportedMode)));
    }

    #[test]
    fn table_outside_memory_is_an_error() {
        let m = mem();
        assert!(matches!(translate(&m, &long_mode(0x4000_0000), 0x1000), Err(PagingError::TableOutsideMemory(_))));
    }
}
