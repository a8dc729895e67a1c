//! No disk at all: what an empty device slot holds until a disk is put in
//! it (a volume attached to a sandbox restored from a template).

use crate::{ChainSpec, Disk, DiskError};

/// A disk of 0 bytes: every read and write is out of range, a flush does
/// nothing, and a checkpoint records no files (`None`), so a snapshot of
/// the VM records the slot empty.
#[derive(Debug, Default)]
pub struct EmptyDisk;

impl Disk for EmptyDisk {
    fn size(&self) -> u64 {
        0
    }

    fn is_read_only(&self) -> bool {
        true
    }

    fn discard_alignment(&self) -> u64 {
        4096
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        Err(DiskError::OutOfRange { offset, len: buf.len() as u64, size: 0 })
    }

    fn write_at(&mut self, _buf: &[u8], _offset: u64) -> Result<(), DiskError> {
        Err(DiskError::ReadOnly)
    }

    fn discard(&mut self, _offset: u64, _len: u64) -> Result<(), DiskError> {
        Err(DiskError::ReadOnly)
    }

    fn write_zeroes(&mut self, _offset: u64, _len: u64) -> Result<(), DiskError> {
        Err(DiskError::ReadOnly)
    }

    fn flush(&mut self) -> Result<(), DiskError> {
        Ok(())
    }

    fn checkpoint(&mut self) -> Result<Option<ChainSpec>, DiskError> {
        Ok(None)
    }

    fn spec(&self) -> ChainSpec {
        ChainSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_slot_holds_nothing_and_records_nothing() {
        let mut d = EmptyDisk;
        assert_eq!(d.size(), 0);
        assert!(d.is_read_only());
        assert!(matches!(d.read_at(&mut [0; 512], 0), Err(DiskError::OutOfRange { size: 0, .. })));
        assert!(matches!(d.write_at(&[0; 512], 0), Err(DiskError::ReadOnly)));
        assert!(d.flush().is_ok());
        assert_eq!(d.checkpoint().unwrap(), None);
        assert_eq!(d.spec(), ChainSpec::default());
    }
}
