//! Branch points: a point-in-time copy of a running VM's guest RAM, taken
//! with a pause that does not grow with the amount of memory copied.
//!
//! [`crate::vm::RunningVm::branch`] pauses the vCPUs, saves the vCPU, VM
//! and device state, write-protects every page of guest RAM that holds data
//! with userfaultfd (`UFFDIO_REGISTER_MODE_WP`, then `UFFDIO_WRITEPROTECT`)
//! and resumes the VM at once. From then on the first write to a protected
//! page (by a vCPU, through KVM, or by a device thread) stops the writer
//! until this module has copied the page's branch-time contents into the
//! branch point's memfd and lifted the protection of that page
//! (copy-before-write). Meanwhile the same thread copies every other page,
//! chunk by chunk, lifting the protection behind it. The result is the
//! memory exactly as it was at the pause.
//!
//! Where the kernel cannot write-protect the memory (no userfaultfd, a
//! kernel before 5.19 for shmem, or RAM that another userfaultfd already
//! serves), the copy is made while the VM stays paused, and the report says
//! why ([`BranchReport::fallback_reason`]).
//!
//! Source: the kernel's `Documentation/admin-guide/mm/userfaultfd.rst`
//! ("Write Protect Notifications"), `ioctl_userfaultfd(2)`. QEMU's
//! background snapshots (`background-snapshot` migration capability) use
//! the same mechanism.

use std::time::Duration;

use userfaultfd::{Event, EventBuffer, RegisterMode, Uffd};

use crate::memory::{MemoryError, PageCopier};
use crate::uffd::{Region, PAGE_SIZE};

/// Pages copied between two looks for write faults (256 KiB): a writer
/// waits at most about one chunk's copy.
const CHUNK_PAGES: u64 = 64;
/// userfaultfd messages read at once.
const EVENT_BATCH: usize = 64;

/// How a branch point's memory was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BranchMode {
    /// The VM ran on while its memory was copied, each page copied before
    /// its first write (userfaultfd write protection).
    WriteProtect,
    /// The memory was copied while the VM stayed paused.
    CopyWhilePaused,
}

/// What taking a branch point cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchReport {
    /// How the memory was taken.
    pub mode: BranchMode,
    /// Why write protection was not used, for [`BranchMode::CopyWhilePaused`].
    pub fallback_reason: Option<String>,
    /// How long the vCPUs were stopped: from the pause request to the
    /// resume (the whole copy, for [`BranchMode::CopyWhilePaused`]).
    pub pause: Duration,
    /// Where the pause went, step by step.
    pub pause_steps: PauseSteps,
    /// From the pause request until the copy was complete.
    pub total: Duration,
    /// Bytes of guest RAM examined (the data ranges at the pause).
    pub bytes_examined: u64,
    /// Bytes written to the branch point (all-zero pages are left out).
    pub bytes_written: u64,
    /// Pages copied ahead of the background copy because the VM was about
    /// to write them (pages of [`PAGE_SIZE`] bytes).
    pub pages_copied_before_write: u64,
    /// Write faults served (pages of [`PAGE_SIZE`] bytes).
    pub write_faults: u64,
}

/// The steps of a branch's pause ([`BranchReport::pause`]), in order; what
/// is left of the pause is the resume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PauseSteps {
    /// Until every vCPU was parked (zero for a VM paused already).
    pub stop_vcpus: Duration,
    /// Making the memfd that holds the branch point's memory.
    pub memfd: Duration,
    /// Saving vCPU, VM and device state (every transport locked).
    pub state: Duration,
    /// Finding the ranges of guest RAM that hold data (`PAGEMAP_SCAN`).
    pub ranges: Duration,
    /// Write-protecting those ranges (or, without protection, copying them).
    pub protect: Duration,
}

/// Guest RAM write-protected for one branch: the userfaultfd, and which
/// pages still hold branch-time contents not yet copied.
pub(crate) struct WriteProtection {
    uffd: Uffd,
    regions: Vec<Region>,
    /// One bit per page of the memory file's layout: set while the page's
    /// branch-time contents are still to be copied (it is then protected).
    pending: Vec<u64>,
    pages_copied_before_write: u64,
    write_faults: u64,
    /// The host page size of the RAM (bytes): 4 KiB, or 2 MiB for huge
    /// pages ([`crate::memory::GuestRam::page_size`]). Protection is set,
    /// faults are reported and protection is lifted in whole pages of this
    /// size (hugetlbfs refuses anything else).
    host_page: u64,
}

