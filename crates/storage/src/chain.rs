//! Copy-on-write disks: a chain of layers read top-down, written at the top.
//!
//! A [`LayeredDisk`] is, bottom to top: an optional read-only raw base
//! image (possibly shorter than the disk: bytes past its end read as
//! zeros), zero or more frozen delta layers, and one writable top (a delta,
//! or, for a plain raw disk, the raw file itself). A disk has a fixed
//! virtual size (bytes, a multiple of 512); the files are sparse, so the
//! host pays only for what was written.
//!
//! Freezing the top ([`LayeredDisk::freeze_top`]) makes it read-only and
//! puts a new, empty delta above it; a branch ([`LayeredDisk::branch`])
//! freezes once and gives each child its own empty top over the shared
//! frozen layers. Both cost O(1) in the data written: no data is copied.
//!
//! # Delta file format (version 1)
//!
//! All integers little-endian. A delta file is three regions:
//!
//! * **Header**, bytes 0..4096:
//!   `0` magic `b"TINEDLTA"`; `8` version `u32` (1); `12` cluster_bits `u32`
//!   (cluster size = `1 << cluster_bits` bytes, 12..=20; default 16, 64 KiB);
//!   `16` virtual size `u64` (bytes); `24` flags `u64` (bit 0: frozen; other
//!   bits must be 0); `32` map offset `u64` (4096); `40` data offset `u64`;
//!   `48` layer id (16 random bytes); `64` parent id (16 bytes: the id of the
//!   delta directly below, all zeros when the layer sits on the raw base or
//!   on nothing); `80` CRC-32 (IEEE) of bytes 0..80 as `u32`; the rest zero.
//! * **Map**, from byte 4096: 2 bits per cluster, cluster `i` in byte
//!   `i / 4` at bit `2 * (i % 4)`: `00` absent (read the layer below), `01`
//!   data (in this layer), `10` zero (reads as zeros whatever is below: a
//!   discarded cluster), `11` invalid. `ceil(clusters / 4)` bytes, the
//!   region padded to a multiple of 4096.
//! * **Data**, from the data offset (the end of the map region rounded up
//!   to a cluster): cluster `i` at `data_offset + i * cluster_size`. The
//!   file is sized to the end of the data region and sparse; only data
//!   clusters are written.
//!
//! # Writes, flush and crash consistency
//!
//! Data writes go straight to the data region (the host page cache: a
//! volatile write cache, which is why the device offers
//! `VIRTIO_BLK_F_FLUSH`); map changes stay in memory. A write into a
//! cluster that is not data in the top first makes the whole cluster data:
//! the bytes from below (or zeros) merged with the new ones are written in
//! one piece, or, when the cluster reads as zeros below, the cluster is
//! punched (zeroed) and only the new bytes are written. So a cluster turns
//! `data` only once all its bytes are in the data region.
//!
//! [`LayeredDisk::flush`] does: `fdatasync` (data durable), then writes the
//! changed 4 KiB map blocks, then `fdatasync` again. The map on disk is
//! thus only ever written after the data it points at is durable, and:
//!
//! * a crash before a flush leaves the map as of the last flush: clusters
//!   first written since read as they did then (from below), clusters that
//!   were already data may hold new or old bytes (as with any disk with a
//!   write cache: the guest has no acknowledgement);
//! * a crash between the two syncs leaves some map blocks old and some new;
//!   each entry is either its old or its new value and in both cases the
//!   data it names is durable;
//! * bytes written into a cluster whose map entry never reached the disk
//!   are garbage in the data region; they are never read, and the next
//!   write to that cluster rewrites (or punches) the whole cluster.
//!
//! Discard punches holes right away and sets entries to `zero` in memory;
//! a crash before the next flush can make a cluster that was data read as
//! zeros (a discarded range's content is unspecified until the flush).
//!
//! A process crash (not a host crash) loses nothing written: the page
//! cache has it; only the map entries since the last flush are lost.
//!
//! Freezing writes the map and the frozen flag without syncing (it runs
//! inside a VM's pause, which must not wait for the host's disk): the
//! frozen layer is complete in the page cache, which is what any process
//! that opens it next reads. [`crate::sync`] makes a checkpoint durable;
//! a hibernation or a template calls it before it is committed, so the
//! memory snapshot that depends on the disk is never durable before it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::delta::{punch_hole, ClusterState, Delta};
use crate::{io_err, read_full_at, Disk, DiskError};

