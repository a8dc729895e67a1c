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
use std::sync::OnceLock;

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
/// The huge page size guest RAM uses with huge pages (bytes): x86_64's
/// PMD-mapped 2 MiB pages from the hugetlbfs pool.
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

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
    /// Lazy restore through userfaultfd could not be set up
    /// ([`MemoryBacking::Userfaultfd`]).
    #[error(transparent)]
    Userfaultfd(#[from] crate::uffd::UffdError),
    /// Guest RAM of huge pages could not be had: too few free huge pages in
    /// the host's pool, or a size that is not whole huge pages.
    #[error("{0}")]
    HugePages(String),
    /// A hibernated guest's page file could not be laid over its base.
    #[error(transparent)]
    PageFile(#[from] crate::pagefile::PageFileError),
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
        vec![(GuestAddress(0), MMIO_GAP_START), (GuestAddress(MMIO_GAP_END), size - MMIO_GAP_START)]
    }
}

/// Guest RAM sizes accepted: [`MIN_MEM_BYTES`]..=[`MAX_MEM_BYTES`], whole pages.
fn check_size(size: u64) -> Result<(), MemoryError> {
    if !(MIN_MEM_BYTES..=MAX_MEM_BYTES).contains(&size) || !size.is_multiple_of(4096) {
        return Err(MemoryError::InvalidSize(size));
    }
    Ok(())
}

/// How a snapshot's memory file becomes guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryBacking {
    /// The file is mapped `MAP_PRIVATE | MAP_NORESERVE`: pages are read from
    /// and shared through the page cache by every VM restored from the same
    /// file, and a guest write copies just that page, privately.
    #[default]
    Private,
    /// Guest RAM is anonymous private memory that a handler thread fills on
    /// first touch, `UFFDIO_COPY` from the file, or `UFFDIO_ZEROPAGE` for
    /// holes, all-zero pages and ranges the guest gave back (see
    /// [`crate::uffd`]). For files not on a local file system (whose pages
    /// should not be mapped from the page cache), or to prefetch. Needs
    /// userfaultfd: root, or access to `/dev/userfaultfd`, or
    /// `vm.unprivileged_userfaultfd=1`.
    Userfaultfd,
}

/// Host memory that guest RAM takes, from `/proc/self/smaps` (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryUsage {
    /// Resident pages of guest RAM in this process (`Rss:`), in bytes.
    pub rss_bytes: u64,
    /// Proportional share of the resident pages (`Pss:`): a page shared by
    /// `n` processes counts `1/n`; in bytes.
    pub pss_bytes: u64,
    /// Resident pages mapped by this process only (`Private_Clean:` +
    /// `Private_Dirty:`), in bytes.
    pub private_bytes: u64,
}

/// Guest RAM backed by one memfd (or, restored from a snapshot, by the
/// snapshot's memory file, see [`MemoryBacking`]).
pub struct GuestRam {
    /// The userfaultfd handler filling `memory` on first touch
    /// ([`MemoryBacking::Userfaultfd`]). Declared before `memory` so that it
    /// is dropped (its thread stopped and joined) before the regions are
    /// unmapped.
    uffd: Option<crate::uffd::Handler>,
    /// The mapped regions, as rust-vmm's memory model sees them.
    pub memory: GuestMemoryMmap,
    /// The memfd behind every region; region `i` starts at the sum of the
    /// lengths of regions `0..i` in the file. Restored from a snapshot, the
    /// snapshot's memory file instead (see [`MemoryBacking`]), which guest
    /// writes do not reach.
    pub file: File,
    /// Total RAM in bytes.
    pub size: u64,
    /// Whether `file` is a snapshot's (restored RAM) rather than the memfd
    /// that guest writes reach.
    restored: bool,
    /// Whether `file` is a hugetlbfs memfd of [`HUGE_PAGE_SIZE`] pages.
    huge_pages: bool,
    /// Restored RAM: the data ranges of `file` (`SEEK_DATA`/`SEEK_HOLE`),
    /// found once. The file is a snapshot's, which nothing writes while
    /// it backs RAM, and walking it took 1.5-2.2 ms of a branch's pause for
    /// 124-134 extents (docs/hosts.md).
    file_data: OnceLock<Vec<(u64, u64)>>,
}

impl GuestRam {
    /// Creates `size` bytes of zeroed guest RAM in a new memfd named `name`.
    ///
    /// Errors: [`MemoryError::InvalidSize`], [`MemoryError::Memfd`],
    /// [`MemoryError::Mmap`].
    pub fn new(name: &str, size: u64) -> Result<Self, MemoryError> {
        check_size(size)?;
        let file = new_memfd(&format!("tine-guest-ram-{name}"), size).map_err(MemoryError::Memfd)?;
        let memory = map_shared(&file, size, libc::MAP_SHARED | libc::MAP_NORESERVE)?;
        Ok(GuestRam { uffd: None, memory, file, size, restored: false, huge_pages: false, file_data: OnceLock::new() })
    }

    /// Creates `size` bytes of zeroed guest RAM of [`HUGE_PAGE_SIZE`] pages:
    /// a hugetlbfs memfd (`MFD_HUGETLB | MFD_HUGE_2MB`, `memfd_create(2)`)
    /// mapped shared, whose huge pages are reserved from the host's pool
    /// when it is mapped (no `MAP_NORESERVE`), so a guest can never touch a
    /// page the pool cannot give (which would be a `SIGBUS` in the VMM).
    /// Each guest page table entry the host keeps, and each page a branch
    /// write-protects, covers 2 MiB instead of 4 KiB
    /// (kernel doc `Documentation/admin-guide/mm/hugetlbpage.rst`).
    ///
    /// Errors: [`MemoryError::InvalidSize`]; [`MemoryError::HugePages`] for
    /// a size that is not whole huge pages or a pool without `size` bytes
    /// of free huge pages (the message says how to reserve them);
    /// [`MemoryError::Memfd`].
    pub fn new_huge(name: &str, size: u64) -> Result<Self, MemoryError> {
        check_size(size)?;
        if !size.is_multiple_of(HUGE_PAGE_SIZE) {
            return Err(MemoryError::HugePages(format!(
                "guest memory of {size} bytes is not a whole number of 2 MiB huge pages"
            )));
        }
        let file = new_hugetlb_memfd(&format!("tine-guest-ram-{name}"), size).map_err(|e| huge_pages_error(size, e))?;
        let memory = map_shared(&file, size, libc::MAP_SHARED).map_err(|e| match e {
            MemoryError::Mmap(m) => huge_pages_error(size, std::io::Error::other(m)),
            other => other,
        })?;
        Ok(GuestRam { uffd: None, memory, file, size, restored: false, huge_pages: true, file_data: OnceLock::new() })
    }

