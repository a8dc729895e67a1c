//! virtio-blk (virtio 1.2, section 5.2) on a [`Disk`]: a raw image file
//! ([`tine_storage::RawDisk`]) or a copy-on-write chain ([`tine_storage::LayeredDisk`]).
//!
//! One request queue. Requests: IN (read), OUT (write), FLUSH, GET_ID, and
//! on a writable disk DISCARD and WRITE_ZEROES; anything else completes
//! with `VIRTIO_BLK_S_UNSUPP`. A read-only disk offers `VIRTIO_BLK_F_RO` and
//! fails writes, discards and write-zeroes with `VIRTIO_BLK_S_IOERR`.
//! Data moves through a bounded bounce buffer, so no guest-supplied
//! length sizes a host allocation.
//!
//! DISCARD and WRITE_ZEROES carry 1..=[`MAX_DISCARD_SEG`] segments of 16
//! bytes (`le64 sector, le32 num_sectors, le32 flags`, section 5.2.6). A
//! segment past the end of the disk, longer than [`MAX_DISCARD_SECTORS`],
//! or a data length that is not a whole number of segments fails the
//! request with `IOERR`; the unmap flag on a DISCARD, or any flag other
//! than unmap, with `UNSUPP` (section 5.2.6.2). Segments need not be
//! aligned to `discard_sector_alignment` (the cluster size): the disk
//! discards the whole clusters a segment covers and zeroes the rest where
//! it holds data ([`Disk::discard`]).
//!
//! A device slot ([`crate::DiskConfig::slot`]) can change its disk while
//! the VM runs ([`Block::swap_disk`]): it offers the features of a
//! writable disk whatever it holds (the driver negotiates them once, at
//! probe), fails writes with `IOERR` while it holds a read-only disk, and
//! holds a 0-byte [`EmptyDisk`] when empty. The transport then raises a
//! configuration change interrupt, on which Linux reads the new capacity
//! (`virtblk_config_changed`).

use std::path::PathBuf;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::chain::{parse_chain, ParsedChain, Segment};
use super::{Activation, Interrupt, VirtioDevice, VirtioError, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use crate::devices::persist::Persist;
use crate::guest_warn;
use crate::log_limit::LogLimiter;
use crate::vm::DiskImage;
use tine_storage::{Disk, DiskError, EmptyDisk, LayeredDisk, RawDisk};

/// virtio device ID of a block device.
pub const VIRTIO_ID_BLOCK: u32 = 2;
/// Sector size (bytes) of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Queue size offered.
pub const QUEUE_SIZE: u16 = 256;
/// Most descriptors in one request (header + data + status).
pub const MAX_SEGMENTS: usize = 130;
/// Bytes of the GET_ID answer.
pub const ID_BYTES: usize = 20;
const BOUNCE_BYTES: usize = 128 * 1024;

/// VIRTIO_BLK_F_RO.
pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
/// VIRTIO_BLK_F_FLUSH.
pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
/// VIRTIO_BLK_F_DISCARD.
pub const VIRTIO_BLK_F_DISCARD: u64 = 1 << 13;
/// VIRTIO_BLK_F_WRITE_ZEROES.
pub const VIRTIO_BLK_F_WRITE_ZEROES: u64 = 1 << 14;
/// Most sectors (512 bytes) in one DISCARD or WRITE_ZEROES segment (1 GiB).
pub const MAX_DISCARD_SECTORS: u32 = 1 << 21;
/// Most segments in one DISCARD or WRITE_ZEROES request.
pub const MAX_DISCARD_SEG: u32 = 32;
/// Bytes of one DISCARD or WRITE_ZEROES segment.
pub const DISCARD_SEGMENT_BYTES: u64 = 16;
/// The unmap flag of a segment (only meaningful for WRITE_ZEROES).
pub const FLAG_UNMAP: u32 = 1;
/// Bytes of the configuration space: up to `write_zeroes_may_unmap` and
/// its padding (struct virtio_blk_config, section 5.2.4).
pub const CONFIG_BYTES: usize = 60;

/// Request types (section 5.2.6).
pub mod req {
    #![allow(missing_docs)]
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
    pub const DISCARD: u32 = 11;
    pub const WRITE_ZEROES: u32 = 13;
}

/// Request status values.
pub mod status {
    #![allow(missing_docs)]
    pub const OK: u8 = 0;
    pub const IOERR: u8 = 1;
    pub const UNSUPP: u8 = 2;
}

/// Errors of opening a disk.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image or chain cannot be opened.
    #[error("cannot open disk {path}: {source}")]
    Open {
        /// The image (the top of a chain).
        path: PathBuf,
        /// Why.
        source: DiskError,
    },
    /// The image size is not a whole number of sectors.
    #[error("disk image {path} is {size} bytes, not a multiple of 512")]
    Size {
        /// The image.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
    },
    /// A disk was to be swapped on a device that is not a slot
    /// ([`crate::DiskConfig::slot`]).
    #[error("the device is not a disk slot: its disk cannot change while the VM runs")]
    NotASlot,
}