#[cfg(test)]
#[path = "chain_tests.rs"]
mod tests;

/// Default cluster size of new deltas, as a power of two (64 KiB).
pub const DEFAULT_CLUSTER_BITS: u32 = 16;

/// The files of a chain, enough to open it again ([`LayeredDisk::open`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChainSpec {
    /// The raw base image, read-only; none: the disk starts as zeros.
    pub base: Option<PathBuf>,
    /// Frozen delta layers, bottom first.
    pub frozen: Vec<PathBuf>,
    /// The writable top delta; none: the chain is read-only.
    pub top: Option<PathBuf>,
}

/// Accounting for one layer of a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    /// The layer's file.
    pub path: PathBuf,
    /// Whether it is a raw image (the base, or a plain raw disk).
    pub raw: bool,
    /// Whether this chain writes it.
    pub writable: bool,
    /// Bytes its file occupies on the host (allocated blocks, metadata
    /// included).
    pub allocated_bytes: u64,
    /// Clusters holding data (deltas; 0 for raw layers).
    pub data_clusters: u64,
}

/// A raw image layer.
pub(crate) struct Raw {
    path: PathBuf,
    file: File,
    /// The file's length in bytes; bytes past it read as zeros.
    len: u64,
}

pub(crate) enum Layer {
    Raw(Raw),
    Delta(Delta),
}

impl Layer {
    fn path(&self) -> &Path {
        match self {
            Layer::Raw(r) => &r.path,
            Layer::Delta(d) => &d.path,
        }
    }

    /// What this layer holds for the cluster at bytes `start..start+len`
    /// (`c` its index): a raw layer holds data up to its end, zeros after.
    fn state(&self, c: u64, start: u64) -> ClusterState {
        match self {
            Layer::Raw(r) if start < r.len => ClusterState::Data,
            Layer::Raw(_) => ClusterState::Zero,
            Layer::Delta(d) => d.state(c),
        }
    }

    /// Reads this layer's data at disk byte `offset` (zeros past a raw end).
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        match self {
            Layer::Raw(r) => {
                let n = read_full_at(&r.file, buf, offset).map_err(io_err(&r.path, "read"))?;
                buf[n..].fill(0);
                Ok(())
            }
            Layer::Delta(d) => d.read_data(buf, offset),
        }
    }

    fn id(&self) -> [u8; 16] {
        match self {
            Layer::Raw(_) => [0; 16],
            Layer::Delta(d) => d.id,
        }
    }

    fn info(&self, writable: bool) -> Result<LayerInfo, DiskError> {
        use std::os::unix::fs::MetadataExt;
        Ok(match self {
            Layer::Raw(r) => LayerInfo {
                path: r.path.clone(),
                raw: true,
                writable,
                allocated_bytes: r.file.metadata().map_err(io_err(&r.path, "stat"))?.blocks().saturating_mul(512),
                data_clusters: 0,
            },
            Layer::Delta(d) => LayerInfo {
                path: d.path.clone(),
                raw: false,
                writable,
                allocated_bytes: d.allocated_bytes()?,
                data_clusters: d.data_clusters(),
            },
        })
    }
}

