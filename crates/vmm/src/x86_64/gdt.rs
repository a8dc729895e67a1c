//! Segment descriptors for the boot GDT (Intel SDM vol. 3A, section 3.4.5)
//! and their `kvm_segment` form.

use kvm_bindings::kvm_segment;

/// Selector index of the boot code segment (`__BOOT_CS` = 0x10).
pub const BOOT_CS_INDEX: u8 = 2;
/// Selector index of the boot data segment (`__BOOT_DS` = 0x18).
pub const BOOT_DS_INDEX: u8 = 3;
/// Selector index of the boot TSS.
pub const BOOT_TSS_INDEX: u8 = 4;

/// Packs a descriptor. `flags` holds the access byte in bits 0..8 and the
/// G/DB/L/AVL nibble in bits 12..16, as in `0xa09b` (64-bit code).
/// `limit` is 20 bits; `base` 32 bits.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

fn base(entry: u64) -> u64 {
    ((entry >> 32) & 0xff00_0000) | ((entry >> 16) & 0x00ff_ffff)
}

fn limit(entry: u64) -> u32 {
    let raw = (((entry >> 32) & 0x000f_0000) | (entry & 0x0000_ffff)) as u32;
    // With G set, the limit counts 4 KiB pages.
    if (entry >> 55) & 1 == 1 {
        (raw << 12) | 0xfff
    } else {
        raw
    }
}

/// The `kvm_segment` for descriptor `entry` at GDT index `index`.
pub fn kvm_segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    kvm_segment {
        base: base(entry),
        limit: limit(entry),
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from((entry >> 47) & 1 == 0),
    }
}

/// The boot GDT: null, null, 64-bit code (0x10), data (0x18), TSS (0x20).
pub fn boot_gdt() -> [u64; 5] {
    [
        0,
        0,
        gdt_entry(0xa09b, 0, 0xfffff), // code: present, exec/read, accessed, L, G
        gdt_entry(0xc093, 0, 0xfffff), // data: present, read/write, accessed, DB, G
        gdt_entry(0x808b, 0, 0xfffff), // TSS: present, busy 64-bit TSS, G
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_segment_decodes() {
        let s = kvm_segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), BOOT_CS_INDEX);
        assert_eq!(s.selector, 0x10);
        assert_eq!((s.type_, s.present, s.dpl, s.s, s.l, s.db, s.g), (0xb, 1, 0, 1, 1, 0, 1));
        assert_eq!(s.limit, 0xffff_ffff);
        assert_eq!(s.base, 0);
        assert_eq!(s.unusable, 0);
    }

    #[test]
    fn base_and_limit_round_trip() {
        let e = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        let s = kvm_segment_from_gdt(e, 1);
        assert_eq!(s.base, 0x1234_5678);
        assert_eq!(s.limit, 0xabcde);
        assert_eq!(s.g, 0);
        assert_eq!(s.type_, 3);
    }

    #[test]
    fn null_descriptor_is_unusable() {
        assert_eq!(kvm_segment_from_gdt(0, 0).unusable, 1);
    }

    #[test]
    fn boot_selectors_match_the_boot_protocol() {
        let gdt = boot_gdt();
        assert_eq!(kvm_segment_from_gdt(gdt[BOOT_DS_INDEX as usize], BOOT_DS_INDEX).selector, 0x18);
        assert_eq!(kvm_segment_from_gdt(gdt[BOOT_TSS_INDEX as usize], BOOT_TSS_INDEX).type_, 0xb);
    }
}
