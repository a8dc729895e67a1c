//! The Intel MultiProcessor table (MP Specification 1.4, chapter 4): tells
//! a guest without ACPI how many CPUs it has, where its IOAPIC is, and how
//! ISA interrupts reach it.
//!
//! Layout: the MP floating pointer structure at [`EBDA_START`], the
//! configuration table right after it; both must fit in the 1 KiB below
//! 640 KiB, which bounds the vCPU count ([`MAX_VCPUS`]).

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::{APIC_START, EBDA_START, IOAPIC_START};

/// Most vCPUs the table (and the guest kernel's NR_CPUS) describes.
pub const MAX_VCPUS: u8 = 32;
/// IOAPIC input pins KVM's in-kernel IOAPIC has.
pub const IOAPIC_PINS: u8 = 24;
const TABLE_LIMIT: usize = 1024;

const MPC_SPEC_REV: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
const MP_INT_TYPE_INT: u8 = 0;
const MP_INT_TYPE_NMI: u8 = 1;
const MP_INT_TYPE_EXTINT: u8 = 3;

/// Errors of MP table set-up.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    /// The vCPU count is 0 or above [`MAX_VCPUS`].
    #[error("{0} vCPUs cannot be described: the MP table takes 1 to {MAX_VCPUS}")]
    TooManyCpus(u8),
    /// Writing to guest memory failed.
    #[error("cannot write the MP table to guest memory: {0}")]
    Write(#[source] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer structure and configuration table for
/// `cpus` vCPUs (APIC IDs `0..cpus`, vCPU 0 the bootstrap processor),
/// placed at GPA `base`. Returns the bytes to write at `base`.
pub fn build(cpus: u8, base: u64) -> Result<Vec<u8>, MptableError> {
    if cpus == 0 || cpus > MAX_VCPUS {
        return Err(MptableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus + 1;
    let table_addr = base + 16;

    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..cpus {
        let flags = CPU_ENABLED | if id == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend_from_slice(&[0, id, APIC_VERSION, flags]);
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;
    // ISA IRQ n -> IOAPIC pin n, as KVM's default GSI routing wires them.
    for pin in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, MP_INT_TYPE_INT, 0, 0, 0, pin, ioapic_id, pin]);
        count += 1;
    }
    // LINT0: ExtINT (the PIC), LINT1: NMI, on every local APIC.
    entries.extend_from_slice(&[4, MP_INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, MP_INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let length = 44 + entries.len();
    let mut table = Vec::with_capacity(length);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&(length as u16).to_le_bytes());
    table.push(MPC_SPEC_REV);
    table.push(0); // checksum, below
    table.extend_from_slice(b"TINE    ");
    table.extend_from_slice(b"MICROVM     ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    table.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = Vec::with_capacity(16);
    fp.extend_from_slice(b"_MP_");
    fp.extend_from_slice(&(table_addr as u32).to_le_bytes());
    fp.push(1); // length in 16-byte units
    fp.push(MPC_SPEC_REV);
    fp.push(0); // checksum, below
    fp.extend_from_slice(&[0; 5]); // feature bytes: a configuration table is present
    fp[10] = checksum(&fp);

    let mut out = fp;
    out.extend_from_slice(&table);
    debug_assert!(out.len() <= TABLE_LIMIT);
    Ok(out)
}

/// Writes the MP table for `cpus` vCPUs at [`EBDA_START`].
pub fn write<M: GuestMemoryBackend>(mem: &M, cpus: u8) -> Result<(), MptableError> {
    let bytes = build(cpus, EBDA_START)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START)).map_err(MptableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_counts_are_right() {
        for cpus in [1u8, 2, MAX_VCPUS] {
            let t = build(cpus, EBDA_START).unwrap();
            assert!(t.len() <= TABLE_LIMIT, "{cpus} cpus: {} bytes", t.len());
            assert_eq!(&t[0..4], b"_MP_");
            assert_eq!(sum(&t[0..16]), 0);
            let ptr = u32::from_le_bytes(t[4..8].try_into().unwrap()) as u64;
            assert_eq!(ptr, EBDA_START + 16);
            let table = &t[16..];
            assert_eq!(&table[0..4], b"PCMP");
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(sum(table), 0);
            let count = u16::from_le_bytes([table[34], table[35]]);
            assert_eq!(count as usize, cpus as usize + 2 + IOAPIC_PINS as usize + 2);
            // Walk the entries: processors first, BSP flagged once.
            let mut off = 44;
            let mut procs = 0;
            let mut bsps = 0;
            while off < len {
                let size = if table[off] == 0 { 20 } else { 8 };
                if table[off] == 0 {
                    procs += 1;
                    bsps += usize::from(table[off + 3] & CPU_BOOTPROCESSOR != 0);
                }
                off += size;
            }
            assert_eq!(off, len);
            assert_eq!((procs, bsps), (cpus as usize, 1));
        }
    }

    #[test]
    fn refuses_bad_counts() {
        assert!(build(0, EBDA_START).is_err());
        assert!(build(MAX_VCPUS + 1, EBDA_START).is_err());
    }
}