/// A disk made of layers: see the [module docs](self).
pub struct LayeredDisk {
    /// Virtual size, bytes.
    pub(crate) size: u64,
    pub(crate) cluster_bits: u32,
    /// Read-only layers, bottom first, shared with other chains.
    pub(crate) lower: Vec<Arc<Layer>>,
    /// The writable top; none: the disk is read-only.
    top: Option<Layer>,
    /// One cluster, for copy-up.
    scratch: Vec<u8>,
}

impl LayeredDisk {
    /// A one-layer disk on a raw image already open (`file` at `path`),
    /// written in place when `writable`; its virtual size is the file's
    /// length in bytes.
    ///
    /// Errors: [`DiskError::Io`] (the file cannot be stat'ed).
    pub fn from_raw(file: File, path: &Path, writable: bool) -> Result<Self, DiskError> {
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        let layer = Layer::Raw(Raw { path: path.to_path_buf(), file, len });
        let (lower, top) = if writable { (vec![], Some(layer)) } else { (vec![Arc::new(layer)], None) };
        Ok(LayeredDisk { size: len, cluster_bits: DEFAULT_CLUSTER_BITS, lower, top, scratch: Vec::new() })
    }

    /// Creates a new disk of `size` bytes: the raw `base` (read-only, at
    /// most `size` bytes; none: zeros) under a new empty delta at `top`
    /// (which must not exist) with clusters of `1 << cluster_bits` bytes.
    ///
    /// Errors: [`DiskError::Size`], [`DiskError::Chain`] (base larger than
    /// `size`), [`DiskError::Io`].
    pub fn create(base: Option<&Path>, size: u64, cluster_bits: u32, top: &Path) -> Result<Self, DiskError> {
        let mut lower = Vec::new();
        if let Some(base) = base {
            let raw = open_raw(base)?;
            if raw.len > size {
                return Err(DiskError::Chain {
                    path: base.to_path_buf(),
                    reason: format!("the base is {} bytes, more than the disk's {size}", raw.len),
                });
            }
            lower.push(Arc::new(Layer::Raw(raw)));
        }
        let delta = Delta::create(top, size, cluster_bits, [0; 16])?;
        Ok(LayeredDisk { size, cluster_bits, lower, top: Some(Layer::Delta(delta)), scratch: Vec::new() })
    }

    /// Opens the chain `spec`. The virtual size and cluster size come from
    /// the deltas (which must agree, each naming the one below as its
    /// parent); a chain of only a base is that raw image, read-only.
    ///
    /// Errors: [`DiskError::Chain`], [`DiskError::Frozen`] (the top is
    /// frozen), the errors of opening a delta ([`DiskError::NotADelta`],
    /// [`DiskError::Version`], [`DiskError::Corrupt`], [`DiskError::Io`]).
    pub fn open(spec: &ChainSpec) -> Result<Self, DiskError> {
        let mut lower: Vec<Arc<Layer>> = Vec::new();
        let mut base_len = None;
        if let Some(base) = &spec.base {
            let raw = open_raw(base)?;
            base_len = Some((base.clone(), raw.len));
            lower.push(Arc::new(Layer::Raw(raw)));
        }
        let mut geometry: Option<(u64, u32)> = None;
        let mut parent = [0u8; 16];
        let mut check = |d: &Delta| -> Result<(), DiskError> {
            let bad = |reason: String| DiskError::Chain { path: d.path.clone(), reason };
            if let Some((size, bits)) = geometry {
                if (size, bits) != (d.size, d.cluster_bits) {
                    return Err(bad(format!(
                        "{} bytes in 2^{} clusters, the layer below {size} in 2^{bits}",
                        d.size, d.cluster_bits
                    )));
                }
            }
            if d.parent != parent {
                return Err(bad("its parent is not the layer below it".into()));
            }
            geometry = Some((d.size, d.cluster_bits));
            parent = d.id;
            Ok(())
        };
        for path in &spec.frozen {
            let d = Delta::open(path, false)?;
            check(&d)?;
            lower.push(Arc::new(Layer::Delta(d)));
        }
        let top = match &spec.top {
            Some(path) => {
                let d = Delta::open(path, true)?;
                check(&d)?;
                Some(Layer::Delta(d))
            }
            None => None,
        };
        let (size, cluster_bits) = match (geometry, &base_len) {
            (Some(g), _) => g,
            (None, Some((_, len))) => (*len, DEFAULT_CLUSTER_BITS),
            (None, None) => {
                return Err(DiskError::Chain { path: PathBuf::new(), reason: "the chain has no layer".into() })
            }
        };
        if let Some((path, len)) = base_len {
            if len > size {
                return Err(DiskError::Chain {
                    path,
                    reason: format!("the base is {len} bytes, more than the disk's {size}"),
                });
            }
        }
        Ok(LayeredDisk { size, cluster_bits, lower, top, scratch: Vec::new() })
    }