/// A virtio-blk device.
pub struct Block {
    disk: Box<dyn Disk>,
    read_only: bool,
    /// A device slot: writable features whatever the disk, disk swappable.
    slot: bool,
    sectors: u64,
    id: [u8; ID_BYTES],
    config: [u8; CONFIG_BYTES],
    queue_sizes: [u16; 1],
    running: Option<Running>,
    bounce: Vec<u8>,
    /// Guest-triggered log lines (shared per VM).
    log: Arc<LogLimiter>,
}

struct Running {
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Arc<Interrupt>,
}

/// How a request went wrong before it could complete with a status.
enum RequestError {
    /// Complete with this status.
    Status(u8),
}

impl Block {
    /// Opens the raw image `path` as a disk; `id` is the serial the guest
    /// reads with GET_ID (truncated to 20 bytes).
    ///
    /// Errors: [`BlockError::Open`], [`BlockError::Size`].
    pub fn open(path: &std::path::Path, read_only: bool, id: &str) -> Result<Self, BlockError> {
        Self::open_image(&DiskImage::Raw { path: path.to_path_buf(), read_only }, id)
    }

    /// Opens `image` (a raw file or a copy-on-write chain) as a disk; `id`
    /// is the serial the guest reads with GET_ID (truncated to 20 bytes).
    ///
    /// Errors: [`BlockError::Open`], [`BlockError::Size`].
    pub fn open_image(image: &DiskImage, id: &str) -> Result<Self, BlockError> {
        Self::with_disk(Self::open_disk(image)?, &image.path(), id)
    }

    /// Opens `config`'s image as a disk, in a device slot when the config
    /// says so ([`crate::DiskConfig::slot`]).
    ///
    /// Errors: [`BlockError::Open`], [`BlockError::Size`].
    pub fn open_config(config: &crate::DiskConfig) -> Result<Self, BlockError> {
        let mut block = Self::open_image(&config.image, &config.id)?;
        block.slot = config.slot;
        Ok(block)
    }

    /// Opens `image` as a [`Disk`].
    ///
    /// Errors: [`BlockError::Open`].
    pub fn open_disk(image: &DiskImage) -> Result<Box<dyn Disk>, BlockError> {
        Ok(match image {
            DiskImage::Raw { path, read_only } => Box::new(
                RawDisk::open(path, !read_only).map_err(|source| BlockError::Open { path: path.clone(), source })?,
            ),
            DiskImage::Chain(spec) => {
                Box::new(LayeredDisk::open(spec).map_err(|source| BlockError::Open { path: image.path(), source })?)
            }
            DiskImage::Empty => Box::new(EmptyDisk),
        })
    }

    /// A device on `disk` (read-only when the disk is); `path` names it in
    /// errors, `id` is the serial the guest reads with GET_ID (truncated to
    /// 20 bytes).
    ///
    /// Errors: [`BlockError::Size`] (the disk's size is not a multiple of
    /// 512 bytes).
    pub fn with_disk(disk: Box<dyn Disk>, path: &std::path::Path, id: &str) -> Result<Self, BlockError> {
        let mut id_bytes = [0u8; ID_BYTES];
        let n = id.len().min(ID_BYTES);
        id_bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
        let (sectors, config) = Self::config_of(disk.as_ref(), path)?;
        Ok(Block {
            read_only: disk.is_read_only(),
            slot: false,
            disk,
            sectors,
            id: id_bytes,
            config,
            queue_sizes: [QUEUE_SIZE],
            running: None,
            bounce: vec![0; BOUNCE_BYTES],
            log: Arc::new(LogLimiter::default()),
        })
    }

