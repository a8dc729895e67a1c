//! Working sets of restored guests: which pages of a snapshot's memory a
//! guest touched (recorded from the host's page tables), and their
//! prefetch into a new guest restored from the same snapshot, so its
//! first work does not fault each of those pages in one at a time
//! (record-and-prefetch, after REAP: Ustiugov et al., "Benchmarking,
//! Analysis, and Optimization of Serverless Function Snapshots",
//! ASPLOS 2021).
//!
//! Recording reads `/proc/self/pagemap` (kernel doc
//! `Documentation/admin-guide/mm/pagemap.rst`) over guest RAM's mappings:
//! a present page was touched; in a `MAP_PRIVATE` mapping of the memory
//! file, a present page that is no longer the file's (bit 61 clear) was
//! written (copied on write). Prefetch populates the page tables with
//! `madvise(MADV_POPULATE_READ)` for pages only read and
//! `MADV_POPULATE_WRITE` for pages written (Linux 5.14, `madvise(2)`), in
//! runs of contiguous pages; under the userfaultfd backing the set is
//! copied in with `UFFDIO_COPY`/`UFFDIO_ZEROPAGE` runs of up to 1 MiB
//! ([`crate::uffd::Handler::prefetch`]).

use serde::{Deserialize, Serialize};

use crate::memory::GuestRam;
use crate::MemoryBacking;

/// Page size of guest RAM's host mappings (bytes).
const PAGE: u64 = 4096;
/// `/proc/self/pagemap` entry bits.
const PM_PRESENT: u64 = 1 << 63;
const PM_FILE_OR_SHARED: u64 = 1 << 61;
/// `MADV_POPULATE_READ` / `MADV_POPULATE_WRITE` (Linux 5.14,
/// include/uapi/asm-generic/mman-common.h).
const MADV_POPULATE_READ: libc::c_int = 22;
const MADV_POPULATE_WRITE: libc::c_int = 23;
/// Pagemap entries read per `pread` (8 bytes each: 512 KiB of entries
/// cover 256 MiB of guest RAM).
const PAGEMAP_BATCH: usize = 65536;

/// The pages a guest touched, as byte ranges `(offset, len)` of the
/// snapshot's memory file layout (page-aligned, sorted, not overlapping).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkingSet {
    /// Pages read but not written.
    pub read: Vec<(u64, u64)>,
    /// Pages written (a private copy was made).
    pub written: Vec<(u64, u64)>,
    /// The backing it was recorded under: under
    /// [`MemoryBacking::Userfaultfd`] every filled page is private, so
    /// `written` holds all of them and cannot tell writes from reads.
    #[serde(default)]
    pub recorded_with: MemoryBacking,
}

impl WorkingSet {
    /// Bytes in `read` and `written`.
    pub fn bytes(&self) -> (u64, u64) {
        let sum = |r: &[(u64, u64)]| r.iter().map(|(_, l)| l).sum();
        (sum(&self.read), sum(&self.written))
    }

    /// Whether `self` fits guest RAM of `size` bytes (every range inside,
    /// page-aligned, in order): a working set read from disk is checked
    /// before it is used.
    pub fn fits(&self, size: u64) -> bool {
        [&self.read, &self.written].iter().all(|ranges| {
            let mut end = 0;
            ranges.iter().all(|&(off, len)| {
                let Some(stop) = off.checked_add(len) else { return false };
                let ok = off >= end && off % PAGE == 0 && len % PAGE == 0 && len > 0 && stop <= size;
                end = stop;
                ok
            })
        })
    }
}

/// What a prefetch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Bytes populated for reading.
    pub read_bytes: u64,
    /// Bytes populated for writing (private copies made).
    pub written_bytes: u64,
    /// Ranges the kernel refused (counted, not fatal: the guest faults
    /// those pages in as usual).
    pub failed_ranges: u64,
}

/// Appends page `offset` to `ranges`, merging with the last range.
fn push_page(ranges: &mut Vec<(u64, u64)>, offset: u64) {
    match ranges.last_mut() {
        Some((start, len)) if *start + *len == offset => *len += PAGE,
        _ => ranges.push((offset, PAGE)),
    }
}