impl WriteProtection {
    /// Registers `regions` with a new userfaultfd in write-protect mode and
    /// protects the pages of `ranges` (offsets in the memory file's
    /// layout), widened to whole host pages of `host_page` bytes (4096, or
    /// [`crate::memory::HUGE_PAGE_SIZE`]). Pages outside `ranges` are zero
    /// and stay unprotected: the branch point leaves them holes whatever the
    /// VM writes there later.
    ///
    /// Errors: why write protection cannot be used, as a sentence.
    ///
    /// # Safety
    ///
    /// The regions must stay mapped until the returned value is dropped, and
    /// the VM must be paused with its devices locked until this returns.
    pub(crate) unsafe fn start(regions: &[Region], ranges: &[(u64, u64)], host_page: u64) -> Result<Self, String> {
        let uffd = crate::uffd::create_wp_uffd().map_err(|e| e.to_string())?;
        let total_pages: u64 = regions.iter().map(|r| r.len as u64 / PAGE_SIZE as u64).sum();
        let mut wp = WriteProtection {
            uffd,
            regions: regions.to_vec(),
            pending: vec![0u64; total_pages.div_ceil(64) as usize],
            pages_copied_before_write: 0,
            write_faults: 0,
            host_page,
        };
        for r in regions {
            let ioctls = wp
                .uffd
                .register_with_mode(r.host_addr as *mut libc::c_void, r.len, RegisterMode::WRITE_PROTECT)
                .map_err(|e| {
                    format!("the kernel refused to write-protect guest RAM ({e}; shmem needs Linux 5.19 or later, and RAM served by another userfaultfd cannot be registered again)")
                })?;
            if !ioctls.contains(userfaultfd::IoctlFlags::WRITE_PROTECT) {
                return Err("the kernel does not offer UFFDIO_WRITEPROTECT for this kind of memory".into());
            }
        }
        for (start, end) in widen(ranges, host_page) {
            for (addr, len) in wp.host_ranges(start, end) {
                wp.uffd
                    .write_protect(addr as *mut libc::c_void, len)
                    .map_err(|e| format!("UFFDIO_WRITEPROTECT failed: {e}"))?;
            }
            let mut page = start / PAGE_SIZE as u64;
            while page < end / PAGE_SIZE as u64 {
                wp.pending[(page / 64) as usize] |= 1 << (page % 64);
                page += 1;
            }
        }
        Ok(wp)
    }

    /// Copies the pages of `ranges` (as given to [`WriteProtection::start`])
    /// into `copier`'s file while the VM runs, serving write faults first,
    /// then lifts all protection and unregisters. Returns (pages copied
    /// before a write, write faults served).
    ///
    /// Errors: [`MemoryError::Memfd`] for I/O and userfaultfd ioctl errors
    /// (the protection is lifted anyway, when `self` is dropped).
    pub(crate) fn copy(mut self, ranges: &[(u64, u64)], copier: &mut PageCopier) -> Result<(u64, u64), MemoryError> {
        let mut events = EventBuffer::new(EVENT_BATCH);
        // A chunk is whole host pages: protection is lifted chunk by chunk.
        let chunk = (CHUNK_PAGES * PAGE_SIZE as u64).max(self.host_page);
        for (start, end) in widen(ranges, self.host_page) {
            let mut at = start;
            while at < end {
                self.serve_faults(&mut events, copier)?;
                let chunk_end = end.min(at + chunk);
                // Copy the runs of pages still pending in the chunk (a write
                // fault may have taken some already), then unprotect it.
                let mut page = at;
                while page < chunk_end {
                    if !self.is_pending(page) {
                        page += PAGE_SIZE as u64;
                        continue;
                    }
                    let run = page;
                    while page < chunk_end && self.is_pending(page) {
                        self.clear_pending(page);
                        page += PAGE_SIZE as u64;
                    }
                    copier.copy(run, page)?;
                }
                self.unprotect(at, chunk_end)?;
                at = chunk_end;
            }
        }
        self.serve_faults(&mut events, copier)?;
        Ok((self.pages_copied_before_write, self.write_faults))
    }

