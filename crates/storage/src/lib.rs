//! Tine's disks: what a virtio-blk device reads and writes.
//!
//! A disk is a fixed number of bytes (a multiple of 512) behind the
//! [`Disk`] trait. Three kinds:
//!
//! - [`raw::RawDisk`]: one image file, read-only or written in place (the
//!   shared root image, a plain data disk);
//! - [`chain::LayeredDisk`]: a copy-on-write chain, a read-only raw base and
//!   frozen delta layers under one writable top delta (a sandbox's own
//!   disk). [`Disk::checkpoint`] freezes its top in O(1) of the data
//!   written, which is what a snapshot, a branch and a hibernation of a VM
//!   do at the instant they capture its memory;
//! - [`empty::EmptyDisk`]: no disk, 0 bytes (an empty device slot).
//!
//! The delta format and its crash-consistency rules are in [`chain`].

pub mod chain;
pub mod compact;
pub mod delta;
pub mod empty;
pub mod raw;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use chain::{ChainSpec, LayerInfo, LayeredDisk, DEFAULT_CLUSTER_BITS};
pub use compact::{flatten, MAX_FROZEN_LAYERS};
pub use empty::EmptyDisk;
pub use raw::RawDisk;

/// Errors of a disk: its files, its format, and requests it refuses.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// An I/O error on one of the disk's files.
    #[error("disk layer {path}: cannot {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file has no delta header.
    #[error("{path} is not a Tine delta layer")]
    NotADelta {
        /// The file.
        path: PathBuf,
    },
    /// The delta's format version is not one this code reads.
    #[error("delta layer {path} has format version {version}, not {}", delta::VERSION)]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
    /// The delta's header or map is inconsistent.
    #[error("delta layer {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The layers do not form a chain (sizes, cluster sizes or parent ids
    /// differ, or the base is larger than the disk).
    #[error("disk layer {path} does not fit the chain: {reason}")]
    Chain {
        /// The layer that does not fit.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A frozen layer was opened for writing.
    #[error("delta layer {path} is frozen and cannot be written")]
    Frozen {
        /// The file.
        path: PathBuf,
    },
    /// A write, discard or freeze on a disk without a writable top.
    #[error("the disk is read-only")]
    ReadOnly,
    /// A request outside the disk.
    #[error("bytes {offset}..+{len} are outside the disk's {size} bytes")]
    OutOfRange {
        /// First byte of the request.
        offset: u64,
        /// Its length in bytes.
        len: u64,
        /// The disk's virtual size in bytes.
        size: u64,
    },
    /// A virtual size that is not a positive multiple of 512 bytes, or a
    /// cluster size outside 4 KiB..=1 MiB.
    #[error("bad disk geometry: {size} bytes in clusters of 2^{cluster_bits} bytes")]
    Size {
        /// The virtual size asked for, bytes.
        size: u64,
        /// The cluster size asked for, as a power of two.
        cluster_bits: u32,
    },
}

/// A disk as a block device sees it: `size()` bytes, read and written at
/// byte offsets (the device checks requests against the size first; a
/// disk checks again and answers [`DiskError::OutOfRange`]).
///
/// Writes may sit in the host's page cache until [`Disk::flush`] (a
/// volatile write cache: the device offers `VIRTIO_BLK_F_FLUSH`, virtio
/// 1.2 section 5.2.3).
pub trait Disk: Send {
    /// The disk's size in bytes.
    fn size(&self) -> u64;
    /// Whether writes, discards and checkpoints are refused.
    fn is_read_only(&self) -> bool;
    /// The unit (bytes) in which [`Disk::discard`] frees host blocks: the
    /// device tells the guest as `discard_sector_alignment`.
    fn discard_alignment(&self) -> u64;
    /// Reads `buf.len()` bytes at byte `offset`.
    ///
    /// Errors: [`DiskError::OutOfRange`], [`DiskError::Io`].
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError>;
    /// Writes `buf` at byte `offset`.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`],
    /// [`DiskError::Io`] (a full host disk among them).
    fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), DiskError>;
    /// Discards `len` bytes at byte `offset`: the host may free their
    /// blocks; what they read afterwards is zeros where whole units of
    /// [`Disk::discard_alignment`] were covered, and unspecified elsewhere
    /// (virtio 1.2 section 5.2.6.2).
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`],
    /// [`DiskError::Io`].
    fn discard(&mut self, offset: u64, len: u64) -> Result<(), DiskError>;
    /// Makes `len` bytes at byte `offset` read as zeros, freeing host blocks
    /// where it can.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`],
    /// [`DiskError::Io`].
    fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), DiskError>;
    /// Makes everything written so far durable.
    ///
    /// Errors: [`DiskError::Io`].
    fn flush(&mut self) -> Result<(), DiskError>;
    /// The disk as it is now, as files that can be opened again and will
    /// not change: for a copy-on-write chain, its writable top is frozen
    /// (written, not synced: [`sync`]) and the disk goes on on a new empty
    /// top in the same directory (O(1) in the data written), or, when
    /// nothing was written to the top, the layers below it are the
    /// checkpoint and the top stays; a read-only disk is its own
    /// checkpoint. `None`: this disk cannot be checkpointed (a raw disk
    /// written in place).
    ///
    /// Errors: [`DiskError::Io`] and the errors of creating a delta.
    fn checkpoint(&mut self) -> Result<Option<ChainSpec>, DiskError>;
    /// Puts the frozen chain `new` under the writable top in place of
    /// `old`, when the layers below the top are still exactly `old`; `new`
    /// must read as `old` does (the same base, its deltas merged by
    /// [`flatten`]): the guest sees no change. `false` (and nothing done)
    /// when the layers below are no longer `old` (a capture froze the top
    /// since), or the disk has no such layers (a raw disk). O(1) in the
    /// data, besides opening `new`'s layers.
    ///
    /// Errors: the errors of opening `new` ([`LayeredDisk::open`]),
    /// [`DiskError::Chain`] (`new` has another base or geometry),
    /// [`DiskError::Io`] (the top's header cannot be written).
    fn replace_lower(&mut self, old: &ChainSpec, new: &ChainSpec) -> Result<bool, DiskError> {
        let _ = (old, new);
        Ok(false)
    }
    /// The files the disk uses now (to keep them from clean-up).
    fn spec(&self) -> ChainSpec;
}

/// Makes the files of a checkpoint ([`Disk::checkpoint`]) durable: each
/// layer's data, map and header (`fdatasync`), then their directories. A
/// checkpoint does not sync (a capture's pause must not wait for the
/// host's disk); call this before committing anything that names the
/// files (a template, a hibernation). Until then a crash can leave a
/// frozen layer whose map names data that never reached the disk: nothing
/// committed names it.
///
/// Errors: [`DiskError::Io`].
pub fn sync(spec: &ChainSpec) -> Result<(), DiskError> {
    let mut dirs: Vec<&Path> = Vec::new();
    for path in spec.base.iter().chain(&spec.frozen).chain(&spec.top) {
        File::open(path).and_then(|f| f.sync_data()).map_err(io_err(path, "sync"))?;
        if let Some(d) = path.parent().filter(|d| !dirs.contains(d)) {
            dirs.push(d);
        }
    }
    for d in dirs {
        delta::sync_parent(&d.join("x"))?;
    }
    Ok(())
}

/// Maps an I/O error on `path` during `op` to [`DiskError::Io`].
pub(crate) fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> DiskError {
    let path = path.to_path_buf();
    move |source| DiskError::Io { path, op, source }
}

/// Reads into `buf` at byte `offset` until it is full or the file ends;
/// returns the bytes read.
pub(crate) fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
