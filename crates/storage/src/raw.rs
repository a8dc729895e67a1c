//! A raw disk: one image file, byte for byte the disk, read-only or
//! written in place.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::delta::punch_hole;
use crate::{io_err, ChainSpec, Disk, DiskError};

/// A raw image file as a disk of the file's length.
pub struct RawDisk {
    path: PathBuf,
    file: File,
    size: u64,
    writable: bool,
}

impl RawDisk {
    /// Opens `path` (for writing too when `writable`); the disk's size is
    /// the file's length in bytes.
    ///
    /// Errors: [`DiskError::Io`] (the file cannot be opened or stat'ed).
    pub fn open(path: &Path, writable: bool) -> Result<Self, DiskError> {
        let file = OpenOptions::new().read(true).write(writable).open(path).map_err(io_err(path, "open"))?;
        let size = file.metadata().map_err(io_err(path, "stat"))?.len();
        Ok(RawDisk { path: path.to_path_buf(), file, size, writable })
    }

    fn check(&self, offset: u64, len: u64, write: bool) -> Result<(), DiskError> {
        if write && !self.writable {
            return Err(DiskError::ReadOnly);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(DiskError::OutOfRange { offset, len, size: self.size }),
        }
    }
}

impl Disk for RawDisk {
    fn size(&self) -> u64 {
        self.size
    }

    fn is_read_only(&self) -> bool {
        !self.writable
    }

    fn discard_alignment(&self) -> u64 {
        4096
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        self.check(offset, buf.len() as u64, false)?;
        self.file.read_exact_at(buf, offset).map_err(io_err(&self.path, "read"))
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), DiskError> {
        self.check(offset, buf.len() as u64, true)?;
        self.file.write_all_at(buf, offset).map_err(io_err(&self.path, "write"))
    }

    fn discard(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        self.write_zeroes(offset, len)
    }

    /// A punched hole reads as zeros (`fallocate(2)`).
    fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        self.check(offset, len, true)?;
        punch_hole(&self.file, offset, len).map_err(io_err(&self.path, "punch a hole"))
    }

    fn flush(&mut self) -> Result<(), DiskError> {
        if !self.writable {
            return Ok(());
        }
        self.file.sync_data().map_err(io_err(&self.path, "sync"))
    }

    fn checkpoint(&mut self) -> Result<Option<ChainSpec>, DiskError> {
        Ok((!self.writable).then(|| self.spec()))
    }

    fn spec(&self) -> ChainSpec {
        ChainSpec { base: Some(self.path.clone()), frozen: Vec::new(), top: None }
    }
}