    /// Serves every write fault queued now: copies the page if it is still
    /// pending, then lifts its protection and wakes the writer.
    fn serve_faults(&mut self, events: &mut EventBuffer, copier: &mut PageCopier) -> Result<(), MemoryError> {
        loop {
            let mut faults = Vec::new();
            for event in
                self.uffd.read_events(events).map_err(|e| MemoryError::Memfd(std::io::Error::other(e.to_string())))?
            {
                match event {
                    Ok(Event::Pagefault { addr, .. }) => faults.push(addr as usize),
                    Ok(other) => tracing::warn!("branch: ignoring userfaultfd event {other:?}"),
                    Err(e) => tracing::warn!("branch: ignoring a userfaultfd event: {e}"),
                }
            }
            if faults.is_empty() {
                return Ok(());
            }
            for addr in faults {
                self.write_faults += 1;
                let Some(offset) = self.offset_of(addr & !(self.host_page as usize - 1)) else {
                    tracing::error!("branch: write fault at {addr:#x} outside guest RAM");
                    continue;
                };
                // The whole host page is protected and lifted at once: copy
                // every pending 4 KiB page in it first.
                let end = offset + self.host_page;
                let mut page = offset;
                while page < end {
                    if self.is_pending(page) {
                        self.clear_pending(page);
                        copier.copy(page, page + PAGE_SIZE as u64)?;
                        self.pages_copied_before_write += 1;
                    }
                    page += PAGE_SIZE as u64;
                }
                self.unprotect(offset, end)?;
            }
        }
    }

    fn is_pending(&self, offset: u64) -> bool {
        let page = offset / PAGE_SIZE as u64;
        self.pending.get((page / 64) as usize).is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    fn clear_pending(&mut self, offset: u64) {
        let page = offset / PAGE_SIZE as u64;
        if let Some(w) = self.pending.get_mut((page / 64) as usize) {
            *w &= !(1 << (page % 64));
        }
    }

    /// The memory file offset of host address `addr`.
    fn offset_of(&self, addr: usize) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| r.host_addr <= addr && addr - r.host_addr < r.len)
            .map(|r| r.file_offset + (addr - r.host_addr) as u64)
    }

    /// The host address ranges of the memory file's bytes `[start, end)`.
    fn host_ranges(&self, start: u64, end: u64) -> Vec<(usize, usize)> {
        crate::uffd::host_slices(&self.regions, start, end).into_iter().map(|(addr, len, _)| (addr, len)).collect()
    }

    /// Lifts the protection of the memory file's bytes `[start, end)` and
    /// wakes writers waiting there.
    fn unprotect(&self, start: u64, end: u64) -> Result<(), MemoryError> {
        for (addr, len) in self.host_ranges(start, end) {
            self.uffd
                .remove_write_protection(addr as *mut libc::c_void, len, true)
                .map_err(|e| MemoryError::Memfd(std::io::Error::other(format!("UFFDIO_WRITEPROTECT (lift): {e}"))))?;
        }
        Ok(())
    }
}