    /// The disk's virtual size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The cluster size in bytes (the unit of copy-on-write and discard).
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Whether the disk has no writable top.
    pub fn is_read_only(&self) -> bool {
        self.top.is_none()
    }

    /// The chain's files (to open it again with [`LayeredDisk::open`]).
    /// A one-layer writable raw disk has no spec of this shape: its file
    /// is reported as `base`, with no top.
    pub fn spec(&self) -> ChainSpec {
        let mut spec = ChainSpec::default();
        for l in &self.lower {
            match l.as_ref() {
                Layer::Raw(r) => spec.base = Some(r.path.clone()),
                Layer::Delta(d) => spec.frozen.push(d.path.clone()),
            }
        }
        match &self.top {
            Some(Layer::Raw(r)) => spec.base = Some(r.path.clone()),
            Some(Layer::Delta(d)) => spec.top = Some(d.path.clone()),
            None => {}
        }
        spec
    }

    /// Accounting for each layer, bottom first.
    ///
    /// Errors: [`DiskError::Io`] (a file cannot be stat'ed).
    pub fn layers(&self) -> Result<Vec<LayerInfo>, DiskError> {
        let mut out: Vec<LayerInfo> = self.lower.iter().map(|l| l.info(false)).collect::<Result<_, _>>()?;
        if let Some(t) = &self.top {
            out.push(t.info(true)?);
        }
        Ok(out)
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), DiskError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(DiskError::OutOfRange { offset, len, size: self.size }),
        }
    }

    /// Splits `offset..offset+len` at cluster boundaries: (cluster,
    /// cluster start, offset in cluster, length).
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64, u64)> {
        let bits = self.cluster_bits;
        let cs = 1u64 << bits;
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let c = at >> bits;
            let start = c << bits;
            let n = (start + cs).min(end) - at;
            let piece = (c, start, at - start, n);
            at += n;
            Some(piece)
        })
    }

    /// Bytes of cluster `c` (the last one may be short).
    fn cluster_len(&self, start: u64) -> u64 {
        (self.size - start).min(self.cluster_size())
    }

    /// Reads `buf` from the layers below the top (`include_top` false) or
    /// from the whole chain, within one cluster. Returns true when the
    /// bytes are known to be zeros without reading them.
    fn read_in_cluster(
        &self,
        buf: &mut [u8],
        c: u64,
        start: u64,
        at: u64,
        include_top: bool,
    ) -> Result<bool, DiskError> {
        let top = if include_top { self.top.as_ref() } else { None };
        for layer in top.into_iter().chain(self.lower.iter().rev().map(|l| l.as_ref())) {
            match layer.state(c, start) {
                ClusterState::Data => {
                    layer.read(buf, at)?;
                    return Ok(false);
                }
                ClusterState::Zero => break,
                ClusterState::Absent => {}
            }
        }
        buf.fill(0);
        Ok(true)
    }

    /// Reads `buf.len()` bytes at byte `offset` through the chain.
    ///
    /// Errors: [`DiskError::OutOfRange`], [`DiskError::Io`].
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        self.check_range(offset, buf.len() as u64)?;
        // Clusters that resolve to the same layer one after another are
        // contiguous in its file too (raw: the disk's offsets; a delta:
        // cluster i at data_offset + i * cluster): one read for the run.
        let mut run: Option<(Option<&Layer>, usize, usize)> = None;
        let mut done = 0usize;
        let flush = |run: (Option<&Layer>, usize, usize), buf: &mut [u8]| -> Result<(), DiskError> {
            let (layer, from, to) = run;
            match layer {
                Some(l) => l.read(&mut buf[from..to], offset + from as u64),
                None => {
                    buf[from..to].fill(0);
                    Ok(())
                }
            }
        };
        for (c, start, _, n) in self.pieces(offset, buf.len() as u64) {
            let source = self.resolve(c, start);
            let end = done + n as usize;
            run = match run {
                Some((l, from, _)) if same_layer(l, source) => Some((l, from, end)),
                Some(r) => {
                    flush(r, buf)?;
                    Some((source, done, end))
                }
                None => Some((source, done, end)),
            };
            done = end;
        }
        if let Some(r) = run {
            flush(r, buf)?;
        }
        Ok(())
    }

    /// The layer cluster `c` (at byte `start`) reads from, top down; `None`
    /// when it reads as zeros.
    fn resolve(&self, c: u64, start: u64) -> Option<&Layer> {
        for layer in self.top.iter().chain(self.lower.iter().rev().map(|l| l.as_ref())) {
            match layer.state(c, start) {
                ClusterState::Data => return Some(layer),
                ClusterState::Zero => return None,
                ClusterState::Absent => {}
            }
        }
        None
    }

    /// Writes `buf` at byte `offset` into the top layer, copying a
    /// cluster up from below first where the write covers only part of
    /// it.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`],
    /// [`DiskError::Io`].
    pub fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), DiskError> {
        self.check_range(offset, buf.len() as u64)?;
        match self.top.as_ref() {
            None => return Err(DiskError::ReadOnly),
            Some(Layer::Raw(r)) => return r.file.write_all_at(buf, offset).map_err(io_err(&r.path, "write")),
            Some(Layer::Delta(_)) => {}
        }
        // Clusters written whole or already data in the top take the bytes
        // as they are: a run of them is one write (contiguous in the data
        // region). Others are copied up one by one.
        let mut done = 0usize;
        let pieces: Vec<_> = self.pieces(offset, buf.len() as u64).collect();
        let mut run: Option<(u64, u64, usize, usize)> = None; // clusters first..=last, bytes from..to
        for (c, start, within, n) in pieces {
            let end = done + n as usize;
            let direct = match self.top.as_ref() {
                Some(Layer::Delta(top)) => top.state(c) == ClusterState::Data || n == self.cluster_len(start),
                _ => false,
            };
            if direct {
                run = match run {
                    Some((first, _, from, _)) => Some((first, c, from, end)),
                    None => Some((c, c, done, end)),
                };
            } else {
                if let Some(r) = run.take() {
                    self.write_run(r, buf, offset)?;
                }
                self.write_cluster(c, start, within, &buf[done..end])?;
            }
            done = end;
        }
        if let Some(r) = run {
            self.write_run(r, buf, offset)?;
        }
        Ok(())
    }

    /// Writes `buf[from..to]` (at disk byte `offset + from`) straight into
    /// the top's data region and marks clusters `first..=last` data.
    fn write_run(
        &mut self,
        (first, last, from, to): (u64, u64, usize, usize),
        buf: &[u8],
        offset: u64,
    ) -> Result<(), DiskError> {
        let Some(Layer::Delta(top)) = self.top.as_mut() else { return Err(DiskError::ReadOnly) };
        top.write_data(&buf[from..to], offset + from as u64)?;
        for c in first..=last {
            top.set_state(c, ClusterState::Data);
        }
        Ok(())
    }

    /// Writes `data` at `within` bytes into cluster `c` (at byte `start`)
    /// of the top delta.
    fn write_cluster(&mut self, c: u64, start: u64, within: u64, data: &[u8]) -> Result<(), DiskError> {
        let clen = self.cluster_len(start);
        let Some(Layer::Delta(top)) = self.top.as_ref() else { return Err(DiskError::ReadOnly) };
        let state = top.state(c);
        if state == ClusterState::Data || data.len() as u64 == clen {
            top.write_data(data, start + within)?;
        } else {
            // Copy-up: the cluster as it reads below (zeros if the top
            // says zero), with the new bytes over it.
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.resize(clen as usize, 0);
            let zeros = if state == ClusterState::Zero {
                true
            } else {
                self.read_in_cluster(&mut scratch, c, start, start, false)? || scratch.iter().all(|&b| b == 0)
            };
            let Some(Layer::Delta(top)) = self.top.as_ref() else { return Err(DiskError::ReadOnly) };
            let result = if zeros {
                top.punch_data(start, clen).and_then(|()| top.write_data(data, start + within))
            } else {
                scratch[within as usize..within as usize + data.len()].copy_from_slice(data);
                top.write_data(&scratch, start)
            };
            self.scratch = scratch;
            result?;
        }
        if let Some(Layer::Delta(top)) = self.top.as_mut() {
            top.set_state(c, ClusterState::Data);
        }
        Ok(())
    }

    /// Discards `len` bytes at byte `offset`: whole clusters in the range
    /// read as zeros afterwards and their host blocks are freed; in a
    /// cluster only partly covered, the covered bytes read as zeros if the
    /// cluster is data in the top and are left as they are otherwise.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`],
    /// [`DiskError::Io`].
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        self.zero_range(offset, len, false)
    }

    /// Makes `len` bytes at byte `offset` read as zeros, freeing the host
    /// blocks of whole clusters.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`],
    /// [`DiskError::Io`].
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        self.zero_range(offset, len, true)
    }

    fn zero_range(&mut self, offset: u64, len: u64, exact: bool) -> Result<(), DiskError> {
        self.check_range(offset, len)?;
        match self.top.as_ref() {
            None => return Err(DiskError::ReadOnly),
            Some(Layer::Raw(r)) => return punch_hole(&r.file, offset, len).map_err(io_err(&r.path, "punch a hole")),
            Some(Layer::Delta(_)) => {}
        }
        let pieces: Vec<_> = self.pieces(offset, len).collect();
        // Whole clusters: one punch per run.
        let mut run: Option<(u64, u64)> = None;
        for (c, start, within, n) in pieces {
            let clen = self.cluster_len(start);
            let Some(Layer::Delta(top)) = self.top.as_mut() else { return Err(DiskError::ReadOnly) };
            if within == 0 && n == clen {
                top.set_state(c, ClusterState::Zero);
                run = match run {
                    Some((s, e)) if e == start => Some((s, start + n)),
                    Some((s, e)) => {
                        top.punch_data(s, e - s)?;
                        Some((start, start + n))
                    }
                    None => Some((start, start + n)),
                };
                continue;
            }
            match top.state(c) {
                ClusterState::Data => top.punch_data(start + within, n)?,
                ClusterState::Zero => {}
                ClusterState::Absent if exact => {
                    let zeros = vec![0u8; n as usize];
                    self.write_cluster(c, start, within, &zeros)?;
                }
                ClusterState::Absent => {}
            }
        }
        if let (Some((s, e)), Some(Layer::Delta(top))) = (run, self.top.as_ref()) {
            top.punch_data(s, e - s)?;
        }
        Ok(())
    }

    /// Makes everything written so far durable (the ordering in the
    /// [module docs](self)). A read-only disk has nothing to flush.
    ///
    /// Errors: [`DiskError::Io`].
    pub fn flush(&mut self) -> Result<(), DiskError> {
        match self.top.as_mut() {
            None => Ok(()),
            Some(Layer::Raw(r)) => r.file.sync_data().map_err(io_err(&r.path, "sync")),
            Some(Layer::Delta(d)) => d.flush(),
        }
    }

    /// Freezes the top (its map written and marked frozen in its header,
    /// not synced: see the [module docs](self); a raw top just stops being
    /// written) and continues on a new empty delta at `new_top` (which must
    /// not exist). Returns the frozen layer's path. O(1) in the data
    /// written.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::Io`], the errors of
    /// creating a delta.
    pub fn freeze_top(&mut self, new_top: &Path) -> Result<PathBuf, DiskError> {
        let Some(top) = self.top.as_mut() else { return Err(DiskError::ReadOnly) };
        // Create the new top first: if that fails, the disk is unchanged
        // (the old top stays writable).
        let parent = top.id();
        let delta = Delta::create(new_top, self.size, self.cluster_bits, parent)?;
        match top {
            Layer::Raw(_) => {}
            Layer::Delta(d) => d.freeze()?,
        }
        let old = self.top.replace(Layer::Delta(delta)).ok_or(DiskError::ReadOnly)?;
        let path = old.path().to_path_buf();
        self.lower.push(Arc::new(old));
        Ok(path)
    }

    /// A new disk sharing this one's frozen layers (everything below the
    /// top), with its own empty top at `top` (which must not exist):
    /// the disk as it was at the last freeze. O(1) in the data written.
    ///
    /// Errors: the errors of creating a delta.
    pub fn sibling(&self, top: &Path) -> Result<LayeredDisk, DiskError> {
        let parent = self.lower.last().map_or([0; 16], |l| l.id());
        let delta = Delta::create(top, self.size, self.cluster_bits, parent)?;
        Ok(LayeredDisk {
            size: self.size,
            cluster_bits: self.cluster_bits,
            lower: self.lower.clone(),
            top: Some(Layer::Delta(delta)),
            scratch: Vec::new(),
        })
    }

    /// A branch: freezes the top ([`LayeredDisk::freeze_top`], this disk
    /// goes on at `new_top`) and returns one child disk per path in
    /// `children`, each with its own empty top over the shared frozen
    /// layers. Returns the frozen layer's path and the children.
    ///
    /// Errors: those of [`LayeredDisk::freeze_top`] and
    /// [`LayeredDisk::sibling`].
    pub fn branch(&mut self, new_top: &Path, children: &[PathBuf]) -> Result<(PathBuf, Vec<LayeredDisk>), DiskError> {
        let frozen = self.freeze_top(new_top)?;
        let kids = children.iter().map(|p| self.sibling(p)).collect::<Result<Vec<_>, _>>()?;
        Ok((frozen, kids))
    }
}

