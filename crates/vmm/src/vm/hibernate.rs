//! Hibernating a VM: [`RunningVm::hibernate`] writes a paused VM's state
//! and the pages of guest RAM that differ from its base (the template or
//! branch point it was restored from) to a directory, so the VM can be
//! freed and restored later with
//! [`SnapshotMemory::Layered`](crate::snapshot::SnapshotMemory::Layered)
//! (`docs/design/hibernate.md` §1).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::memory::MemoryError;
use crate::pagefile::{PageFile, PageReport};
use crate::snapshot::{SnapshotMemory, PAGES_FILE};
use crate::vm::{ControlError, RunningVm};

/// What [`RunningVm::hibernate`] wrote.
#[derive(Clone, Debug)]
pub struct HibernateReport {
    /// Whether the page file holds only the pages that differ from a base
    /// (else every non-zero page).
    pub based: bool,
    /// Pages and bytes of the page file.
    pub pages: PageReport,
    /// The bytes of guest RAM examined (the candidates' total).
    pub bytes_examined: u64,
    /// From the call to the synced directory.
    pub took: Duration,
    /// Each disk's checkpoint at the capture ([`crate::Snapshot::disks`]),
    /// also in the state file.
    pub disks: Vec<Option<tine_storage::ChainSpec>>,
}

/// A file mapped read-only for the length of a hibernation.
struct ReadOnlyMap {
    addr: *mut libc::c_void,
    len: usize,
}

impl ReadOnlyMap {
    /// Maps the first `len` bytes of `file` (which must be that long).
    fn new(file: &File, len: u64) -> std::io::Result<Self> {
        let found = file.metadata()?.len();
        if found != len {
            return Err(std::io::Error::other(format!("the base is {found} bytes, guest RAM {len}")));
        }
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        // SAFETY: a new read-only private mapping of a file this function
        // borrows; the kernel picks the address, and the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ReadOnlyMap { addr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `addr` is a live read-only mapping of `len` bytes, unmapped
        // only by `drop`, after every borrow of `self` has ended.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl Drop for ReadOnlyMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made, which nothing
        // borrows any more.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

impl RunningVm {
    /// Hibernates the paused VM into the directory `dir` (which must exist
    /// and be empty): guest RAM to `dir/pages` ([`crate::pagefile`]), then
    /// the state file, then `dir` is synced. With a `base` (the memory the
    /// VM was restored from: a template's memory file or memfd, or a branch
    /// point's memfd, exactly `mem_bytes` long) only the pages that differ
    /// from it are written; without one every non-zero page is. Every
    /// virtio transport is locked while guest RAM is read. The VM stays
    /// paused; the caller stops it once the hibernation is committed, or
    /// resumes it after an error. On an error `dir`'s files may be partly
    /// written: remove the directory.
    ///
    /// Restore it with [`crate::snapshot::Snapshot::load_state`] and
    /// [`SnapshotMemory::Layered`] over the same base.
    ///
    /// Errors: [`ControlError::NotPaused`], [`ControlError::VcpuState`],
    /// [`ControlError::VmState`], [`ControlError::Memory`] (reading the page
    /// tables; [`MemoryError::PageFile`] for the page file, ENOSPC
    /// included), [`ControlError::Snapshot`] (the state file, the sync).
    pub fn hibernate(&self, dir: &Path, base: Option<&File>) -> Result<HibernateReport, ControlError> {
        let start = Instant::now();
        let (locks, state) = self.capture_state()?;
        let candidates = if base.is_some() { self.ram.own_candidates()? } else { self.ram.content_ranges()? };
        let bytes_examined = candidates.iter().map(|(s, e)| e - s).sum();
        let base_map = base.map(|f| ReadOnlyMap::new(f, self.ram.size)).transpose().map_err(MemoryError::Memfd)?;
        let regions = self.ram.regions();
        let segments: Vec<&[u8]> = regions
            .iter()
            // SAFETY: each region is one of guest RAM's mappings, alive while
            // `self.ram` is (past this function); the vCPUs are paused and
            // every transport is locked (`locks`) until the page file is
            // written, so nothing writes these bytes meanwhile.
            .map(|r| unsafe { std::slice::from_raw_parts(r.host_addr as *const u8, r.len) })
            .collect();
        let pages_path = dir.join(PAGES_FILE);
        let pages = crate::pagefile::write(&pages_path, &segments, &candidates, base_map.as_ref().map(|m| m.bytes()))
            .map_err(MemoryError::from)?;
        drop(locks);
        drop(base_map);
        super::capture::sync_disks(&state.disks)?;
        let file = PageFile::open(&pages_path, self.ram.size).map_err(MemoryError::from)?;
        let snapshot = self.snapshot_of(state, 0, SnapshotMemory::Layered { base: None, pages: Arc::new(file) });
        snapshot.write_state(dir)?;
        let sync = File::open(dir).and_then(|d| d.sync_all());
        sync.map_err(|source| crate::snapshot::SnapshotError::Io { path: dir.to_path_buf(), source })?;
        let report = HibernateReport {
            based: base.is_some(),
            pages,
            bytes_examined,
            took: start.elapsed(),
            disks: snapshot.disks.clone(),
        };
        tracing::info!(
            name = %self.name,
            based = report.based,
            data_pages = pages.data_pages,
            zero_pages = pages.zero_pages,
            examined_mib = bytes_examined >> 20,
            "hibernated in {:?}: {} KiB written",
            report.took,
            pages.file_bytes >> 10
        );
        Ok(report)
    }
}