    /// Guest RAM of `size` bytes of huge pages ([`GuestRam::new_huge`])
    /// holding a snapshot's memory (a file as [`GuestRam::write_to`] wrote
    /// it, or a branch point's memfd): the file's data ranges are read into
    /// it up front, before any vCPU runs. Huge pages cannot be shared with
    /// the page cache copy-on-write, so a restore with huge pages costs a
    /// copy of the snapshot's data (about what it holds, not the RAM size)
    /// and takes its RAM privately.
    ///
    /// Errors: those of [`GuestRam::new_huge`], [`MemoryError::InvalidSize`]
    /// for a file of another size, [`MemoryError::Memfd`] for read errors.
    pub fn from_snapshot_huge(
        name: &str,
        memory: &crate::snapshot::SnapshotMemory,
        size: u64,
    ) -> Result<Self, MemoryError> {
        use std::os::unix::fs::FileExt;
        if let crate::snapshot::SnapshotMemory::Layered { base, pages } = memory {
            let ram = match base {
                Some(base) => Self::from_snapshot_huge(name, base, size)?,
                None => Self::new_huge(name, size)?,
            };
            ram.apply_pages(pages)?;
            return Ok(ram);
        }
        let file = memory.open().map_err(MemoryError::Memfd)?;
        check_snapshot_file(&file, size)?;
        let ram = Self::new_huge(name, size)?;
        for (start, end) in data_ranges(&file, size).map_err(MemoryError::Memfd)? {
            for (host, len, offset) in crate::uffd::host_slices(&ram.regions(), start, end) {
                // SAFETY: [host, host + len) lies inside one of `ram`'s
                // regions (host_slices clips to them), mapped read-write and
                // alive while `ram` is; no vCPU or device uses the RAM yet,
                // so nothing else reads or writes these bytes meanwhile.
                let dest = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, len) };
                file.read_exact_at(dest, offset).map_err(MemoryError::Memfd)?;
            }
        }
        Ok(ram)
    }

    /// Copies a page file's pages over this RAM (region by region in the
    /// memory file's layout); returns the pages written. Call it before any
    /// vCPU or device uses the RAM.
    ///
    /// Errors: [`MemoryError::PageFile`] (another size, a read error, a
    /// data CRC that does not match: the RAM must then not run).
    pub fn apply_pages(&self, pages: &crate::pagefile::PageFile) -> Result<u64, MemoryError> {
        let mut segments: Vec<&mut [u8]> = self
            .regions()
            .iter()
            // SAFETY: each region is one of this RAM's mappings, read-write
            // and alive while `self` is; the regions do not overlap, and no
            // vCPU or device uses the RAM yet (the caller's contract), so
            // these are the only references to those bytes.
            .map(|r| unsafe { std::slice::from_raw_parts_mut(r.host_addr as *mut u8, r.len) })
            .collect();
        Ok(pages.apply(&mut segments)?)
    }

    /// Whether this RAM is of [`HUGE_PAGE_SIZE`] pages ([`GuestRam::new_huge`]).
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The size of the pages backing this RAM in the host (bytes): 4096, or
    /// [`HUGE_PAGE_SIZE`]. Write protection and page faults work on whole
    /// pages of this size.
    pub fn page_size(&self) -> u64 {
        if self.huge_pages {
            HUGE_PAGE_SIZE
        } else {
            4096
        }
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
            // keeps alive for as long as the VM exists (the `RunningVm` owns both).
            unsafe { vm.set_user_memory_region(mem_region) }
                .map_err(|source| MemoryError::RegisterSlot { slot, source })?;
        }
        Ok(())
    }

    /// Maps the memory file `file` (as [`GuestRam::write_to`] wrote it, or a
    /// branch point's memfd) copy-on-write (`MAP_PRIVATE`) as guest RAM of
    /// `size` bytes: pages come from the page cache (or shmem), shared by
    /// every VM mapped from the same file, and a guest write copies just
    /// that page.
    ///
    /// Errors: [`MemoryError::InvalidSize`] (also if the file's size is not
    /// `size`), [`MemoryError::Memfd`] (its `fstat`),
    /// [`MemoryError::Mmap`].
    pub fn from_file_private(file: File, size: u64) -> Result<Self, MemoryError> {
        use vm_memory::mmap::MmapRegionBuilder;
        use vm_memory::GuestRegionMmap;
        check_snapshot_file(&file, size)?;
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
            regions
                .push(GuestRegionMmap::new(region, gpa).ok_or_else(|| MemoryError::Mmap("region overflows".into()))?);
            offset += len;
        }
        let memory = GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Mmap(e.to_string()))?;
        Ok(GuestRam::restored(None, memory, file, size))
    }

    /// Guest RAM of `size` bytes from a snapshot's memory (a file as
    /// [`GuestRam::write_to`] wrote it, or a branch point's memfd), the way
    /// `backing` says: [`GuestRam::from_file_private`] or
    /// [`GuestRam::from_file_uffd`] (whose handler thread is named
    /// `uffd-<name>`).
    ///
    /// A [`SnapshotMemory::Layered`](crate::snapshot::SnapshotMemory::Layered)
    /// memory is its base restored this way (or [`GuestRam::new`] without
    /// one) with the page file's pages copied over it before this returns.
    ///
    /// Errors: [`MemoryError::Memfd`] if the file cannot be opened,
    /// [`MemoryError::PageFile`], and those of the function it dispatches
    /// to.
    pub fn from_snapshot(
        name: &str,
        memory: &crate::snapshot::SnapshotMemory,
        size: u64,
        backing: MemoryBacking,
    ) -> Result<Self, MemoryError> {
        if let crate::snapshot::SnapshotMemory::Layered { base, pages } = memory {
            let ram = match base {
                Some(base) => Self::from_snapshot(name, base, size, backing)?,
                None => Self::new(name, size)?,
            };
            ram.apply_pages(pages)?;
            return Ok(ram);
        }
        let file = memory.open().map_err(MemoryError::Memfd)?;
        match backing {
            MemoryBacking::Private => Self::from_file_private(file, size),
            MemoryBacking::Userfaultfd => Self::from_file_uffd(name, file, size),
        }
    }

    /// Restores guest RAM of `size` bytes lazily from the memory file `file`
    /// (as [`GuestRam::write_to`] wrote it, or a branch point's memfd): the regions are anonymous
    /// private memory (`MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE`)
    /// registered with a userfaultfd, and the thread `uffd-<name>` fills each
    /// page from the file when it is first touched (see [`crate::uffd`]).
    /// Nothing is read up front. Dropping the `GuestRam` stops the thread.
    ///
    /// [`GuestRam::file`] is the memory file, opened read-only: it is not
    /// guest RAM, which lives in anonymous memory (see
    /// [`GuestRam::memory_usage`]).
    ///
    /// Errors: [`MemoryError::InvalidSize`] (also if the file's size is not
    /// `size`), [`MemoryError::Memfd`] (its `fstat`),
    /// [`MemoryError::Mmap`], [`MemoryError::Userfaultfd`] (e.g. not
    /// permitted: run as root or allow `/dev/userfaultfd` /
    /// `vm.unprivileged_userfaultfd=1`, or use [`MemoryBacking::Private`]).
    pub fn from_file_uffd(name: &str, file: File, size: u64) -> Result<Self, MemoryError> {
        use vm_memory::mmap::MmapRegionBuilder;
        use vm_memory::GuestRegionMmap;
        check_snapshot_file(&file, size)?;
        let mut regions = Vec::new();
        for (gpa, len) in ram_ranges(size) {
            let region = MmapRegionBuilder::new(len as usize)
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
                .build()
                .map_err(|e| MemoryError::Mmap(e.to_string()))?;
            regions
                .push(GuestRegionMmap::new(region, gpa).ok_or_else(|| MemoryError::Mmap("region overflows".into()))?);
        }
        let memory = GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Mmap(e.to_string()))?;
        let mut offset = 0u64;
        let mut uffd_regions = Vec::new();
        for region in memory.iter() {
            uffd_regions.push(crate::uffd::Region {
                host_addr: region.as_ptr() as usize,
                len: region.len() as usize,
                file_offset: offset,
            });
            offset += region.len();
        }
        let handler_file = file.try_clone().map_err(MemoryError::Memfd)?;
        // SAFETY: the regions are the anonymous private mappings just made,
        // owned by `memory` and untouched; the handler is dropped before
        // `memory` (field order of `GuestRam`), so they stay mapped while it
        // runs.
        let handler = unsafe { crate::uffd::Handler::start(name, handler_file, &uffd_regions) }?;
        Ok(GuestRam::restored(Some(handler), memory, file, size))
    }

    /// Restored RAM over the snapshot memory file `file`, its data ranges
    /// found now (off a later branch's pause); if that fails, the first
    /// [`GuestRam::content_ranges`] tries again and reports the error.
    fn restored(uffd: Option<crate::uffd::Handler>, memory: GuestMemoryMmap, file: File, size: u64) -> Self {
        let file_data = OnceLock::new();
        if let Ok(ranges) = data_ranges(&file, size) {
            let _ = file_data.set(ranges);
        }
        GuestRam { uffd, memory, file, size, restored: true, huge_pages: false, file_data }
    }

    /// The data ranges of a restored RAM's snapshot file ([`GuestRam::file_data`]).
    fn file_data_ranges(&self) -> Result<&[(u64, u64)], MemoryError> {
        if let Some(r) = self.file_data.get() {
            return Ok(r);
        }
        let ranges = data_ranges(&self.file, self.size).map_err(MemoryError::Memfd)?;
        Ok(self.file_data.get_or_init(|| ranges))
    }

    /// The userfaultfd handler filling this RAM ([`MemoryBacking::Userfaultfd`]
    /// only): its [`crate::uffd::Handler::stats`] and
    /// [`crate::uffd::Handler::error`].
    pub fn uffd_handler(&self) -> Option<&crate::uffd::Handler> {
        self.uffd.as_ref()
    }

    /// Host memory guest RAM takes in this process: the `Rss:`, `Pss:` and
    /// `Private_Clean:` + `Private_Dirty:` lines of `/proc/self/smaps`
    /// (`proc(5)`) for the mappings inside guest RAM's regions, summed. Works
    /// for every backing (memfd, private file mapping, userfaultfd).
    ///
    /// Errors: reading `/proc/self/smaps`.
    pub fn memory_usage(&self) -> std::io::Result<MemoryUsage> {
        let ranges: Vec<(usize, usize)> =
            self.memory.iter().map(|r| (r.as_ptr() as usize, r.as_ptr() as usize + r.len() as usize)).collect();
        Ok(smaps_usage(&std::fs::read_to_string("/proc/self/smaps")?, &ranges))
    }

    /// Writes guest RAM to `path` (created or truncated) as a sparse file
    /// of `size` bytes: the pages of [`GuestRam::content_ranges`], read
    /// through the guest mapping, except all-zero pages, which stay holes
    /// like untouched memory. The VM must not run meanwhile. Returns the
    /// bytes written.
    ///
    /// Errors: [`MemoryError::Memfd`] for I/O errors, [`MemoryError::Mmap`]
    /// for a range outside guest RAM (a bug).
    pub fn write_to(&self, path: &std::path::Path) -> Result<u64, MemoryError> {
        let out = File::create(path).map_err(MemoryError::Memfd)?;
        out.set_len(self.size).map_err(MemoryError::Memfd)?;
        let mut copier = PageCopier::new(self, &out);
        for (start, end) in self.content_ranges()? {
            copier.copy(start, end)?;
        }
        out.sync_data().map_err(MemoryError::Memfd)?;
        Ok(copier.bytes_written)
    }

    /// The byte ranges of guest RAM, as `(start, end)` offsets in the
    /// memory file's layout (region `i` after regions `0..i`, see
    /// [`GuestRam::regions`]), sorted, outside which every byte is zero:
    /// - memfd RAM: the memfd's data ranges (`SEEK_DATA`/`SEEK_HOLE`).
    /// - Restored RAM lives in three places: pages the guest wrote (private
    ///   copies), pages still read from the snapshot's file, and pages never
    ///   touched (zero). So: every page in the file's data ranges, or
    ///   mapped (present or swapped) in this process's page table.
    /// - Huge-page RAM: the huge pages mapped in this process, whole. A
    ///   hugetlbfs file has no `SEEK_DATA` (all of it reads as data), and
    ///   reading a hole through the shared mapping would allocate a huge
    ///   page; guest RAM's mapping is the only one and is never unmapped
    ///   while the VM lives, so mapped is allocated.
    ///
    /// Mapped pages come from the `PAGEMAP_SCAN` ioctl on
    /// `/proc/self/pagemap` (Linux 6.7; it walks page tables and returns
    /// ranges, so a hole costs one step per page-table entry above it), or,
    /// on older kernels, from reading one `/proc/self/pagemap` entry per
    /// 4 KiB page (kernel doc `Documentation/admin-guide/mm/pagemap.rst`:
    /// bit 63 present, bit 62 swapped), which costs about 5 ms for 4 GiB.
    ///
    /// The ranges can hold all-zero pages too. The answer is only exact
    /// while the VM (vCPUs and devices) does not run.
    ///
    /// Errors: [`MemoryError::Memfd`] for I/O errors.
    pub fn content_ranges(&self) -> Result<Vec<(u64, u64)>, MemoryError> {
        if !self.restored && !self.huge_pages {
            return data_ranges(&self.file, self.size).map_err(MemoryError::Memfd);
        }
        let in_file = if self.restored { self.file_data_ranges()? } else { &[] };
        let pagemap = File::open("/proc/self/pagemap").map_err(MemoryError::Memfd)?;
        let mapped = match self.scan_mapped(&pagemap) {
            Ok(ranges) => ranges,
            Err(e) => {
                tracing::debug!("PAGEMAP_SCAN unavailable ({e}); reading /proc/self/pagemap");
                self.read_mapped(&pagemap)?
            }
        };
        let mut out = union(in_file, &mapped);
        if self.huge_pages {
            out = out
                .into_iter()
                .map(|(s, e)| (s / HUGE_PAGE_SIZE * HUGE_PAGE_SIZE, e.div_ceil(HUGE_PAGE_SIZE) * HUGE_PAGE_SIZE))
                .collect();
            out = union(&out, &[]);
        }
        Ok(out)
    }

    /// The pages this VM may have of its own, apart from its snapshot's
    /// memory file (the base), as sorted `(start, end)` offsets of the
    /// memory file's layout: what a page file of a hibernation must look
    /// at (`crate::pagefile`, `docs/design/hibernate.md` §1.2).
    ///
    /// - RAM restored into a private mapping of the file: the pages written
    ///   since (copied on write) or swapped, by `PAGEMAP_SCAN` with
    ///   `PAGE_IS_FILE | PAGE_IS_PFNZERO` excluded, or reading
    ///   `/proc/self/pagemap` on kernels before 6.7. Pages only read are
    ///   the file's and are left out.
    /// - Every other RAM (booted, userfaultfd, huge pages):
    ///   [`GuestRam::content_ranges`]; the writer's compare with the base,
    ///   where there is one, drops the pages equal to it.
    ///
    /// Only exact while the VM does not run.
    ///
    /// Errors: [`MemoryError::Memfd`] for I/O errors.
    pub fn own_candidates(&self) -> Result<Vec<(u64, u64)>, MemoryError> {
        if !self.reads_from_file() {
            return self.content_ranges();
        }
        let pagemap = File::open("/proc/self/pagemap").map_err(MemoryError::Memfd)?;
        match self.scan(&pagemap, PAGE_IS_FILE | PAGE_IS_PFNZERO) {
            Ok(ranges) => Ok(ranges),
            Err(e) => {
                tracing::debug!("PAGEMAP_SCAN unavailable ({e}); reading /proc/self/pagemap");
                self.read_own(&pagemap)
            }
        }
    }

    /// What a branch point takes of this RAM, as sorted `(start, end)`
    /// offsets of the memory file's layout: `(content, written)`, where
    /// `content` is [`GuestRam::content_ranges`] and `written` the part of
    /// it that a guest write can change in place, so the part to
    /// write-protect until copied. RAM restored into a private mapping of
    /// its snapshot file: the pages it has of its own
    /// ([`GuestRam::own_candidates`]); the rest of `content` is the file's,
    /// which a guest write does not reach (it copies the page), so it is
    /// read from the file ([`PageCopier::copy_from_file`]) whenever. Every
    /// other RAM: all of `content`.
    ///
    /// Only exact while the VM does not run.
    ///
    /// Errors: as [`GuestRam::content_ranges`].
    pub(crate) fn branch_ranges(&self) -> Result<(Ranges, Ranges), MemoryError> {
        let content = self.content_ranges()?;
        if !self.reads_from_file() {
            let written = content.clone();
            return Ok((content, written));
        }
        Ok((content, self.own_candidates()?))
    }

    /// Whether guest RAM is a private mapping of its snapshot file: pages
    /// not yet written are the file's own.
    fn reads_from_file(&self) -> bool {
        self.restored && !self.huge_pages && self.uffd.is_none()
    }

    /// The bytes of [`GuestRam::own_candidates`]: an upper bound of what
    /// this VM holds of its own on the host (bytes), for admission by real
    /// use.
    ///
    /// Errors: as [`GuestRam::own_candidates`].
    pub fn own_bytes(&self) -> Result<u64, MemoryError> {
        Ok(self.own_candidates()?.iter().map(|(s, e)| e - s).sum())
    }

    /// The pages of guest RAM present or swapped in this process's page
    /// table, as sorted `(start, end)` offsets of the memory file's layout,
    /// by the `PAGEMAP_SCAN` ioctl (`pagemap` is `/proc/self/pagemap`).
    ///
    /// Errors: the ioctl's (`ENOTTY` before Linux 6.7).
    fn scan_mapped(&self, pagemap: &File) -> std::io::Result<Vec<(u64, u64)>> {
        self.scan(pagemap, 0)
    }

    /// As [`GuestRam::scan_mapped`], less the pages in any category of
    /// `excluded` (`PAGE_IS_*` bits): with `PAGE_IS_FILE | PAGE_IS_PFNZERO`,
    /// the pages a private mapping has of its own (written, so copied on
    /// write, or swapped), not those still read from the file or the zero
    /// page.
    fn scan(&self, pagemap: &File, excluded: u64) -> std::io::Result<Vec<(u64, u64)>> {
        let mut out = Vec::new();
        let mut found = vec![PageRegion::default(); 256];
        for region in self.regions() {
            let end = (region.host_addr + region.len) as u64;
            let mut at = region.host_addr as u64;
            while at < end {
                let mut arg = PmScanArg {
                    size: std::mem::size_of::<PmScanArg>() as u64,
                    start: at,
                    end,
                    vec: found.as_mut_ptr() as u64,
                    vec_len: found.len() as u64,
                    // A page matches when its categories, with `excluded`'s
                    // inverted, have all of `excluded` (none of them set)
                    // and any of present and swapped.
                    category_inverted: excluded,
                    category_mask: excluded,
                    category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                    return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                    ..PmScanArg::default()
                };
                // SAFETY: `arg` is a pm_scan_arg of the size it states, and
                // `vec` points at `found`, `vec_len` page_region entries
                // that the kernel may write and that live across the call.
                let n = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg) };
                if n < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                for r in &found[..(n as usize).min(found.len())] {
                    let (s, e) = (r.start.max(at), r.end.min(end));
                    if s < e {
                        // Host address to memory-file offset: `s` and `e`
                        // lie in the region, so the difference cannot wrap.
                        let to_file = |a: u64| a - region.host_addr as u64 + region.file_offset;
                        push_range(&mut out, (to_file(s), to_file(e)));
                    }
                }
                if arg.walk_end <= at {
                    return Err(std::io::Error::other("PAGEMAP_SCAN made no progress"));
                }
                at = arg.walk_end;
            }
        }
        Ok(out)
    }

    /// As [`GuestRam::scan_mapped`], by reading one `/proc/self/pagemap`
    /// entry per 4 KiB page.
    ///
    /// Errors: [`MemoryError::Memfd`] for read errors.
    fn read_mapped(&self, pagemap: &File) -> Result<Vec<(u64, u64)>, MemoryError> {
        self.read_pages(pagemap, |e| e & (3 << 62) != 0)
    }

    /// As [`GuestRam::scan`] with `PAGE_IS_FILE | PAGE_IS_PFNZERO`, by
    /// reading `/proc/self/pagemap`: present and not file-backed or shared
    /// (bit 63 set, bit 61 clear), or swapped (bit 62). The zero page reads
    /// as present and not file-backed here; its pages are all zero, which
    /// the page-file writer's compare drops.
    fn read_own(&self, pagemap: &File) -> Result<Vec<(u64, u64)>, MemoryError> {
        self.read_pages(pagemap, |e| (e & (1 << 63) != 0 && e & (1 << 61) == 0) || e & (1 << 62) != 0)
    }

    /// The pages whose `/proc/self/pagemap` entry satisfies `keep`.
    fn read_pages(&self, pagemap: &File, keep: impl Fn(u64) -> bool) -> Result<Vec<(u64, u64)>, MemoryError> {
        use std::os::unix::fs::FileExt;
        const PAGE: u64 = 4096;
        let mut out = Vec::new();
        let mut entries = vec![0u8; 8 * 4096];
        for region in self.regions() {
            let host_page = region.host_addr as u64 / PAGE;
            let pages = region.len as u64 / PAGE;
            let mut i = 0u64;
            while i < pages {
                let n = (pages - i).min(4096);
                let bytes = &mut entries[..(n * 8) as usize];
                pagemap.read_exact_at(bytes, (host_page + i) * 8).map_err(MemoryError::Memfd)?;
                for (j, entry) in bytes.chunks_exact(8).enumerate() {
                    let e = u64::from_le_bytes(entry.try_into().unwrap_or_default());
                    if keep(e) {
                        let at = region.file_offset + (i + j as u64) * PAGE;
                        push_range(&mut out, (at, at + PAGE));
                    }
                }
                i += n;
            }
        }
        Ok(out)
    }

    /// Guest RAM's regions: host virtual address, length and offset in the
    /// memory file's layout (bytes), in GPA order.
    pub fn regions(&self) -> Vec<crate::uffd::Region> {
        let mut offset = 0u64;
        self.memory
            .iter()
            .map(|r| {
                let region =
                    crate::uffd::Region { host_addr: r.as_ptr() as usize, len: r.len() as usize, file_offset: offset };
                offset += r.len();
                region
            })
            .collect()
    }

    /// The guest physical address of byte `offset` of the memory file's
    /// layout and the bytes left in its region from there, if it is inside
    /// guest RAM.
    pub fn offset_to_gpa(&self, offset: u64) -> Option<(GuestAddress, u64)> {
        let mut start = 0u64;
        for r in self.memory.iter() {
            if offset < start + r.len() {
                return Some((GuestAddress(r.start_addr().0 + (offset - start)), start + r.len() - offset));
            }
            start += r.len();
        }
        None
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

/// Sums the usage of the `smaps` mappings lying inside one of `ranges`
/// (host addresses `[start, end)`).
fn smaps_usage(smaps: &str, ranges: &[(usize, usize)]) -> MemoryUsage {
    let mut usage = MemoryUsage::default();
    let mut inside = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        // A mapping's header: "start-end perms offset dev inode [path]", hex
        // addresses without 0x.
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) {
                inside = ranges.iter().any(|&(s, e)| start >= s && end <= e);
                continue;
            }
        }
        if !inside {
            continue;
        }
        let bytes = words.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 1024; // kB
        match first {
            "Rss:" => usage.rss_bytes += bytes,
            "Pss:" => usage.pss_bytes += bytes,
            "Private_Clean:" | "Private_Dirty:" => usage.private_bytes += bytes,
            // hugetlbfs pages are not in `Rss:` (`proc(5)`); guest RAM of
            // huge pages is mapped by this process only.
            "Shared_Hugetlb:" | "Private_Hugetlb:" => {
                usage.rss_bytes += bytes;
                usage.pss_bytes += bytes;
                usage.private_bytes += bytes;
            }
            _ => {}
        }
    }
    usage
}