/// Whether two resolved sources are the same layer (both zeros, or the
/// same layer object).
fn same_layer(a: Option<&Layer>, b: Option<&Layer>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => std::ptr::eq(x, y),
        _ => false,
    }
}

/// Opens a raw image read-only.
fn open_raw(path: &Path) -> Result<Raw, DiskError> {
    let file = OpenOptions::new().read(true).open(path).map_err(io_err(path, "open the base"))?;
    let len = file.metadata().map_err(io_err(path, "stat the base"))?.len();
    Ok(Raw { path: path.to_path_buf(), file, len })
}

impl LayeredDisk {
    /// Creates an empty writable top at `top` (which must not exist) over
    /// the read-only chain `lower` (its `top` ignored) and returns the
    /// whole chain: a new disk that reads as `lower` does. O(1) in the
    /// data below.
    ///
    /// Errors: those of [`LayeredDisk::open`] and of creating a delta.
    pub fn create_top(lower: &ChainSpec, top: &Path) -> Result<ChainSpec, DiskError> {
        let below = ChainSpec { top: None, ..lower.clone() };
        LayeredDisk::open(&below)?.sibling(top)?;
        Ok(ChainSpec { top: Some(top.to_path_buf()), ..below })
    }

    /// A path for a new delta in the directory of this disk's top (or of
    /// its highest layer): see [`new_layer_path`].
    ///
    /// Errors: [`DiskError::Io`] (no randomness), [`DiskError::ReadOnly`]
    /// (a disk with no layer file to sit beside).
    pub fn new_layer_path(&self) -> Result<PathBuf, DiskError> {
        let beside = match (&self.top, self.lower.last()) {
            (Some(t), _) => t.path(),
            (None, Some(l)) => l.path(),
            (None, None) => return Err(DiskError::ReadOnly),
        };
        new_layer_path(beside.parent().unwrap_or(Path::new(".")))
    }
}

