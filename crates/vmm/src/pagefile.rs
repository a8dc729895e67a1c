//! Page files: a guest's memory as the pages that differ from a base (the
//! template or branch point it was restored from), for hibernation (issue
//! 31, `docs/design/hibernate.md` §1.4). A sandbox restored from a
//! template owns a few MiB of its 512 MiB; writing only those, and laying
//! them over the base again on resume, keeps an idle sandbox's disk and
//! write time small. Without a base the file holds every non-zero page.
//!
//! Layout (little-endian), written once and never changed in place:
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `TINEPAGE` |
//! | 8 | 4 | version ([`VERSION`]) |
//! | 12 | 4 | flags (bit 0: written against a base) |
//! | 16 | 8 | guest memory size (bytes) |
//! | 24 | 4 | page size (4096) |
//! | 28 | 4 | extent count N |
//! | 32 | 8 | data offset (a multiple of the page size) |
//! | 40 | 8 | data bytes |
//! | 48 | 4 | CRC32 of the extent table |
//! | 52 | 4 | CRC32 of the data |
//! | 56 | 4 | CRC32 of bytes 0..56 |
//! | 60 | 4 | 0 |
//! | 64 | 16 N | extents: offset u64 (bytes, in memory-file layout), pages u32, kind u32 (0 data, 1 zero) |
//!
//! The data of the `data` extents follows at the data offset, in extent
//! order. The header is written last and synced, so a file cut short by a
//! crash fails [`PageFile::open`] instead of restoring half a guest.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"TINEPAGE";
/// The format version this code writes and reads.
pub const VERSION: u32 = 1;
/// The page size of the extents (bytes).
pub const PAGE_BYTES: u64 = 4096;
const HEADER_BYTES: u64 = 64;
const EXTENT_BYTES: u64 = 16;
/// Flag bit: the file holds the pages that differ from a base.
const FLAG_BASE: u32 = 1;
/// Most pages in one extent (its count is a u32).
const MAX_EXTENT_PAGES: u64 = u32::MAX as u64;
/// Bytes read or written at a time when data moves.
const CHUNK_BYTES: usize = 1 << 20;

/// Errors of page files.
#[derive(Debug, thiserror::Error)]
pub enum PageFileError {
    /// A read, write or sync failed (ENOSPC included).
    #[error("page file {path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a page file, of another version, or damaged.
    #[error("page file {path} cannot be used: {reason}")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The caller's memory or base does not match the file or each other.
    #[error("page file {path}: {reason}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// What an extent holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtentKind {
    /// Pages whose bytes follow in the data.
    Data,
    /// Pages that are all zero (over a base page that is not).
    Zero,
}

/// A run of pages of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Where the run starts in guest memory (bytes, memory-file layout, a
    /// multiple of [`PAGE_BYTES`]).
    pub offset: u64,
    /// Its length (pages).
    pub pages: u32,
    /// What it holds.
    pub kind: ExtentKind,
}

/// What [`write`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageReport {
    /// Pages written with their bytes.
    pub data_pages: u64,
    /// Pages recorded as zero.
    pub zero_pages: u64,
    /// The file's length (bytes).
    pub file_bytes: u64,
}

fn io(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> PageFileError {
    let path = path.to_path_buf();
    move |source| PageFileError::Io { path, what, source }
}

/// Guest memory as the host maps it: its regions in the memory file's
/// layout, in order (the first at offset 0, each next one right after the
/// one before), each a whole number of pages
/// ([`crate::memory::GuestRam::regions`]).
pub type Segments<'a> = [&'a [u8]];

/// The bytes of `mem` (segments as [`Segments`]) from `offset` on, at most
/// `len` of them and no further than the end of the segment holding
/// `offset`; empty past the end.
fn span<'a>(mem: &[&'a [u8]], offset: u64, len: u64) -> &'a [u8] {
    let mut start = 0u64;
    for seg in mem {
        let end = start + seg.len() as u64;
        if offset < end {
            let from = (offset - start) as usize;
            let to = (offset.saturating_add(len).min(end) - start) as usize;
            return &seg[from..to];
        }
        start = end;
    }
    &[]
}