    /// Puts `disk` in this device slot in place of the disk it holds,
    /// which it returns (flushed): the capacity and discard alignment the
    /// guest reads change with it. The caller holds the transport's lock
    /// (no request runs meanwhile) and tells the guest
    /// ([`super::mmio::MmioTransport::swap_disk`]).
    ///
    /// Errors: [`BlockError::NotASlot`], [`BlockError::Size`],
    /// [`BlockError::Open`] (the old disk's flush failed: nothing changed).
    pub fn swap_disk(&mut self, disk: Box<dyn Disk>, path: &std::path::Path) -> Result<Box<dyn Disk>, BlockError> {
        if !self.slot {
            return Err(BlockError::NotASlot);
        }
        let (sectors, config) = Self::config_of(disk.as_ref(), path)?;
        self.disk.flush().map_err(|source| BlockError::Open { path: path.to_path_buf(), source })?;
        self.read_only = disk.is_read_only();
        self.sectors = sectors;
        self.config = config;
        Ok(std::mem::replace(&mut self.disk, disk))
    }

    /// The capacity (sectors) and configuration space of `disk`.
    ///
    /// Errors: [`BlockError::Size`] (not a multiple of 512 bytes).
    fn config_of(disk: &dyn Disk, path: &std::path::Path) -> Result<(u64, [u8; CONFIG_BYTES]), BlockError> {
        let size = disk.size();
        if !size.is_multiple_of(SECTOR_SIZE) {
            return Err(BlockError::Size { path: path.to_path_buf(), size });
        }
        let sectors = size / SECTOR_SIZE;
        let mut config = [0u8; CONFIG_BYTES];
        config[0..8].copy_from_slice(&sectors.to_le_bytes());
        // Discard: max_discard_sectors, max_discard_seg,
        // discard_sector_alignment (the disk's unit, in sectors).
        let alignment = u32::try_from(disk.discard_alignment() / SECTOR_SIZE).unwrap_or(1);
        config[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        config[40..44].copy_from_slice(&MAX_DISCARD_SEG.to_le_bytes());
        config[44..48].copy_from_slice(&alignment.to_le_bytes());
        // Write zeroes: max_write_zeroes_sectors, max_write_zeroes_seg,
        // write_zeroes_may_unmap.
        config[48..52].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        config[52..56].copy_from_slice(&MAX_DISCARD_SEG.to_le_bytes());
        config[56] = 1;
        Ok((sectors, config))
    }

    /// The disk (for its size and layers' accounting).
    pub fn disk(&self) -> &dyn Disk {
        self.disk.as_ref()
    }

    /// The disk, to flush or checkpoint it while the device is quiescent
    /// (its transport locked, so no request is in progress).
    pub fn disk_mut(&mut self) -> &mut dyn Disk {
        self.disk.as_mut()
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// Runs one parsed request; returns the bytes written into guest
    /// buffers (status byte included) for the used ring.
    fn execute(&mut self, mem: &GuestMemoryMmap, chain: &ParsedChain) -> u32 {
        let segs = &chain.segments;
        // The status byte: the last byte of the last, device-writable, segment.
        let Some(last) = segs.last().filter(|s| s.writable && s.len >= 1) else {
            guest_warn!(self.log, "virtio-blk: request {} has no writable status byte; dropped", chain.head);
            return 0;
        };
        let status_addr = GuestAddress(last.addr.0 + u64::from(last.len) - 1);
        let (written, status) = match self.run_request(mem, segs) {
            Ok(written) => (written, status::OK),
            Err(RequestError::Status(s)) => (0, s),
        };
        if mem.write_obj(status, status_addr).is_err() {
            return 0;
        }
        written.saturating_add(1)
    }

    fn run_request(&mut self, mem: &GuestMemoryMmap, segs: &[Segment]) -> Result<u32, RequestError> {
        let head = segs[0];
        if head.writable || head.len < 16 {
            guest_warn!(self.log, "virtio-blk: request header is not a readable 16-byte buffer");
            return Err(RequestError::Status(status::IOERR));
        }
        let kind: u32 = mem.read_obj(head.addr).map_err(|_| RequestError::Status(status::IOERR))?;
        let sector: u64 =
            mem.read_obj(GuestAddress(head.addr.0 + 8)).map_err(|_| RequestError::Status(status::IOERR))?;
        // Data segments: everything between the header and the status
        // segment, plus the status segment's bytes before the status byte.
        let last = segs[segs.len() - 1];
        let mut data: Vec<Segment> = segs[1..segs.len() - 1].to_vec();
        if last.len > 1 {
            data.push(Segment { addr: last.addr, len: last.len - 1, writable: true });
        }
        let data_len: u64 = data.iter().map(|s| u64::from(s.len)).sum();
        match kind {
            req::IN | req::OUT => {
                let writing = kind == req::OUT;
                if writing && self.read_only {
                    return Err(RequestError::Status(status::IOERR));
                }
                if data.iter().any(|s| s.writable == writing) {
                    guest_warn!(
                        self.log,
                        "virtio-blk: {} request with a data buffer of the wrong direction",
                        if writing { "OUT" } else { "IN" }
                    );
                    return Err(RequestError::Status(status::IOERR));
                }
                if !data_len.is_multiple_of(SECTOR_SIZE) {
                    return Err(RequestError::Status(status::IOERR));
                }
                let end = sector.checked_add(data_len / SECTOR_SIZE);
                if end.is_none_or(|e| e > self.sectors) {
                    return Err(RequestError::Status(status::IOERR));
                }
                let mut offset = sector * SECTOR_SIZE;
                for seg in &data {
                    self.transfer(mem, *seg, offset, writing).map_err(|e| {
                        guest_warn!(self.log, "virtio-blk: I/O at byte {offset}: {e}");
                        RequestError::Status(status::IOERR)
                    })?;
                    offset += u64::from(seg.len);
                }
                Ok(if writing { 0 } else { data_len as u32 })
            }
            req::FLUSH => {
                self.disk.flush().map_err(|e| {
                    guest_warn!(self.log, "virtio-blk: flush: {e}");
                    RequestError::Status(status::IOERR)
                })?;
                Ok(0)
            }
            req::DISCARD | req::WRITE_ZEROES => {
                self.zero_ranges(mem, &data, kind == req::WRITE_ZEROES)?;
                Ok(0)
            }
            req::GET_ID => {
                let seg = data.first().filter(|s| s.writable).ok_or(RequestError::Status(status::IOERR))?;
                let n = (seg.len as usize).min(ID_BYTES);
                mem.write_slice(&self.id[..n], seg.addr).map_err(|_| RequestError::Status(status::IOERR))?;
                Ok(n as u32)
            }
            _ => Err(RequestError::Status(status::UNSUPP)),
        }
    }

    /// Runs a DISCARD (`zeroes` false) or WRITE_ZEROES request whose data
    /// segments are `data`: all its ranges are checked before any is
    /// applied.
    fn zero_ranges(&mut self, mem: &GuestMemoryMmap, data: &[Segment], zeroes: bool) -> Result<(), RequestError> {
        if self.read_only {
            return Err(RequestError::Status(status::IOERR));
        }
        if data.iter().any(|s| s.writable) {
            guest_warn!(self.log, "virtio-blk: discard/write-zeroes request with a device-writable data buffer");
            return Err(RequestError::Status(status::IOERR));
        }
        let total: u64 = data.iter().map(|s| u64::from(s.len)).sum();
        let count = total / DISCARD_SEGMENT_BYTES;
        if total == 0 || !total.is_multiple_of(DISCARD_SEGMENT_BYTES) || count > u64::from(MAX_DISCARD_SEG) {
            return Err(RequestError::Status(status::IOERR));
        }
        // Gather the segments' bytes (at most 512) from the buffers.
        let mut raw = [0u8; (MAX_DISCARD_SEG as usize) * DISCARD_SEGMENT_BYTES as usize];
        let mut at = 0usize;
        for seg in data {
            let n = seg.len as usize;
            mem.read_slice(&mut raw[at..at + n], seg.addr).map_err(|_| RequestError::Status(status::IOERR))?;
            at += n;
        }
        let mut ranges = [(0u64, 0u64); MAX_DISCARD_SEG as usize];
        for (i, range) in ranges.iter_mut().enumerate().take(count as usize) {
            let e = &raw[i * 16..i * 16 + 16];
            let sector = u64::from_le_bytes(e[0..8].try_into().unwrap_or_default());
            let sectors = u32::from_le_bytes(e[8..12].try_into().unwrap_or_default());
            let flags = u32::from_le_bytes(e[12..16].try_into().unwrap_or_default());
            if flags & !FLAG_UNMAP != 0 || (!zeroes && flags & FLAG_UNMAP != 0) {
                return Err(RequestError::Status(status::UNSUPP));
            }
            if sectors > MAX_DISCARD_SECTORS || sector.checked_add(u64::from(sectors)).is_none_or(|e| e > self.sectors)
            {
                return Err(RequestError::Status(status::IOERR));
            }
            *range = (sector * SECTOR_SIZE, u64::from(sectors) * SECTOR_SIZE);
        }
        for &(offset, len) in &ranges[..count as usize] {
            let r = if zeroes { self.disk.write_zeroes(offset, len) } else { self.disk.discard(offset, len) };
            r.map_err(|e| {
                guest_warn!(self.log, "virtio-blk: discard/write-zeroes at byte {offset}: {e}");
                RequestError::Status(status::IOERR)
            })?;
        }
        Ok(())
    }

    /// Copies one segment between guest memory and the disk at byte `offset`.
    fn transfer(&mut self, mem: &GuestMemoryMmap, seg: Segment, offset: u64, to_disk: bool) -> std::io::Result<()> {
        let mut done = 0usize;
        let len = seg.len as usize;
        while done < len {
            let n = (len - done).min(self.bounce.len());
            let buf = &mut self.bounce[..n];
            let gpa = GuestAddress(seg.addr.0 + done as u64);
            let at = offset + done as u64;
            if to_disk {
                mem.read_slice(buf, gpa).map_err(std::io::Error::other)?;
                self.disk.write_at(buf, at).map_err(std::io::Error::other)?;
            } else {
                self.disk.read_at(buf, at).map_err(std::io::Error::other)?;
                mem.write_slice(buf, gpa).map_err(std::io::Error::other)?;
            }
            done += n;
        }
        Ok(())
    }
}

/// The persisted state of a virtio-blk device: empty. Its virtqueue (the
/// only state it has while running) is saved by its transport
/// ([`super::mmio::TransportState`], through [`VirtioDevice::queue_states`]),
/// and the disk image is a host resource, reopened from [`BlockArgs`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockState {}

/// What restoring a virtio-blk device needs: the arguments of
/// [`Block::open_image`] (a slot is restored by
/// [`Block::open_config`]).
pub struct BlockArgs<'a> {
    /// The disk: a raw image, or the chain to go on from (a restored VM
    /// gets a new top over the snapshot's frozen layers).
    pub image: &'a DiskImage,
    /// The serial the guest reads with GET_ID.
    pub id: &'a str,
}

impl<'a> Persist<'a> for Block {
    type State = BlockState;
    type ConstructorArgs = BlockArgs<'a>;
    type Error = BlockError;