/// A path for a new delta in `dir`: `<dir>/<32 hex digits>.delta`, from 128
/// random bits (so concurrent writers never pick the same name).
///
/// Errors: [`DiskError::Io`] (no randomness).
pub fn new_layer_path(dir: &Path) -> Result<PathBuf, DiskError> {
    let id = crate::delta::new_id()?;
    let name: String = id.iter().map(|b| format!("{b:02x}")).collect();
    Ok(dir.join(format!("{name}.delta")))
}

impl Disk for LayeredDisk {
    fn size(&self) -> u64 {
        self.size
    }

    fn is_read_only(&self) -> bool {
        self.top.is_none()
    }

    fn discard_alignment(&self) -> u64 {
        self.cluster_size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        LayeredDisk::read_at(self, buf, offset)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), DiskError> {
        LayeredDisk::write_at(self, buf, offset)
    }

    fn discard(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        LayeredDisk::discard(self, offset, len)
    }

    fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        LayeredDisk::write_zeroes(self, offset, len)
    }

    fn flush(&mut self) -> Result<(), DiskError> {
        LayeredDisk::flush(self)
    }

    /// Freezes the top beside itself ([`LayeredDisk::freeze_top`] at
    /// [`LayeredDisk::new_layer_path`]) and returns the frozen layers; a
    /// read-only chain returns itself. A delta top nothing was written to
    /// since it was made is not frozen: the layers below it are already the
    /// disk as it is, and the chain does not grow by an empty layer at
    /// every capture (a sandbox branched or hibernated again and again
    /// without writing in between).
    fn checkpoint(&mut self) -> Result<Option<ChainSpec>, DiskError> {
        let empty_top = matches!(&self.top, Some(Layer::Delta(d)) if d.is_empty());
        if self.top.is_some() && !empty_top {
            let next = self.new_layer_path()?;
            self.freeze_top(&next)?;
        }
        let mut spec = LayeredDisk::spec(self);
        spec.top = None;
        Ok(Some(spec))
    }

    fn spec(&self) -> ChainSpec {
        LayeredDisk::spec(self)
    }

    fn replace_lower(&mut self, old: &ChainSpec, new: &ChainSpec) -> Result<bool, DiskError> {
        let mut below = LayeredDisk::spec(self);
        below.top = None;
        if below != *old || !matches!(self.top, Some(Layer::Delta(_))) {
            return Ok(false);
        }
        let opened = LayeredDisk::open(new)?;
        if new.base != old.base || (opened.size, opened.cluster_bits) != (self.size, self.cluster_bits) {
            let path = new.frozen.last().or(new.base.as_ref()).cloned().unwrap_or_default();
            return Err(DiskError::Chain { path, reason: "not the same disk as the layers it would replace".into() });
        }
        let parent = opened.lower.last().map_or([0; 16], |l| l.id());
        if let Some(Layer::Delta(top)) = self.top.as_mut() {
            top.set_parent(parent)?;
        }
        self.lower = opened.lower;
        Ok(true)
    }
}