/// As [`span`], writable.
fn span_mut<'m>(mem: &'m mut [&mut [u8]], offset: u64, len: u64) -> &'m mut [u8] {
    let mut start = 0u64;
    for seg in mem.iter_mut() {
        let end = start + seg.len() as u64;
        if offset < end {
            let from = (offset - start) as usize;
            let to = (offset.saturating_add(len).min(end) - start) as usize;
            return &mut seg[from..to];
        }
        start = end;
    }
    &mut []
}

/// The extents of the pages of `mem` within `candidates` (`(start, end)`
/// byte offsets of the memory file's layout, in any order, widened to whole
/// pages and cut at the end of `mem`) that must be kept: with a `base` (as
/// long as `mem`), those that differ from it (all-zero ones as
/// [`ExtentKind::Zero`]); without one, the non-zero ones. Sorted, adjacent
/// runs of a kind joined.
pub fn own_extents(mem: &Segments<'_>, candidates: &[(u64, u64)], base: Option<&[u8]>) -> Vec<Extent> {
    let total_pages = mem.iter().map(|s| s.len() as u64).sum::<u64>() / PAGE_BYTES;
    let mut ranges: Vec<(u64, u64)> = candidates
        .iter()
        .map(|&(start, end)| (start / PAGE_BYTES, end.div_ceil(PAGE_BYTES).min(total_pages)))
        .filter(|(a, b)| a < b)
        .collect();
    ranges.sort_unstable();
    let mut out: Vec<Extent> = Vec::new();
    let mut next = 0;
    for (first, end) in ranges {
        for page in first.max(next)..end {
            let offset = page * PAGE_BYTES;
            let bytes = span(mem, offset, PAGE_BYTES);
            let zero = bytes.iter().all(|&b| b == 0);
            let at = offset as usize;
            let kind = match base {
                Some(b) if b[at..at + PAGE_BYTES as usize] == *bytes => continue,
                Some(_) if zero => ExtentKind::Zero,
                None if zero => continue,
                _ => ExtentKind::Data,
            };
            match out.last_mut() {
                Some(e)
                    if e.kind == kind
                        && e.offset + u64::from(e.pages) * PAGE_BYTES == offset
                        && u64::from(e.pages) < MAX_EXTENT_PAGES =>
                {
                    e.pages += 1
                }
                _ => out.push(Extent { offset, pages: 1, kind }),
            }
        }
        next = next.max(end);
    }
    out
}

/// Writes `mem`'s own pages ([`own_extents`]) to a new file `out` and
/// syncs it. The space is allocated first, so a full file system fails
/// before anything else is written; on any error the file is removed.
///
/// Errors: [`PageFileError::Mismatch`] (a base of another size, a segment
/// not a whole number of pages), [`PageFileError::Io`].
pub fn write(
    out: &Path,
    mem: &Segments<'_>,
    candidates: &[(u64, u64)],
    base: Option<&[u8]>,
) -> Result<PageReport, PageFileError> {
    let mismatch = |reason: String| PageFileError::Mismatch { path: out.to_path_buf(), reason };
    if let Some(seg) = mem.iter().find(|s| !(s.len() as u64).is_multiple_of(PAGE_BYTES)) {
        return Err(mismatch(format!("a memory segment of {} bytes is not whole pages", seg.len())));
    }
    let mem_bytes: u64 = mem.iter().map(|s| s.len() as u64).sum();
    if let Some(b) = base.filter(|b| b.len() as u64 != mem_bytes) {
        return Err(mismatch(format!("a base of {} bytes for guest memory of {mem_bytes} bytes", b.len())));
    }
    let extents = own_extents(mem, candidates, base);
    let written = write_extents(out, mem, mem_bytes, &extents, base.is_some());
    if written.is_err() {
        let _ = std::fs::remove_file(out);
    }
    written
}

