//! One delta layer: a Tine delta file (format in the [`crate::chain`] docs).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{io_err, read_full_at, DiskError};

/// The first 8 bytes of a delta file.
pub const MAGIC: [u8; 8] = *b"TINEDLTA";
/// The format version this code reads and writes.
pub const VERSION: u32 = 1;
/// Bytes of the header block (the map starts right after it).
pub const HEADER_BYTES: u64 = 4096;
/// Bytes of one map block: the unit in which the map is rewritten on flush.
pub const MAP_BLOCK_BYTES: u64 = 4096;
/// Smallest cluster size allowed, as a power of two (4 KiB).
pub const MIN_CLUSTER_BITS: u32 = 12;
/// Largest cluster size allowed, as a power of two (1 MiB).
pub const MAX_CLUSTER_BITS: u32 = 20;
/// Header flag: the layer is frozen (read-only forever).
const FLAG_FROZEN: u64 = 1;
/// Bytes of the header covered by its CRC.
const HEADER_CRC_AT: usize = 80;

/// What a layer holds for one cluster (2 bits in the map).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterState {
    /// Nothing: read through to the layer below (map bits `00`).
    Absent,
    /// The cluster's bytes are in this layer's data region (`01`).
    Data,
    /// The cluster reads as zeros whatever lies below (`10`).
    Zero,
}

impl ClusterState {
    fn bits(self) -> u8 {
        match self {
            ClusterState::Absent => 0,
            ClusterState::Data => 1,
            ClusterState::Zero => 2,
        }
    }
}

/// An open delta layer.
pub struct Delta {
    pub(crate) path: PathBuf,
    file: File,
    /// Virtual size of the disk, bytes.
    pub(crate) size: u64,
    pub(crate) cluster_bits: u32,
    pub(crate) clusters: u64,
    data_offset: u64,
    pub(crate) id: [u8; 16],
    pub(crate) parent: [u8; 16],
    pub(crate) frozen: bool,
    /// 2 bits per cluster, cluster `i` at byte `i / 4`, bits `2 * (i % 4)`.
    map: Vec<u8>,
    /// Indices of map blocks changed since the last flush, ascending.
    dirty: std::collections::BTreeSet<u64>,
}

/// Where the map and the data region lie for a disk of `size` bytes in
/// clusters of `1 << cluster_bits` bytes: (clusters, map bytes, data offset).
fn geometry(size: u64, cluster_bits: u32) -> Option<(u64, u64, u64)> {
    let cluster = 1u64 << cluster_bits;
    let clusters = size.div_ceil(cluster);
    let map_bytes = clusters.div_ceil(4);
    let map_region = map_bytes.checked_next_multiple_of(MAP_BLOCK_BYTES)?;
    let data_offset = HEADER_BYTES.checked_add(map_region)?.checked_next_multiple_of(cluster)?;
    // The data region must fit in a file offset.
    data_offset.checked_add(clusters.checked_mul(cluster)?).filter(|&end| end <= i64::MAX as u64)?;
    Some((clusters, map_bytes, data_offset))
}

/// A random 16-byte layer id.
pub(crate) fn new_id() -> Result<[u8; 16], DiskError> {
    let mut id = [0u8; 16];
    let mut got = 0;
    while got < id.len() {
        // SAFETY: getrandom(2) writes at most `id.len() - got` bytes into
        // the live buffer `id[got..]`.
        let n = unsafe { libc::getrandom(id[got..].as_mut_ptr().cast(), id.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(DiskError::Io { path: PathBuf::from("getrandom"), op: "make a layer id", source: e });
        }
        got += n as usize;
    }
    Ok(id)
}

/// Punches a hole (`FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`) of `len`
/// bytes at byte `offset` of `file`: the range reads as zeros and its
/// blocks go back to the host's filesystem.
pub(crate) fn punch_hole(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: fallocate(2) on a descriptor owned by `file`, with plain
    // integer arguments; it touches no memory of this process.
    let r =
        unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, n) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// fsyncs the directory holding `path`, so that a file just created in
/// it survives a crash.
pub(crate) fn sync_parent(path: &Path) -> Result<(), DiskError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "sync the directory"))
}