    fn save(&self) -> BlockState {
        BlockState {}
    }

    /// Opens the disk again ([`Block::open_image`]); the transport's restore
    /// then activates it on the saved virtqueue.
    ///
    /// Errors: [`BlockError`].
    fn restore(args: BlockArgs<'a>, _state: &BlockState) -> Result<Self, BlockError> {
        Block::open_image(args.image, args.id)
    }
}

impl VirtioDevice for Block {
    fn name(&self) -> &'static str {
        "virtio-blk"
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_BLK_F_FLUSH;
        if self.read_only && !self.slot {
            f |= VIRTIO_BLK_F_RO;
        } else {
            f |= VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!("virtio-blk: config write at {offset:#x} ignored (read-only fields)");
    }

    fn activate(&mut self, activation: Activation, interrupt: Arc<Interrupt>) -> Result<(), VirtioError> {
        let queue =
            activation.queues.into_iter().next().filter(|q| q.ready()).ok_or(VirtioError::Activate {
                device: "virtio-blk",
                reason: "the request queue is not ready".into(),
            })?;
        self.running = Some(Running { mem: activation.mem, queue, interrupt });
        Ok(())
    }

    fn reset(&mut self) {
        self.running = None;
    }

    fn set_log_limiter(&mut self, log: Arc<LogLimiter>) {
        self.log = log;
    }

    fn disk(&mut self) -> Option<&mut dyn Disk> {
        Some(self.disk.as_mut())
    }

    fn swap_disk(&mut self, disk: Box<dyn Disk>, path: &std::path::Path) -> Result<Box<dyn Disk>, BlockError> {
        Block::swap_disk(self, disk, path)
    }

    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        self.running.as_ref().map(|r| vec![r.queue.state()])
    }

    fn process_queue(&mut self, index: usize) -> Result<(), VirtioError> {
        if index != 0 {
            return Ok(());
        }
        let Some(mut run) = self.running.take() else { return Ok(()) };
        let log = self.log.clone();
        let result = super::drain_queue("virtio-blk", &mut run.queue, &run.mem, &run.interrupt, |chain| {
            match parse_chain(&run.mem, chain, MAX_SEGMENTS) {
                Ok(parsed) => self.execute(&run.mem, &parsed),
                Err(e) => {
                    guest_warn!(log, "virtio-blk: {e}; request dropped");
                    0
                }
            }
        });
        self.running = Some(run);
        result
    }
}