fn write_extents(
    out: &Path,
    mem: &Segments<'_>,
    mem_bytes: u64,
    extents: &[Extent],
    based: bool,
) -> Result<PageReport, PageFileError> {
    let mut table = Vec::with_capacity(extents.len() * EXTENT_BYTES as usize);
    let (mut data_pages, mut zero_pages) = (0u64, 0u64);
    for e in extents {
        table.extend_from_slice(&e.offset.to_le_bytes());
        table.extend_from_slice(&e.pages.to_le_bytes());
        table.extend_from_slice(&(e.kind as u32).to_le_bytes());
        match e.kind {
            ExtentKind::Data => data_pages += u64::from(e.pages),
            ExtentKind::Zero => zero_pages += u64::from(e.pages),
        }
    }
    let data_offset = (HEADER_BYTES + table.len() as u64).next_multiple_of(PAGE_BYTES);
    let data_bytes = data_pages * PAGE_BYTES;
    let file_bytes = data_offset + data_bytes;

    let f = File::options().write(true).create_new(true).open(out).map_err(io(out, "create"))?;
    // Allocate the whole file first: ENOSPC here, not half-way.
    let len = libc::off_t::try_from(file_bytes)
        .map_err(|_| PageFileError::Mismatch { path: out.to_path_buf(), reason: "too large".into() })?;
    // SAFETY: fallocate(2) on a file descriptor this function owns, with
    // no pointers; the result is checked.
    if unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, len) } != 0 {
        return Err(io(out, "allocate")(std::io::Error::last_os_error()));
    }
    f.write_all_at(&table, HEADER_BYTES).map_err(io(out, "write the extent table"))?;
    let mut data_crc = crc32fast::Hasher::new();
    let mut at = data_offset;
    for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
        let (mut from, mut left) = (e.offset, u64::from(e.pages) * PAGE_BYTES);
        while left > 0 {
            let bytes = span(mem, from, left);
            if bytes.is_empty() {
                return Err(PageFileError::Mismatch {
                    path: out.to_path_buf(),
                    reason: "an extent past the memory".into(),
                });
            }
            for chunk in bytes.chunks(CHUNK_BYTES) {
                data_crc.update(chunk);
                f.write_all_at(chunk, at).map_err(io(out, "write pages"))?;
                at += chunk.len() as u64;
            }
            from += bytes.len() as u64;
            left -= bytes.len() as u64;
        }
    }
    f.sync_data().map_err(io(out, "sync pages"))?;

    let mut header = Vec::with_capacity(HEADER_BYTES as usize);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&(if based { FLAG_BASE } else { 0 }).to_le_bytes());
    header.extend_from_slice(&mem_bytes.to_le_bytes());
    header.extend_from_slice(&(PAGE_BYTES as u32).to_le_bytes());
    header.extend_from_slice(&(extents.len() as u32).to_le_bytes());
    header.extend_from_slice(&data_offset.to_le_bytes());
    header.extend_from_slice(&data_bytes.to_le_bytes());
    header.extend_from_slice(&crc32fast::hash(&table).to_le_bytes());
    header.extend_from_slice(&data_crc.finalize().to_le_bytes());
    header.extend_from_slice(&crc32fast::hash(&header).to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    f.write_all_at(&header, 0).map_err(io(out, "write the header"))?;
    f.sync_all().map_err(io(out, "sync"))?;
    Ok(PageReport { data_pages, zero_pages, file_bytes })
}

/// A page file checked by [`PageFile::open`]: header, extent table and
/// length; the data's CRC is checked as [`PageFile::apply`] reads it.
#[derive(Debug)]
pub struct PageFile {
    path: PathBuf,
    file: File,
    mem_bytes: u64,
    based: bool,
    extents: Vec<Extent>,
    data_offset: u64,
    data_crc: u32,
}