/// `ranges` (sorted `(start, end)` byte offsets) widened to whole pages of
/// `host_page` bytes, overlapping ones merged.
fn widen(ranges: &[(u64, u64)], host_page: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(start, end) in ranges {
        let (s, e) = (start / host_page * host_page, end.div_ceil(host_page) * host_page);
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

impl Drop for WriteProtection {
    /// Lifts every protection left (after an error) and unregisters, so no
    /// writer of the VM waits for a copy that will not come.
    fn drop(&mut self) {
        for r in &self.regions {
            let addr = r.host_addr as *mut libc::c_void;
            if let Err(e) = self.uffd.remove_write_protection(addr, r.len, true) {
                tracing::error!("branch: cannot lift the write protection of guest RAM at {addr:?}: {e}");
            }
            if let Err(e) = self.uffd.unregister(addr, r.len) {
                tracing::warn!("branch: cannot unregister guest RAM at {addr:?} from userfaultfd: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{GuestRam, MemoryBacking};
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use vm_memory::{Bytes, GuestAddress};

    const SIZE: u64 = 64 << 20;
    const PAGE: u64 = PAGE_SIZE as u64;
    /// Pages of data the tests write (the rest of RAM stays a hole).
    const DATA_PAGES: u64 = 4096;

    fn protection_or_skip(ram: &GuestRam, ranges: &[(u64, u64)]) -> Option<WriteProtection> {
        // SAFETY: `ram` outlives the protection in every test below, and
        // nothing else runs on it until `start` returns.
        match unsafe { WriteProtection::start(&ram.regions(), ranges, ram.page_size()) } {
            Ok(wp) => Some(wp),
            Err(e) if e.contains("unavailable") => {
                eprintln!("SKIP: userfaultfd unavailable: {e}");
                None
            }
            Err(e) => panic!("write protection refused: {e}"),
        }
    }

    /// A writer thread keeps rewriting every data page with a new
    /// generation number while the copy runs: the copy must hold exactly
    /// the contents from before the protection, and the writer must not be
    /// stuck afterwards.
    fn copy_is_point_in_time(ram: Arc<GuestRam>) {
        for p in 0..DATA_PAGES {
            ram.memory.write_obj(p * 1000 + 7, GuestAddress(p * PAGE)).unwrap();
        }
        let ranges = ram.content_ranges().unwrap();
        let Some(wp) = protection_or_skip(&ram, &ranges) else { return };
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let writer = {
            let (ram, stop, writes) = (ram.clone(), stop.clone(), writes.clone());
            std::thread::spawn(move || {
                let mut generation = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    for p in (0..DATA_PAGES).rev() {
                        ram.memory.write_obj(u64::MAX - generation, GuestAddress(p * PAGE)).unwrap();
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                    generation += 1;
                }
            })
        };
        // Let the writer run into a protected page first (it then waits
        // for the copy below).
        std::thread::sleep(std::time::Duration::from_millis(20));
        let out = crate::memory::new_memfd("branch-test", SIZE).unwrap();
        let mut copier = PageCopier::new(&ram, &out);
        let (early, faults) = wp.copy(&ranges, &mut copier).unwrap();
        let after = writes.load(Ordering::Relaxed);
        while writes.load(Ordering::Relaxed) < after + DATA_PAGES {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        eprintln!("{early} pages copied before a write, {faults} write faults");
        // A fault copies the pending 4 KiB pages of one host page.
        let per_fault = ram.page_size() / PAGE;
        assert!(early > 0 && faults * per_fault >= early, "the writer never waited for a copy ({early}, {faults})");
        let mut word = [0u8; 8];
        for p in 0..DATA_PAGES {
            out.read_exact_at(&mut word, p * PAGE).unwrap();
            assert_eq!(u64::from_le_bytes(word), p * 1000 + 7, "page {p} of the copy is not the branch-time page");
        }
        assert_eq!(copier.bytes_written, DATA_PAGES * PAGE);
        assert_eq!(crate::memory::data_ranges(&out, SIZE).unwrap(), vec![(0, DATA_PAGES * PAGE)]);
    }

    #[test]
    fn memfd_ram_copy_is_point_in_time() {
        copy_is_point_in_time(Arc::new(GuestRam::new("wp-memfd", SIZE).unwrap()));
    }

    /// Huge-page RAM is protected, faulted and lifted 2 MiB at a time; the
    /// copy is still the memory of one instant.
    #[test]
    fn huge_page_ram_copy_is_point_in_time() {
        if !crate::memory::tests::huge_pages_free("huge_page_ram_copy_is_point_in_time", SIZE) {
            return;
        }
        let ram = GuestRam::new_huge("wp-huge", SIZE).unwrap();
        copy_is_point_in_time(Arc::new(ram));
    }

    /// RAM restored from a branch point maps the memfd `MAP_PRIVATE`:
    /// it can be write-protected in turn (branches of branches).
    #[test]
    fn private_shmem_ram_copy_is_point_in_time() {
        let base = crate::memory::new_memfd("branch-base", SIZE).unwrap();
        base.write_all_at(&[9u8; 4096], 100 * PAGE).unwrap();
        let ram = GuestRam::from_file_private(base, SIZE).unwrap();
        copy_is_point_in_time(Arc::new(ram));
    }

    /// RAM that another userfaultfd serves cannot be registered again: the
    /// error says why, so the caller can fall back to a copy while paused.
    #[test]
    fn userfaultfd_ram_is_refused_with_a_reason() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(SIZE).unwrap();
        let mem = crate::snapshot::SnapshotMemory::Shared(Arc::new(file));
        let ram = match GuestRam::from_snapshot("wp-uffd", &mem, SIZE, MemoryBacking::Userfaultfd) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("SKIP: userfaultfd unavailable: {e}");
                return;
            }
        };
        // SAFETY: `ram` outlives the call; nothing runs on it.
        let err = unsafe { WriteProtection::start(&ram.regions(), &[(0, PAGE)], PAGE) }
            .err()
            .expect("registration must fail");
        assert!(err.contains("another userfaultfd"), "{err}");
    }
}