impl Delta {
    /// Creates an empty delta at `path` (which must not exist) for a disk
    /// of `size` bytes in clusters of `1 << cluster_bits` bytes, above the
    /// layer whose id is `parent` (all zeros: above the raw base or
    /// nothing). Not synced: a new top is only ever needed by the running
    /// VM that writes it (durability comes with a checkpoint that a
    /// template or hibernation commits, [`crate::sync`]), and a VM start or
    /// a branch's pause should not wait for the host's disk.
    ///
    /// Errors: [`DiskError::Size`] (size not a positive multiple of 512,
    /// cluster size out of range), [`DiskError::Io`].
    pub(crate) fn create(path: &Path, size: u64, cluster_bits: u32, parent: [u8; 16]) -> Result<Delta, DiskError> {
        if size == 0 || !size.is_multiple_of(512) || !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(DiskError::Size { size, cluster_bits });
        }
        let (clusters, map_bytes, data_offset) =
            geometry(size, cluster_bits).ok_or(DiskError::Size { size, cluster_bits })?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io_err(path, "create the delta"))?;
        let delta = Delta {
            path: path.to_path_buf(),
            file,
            size,
            cluster_bits,
            clusters,
            data_offset,
            id: new_id()?,
            parent,
            frozen: false,
            map: vec![0; map_bytes as usize],
            dirty: Default::default(),
        };
        let end = data_offset + clusters * (1u64 << cluster_bits);
        delta.file.set_len(end).map_err(io_err(path, "size the delta"))?;
        delta.write_header()?;
        Ok(delta)
    }

    /// Opens the delta at `path`; `writable` opens it for writing (it must
    /// not be frozen).
    ///
    /// Errors: [`DiskError::Io`], [`DiskError::NotADelta`],
    /// [`DiskError::Version`], [`DiskError::Corrupt`] (bad CRC, geometry or
    /// map entry), [`DiskError::Frozen`] (writable open of a frozen layer).
    pub(crate) fn open(path: &Path, writable: bool) -> Result<Delta, DiskError> {
        let file = OpenOptions::new().read(true).write(writable).open(path).map_err(io_err(path, "open the delta"))?;
        let mut h = [0u8; HEADER_BYTES as usize];
        let n = read_full_at(&file, &mut h, 0).map_err(io_err(path, "read the header"))?;
        let corrupt = |reason: &str| DiskError::Corrupt { path: path.to_path_buf(), reason: reason.to_string() };
        if n < HEADER_CRC_AT + 4 || h[..8] != MAGIC {
            return Err(DiskError::NotADelta { path: path.to_path_buf() });
        }
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap_or_default());
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or_default());
        let version = u32_at(8);
        if version != VERSION {
            return Err(DiskError::Version { path: path.to_path_buf(), version });
        }
        if crc32fast::hash(&h[..HEADER_CRC_AT]) != u32_at(HEADER_CRC_AT) {
            return Err(corrupt("header checksum mismatch"));
        }
        let cluster_bits = u32_at(12);
        let size = u64_at(16);
        let flags = u64_at(24);
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) || size == 0 || !size.is_multiple_of(512) {
            return Err(corrupt("bad cluster size or virtual size"));
        }
        let (clusters, map_bytes, data_offset) = geometry(size, cluster_bits).ok_or_else(|| corrupt("geometry"))?;
        if u64_at(32) != HEADER_BYTES || u64_at(40) != data_offset {
            return Err(corrupt("map or data offset does not match the geometry"));
        }
        if flags & !FLAG_FROZEN != 0 {
            return Err(corrupt("unknown header flags"));
        }
        let frozen = flags & FLAG_FROZEN != 0;
        if writable && frozen {
            return Err(DiskError::Frozen { path: path.to_path_buf() });
        }
        let mut map = vec![0u8; map_bytes as usize];
        let got = read_full_at(&file, &mut map, HEADER_BYTES).map_err(io_err(path, "read the map"))?;
        if got != map.len() {
            return Err(corrupt("the map is truncated"));
        }
        // Every entry is 00, 01 or 10; the padding after the last cluster is 00.
        for (i, b) in map.iter().enumerate() {
            for k in 0..4u64 {
                let bits = (b >> (2 * k)) & 3;
                let cluster = i as u64 * 4 + k;
                if bits == 3 || (cluster >= clusters && bits != 0) {
                    return Err(corrupt("bad map entry"));
                }
            }
        }
        Ok(Delta {
            path: path.to_path_buf(),
            file,
            size,
            cluster_bits,
            clusters,
            data_offset,
            id: h[48..64].try_into().unwrap_or_default(),
            parent: h[64..80].try_into().unwrap_or_default(),
            frozen,
            map,
            dirty: Default::default(),
        })
    }

    fn write_header(&self) -> Result<(), DiskError> {
        let mut h = [0u8; HEADER_BYTES as usize];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.cluster_bits.to_le_bytes());
        h[16..24].copy_from_slice(&self.size.to_le_bytes());
        let flags = if self.frozen { FLAG_FROZEN } else { 0 };
        h[24..32].copy_from_slice(&flags.to_le_bytes());
        h[32..40].copy_from_slice(&HEADER_BYTES.to_le_bytes());
        h[40..48].copy_from_slice(&self.data_offset.to_le_bytes());
        h[48..64].copy_from_slice(&self.id);
        h[64..80].copy_from_slice(&self.parent);
        let crc = crc32fast::hash(&h[..HEADER_CRC_AT]);
        h[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        self.file.write_all_at(&h, 0).map_err(io_err(&self.path, "write the header"))
    }

    /// The state of cluster `c` (Absent past the end).
    pub(crate) fn state(&self, c: u64) -> ClusterState {
        if c >= self.clusters {
            return ClusterState::Absent;
        }
        match (self.map[(c / 4) as usize] >> (2 * (c % 4))) & 3 {
            1 => ClusterState::Data,
            2 => ClusterState::Zero,
            _ => ClusterState::Absent,
        }
    }

    /// Sets the state of cluster `c` (< clusters) in memory; it reaches
    /// the file at the next [`Delta::flush`].
    pub(crate) fn set_state(&mut self, c: u64, s: ClusterState) {
        if c >= self.clusters || self.state(c) == s {
            return;
        }
        let byte = (c / 4) as usize;
        let shift = 2 * (c % 4);
        self.map[byte] = (self.map[byte] & !(3 << shift)) | (s.bits() << shift);
        self.dirty.insert(byte as u64 / MAP_BLOCK_BYTES);
    }

    /// Reads `buf.len()` bytes of the data region at disk byte `offset`.
    pub(crate) fn read_data(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        let at = self.data_offset + offset;
        let n = read_full_at(&self.file, buf, at).map_err(io_err(&self.path, "read data"))?;
        buf[n..].fill(0);
        Ok(())
    }

    /// Writes `buf` into the data region at disk byte `offset`.
    pub(crate) fn write_data(&self, buf: &[u8], offset: u64) -> Result<(), DiskError> {
        self.file.write_all_at(buf, self.data_offset + offset).map_err(io_err(&self.path, "write data"))
    }

    /// Punches `len` bytes of the data region at disk byte `offset`.
    pub(crate) fn punch_data(&self, offset: u64, len: u64) -> Result<(), DiskError> {
        punch_hole(&self.file, self.data_offset + offset, len).map_err(io_err(&self.path, "punch a hole"))
    }

    /// Makes everything written so far durable: data first (fdatasync),
    /// then the changed map blocks, then fdatasync again.
    pub(crate) fn flush(&mut self) -> Result<(), DiskError> {
        self.file.sync_data().map_err(io_err(&self.path, "sync data"))?;
        if self.dirty.is_empty() {
            return Ok(());
        }
        self.write_map()?;
        self.file.sync_data().map_err(io_err(&self.path, "sync the map"))
    }

    /// Writes the changed map blocks and marks the layer frozen in its
    /// header, without syncing (a capture's pause must not wait for the
    /// host's disk, nor grow with what was written): the file is complete
    /// in the page cache, so any open of it sees the layer as frozen here;
    /// [`crate::sync`] makes it durable before a template or hibernation
    /// that needs it is committed.
    pub(crate) fn freeze(&mut self) -> Result<(), DiskError> {
        self.write_map()?;
        self.frozen = true;
        self.write_header()
    }

    /// Names `parent` as the layer below in the header of this writable
    /// delta (not synced: a top's header is made durable when it is
    /// frozen). Unchanged on an error.
    ///
    /// Errors: [`DiskError::Frozen`], [`DiskError::Io`].
    pub(crate) fn set_parent(&mut self, parent: [u8; 16]) -> Result<(), DiskError> {
        if self.frozen {
            return Err(DiskError::Frozen { path: self.path.clone() });
        }
        let old = std::mem::replace(&mut self.parent, parent);
        let written = self.write_header();
        if written.is_err() {
            self.parent = old;
        }
        written
    }

    /// [`Delta::freeze`], then `fdatasync`: the layer is durable.
    pub(crate) fn freeze_synced(&mut self) -> Result<(), DiskError> {
        self.freeze()?;
        self.file.sync_data().map_err(io_err(&self.path, "sync"))
    }

    /// Writes the changed map blocks (no sync).
    fn write_map(&mut self) -> Result<(), DiskError> {
        for &block in &self.dirty {
            let start = (block * MAP_BLOCK_BYTES) as usize;
            let end = (start + MAP_BLOCK_BYTES as usize).min(self.map.len());
            self.file
                .write_all_at(&self.map[start..end], HEADER_BYTES + start as u64)
                .map_err(io_err(&self.path, "write the map"))?;
        }
        self.dirty.clear();
        Ok(())
    }

    /// Bytes the file occupies on the host (allocated blocks).
    pub(crate) fn allocated_bytes(&self) -> Result<u64, DiskError> {
        use std::os::unix::fs::MetadataExt;
        let m = self.file.metadata().map_err(io_err(&self.path, "stat"))?;
        Ok(m.blocks().saturating_mul(512))
    }

    /// Whether no cluster has a state of its own (every entry absent):
    /// nothing was written or discarded here. A scan of the map in memory
    /// (40 KiB for 10 GiB in 64 KiB clusters).
    pub(crate) fn is_empty(&self) -> bool {
        self.map.iter().all(|&b| b == 0)
    }

    /// Clusters in state Data.
    pub(crate) fn data_clusters(&self) -> u64 {
        (0..self.clusters).filter(|&c| self.state(c) == ClusterState::Data).count() as u64
    }
}