/// Checks that a snapshot's memory file fits `size` bytes of guest RAM.
///
/// Errors: [`MemoryError::InvalidSize`] for a bad size or a file of
/// another length, [`MemoryError::Memfd`] for the `fstat` error.
fn check_snapshot_file(file: &File, size: u64) -> Result<(), MemoryError> {
    check_size(size)?;
    let len = file.metadata().map_err(MemoryError::Memfd)?.len();
    if len != size {
        return Err(MemoryError::InvalidSize(len));
    }
    Ok(())
}

/// A new, empty memfd (close-on-exec) of `size` bytes named `name` (as
/// `/proc/<pid>/maps` shows it, after `memfd:`).
///
/// Errors: the `memfd_create(2)` or `ftruncate(2)` error.
pub fn new_memfd(name: &str, size: u64) -> std::io::Result<File> {
    memfd_with(name, size, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
}

/// A new memfd made with `flags`, of `size` bytes, named `name`.
fn memfd_with(name: &str, size: u64, flags: nix::sys::memfd::MemFdCreateFlag) -> std::io::Result<File> {
    let cname = CString::new(name).unwrap_or_default();
    let file = File::from(nix::sys::memfd::memfd_create(&cname, flags)?);
    file.set_len(size)?;
    Ok(file)
}

/// `struct page_region` of `PAGEMAP_SCAN` (`include/uapi/linux/fs.h`,
/// Linux 6.7): pages `[start, end)` (host virtual addresses) sharing the
/// categories `categories`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg` of `PAGEMAP_SCAN` (`include/uapi/linux/fs.h`,
/// kernel doc `Documentation/admin-guide/mm/pagemap.rst`, "PAGEMAP_SCAN
/// IOCTL"): scan `[start, end)`, write at most `vec_len` regions of pages
/// matching the masks to `vec`; the kernel sets `walk_end` to where it
/// stopped (`end` when done).
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

const _: () = assert!(std::mem::size_of::<PageRegion>() == 24 && std::mem::size_of::<PmScanArg>() == 96);
/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: libc::Ioctl = nix::request_code_readwrite!(b'f', 16, std::mem::size_of::<PmScanArg>()) as _;
const _: () = assert!(PAGEMAP_SCAN == 0xc060_6610);
/// A page of a file or shared memory (`PAGE_IS_FILE`); in a private
/// mapping, one not (yet) written.
const PAGE_IS_FILE: u64 = 1 << 2;
/// A page present in RAM (`PAGE_IS_PRESENT`).
const PAGE_IS_PRESENT: u64 = 1 << 3;
/// A page swapped out (`PAGE_IS_SWAPPED`).
const PAGE_IS_SWAPPED: u64 = 1 << 4;
/// The shared zero page (`PAGE_IS_PFNZERO`): a read of a hole.
const PAGE_IS_PFNZERO: u64 = 1 << 5;

/// Appends `r` to the sorted ranges `out`, merging it with the last one
/// where they touch or overlap.
fn push_range(out: &mut Vec<(u64, u64)>, r: (u64, u64)) {
    match out.last_mut() {
        Some(last) if r.0 <= last.1 => last.1 = last.1.max(r.1),
        _ => out.push(r),
    }
}

/// The union of the sorted ranges `a` and `b`, sorted and merged.
fn union(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut all: Vec<(u64, u64)> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let mut out = Vec::with_capacity(all.len());
    for r in all {
        push_range(&mut out, r);
    }
    out
}

/// Sorted, merged `(start, end)` byte offsets of the memory file's layout.
pub(crate) type Ranges = Vec<(u64, u64)>;

/// The sorted ranges `a` less the sorted ranges `b` (each sorted and
/// merged, as [`union`] makes them), sorted.
pub(crate) fn difference(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut cut = b.iter().peekable();
    for &(mut s, e) in a {
        while let Some(&&(cs, ce)) = cut.peek() {
            if ce <= s {
                cut.next();
                continue;
            }
            if cs >= e {
                break;
            }
            if cs > s {
                out.push((s, cs));
            }
            s = s.max(ce);
            if ce >= e {
                break;
            }
            cut.next();
        }
        if s < e {
            out.push((s, e));
        }
    }
    out
}

/// A new, empty hugetlbfs memfd (close-on-exec, 2 MiB pages) of `size`
/// bytes (whole huge pages) named `name`.
///
/// Errors: the `memfd_create(2)` or `ftruncate(2)` error.
fn new_hugetlb_memfd(name: &str, size: u64) -> std::io::Result<File> {
    use nix::sys::memfd::MemFdCreateFlag as F;
    memfd_with(name, size, F::MFD_CLOEXEC | F::MFD_HUGETLB | F::MFD_HUGE_2MB)
}

/// The host's default-size (2 MiB) hugetlbfs pool, from `/proc/meminfo`
/// (kernel doc `Documentation/admin-guide/mm/hugetlbpage.rst`), in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HugePagePool {
    /// `HugePages_Total:`: pages in the pool.
    pub total: u64,
    /// `HugePages_Free:` less `HugePages_Rsvd:`: pages neither in use nor
    /// promised to a mapping already made (what a new guest can reserve).
    pub available: u64,
}