impl GuestRam {
    /// The pages of guest RAM present in this process's page tables now,
    /// split into read and written (see the module doc). Meaningful for
    /// restored RAM (a `MAP_PRIVATE` file mapping or the userfaultfd
    /// backing, whose filled pages all count as written).
    ///
    /// Errors: reading `/proc/self/pagemap`.
    pub fn working_set(&self) -> std::io::Result<WorkingSet> {
        use std::os::unix::fs::FileExt;
        let pagemap = std::fs::File::open("/proc/self/pagemap")?;
        let recorded_with =
            if self.uffd_handler().is_some() { MemoryBacking::Userfaultfd } else { MemoryBacking::Private };
        let mut ws = WorkingSet { recorded_with, ..WorkingSet::default() };
        let mut buf = vec![0u8; PAGEMAP_BATCH * 8];
        for region in self.regions() {
            let pages = region.len as u64 / PAGE;
            let first = region.host_addr as u64 / PAGE;
            let mut done = 0u64;
            while done < pages {
                let n = (pages - done).min(PAGEMAP_BATCH as u64) as usize;
                let bytes = &mut buf[..n * 8];
                pagemap.read_exact_at(bytes, (first + done) * 8)?;
                for (i, entry) in bytes.chunks_exact(8).enumerate() {
                    let e = u64::from_ne_bytes(entry.try_into().unwrap_or_default());
                    if e & PM_PRESENT == 0 {
                        continue;
                    }
                    let offset = region.file_offset + (done + i as u64) * PAGE;
                    match e & PM_FILE_OR_SHARED != 0 {
                        true => push_page(&mut ws.read, offset),
                        false => push_page(&mut ws.written, offset),
                    }
                }
                done += n as u64;
            }
        }
        Ok(ws)
    }