impl PageFile {
    /// Opens and checks `path`, written for guest memory of `mem_bytes`.
    ///
    /// Errors: [`PageFileError::Io`], [`PageFileError::Damaged`] (bad
    /// magic, other version, a checksum, extents out of order or past the
    /// memory, a length that disagrees), [`PageFileError::Mismatch`]
    /// (another memory size).
    pub fn open(path: &Path, mem_bytes: u64) -> Result<PageFile, PageFileError> {
        let damaged = |reason: String| PageFileError::Damaged { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(io(path, "open"))?;
        let len = file.metadata().map_err(io(path, "stat"))?.len();
        if len < HEADER_BYTES {
            return Err(damaged(format!("{len} bytes, shorter than its header")));
        }
        let mut h = [0u8; HEADER_BYTES as usize];
        file.read_exact_at(&mut h, 0).map_err(io(path, "read the header"))?;
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
        if &h[..8] != MAGIC {
            return Err(damaged("not a page file (bad magic number)".into()));
        }
        if crc32fast::hash(&h[..56]) != u32_at(56) {
            return Err(damaged("the header's CRC32 does not match".into()));
        }
        if u32_at(8) != VERSION {
            return Err(damaged(format!("format version {}, this tine reads {VERSION}", u32_at(8))));
        }
        if u64::from(u32_at(24)) != PAGE_BYTES {
            return Err(damaged(format!("page size {}", u32_at(24))));
        }
        if u64_at(16) != mem_bytes {
            return Err(PageFileError::Mismatch {
                path: path.to_path_buf(),
                reason: format!("written for {} bytes of guest memory, not {mem_bytes}", u64_at(16)),
            });
        }
        let count = u64::from(u32_at(28));
        let (data_offset, data_bytes) = (u64_at(32), u64_at(40));
        let table_end = HEADER_BYTES + count * EXTENT_BYTES;
        if !data_offset.is_multiple_of(PAGE_BYTES) || data_offset < table_end {
            return Err(damaged(format!("data offset {data_offset} with {count} extents")));
        }
        if data_offset.checked_add(data_bytes) != Some(len) {
            return Err(damaged(format!("{len} bytes where {data_offset} + {data_bytes} were expected")));
        }
        let mut table = vec![0u8; (count * EXTENT_BYTES) as usize];
        file.read_exact_at(&mut table, HEADER_BYTES).map_err(io(path, "read the extent table"))?;
        if crc32fast::hash(&table) != u32_at(48) {
            return Err(damaged("the extent table's CRC32 does not match".into()));
        }
        let mut extents = Vec::with_capacity(count as usize);
        let (mut next, mut data_pages) = (0u64, 0u64);
        for raw in table.chunks_exact(EXTENT_BYTES as usize) {
            let offset = u64::from_le_bytes(raw[..8].try_into().expect("8 bytes"));
            let pages = u32::from_le_bytes(raw[8..12].try_into().expect("4 bytes"));
            let kind = match u32::from_le_bytes(raw[12..16].try_into().expect("4 bytes")) {
                0 => ExtentKind::Data,
                1 => ExtentKind::Zero,
                k => return Err(damaged(format!("extent kind {k}"))),
            };
            let end = offset.checked_add(u64::from(pages) * PAGE_BYTES);
            if !offset.is_multiple_of(PAGE_BYTES) || pages == 0 || offset < next || end.is_none_or(|e| e > mem_bytes) {
                return Err(damaged(format!("extent of {pages} pages at {offset} out of order or out of memory")));
            }
            next = end.unwrap_or(mem_bytes);
            if kind == ExtentKind::Data {
                data_pages += u64::from(pages);
            }
            extents.push(Extent { offset, pages, kind });
        }
        if data_pages * PAGE_BYTES != data_bytes {
            return Err(damaged(format!("{data_bytes} data bytes for {data_pages} data pages")));
        }
        Ok(PageFile {
            path: path.to_path_buf(),
            file,
            mem_bytes,
            based: u32_at(12) & FLAG_BASE != 0,
            extents,
            data_offset,
            data_crc: u32_at(52),
        })
    }

    /// Whether the file was written against a base (its pages go over the
    /// base's) or holds every non-zero page (they go over zeroed memory).
    pub fn has_base(&self) -> bool {
        self.based
    }

    /// The extents, in memory order.
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }

    /// Lays the file's pages over `mem` (segments as [`Segments`], holding
    /// the base's pages or zeroed memory), checking the data's CRC32 as it
    /// reads; returns the pages written. On an error `mem` is partly
    /// written and must not run.
    ///
    /// Errors: [`PageFileError::Mismatch`] (another memory size),
    /// [`PageFileError::Io`], [`PageFileError::Damaged`] (the data's CRC).
    pub fn apply(&self, mem: &mut [&mut [u8]]) -> Result<u64, PageFileError> {
        let mem_bytes: u64 = mem.iter().map(|s| s.len() as u64).sum();
        if mem_bytes != self.mem_bytes {
            return Err(PageFileError::Mismatch {
                path: self.path.clone(),
                reason: format!("{mem_bytes} bytes of memory for a file of {}", self.mem_bytes),
            });
        }
        let mut crc = crc32fast::Hasher::new();
        let (mut at, mut pages) = (self.data_offset, 0u64);
        for e in &self.extents {
            let (mut from, mut left) = (e.offset, u64::from(e.pages) * PAGE_BYTES);
            while left > 0 {
                let span = span_mut(mem, from, left);
                let n = span.len() as u64;
                if n == 0 {
                    break; // open() checked every extent against the size
                }
                match e.kind {
                    ExtentKind::Zero => span.fill(0),
                    ExtentKind::Data => {
                        for chunk in span.chunks_mut(CHUNK_BYTES) {
                            self.file.read_exact_at(chunk, at).map_err(io(&self.path, "read pages"))?;
                            crc.update(chunk);
                            at += chunk.len() as u64;
                        }
                    }
                }
                from += n;
                left -= n;
            }
            pages += u64::from(e.pages);
        }
        let found = crc.finalize();
        if found != self.data_crc {
            return Err(PageFileError::Damaged {
                path: self.path.clone(),
                reason: format!("the data's CRC32 is {found:#010x}, expected {:#010x}", self.data_crc),
            });
        }
        Ok(pages)
    }