impl HugePagePool {
    /// Reads the pool's state; `None` where `/proc/meminfo` cannot be read
    /// or has no huge page lines (a kernel without hugetlbfs).
    pub fn read() -> Option<Self> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let field =
            |name: &str| meminfo.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<u64>().ok()));
        let (total, free, reserved) =
            (field("HugePages_Total:")?, field("HugePages_Free:")?, field("HugePages_Rsvd:").unwrap_or(0));
        Some(HugePagePool { total, available: free.saturating_sub(reserved) })
    }
}

/// The error for huge pages that could not be had, with the pool's state
/// ([`HugePagePool`]) and how to grow it.
fn huge_pages_error(size: u64, e: std::io::Error) -> MemoryError {
    let available = HugePagePool::read().map_or_else(|| "unknown".to_string(), |p| p.available.to_string());
    MemoryError::HugePages(format!(
        "cannot get {} huge pages of 2 MiB for guest RAM ({e}); the host's pool has {available} available \
         (HugePages_Free less HugePages_Rsvd in /proc/meminfo): reserve more with `sysctl vm.nr_hugepages=N`, \
         or turn huge pages off",
        size / HUGE_PAGE_SIZE
    ))
}

/// Maps `file` (guest RAM's memfd) with `flags` as the regions of
/// [`ram_ranges`]`(size)`, region `i` at the file offset after regions
/// `0..i`.
fn map_shared(file: &File, size: u64, flags: i32) -> Result<GuestMemoryMmap, MemoryError> {
    use vm_memory::mmap::MmapRegionBuilder;
    use vm_memory::GuestRegionMmap;
    let mut offset = 0u64;
    let mut regions = Vec::new();
    for (gpa, len) in ram_ranges(size) {
        let dup = file.try_clone().map_err(MemoryError::Memfd)?;
        let region = MmapRegionBuilder::new(len as usize)
            .with_file_offset(FileOffset::new(dup, offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(flags)
            .build()
            .map_err(|e| MemoryError::Mmap(e.to_string()))?;
        regions.push(GuestRegionMmap::new(region, gpa).ok_or_else(|| MemoryError::Mmap("region overflows".into()))?);
        offset += len;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Mmap(e.to_string()))
}

/// Copies pages of guest RAM (read through the guest mapping) into a
/// file of the memory file's layout, leaving all-zero pages as holes.
pub(crate) struct PageCopier<'a> {
    ram: &'a GuestRam,
    out: &'a File,
    buf: Vec<u8>,
    /// Bytes written so far.
    pub bytes_written: u64,
}

impl<'a> PageCopier<'a> {
    /// Bytes read through the mapping at once.
    const CHUNK: u64 = 256 << 10;

    pub(crate) fn new(ram: &'a GuestRam, out: &'a File) -> Self {
        PageCopier { ram, out, buf: vec![0u8; Self::CHUNK as usize], bytes_written: 0 }
    }

    /// Copies the bytes `[start, end)` of the memory file's layout (page
    /// aligned).
    ///
    /// Errors: [`MemoryError::Mmap`] for a range outside guest RAM,
    /// [`MemoryError::Memfd`] for write errors.
    pub(crate) fn copy(&mut self, start: u64, end: u64) -> Result<(), MemoryError> {
        use vm_memory::Bytes;
        let mut at = start;
        while at < end {
            let (gpa, left) = self
                .ram
                .offset_to_gpa(at)
                .ok_or_else(|| MemoryError::Mmap(format!("offset {at:#x} is outside guest RAM")))?;
            let n = (end - at).min(Self::CHUNK).min(left) as usize;
            self.ram.memory.read_slice(&mut self.buf[..n], gpa).map_err(|e| MemoryError::Mmap(e.to_string()))?;
            self.write_nonzero(n, at)?;
            at += n as u64;
        }
        Ok(())
    }

    /// As [`PageCopier::copy`], reading the RAM's snapshot file instead of
    /// the guest mapping: for the pages of restored RAM that it has not
    /// written (see [`GuestRam::branch_ranges`]), whose contents are the
    /// file's whatever the guest does meanwhile.
    ///
    /// Errors: [`MemoryError::Memfd`] for read and write errors (a read
    /// past the end of the file included).
    pub(crate) fn copy_from_file(&mut self, start: u64, end: u64) -> Result<(), MemoryError> {
        use std::os::unix::fs::FileExt;
        let mut at = start;
        while at < end {
            let n = (end - at).min(Self::CHUNK) as usize;
            self.ram.file.read_exact_at(&mut self.buf[..n], at).map_err(MemoryError::Memfd)?;
            self.write_nonzero(n, at)?;
            at += n as u64;
        }
        Ok(())
    }

    /// Writes the runs of non-zero 4 KiB pages of `buf[..n]` (whole pages)
    /// at offset `at` of the output.
    fn write_nonzero(&mut self, n: usize, at: u64) -> Result<(), MemoryError> {
        use std::os::unix::fs::FileExt;
        const PAGE: usize = 4096;
        let buf = &self.buf[..n];
        let mut page = 0;
        while page < n {
            if buf[page..page + PAGE].iter().all(|&b| b == 0) {
                page += PAGE;
                continue;
            }
            let run_start = page;
            while page < n && buf[page..page + PAGE].iter().any(|&b| b != 0) {
                page += PAGE;
            }
            self.out.write_all_at(&buf[run_start..page], at + run_start as u64).map_err(MemoryError::Memfd)?;
            self.bytes_written += (page - run_start) as u64;
        }
        Ok(())
    }
}

/// The data ranges of `file` below `size` (`SEEK_DATA`/`SEEK_HOLE`,
/// `lseek(2)`), as sorted `(start, end)` byte offsets; the rest reads as
/// zeros.
///
/// Errors: `lseek` errors other than `ENXIO` (no data after the offset).
pub fn data_ranges(file: &File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        // SAFETY: lseek on an fd `file` owns; no memory is passed.
        let data = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // Only a hole is left.
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size } else { (hole as u64).min(size) };
        if data as u64 >= end {
            break;
        }
        out.push((data as u64, end));
        pos = end;
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn difference_cuts_every_overlap() {
        let a = [(0, 10), (20, 30), (40, 50)];
        assert_eq!(difference(&a, &[]), a);
        assert_eq!(difference(&a, &a), []);
        assert_eq!(difference(&a, &[(5, 25)]), [(0, 5), (25, 30), (40, 50)]);
        assert_eq!(difference(&a, &[(2, 3), (4, 6), (28, 45)]), [(0, 2), (3, 4), (6, 10), (20, 28), (45, 50)]);
        assert_eq!(difference(&a, &[(0, 100)]), []);
        assert_eq!(difference(&a, &[(10, 20), (30, 40)]), a);
        assert_eq!(difference(&[(0, 100)], &[(10, 20), (30, 40)]), [(0, 10), (20, 30), (40, 100)]);
    }
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
        assert_eq!(
            r,
            vec![(GuestAddress(0), MMIO_GAP_START), (GuestAddress(MMIO_GAP_END), (4 << 30) - MMIO_GAP_START)]
        );
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), 4 << 30);
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(matches!(GuestRam::new("t", 1 << 20), Err(MemoryError::InvalidSize(_))));
        assert!(matches!(GuestRam::new("t", (64 << 20) + 1), Err(MemoryError::InvalidSize(_))));
    }

    #[test]
    fn memory_usage_grows_with_touched_pages() {
        let ram = GuestRam::new("usage-test", 64 << 20).unwrap();
        let before = ram.memory_usage().unwrap();
        ram.memory.write_slice(&[7u8; 4 << 20], GuestAddress(8 << 20)).unwrap();
        let after = ram.memory_usage().unwrap();
        assert!(after.rss_bytes >= before.rss_bytes + (4 << 20), "{before:?} -> {after:?}");
        assert!(after.pss_bytes >= before.pss_bytes + (4 << 20), "{before:?} -> {after:?}");
        assert!(after.private_bytes >= before.private_bytes + (4 << 20), "{before:?} -> {after:?}");
    }

    #[test]
    fn smaps_parsing() {
        let smaps = "\
7f0000000000-7f0000002000 rw-s 00000000 00:01 5 /memfd:tine-guest-ram-x (deleted)
Size:                  8 kB
Rss:                   8 kB
Pss:                   4 kB
Private_Clean:         0 kB
Private_Dirty:         4 kB
VmFlags: rd wr sh mr mw me ms sd
7f0000002000-7f0000003000 rw-p 00000000 00:00 0
Rss:                   4 kB
Pss:                   4 kB
Private_Clean:         4 kB
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
Rss:                 100 kB
";
        let u = smaps_usage(smaps, &[(0x7f00_0000_0000, 0x7f00_0000_3000)]);
        assert_eq!(u, MemoryUsage { rss_bytes: 12 << 10, pss_bytes: 8 << 10, private_bytes: 8 << 10 });
    }

    #[test]
    fn memory_backing_serde_names() {
        assert_eq!(serde_json::to_string(&MemoryBacking::Userfaultfd).unwrap(), "\"userfaultfd\"");
        assert_eq!(serde_json::from_str::<MemoryBacking>("\"private\"").unwrap(), MemoryBacking::Private);
        assert_eq!(MemoryBacking::default(), MemoryBacking::Private);
    }

    const SNAP_BYTES: u64 = 64 << 20;
    const PAGE: u64 = 4096;

    /// The test pattern of file page `page`: no zero byte.
    fn pattern(page: u64) -> Vec<u8> {
        (0..PAGE).map(|i| ((page * 7 + i) % 255) as u8 + 1).collect()
    }

    /// A sparse 64 MiB memory file with [`pattern`] in `pages`, an all-zero
    /// data page at `zero_page`, holes elsewhere.
    fn snapshot_file(pages: &[u64], zero_page: u64) -> tempfile::NamedTempFile {
        use std::os::unix::fs::FileExt;
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(SNAP_BYTES).unwrap();
        for &p in pages {
            f.as_file().write_all_at(&pattern(p), p * PAGE).unwrap();
        }
        f.as_file().write_all_at(&[0u8; PAGE as usize], zero_page * PAGE).unwrap();
        f.as_file().sync_all().unwrap();
        f
    }

    /// Restores `file` through userfaultfd, or `None` after a loud SKIP if
    /// this process may not use userfaultfd.
    fn uffd_ram(name: &str, file: &tempfile::NamedTempFile) -> Option<GuestRam> {
        match GuestRam::from_snapshot(
            name,
            &crate::snapshot::SnapshotMemory::File(file.path().to_path_buf()),
            SNAP_BYTES,
            MemoryBacking::Userfaultfd,
        ) {
            Ok(ram) => Some(ram),
            Err(MemoryError::Userfaultfd(e @ crate::uffd::UffdError::Unavailable(_))) => {
                eprintln!("SKIP: userfaultfd unavailable: {e}");
                None
            }
            Err(e) => panic!("userfaultfd restore failed: {e}"),
        }
    }

    fn read_page(ram: &GuestRam, page: u64) -> Vec<u8> {
        let mut buf = vec![0u8; PAGE as usize];
        ram.memory.read_slice(&mut buf, GuestAddress(page * PAGE)).unwrap();
        buf
    }

    /// The handler's stats once `done` holds, or after 2 s: a fill is
    /// counted just after the ioctl that woke the faulting thread returns.
    fn settled_stats(ram: &GuestRam, done: impl Fn(crate::uffd::UffdStats) -> bool) -> crate::uffd::UffdStats {
        let handler = ram.uffd_handler().unwrap();
        for _ in 0..400 {
            if done(handler.stats()) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        handler.stats()
    }

    /// Names of this process's threads (`/proc/self/task/*/comm`).
    fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim_end().to_string())
            .collect()
    }

    /// A prefetch through userfaultfd fills the set's pages in runs (data
    /// pages copied, holes and zero pages as zero pages) before any touch;
    /// reading them after takes no fault.
    #[test]
    fn uffd_prefetch_fills_runs_before_the_first_touch() {
        let file = snapshot_file(&[1, 2, 3, 10], 5);
        let Some(ram) = uffd_ram("uffd-prefetch", &file) else { return };
        let ws = crate::WorkingSet {
            read: vec![(PAGE, 5 * PAGE)],
            written: vec![(10 * PAGE, PAGE)],
            ..crate::WorkingSet::default()
        };
        let stats = ram.prefetch(&ws);
        assert_eq!((stats.read_bytes, stats.written_bytes, stats.failed_ranges), (5 * PAGE, PAGE, 0));
        let filled = ram.uffd_handler().unwrap().stats();
        assert_eq!(
            (filled.pages_copied, filled.pages_zeroed),
            (4, 2),
            "pages 1-3 and 10 copied, 4 (a hole) and 5 zero"
        );
        for p in [1, 2, 3, 10] {
            assert_eq!(read_page(&ram, p), pattern(p), "page {p}");
        }
        for p in [4, 5] {
            assert!(read_page(&ram, p).iter().all(|&b| b == 0), "page {p}");
        }
        assert_eq!(ram.uffd_handler().unwrap().stats(), filled, "no fault was left for the handler");
        // A second prefetch finds the pages there and fills nothing.
        let again = ram.prefetch(&ws);
        assert_eq!((again.read_bytes, again.written_bytes), (0, 0));
    }

    #[test]
    fn uffd_restore_fills_pages_lazily() {
        let pages = [0, 1, 100, 5000, 12000, 16383];
        let (zero_page, hole, written, dontneed) = (200, 7000, 5000, 1);
        let file = snapshot_file(&pages, zero_page);
        let Some(ram) = uffd_ram("lazy", &file) else { return };
        // The thread names itself once it runs.
        let named = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            thread_names().iter().any(|n| n == "uffd-lazy")
        });
        assert!(named, "no uffd-lazy thread: {:?}", thread_names());
        assert_eq!(ram.uffd_handler().unwrap().stats(), crate::uffd::UffdStats::default());

        // Patterned pages come from the file; `written` is first touched by
        // a write below.
        for &p in pages.iter().filter(|&&p| p != written) {
            assert_eq!(read_page(&ram, p), pattern(p), "page {p}");
        }
        let stats = settled_stats(&ram, |s| s.pages_copied >= pages.len() as u64 - 1);
        assert!(stats.pages_copied >= pages.len() as u64 - 1, "{stats:?}");
        // Holes and all-zero data pages read as zeros, as zero pages.
        assert_eq!(read_page(&ram, hole), vec![0u8; PAGE as usize]);
        assert_eq!(read_page(&ram, zero_page), vec![0u8; PAGE as usize]);
        let stats = settled_stats(&ram, |s| s.pages_zeroed >= 2);
        assert!(stats.pages_zeroed >= 2, "{stats:?}");

        // A write as first touch lands on top of the file's contents.
        ram.memory.write_obj(0x1122_3344_5566_7788u64, GuestAddress(written * PAGE + 16)).unwrap();
        let mut want = pattern(written);
        want[16..24].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(read_page(&ram, written), want);
        // A write to a zero page copies it.
        ram.memory.write_obj(0xabu8, GuestAddress(hole * PAGE + 5)).unwrap();
        assert_eq!(ram.memory.read_obj::<u8>(GuestAddress(hole * PAGE + 5)).unwrap(), 0xab);

        // The guest gives a page back (balloon, DONTNEED): it reads as zeros
        // afterwards, not as the snapshot's page.
        let host = ram.memory.get_host_address(GuestAddress(dontneed * PAGE)).unwrap();
        // SAFETY: one page of guest RAM that no Rust reference points into.
        assert_eq!(unsafe { libc::madvise(host.cast(), PAGE as usize, libc::MADV_DONTNEED) }, 0);
        assert_eq!(read_page(&ram, dontneed), vec![0u8; PAGE as usize]);

        // Every page not changed above reads the same as a private mapping of
        // the same file.
        let private = GuestRam::from_snapshot(
            "lazy-private",
            &crate::snapshot::SnapshotMemory::File(file.path().to_path_buf()),
            SNAP_BYTES,
            MemoryBacking::Private,
        )
        .unwrap();
        let (mut a, mut b) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
        for mib in 0..(SNAP_BYTES >> 20) {
            ram.memory.read_slice(&mut a, GuestAddress(mib << 20)).unwrap();
            private.memory.read_slice(&mut b, GuestAddress(mib << 20)).unwrap();
            for p in 0..(1 << 20) / PAGE as usize {
                let page = (mib << 20) / PAGE + p as u64;
                if [written, hole, dontneed].contains(&page) {
                    continue;
                }
                let r = p * PAGE as usize..(p + 1) * PAGE as usize;
                assert!(a[r.clone()] == b[r], "page {page} differs between the backings");
            }
        }
        let stats = settled_stats(&ram, |s| s.pages_copied + s.pages_zeroed == SNAP_BYTES / PAGE + 1);
        assert_eq!(stats.pages_copied + stats.pages_zeroed, SNAP_BYTES / PAGE + 1, "{stats:?}"); // + the page filled again after DONTNEED
        assert!(ram.uffd_handler().unwrap().error().is_none());
        let usage = ram.memory_usage().unwrap();
        assert!(
            usage.rss_bytes >= pages.len() as u64 * PAGE && usage.private_bytes >= pages.len() as u64 * PAGE,
            "{usage:?}"
        );
        println!("uffd stats {stats:?}, usage {usage:?}");

        drop(ram);
        assert!(
            !thread_names().iter().any(|n| n == "uffd-lazy"),
            "the handler thread outlived its GuestRam: {:?}",
            thread_names()
        );
    }

    #[test]
    fn uffd_concurrent_faults_on_the_same_pages() {
        // 2048 patterned pages (8 MiB) and as many holes, read by 4 threads
        // at once: the same page faults in several threads, and all but the
        // first UFFDIO_COPY/ZEROPAGE meet EEXIST.
        let pages: Vec<u64> = (0..2048).map(|i| 1024 + 2 * i).collect();
        let file = snapshot_file(&pages, 0);
        let Some(ram) = uffd_ram("race", &file) else { return };
        let barrier = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (ram, pages, barrier) = (&ram, &pages, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    // Half the threads go up, half down, so they meet.
                    let order: Vec<u64> =
                        if t % 2 == 0 { pages.clone() } else { pages.iter().rev().copied().collect() };
                    for &p in &order {
                        assert_eq!(read_page(ram, p), pattern(p), "thread {t}, page {p}");
                        assert_eq!(read_page(ram, p + 1), vec![0u8; PAGE as usize], "thread {t}, page {}", p + 1);
                    }
                });
            }
        });
        let want = crate::uffd::UffdStats { pages_copied: pages.len() as u64, pages_zeroed: pages.len() as u64 };
        let stats = settled_stats(&ram, |s| s == want);
        // Each page is filled once, however many threads faulted on it.
        assert_eq!(stats, want);
        drop(ram);
        assert!(!thread_names().iter().any(|n| n == "uffd-race"));
    }

    #[test]
    fn uffd_serves_faults_taken_inside_the_kernel() {
        // KVM and device I/O (read(2)/write(2) on guest memory) touch guest
        // RAM from the kernel: those faults must be served too (the
        // userfaultfd is not UFFD_USER_MODE_ONLY), not fail with EFAULT.
        use std::io::{Read, Seek};
        let file = snapshot_file(&[10, 11], 0);
        let Some(ram) = uffd_ram("kernel", &file) else { return };
        let mut out = tempfile::tempfile().unwrap();
        // write(2) from untouched guest pages: the kernel reads them.
        ram.memory.write_all_volatile_to(GuestAddress(10 * PAGE), &mut out, 2 * PAGE as usize).unwrap();
        // read(2) into an untouched guest page: the kernel writes it.
        out.rewind().unwrap();
        ram.memory.read_exact_volatile_from(GuestAddress(300 * PAGE), &mut out, PAGE as usize).unwrap();
        let mut back = Vec::new();
        out.rewind().unwrap();
        out.read_to_end(&mut back).unwrap();
        assert_eq!(back, [pattern(10), pattern(11)].concat());
        assert_eq!(read_page(&ram, 300), pattern(10));
    }

    #[test]
    fn uffd_restore_checks_the_file_size() {
        let file = snapshot_file(&[], 0);
        let r = GuestRam::from_snapshot(
            "size",
            &crate::snapshot::SnapshotMemory::File(file.path().to_path_buf()),
            SNAP_BYTES * 2,
            MemoryBacking::Userfaultfd,
        );
        assert!(matches!(r, Err(MemoryError::InvalidSize(n)) if n == SNAP_BYTES));
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

    /// A snapshot of restored RAM holds the guest's writes on top of the
    /// file it was restored from, and keeps untouched memory a hole.
    #[test]
    fn restored_ram_writes_out_what_the_guest_sees() {
        use std::os::unix::fs::MetadataExt;
        let pages = [0, 1, 100, 5000];
        let file = snapshot_file(&pages, 200);
        for backing in [MemoryBacking::Private, MemoryBacking::Userfaultfd] {
            let ram = match GuestRam::from_snapshot(
                "wt",
                &crate::snapshot::SnapshotMemory::File(file.path().to_path_buf()),
                SNAP_BYTES,
                backing,
            ) {
                Ok(r) => r,
                Err(MemoryError::Userfaultfd(e)) => {
                    eprintln!("SKIP: userfaultfd unavailable: {e}");
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            // Overwrite a file page, write a hole page, read another hole.
            ram.memory.write_slice(&[0xabu8; 16], GuestAddress(100 * PAGE + 8)).unwrap();
            ram.memory.write_slice(&[0xcdu8; 4], GuestAddress(9000 * PAGE)).unwrap();
            assert!(read_page(&ram, 7000).iter().all(|&b| b == 0));
            let out = tempfile::NamedTempFile::new().unwrap();
            let copied = ram.write_to(out.path()).unwrap();
            // Pages 0, 1, 100, 5000 and 9000; the all-zero data page 200 and
            // the read hole stay holes.
            assert_eq!(copied, 5 * PAGE, "{backing:?}");
            let back = GuestRam::from_file_private(File::open(out.path()).unwrap(), SNAP_BYTES).unwrap();
            let mut want = pattern(100);
            want[8..24].fill(0xab);
            assert_eq!(read_page(&back, 100), want, "{backing:?}");
            assert_eq!(read_page(&back, 5000), pattern(5000));
            assert_eq!(&read_page(&back, 9000)[..5], &[0xcd, 0xcd, 0xcd, 0xcd, 0]);
            assert!(read_page(&back, 7000).iter().all(|&b| b == 0));
            assert!(std::fs::metadata(out.path()).unwrap().blocks() * 512 <= 5 * PAGE + 4 * PAGE, "sparse");
        }
    }

    /// Whether the host's hugetlbfs pool has `bytes` of free 2 MiB pages.
    /// Without them the huge-page tests skip loudly, or fail where
    /// `TINE_REQUIRE_HUGE_PAGES=1` says the pool was reserved for them
    /// (`scripts/test.sh` does, as root).
    pub(crate) fn huge_pages_free(what: &str, bytes: u64) -> bool {
        let free = HugePagePool::read().unwrap_or_default().available;
        if free * HUGE_PAGE_SIZE >= bytes {
            return true;
        }
        let msg = format!(
            "{what}: needs {} free 2 MiB huge pages, the host has {free} (sysctl vm.nr_hugepages)",
            bytes / HUGE_PAGE_SIZE
        );
        assert!(std::env::var("TINE_REQUIRE_HUGE_PAGES").as_deref() != Ok("1"), "{msg}");
        eprintln!("\n*** SKIP: {msg} ***\n");
        false
    }

    #[test]
    fn huge_page_ram_snapshots_and_restores() {
        const SIZE: u64 = 32 << 20;
        if !huge_pages_free("huge_page_ram_snapshots_and_restores", 2 * SIZE) {
            return;
        }
        let ram = GuestRam::new_huge("huge-test", SIZE).unwrap();
        assert!(ram.huge_pages());
        assert_eq!(ram.page_size(), HUGE_PAGE_SIZE);
        assert!(ram.content_ranges().unwrap().is_empty(), "nothing touched yet");
        // Two bytes in two huge pages (the 2nd and the 9th).
        ram.memory.write_slice(&[0x11u8; 8], GuestAddress(HUGE_PAGE_SIZE + 4096)).unwrap();
        ram.memory.write_slice(&[0x22u8; 8], GuestAddress(8 * HUGE_PAGE_SIZE + 100)).unwrap();
        let h = HUGE_PAGE_SIZE;
        assert_eq!(ram.content_ranges().unwrap(), vec![(h, 2 * h), (8 * h, 9 * h)]);
        assert_eq!(ram.allocated_bytes().unwrap(), 2 * h);
        let usage = ram.memory_usage().unwrap();
        assert_eq!(usage.rss_bytes, 2 * h, "{usage:?}");
        let out = tempfile::NamedTempFile::new().unwrap();
        assert_eq!(ram.write_to(out.path()).unwrap(), 2 * PAGE, "only the non-zero 4 KiB pages are written");
        let mem = crate::snapshot::SnapshotMemory::Shared(std::sync::Arc::new(File::open(out.path()).unwrap()));
        let back = GuestRam::from_snapshot_huge("huge-back", &mem, SIZE).unwrap();
        let mut word = [0u8; 8];
        back.memory.read_slice(&mut word, GuestAddress(h + 4096)).unwrap();
        assert_eq!(word, [0x11; 8]);
        back.memory.read_slice(&mut word, GuestAddress(8 * h + 100)).unwrap();
        assert_eq!(word, [0x22; 8]);
        assert_eq!(back.content_ranges().unwrap(), vec![(h, 2 * h), (8 * h, 9 * h)], "only the data was copied");
    }

    /// `PAGEMAP_SCAN` (where the kernel has it) and the per-page read of
    /// `/proc/self/pagemap` agree on which pages are mapped.
    #[test]
    fn pagemap_scan_matches_the_pagemap_read() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(64 << 20).unwrap();
        let ram = GuestRam::from_file_private(file, 64 << 20).unwrap();
        for page in [0u64, 1, 2, 77, 4000, 4001, 16383] {
            ram.memory.write_slice(&[1u8], GuestAddress(page * PAGE)).unwrap();
        }
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        let read = ram.read_mapped(&pagemap).unwrap();
        assert_eq!(
            read,
            vec![(0, 3 * PAGE), (77 * PAGE, 78 * PAGE), (4000 * PAGE, 4002 * PAGE), (16383 * PAGE, 16384 * PAGE)]
        );
        match ram.scan_mapped(&pagemap) {
            Ok(scanned) => assert_eq!(scanned, read),
            Err(e) => eprintln!("PAGEMAP_SCAN not available here ({e}): only the read was checked"),
        }
        assert_eq!(ram.content_ranges().unwrap(), read);
    }

    /// Restored into a private mapping, the pages written since are the
    /// VM's own; those only read are the file's; the writer needs only the
    /// former (by `PAGEMAP_SCAN` and by the pagemap read alike).
    #[test]
    fn own_candidates_are_the_written_pages_of_a_restored_mapping() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(16 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[9u8; 4096], 100 * PAGE).unwrap();
        let ram = GuestRam::from_file_private(file, 16 << 20).unwrap();
        let mut byte = [0u8; 1];
        for page in [100u64, 200, 300] {
            ram.memory.read_slice(&mut byte, GuestAddress(page * PAGE)).unwrap();
        }
        for page in [5u64, 6, 200, 4095] {
            ram.memory.write_slice(&[1u8], GuestAddress(page * PAGE)).unwrap();
        }
        let want = vec![(5 * PAGE, 7 * PAGE), (200 * PAGE, 201 * PAGE), (4095 * PAGE, 4096 * PAGE)];
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        assert_eq!(ram.read_own(&pagemap).unwrap(), want, "pagemap: written pages only");
        match ram.scan(&pagemap, PAGE_IS_FILE | PAGE_IS_PFNZERO) {
            Ok(scanned) => assert_eq!(scanned, want),
            Err(e) => eprintln!("PAGEMAP_SCAN not available here ({e}): only the read was checked"),
        }
        assert_eq!(ram.own_candidates().unwrap(), want);
        assert_eq!(ram.own_bytes().unwrap(), 4 * PAGE);
        // Booted RAM has no base: every page with data is a candidate.
        let booted = GuestRam::new("own", 16 << 20).unwrap();
        booted.memory.write_slice(&[1u8], GuestAddress(7 * PAGE)).unwrap();
        assert_eq!(booted.own_candidates().unwrap(), booted.content_ranges().unwrap());
    }

    #[test]
    fn huge_pages_refused_with_a_reason() {
        let err = GuestRam::new_huge("huge-odd", (32 << 20) + 4096).err().expect("not whole huge pages");
        assert!(err.to_string().contains("2 MiB huge pages"), "{err}");
        // More than any test host's pool: the reservation at mmap fails.
        let err = GuestRam::new_huge("huge-big", 512 << 30).err().expect("the pool is too small");
        assert!(err.to_string().contains("HugePages_Rsvd") && err.to_string().contains("nr_hugepages"), "{err}");
    }
}