    /// Populates the page tables of `ws`'s pages (see the module doc).
    /// Ranges outside guest RAM are skipped; a range the kernel refuses
    /// (e.g. a host without `MADV_POPULATE_*`) is counted and left to fault
    /// in as usual.
    pub fn prefetch(&self, ws: &WorkingSet) -> PrefetchStats {
        let regions = self.regions();
        let mut stats = PrefetchStats::default();
        if let Some(handler) = self.uffd_handler() {
            // Many pages per ioctl from the memory file, instead of one
            // populate fault (and one handler round trip) per page.
            for (ranges, bytes) in [(&ws.written, &mut stats.written_bytes), (&ws.read, &mut stats.read_bytes)] {
                *bytes += handler.prefetch(&self.file, &regions, ranges) * PAGE;
            }
            return stats;
        }
        // A set recorded through userfaultfd cannot tell writes from reads:
        // populate it for reading (a later write copies just that page).
        let write_advice =
            if ws.recorded_with == MemoryBacking::Userfaultfd { MADV_POPULATE_READ } else { MADV_POPULATE_WRITE };
        for (ranges, advice) in [(&ws.written, write_advice), (&ws.read, MADV_POPULATE_READ)] {
            for &(offset, len) in ranges.iter() {
                // A range may span two regions (the layout is contiguous).
                let (mut at, end) = (offset, offset.saturating_add(len));
                while at < end {
                    let Some(r) = regions.iter().find(|r| at >= r.file_offset && at < r.file_offset + r.len as u64)
                    else {
                        stats.failed_ranges += 1;
                        break;
                    };
                    let n = (end - at).min(r.file_offset + r.len as u64 - at);
                    let addr = r.host_addr + (at - r.file_offset) as usize;
                    // SAFETY: [addr, addr + n) lies inside one of guest RAM's
                    // mappings, which `self` owns and keeps mapped; populating
                    // page tables changes no memory contents (a write populate
                    // makes the private copy the guest's own write would make).
                    let rc = unsafe { libc::madvise(addr as *mut libc::c_void, n as usize, advice) };
                    match (rc, std::ptr::eq(ranges, &ws.written)) {
                        (0, true) => stats.written_bytes += n,
                        (0, false) => stats.read_bytes += n,
                        _ => stats.failed_ranges += 1,
                    }
                    at += n;
                }
            }
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_merge_into_ranges() {
        let mut r = Vec::new();
        for p in [0, 1, 2, 5, 6, 9] {
            push_page(&mut r, p * PAGE);
        }
        assert_eq!(r, vec![(0, 3 * PAGE), (5 * PAGE, 2 * PAGE), (9 * PAGE, PAGE)]);
    }

    #[test]
    fn fits_checks_bounds_alignment_and_order() {
        let ws = |read: Vec<(u64, u64)>| WorkingSet { read, ..WorkingSet::default() };
        assert!(ws(vec![(0, PAGE), (2 * PAGE, PAGE)]).fits(4 * PAGE));
        assert!(!ws(vec![(0, PAGE), (3 * PAGE, 2 * PAGE)]).fits(4 * PAGE), "past the end");
        assert!(!ws(vec![(1, PAGE)]).fits(4 * PAGE), "unaligned");
        assert!(!ws(vec![(2 * PAGE, PAGE), (0, PAGE)]).fits(4 * PAGE), "out of order");
        assert!(!ws(vec![(0, 0)]).fits(4 * PAGE), "empty range");
        assert!(!ws(vec![(u64::MAX - PAGE + 1, PAGE)]).fits(u64::MAX), "overflow");
    }

    /// Whether page `offset` is inside one of `ranges`.
    fn covers(ranges: &[(u64, u64)], offset: u64) -> bool {
        ranges.iter().any(|&(o, l)| offset >= o && offset < o + l)
    }

    /// Recorded from a private mapping of a memory file: pages read are in
    /// `read` (with the neighbours the kernel's fault-around mapped), the
    /// page written is `written`; a prefetch of that set into a new mapping
    /// of the same file makes those pages present, the written one private
    /// with the file's contents.
    #[test]
    fn record_and_prefetch_a_private_mapping() {
        use std::io::Write;
        use vm_memory::{Bytes, GuestAddress};
        let size = crate::memory::MIN_MEM_BYTES;
        let mut f = tempfile::tempfile().unwrap();
        let content: Vec<u8> = (0..64 * PAGE).map(|i| (i / PAGE) as u8 + 1).collect();
        f.write_all(&content).unwrap();
        f.set_len(size).unwrap();
        let ram = GuestRam::from_file_private(f.try_clone().unwrap(), size).unwrap();
        assert_eq!(ram.working_set().unwrap(), WorkingSet::default(), "nothing touched yet");
        let mut b = [0u8; 1];
        for p in [1u64, 2, 40] {
            ram.memory.read_slice(&mut b, GuestAddress(p * PAGE)).unwrap();
        }
        ram.memory.write_slice(&[0xff], GuestAddress(3 * PAGE)).unwrap();
        let ws = ram.working_set().unwrap();
        for p in [1u64, 2, 40] {
            assert!(covers(&ws.read, p * PAGE), "page {p} read: {ws:?}");
        }
        assert_eq!(ws.written, vec![(3 * PAGE, PAGE)]);
        assert!(!covers(&ws.read, 3 * PAGE), "{ws:?}");
        assert!(ws.fits(size));

        let fresh = GuestRam::from_file_private(f, size).unwrap();
        let stats = fresh.prefetch(&ws);
        assert_eq!((stats.read_bytes, stats.written_bytes, stats.failed_ranges), (ws.bytes().0, PAGE, 0));
        let again = fresh.working_set().unwrap();
        assert_eq!(again.written, ws.written, "the written page is private again");
        for &(o, l) in &ws.read {
            assert!((o..o + l).step_by(PAGE as usize).all(|p| covers(&again.read, p)), "{again:?} holds {ws:?}");
        }
        fresh.memory.read_slice(&mut b, GuestAddress(3 * PAGE)).unwrap();
        assert_eq!(b[0], 4, "a write populate keeps the file's contents");
    }
}