    /// The guest memory size the file was written for (bytes).
    pub fn mem_bytes(&self) -> u64 {
        self.mem_bytes
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGES: usize = 64;

    /// A base of reproducible non-zero bytes with a zero page at 5.
    fn base() -> Vec<u8> {
        let mut x: u32 = 0x2545_f491;
        let mut v: Vec<u8> = (0..PAGES * PAGE_BYTES as usize)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 24) as u8 | 1
            })
            .collect();
        v[5 * 4096..6 * 4096].fill(0);
        v
    }

    fn page(mem: &mut [u8], n: usize) -> &mut [u8] {
        &mut mem[n * 4096..(n + 1) * 4096]
    }

    /// The guest's memory: pages 3 and 4 written, 10 zeroed, 20 written
    /// with the base's bytes (unchanged), 5 (a zero page) written.
    fn guest(base: &[u8]) -> Vec<u8> {
        let mut mem = base.to_vec();
        page(&mut mem, 3).fill(0xaa);
        page(&mut mem, 4)[17] ^= 0xff;
        page(&mut mem, 10).fill(0);
        page(&mut mem, 5)[0] = 7;
        mem
    }

    #[test]
    fn a_delta_over_its_base_round_trips_and_holds_only_the_changed_pages() {
        let d = tempfile::tempdir().unwrap();
        let (b, mem) = (base(), guest(&base()));
        let all = [(0, mem.len() as u64)];
        let out = d.path().join("pages");
        let r = write(&out, &[&mem], &all, Some(&b)).unwrap();
        assert_eq!((r.data_pages, r.zero_pages), (3, 1), "pages 3, 4, 5 data; 10 zero");
        assert_eq!(r.file_bytes, 4096 + 3 * 4096, "header and table in one page, then the data");
        let f = PageFile::open(&out, mem.len() as u64).unwrap();
        assert!(f.has_base());
        assert_eq!(
            f.extents(),
            [
                Extent { offset: 3 * 4096, pages: 3, kind: ExtentKind::Data },
                Extent { offset: 10 * 4096, pages: 1, kind: ExtentKind::Zero }
            ]
        );
        let mut resumed = b.clone();
        assert_eq!(f.apply(&mut [&mut resumed]).unwrap(), 4);
        assert!(resumed == mem, "the base with the file's pages laid over it is the guest's memory");
    }

    /// Guest memory in two regions (RAM above the MMIO gap) round trips,
    /// with extents that cross from one to the other.
    #[test]
    fn memory_in_two_segments_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let b = base();
        let mut mem = guest(&b);
        page(&mut mem, 7).fill(0x55);
        page(&mut mem, 8).fill(0x66);
        let (lo, hi) = mem.split_at(8 * 4096);
        let out = d.path().join("pages");
        let r = write(&out, &[lo, hi], &[(0, mem.len() as u64)], Some(&b)).unwrap();
        assert_eq!((r.data_pages, r.zero_pages), (5, 1), "pages 3, 4, 5, 7, 8 data; 10 zero");
        let f = PageFile::open(&out, mem.len() as u64).unwrap();
        assert!(f.extents().contains(&Extent { offset: 7 * 4096, pages: 2, kind: ExtentKind::Data }));
        let mut resumed = b.clone();
        let (lo, hi) = resumed.split_at_mut(8 * 4096);
        f.apply(&mut [lo, hi]).unwrap();
        assert!(resumed == mem);
    }

    #[test]
    fn candidates_bound_what_is_looked_at() {
        let d = tempfile::tempdir().unwrap();
        let (b, mem) = (base(), guest(&base()));
        // Only page 10 and a range that ends mid-page 4 (widened to it).
        let out = d.path().join("pages");
        let r = write(
            &out,
            &[&mem],
            &[(10 * 4096, 10 * 4096 + 1), (4 * 4096 - 8, 4 * 4096 + 8), (1 << 40, (1 << 40) + 4096)],
            Some(&b),
        )
        .unwrap();
        assert_eq!((r.data_pages, r.zero_pages), (2, 1), "pages 3 and 4 (widened), 10");
    }

    #[test]
    fn without_a_base_every_non_zero_page_is_kept() {
        let d = tempfile::tempdir().unwrap();
        let mem = guest(&base());
        let out = d.path().join("pages");
        let r = write(&out, &[&mem], &[(0, mem.len() as u64)], None).unwrap();
        assert_eq!((r.data_pages, r.zero_pages), (PAGES as u64 - 1, 0), "page 10 is zero");
        let f = PageFile::open(&out, mem.len() as u64).unwrap();
        assert!(!f.has_base());
        let mut resumed = vec![0u8; mem.len()];
        f.apply(&mut [&mut resumed]).unwrap();
        assert!(resumed == mem);
    }

    #[test]
    fn damage_is_refused_with_the_reason() {
        let d = tempfile::tempdir().unwrap();
        let (b, mem) = (base(), guest(&base()));
        let good = d.path().join("good");
        write(&good, &[&mem], &[(0, mem.len() as u64)], Some(&b)).unwrap();
        let bytes = std::fs::read(&good).unwrap();
        let n = mem.len() as u64;
        let damaged = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| {
            let mut v = bytes.clone();
            edit(&mut v);
            let p = d.path().join(name);
            std::fs::write(&p, v).unwrap();
            p
        };
        let reason = |p: &Path| match PageFile::open(p, n) {
            Err(PageFileError::Damaged { reason, .. }) => reason,
            other => panic!("{}: {other:?}", p.display()),
        };
        assert!(reason(&damaged("magic", &|v| v[0] = b'X')).contains("magic"));
        assert!(reason(&damaged("header", &|v| v[20] ^= 1)).contains("header"));
        assert!(reason(&damaged("table", &|v| v[64] ^= 1)).contains("extent table"));
        assert!(reason(&damaged("short", &|v| v.truncate(v.len() - 1))).contains("bytes where"));
        assert!(reason(&damaged("tiny", &|v| v.truncate(10))).contains("shorter than its header"));
        let data = damaged("data", &|v| *v.last_mut().unwrap() ^= 1);
        let mut resumed = b.clone();
        match PageFile::open(&data, n).unwrap().apply(&mut [&mut resumed]) {
            Err(PageFileError::Damaged { reason, .. }) => assert!(reason.contains("data's CRC32"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(PageFile::open(&good, n + 4096), Err(PageFileError::Mismatch { .. })));
        assert!(matches!(
            write(&d.path().join("x"), &[&mem], &[], Some(&b[..4096])),
            Err(PageFileError::Mismatch { .. })
        ));
    }

    /// A full file system fails the write before any page is written, and
    /// leaves no file behind. Needs root to mount a small tmpfs; skips
    /// loudly otherwise.
    #[test]
    fn a_full_file_system_fails_the_write_and_leaves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let mnt = d.path().join("small");
        std::fs::create_dir(&mnt).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
            .arg(&mnt)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!(
                "SKIPPED a_full_file_system_fails_the_write_and_leaves_nothing: cannot mount a tmpfs (not root?)"
            );
            return;
        }
        let mem = guest(&base());
        let out = mnt.join("pages");
        let e = write(&out, &[&mem], &[(0, mem.len() as u64)], None).unwrap_err();
        let left = out.exists();
        let _ = std::process::Command::new("umount").arg(&mnt).status();
        assert!(!left, "no partial file");
        match e {
            PageFileError::Io { source, what, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{what}: {source}")
            }
            other => panic!("{other:?}"),
        }
    }
}
