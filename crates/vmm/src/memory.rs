//! Guest memory: one memfd backs all guest RAM, mapped shared into the VMM
//! and registered with KVM as one memory slot per region.
//!
//! The memfd is what later snapshots write out and what copy-on-write
//! branches map privately, so every byte of guest RAM lives in it.
//!
//! Layout (x86_64): RAM starts at guest physical address (GPA) 0; RAM that
//! does not fit below [`MMIO_GAP_START`] continues at 4 GiB, leaving
//! `[MMIO_GAP_START, 4 GiB)` for device MMIO.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Start of the MMIO gap below 4 GiB (GPA, bytes).
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO gap (GPA, bytes): RAM resumes here.
pub const MMIO_GAP_END: u64 = 1 << 32;
/// Smallest guest RAM accepted (bytes).
pub const MIN_MEM_BYTES: u64 = 16 << 20;
/// Largest guest RAM accepted (bytes).
pub const MAX_MEM_BYTES: u64 = 1 << 40;

/// Errors of guest memory set-up.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The requested size is outside [`MIN_MEM_BYTES`]..=[`MAX_MEM_BYTES`] or not page aligned.
    #[error("guest memory size {0} bytes is invalid: it must be a multiple of 4 KiB between 16 MiB and 1 TiB")]
    InvalidSize(u64),
    /// memfd_create or ftruncate failed.
    #[error("cannot create the guest memory file: {0}")]
    Memfd(#[source] std::io::Error),
    /// mmap of the memory file failed.
    #[error("cannot map guest memory: {0}")]
    Mmap(String),
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error("KVM_SET_USER_MEMORY_REGION for slot {slot} failed: {source}")]
    RegisterSlot {
        /// The memory slot.
        slot: u32,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// The guest RAM ranges for `size` bytes of RAM: `(start GPA, length in bytes)`,
/// sorted, split around the MMIO gap.
pub fn ram_ranges(size: u64) -> Vec<(GuestAddress, u64)> {
    if size <= MMIO_GAP_START {
        vec![(GuestAddress(0), size)]
    } else {
        vec![
            (GuestAddress(0), MMIO_GAP_START),
            (GuestAddress(MMIO_GAP_END), size - MMIO_GAP_START),
        ]
    }
}

/// Guest RAM sizes accepted: [`MIN_MEM_BYTES`]..=[`MAX_MEM_BYTES`], whole pages.
fn check_size(size: u64) -> Result<(), MemoryError> {
    if !(MIN_MEM_BYTES..=MAX_MEM_BYTES).contains(&size) || !size.is_multiple_of(4096) {
        return Err(MemoryError::InvalidSize(size));
    }
    Ok(())
}

/// Guest RAM backed by one memfd.
pub struct GuestRam {
    /// The mapped regions, as rust-vmm's memory model sees them.
    pub memory: GuestMemoryMmap,
    /// The memfd behind every region; region `i` starts at the sum of the
    /// lengths of regions `0..i` in the file.
    pub file: File,
    /// Total RAM in bytes.
    pub size: u64,
}

impl GuestRam {
    /// Creates `size` bytes of zeroed guest RAM in a new memfd named `name`.
    ///
    /// Errors: [`MemoryError::InvalidSize`], [`MemoryError::Memfd`],
    /// [`MemoryError::Mmap`].
    pub fn new(name: &str, size: u64) -> Result<Self, MemoryError> {
        check_size(size)?;
        let cname = CString::new(format!("tine-guest-ram-{name}")).unwrap_or_default();
        let fd = nix::sys::memfd::memfd_create(&cname, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
            .map_err(|e| MemoryError::Memfd(e.into()))?;
        let file = File::from(fd);
        file.set_len(size).map_err(MemoryError::Memfd)?;

        let mut offset = 0u64;
        let mut ranges = Vec::new();
        for (gpa, len) in ram_ranges(size) {
            let dup = file.try_clone().map_err(MemoryError::Memfd)?;
            ranges.push((gpa, len as usize, Some(FileOffset::new(dup, offset))));
            offset += len;
        }
        let memory = GuestMemoryMmap::from_ranges_with_files(ranges)
            .map_err(|e| MemoryError::Mmap(e.to_string()))?;
        Ok(GuestRam { memory, file, size })
    }

    /// Registers every region with KVM, slot `i` for region `i`.
    ///
    /// Errors: [`MemoryError::RegisterSlot`].
    pub fn register(&self, vm: &VmFd) -> Result<(), MemoryError> {
        for (slot, region) in self.memory.iter().enumerate() {
            let slot = slot as u32;
            let mem_region = kvm_userspace_memory_region {
                slot,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
                flags: 0,
            };
            // SAFETY: the host virtual address range [as_ptr, as_ptr + len)
            // is a live mapping owned by `self.memory`, which the caller
            // keeps alive for as long as the VM exists (the `Vm` owns both).
            unsafe { vm.set_user_memory_region(mem_region) }
                .map_err(|source| MemoryError::RegisterSlot { slot, source })?;
        }
        Ok(())
    }

    /// Maps the memory file `path` (as [`GuestRam::write_to`] wrote it)
    /// copy-on-write (`MAP_PRIVATE`) as guest RAM of `size` bytes: pages
    /// come from the page cache, shared by every VM mapped from the same
    /// file, and a guest write copies just that page.
    ///
    /// Errors: [`MemoryError::InvalidSize`] (also if the file's size is not
    /// `size`), [`MemoryError::Memfd`] (opening the file),
    /// [`MemoryError::Mmap`].
    pub fn from_file_private(path: &std::path::Path, size: u64) -> Result<Self, MemoryError> {
        use vm_memory::mmap::MmapRegionBuilder;
        use vm_memory::GuestRegionMmap;
        check_size(size)?;
        let file = File::open(path).map_err(MemoryError::Memfd)?;
        let len = file.metadata().map_err(MemoryError::Memfd)?.len();
        if len != size {
            return Err(MemoryError::InvalidSize(len));
        }
        let mut regions = Vec::new();
        let mut offset = 0u64;
        for (gpa, len) in ram_ranges(size) {
            let dup = file.try_clone().map_err(MemoryError::Memfd)?;
            let region = MmapRegionBuilder::new(len as usize)
                .with_file_offset(FileOffset::new(dup, offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
                .build()
                .map_err(|e| MemoryError::Mmap(e.to_string()))?;
            regions.push(GuestRegionMmap::new(region, gpa).ok_or_else(|| MemoryError::Mmap("region overflows".into()))?);
            offset += len;
        }
        let memory = GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Mmap(e.to_string()))?;
        Ok(GuestRam { memory, file, size })
    }

    /// Writes guest RAM to `path` (created or truncated): the memfd's data
    /// ranges only (`SEEK_DATA`/`SEEK_HOLE`), so untouched memory stays a
    /// hole in a sparse file. The VM must not run meanwhile. Returns the
    /// bytes copied.
    ///
    /// Errors: [`MemoryError::Memfd`] for I/O errors.
    pub fn write_to(&self, path: &std::path::Path) -> Result<u64, MemoryError> {
        use std::os::unix::fs::FileExt;
        let out = File::create(path).map_err(MemoryError::Memfd)?;
        out.set_len(self.size).map_err(MemoryError::Memfd)?;
        let fd = self.file.as_raw_fd();
        let mut pos: i64 = 0;
        let mut copied = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        while (pos as u64) < self.size {
            // SAFETY: lseek on our own fd; no memory is passed.
            let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
            if data < 0 {
                break; // ENXIO: no data after `pos`.
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let end = if hole < 0 { self.size as i64 } else { hole };
            let mut at = data as u64;
            while at < end as u64 {
                let n = ((end as u64 - at) as usize).min(buf.len());
                self.file.read_exact_at(&mut buf[..n], at).map_err(MemoryError::Memfd)?;
                out.write_all_at(&buf[..n], at).map_err(MemoryError::Memfd)?;
                at += n as u64;
                copied += n as u64;
            }
            pos = end;
        }
        out.sync_data().map_err(MemoryError::Memfd)?;
        Ok(copied)
    }

    /// The raw fd of the backing memfd.
    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// Bytes of host memory allocated to the memfd (pages the guest or the
    /// VMM has touched), from `st_blocks` (512-byte units, `stat(2)`).
    ///
    /// Errors: the `fstat` error.
    pub fn allocated_bytes(&self) -> std::io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.file.metadata()?.blocks() * 512)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn allocated_bytes_counts_touched_pages_only() {
        let ram = GuestRam::new("alloc-test", 64 << 20).unwrap();
        assert_eq!(ram.allocated_bytes().unwrap(), 0);
        ram.memory.write_slice(&[1u8; 8192], GuestAddress(1 << 20)).unwrap();
        assert_eq!(ram.allocated_bytes().unwrap(), 8192);
    }

    #[test]
    fn ranges_split_around_the_mmio_gap() {
        assert_eq!(ram_ranges(512 << 20), vec![(GuestAddress(0), 512 << 20)]);
        assert_eq!(ram_ranges(MMIO_GAP_START), vec![(GuestAddress(0), MMIO_GAP_START)]);
        let r = ram_ranges(4 << 30);
        assert_eq!(r, vec![(GuestAddress(0), MMIO_GAP_START), (GuestAddress(MMIO_GAP_END), (4 << 30) - MMIO_GAP_START)]);
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), 4 << 30);
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(matches!(GuestRam::new("t", 1 << 20), Err(MemoryError::InvalidSize(_))));
        assert!(matches!(GuestRam::new("t", (64 << 20) + 1), Err(MemoryError::InvalidSize(_))));
    }

    #[test]
    fn memory_is_backed_by_the_memfd() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new("t", 64 << 20).unwrap();
        ram.memory.write_obj(0xdead_beefu32, GuestAddress(0x1234)).unwrap();
        let mut buf = [0u8; 4];
        ram.file.read_exact_at(&mut buf, 0x1234).unwrap();
        assert_eq!(u32::from_le_bytes(buf), 0xdead_beef);
    }
}
