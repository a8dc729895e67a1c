//! virtio-blk driven by the test driver (tests/common/driver.rs): normal
//! requests, and what a hostile guest can write into the virtqueue. Every
//! bad request must fail or be dropped with the device still serving the
//! next one; a corrupt ring must mark the device broken. No KVM needed:
//! the device and transport are the real ones, the driver is the test.

mod common;

use std::os::unix::fs::FileExt;

use common::driver::{Driver, DATA_BASE, INDIRECT, WRITE};
use vmm::devices::virtio::block::{req, status, Block, VIRTIO_BLK_F_FLUSH};
use vmm::devices::Persist;

const DISK_BYTES: u64 = 1 << 20;
const HDR: u64 = DATA_BASE;
const DATA: u64 = DATA_BASE + 0x1000;
const STATUS: u64 = DATA_BASE + 0x10_0000;

fn disk(read_only: bool) -> (tempfile::NamedTempFile, Driver) {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(DISK_BYTES).unwrap();
    let block = Block::open(f.path(), read_only, "test-serial-0123456789").unwrap();
    let d = Driver::new(Box::new(block), VIRTIO_BLK_F_FLUSH, 16);
    (f, d)
}

fn header(d: &Driver, kind: u32, sector: u64) {
    let mut h = Vec::new();
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&sector.to_le_bytes());
    d.write_bytes(HDR, &h);
}

/// Submits header + data + status at descriptors 0..3; returns the status
/// byte and the used entries.
fn request(d: &mut Driver, kind: u32, sector: u64, data_len: u32, data_flags: u16) -> (u8, Vec<(u32, u32)>) {
    header(d, kind, sector);
    d.write_bytes(STATUS, &[0xee]);
    let mut bufs = vec![(HDR, 16, 0)];
    if data_len > 0 {
        bufs.push((DATA, data_len, data_flags));
    }
    bufs.push((STATUS, 1, WRITE));
    d.add_chain(0, 0, &bufs);
    d.kick(0);
    (d.read_u8(STATUS), d.used(0))
}

#[test]
fn write_read_flush_and_get_id() {
    let (f, mut d) = disk(false);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    d.write_bytes(DATA, &pattern);
    let (st, used) = request(&mut d, req::OUT, 8, 4096, 0);
    assert_eq!(st, status::OK);
    assert_eq!(used, vec![(0, 1)], "a write returns only the status byte");
    let mut on_disk = vec![0u8; 4096];
    f.as_file().read_exact_at(&mut on_disk, 8 * 512).unwrap();
    assert_eq!(on_disk, pattern);

    d.write_bytes(DATA, &[0u8; 4096]);
    let (st, used) = request(&mut d, req::IN, 8, 4096, WRITE);
    assert_eq!(st, status::OK);
    assert_eq!(used, vec![(0, 4097)]);
    assert_eq!(d.read_bytes(DATA, 4096), pattern);

    let (st, _) = request(&mut d, req::FLUSH, 0, 0, 0);
    assert_eq!(st, status::OK);

    let (st, used) = request(&mut d, req::GET_ID, 0, 20, WRITE);
    assert_eq!(st, status::OK);
    assert_eq!(used, vec![(0, 21)]);
    assert_eq!(d.read_bytes(DATA, 20), b"test-serial-01234567");
    // An interrupt was raised for the completions.
    assert!(d.irq.read().unwrap() >= 1);
    assert!(!d.needs_reset());
}

#[test]
fn bad_requests_fail_with_a_status_and_the_device_goes_on() {
    let (_f, mut d) = disk(false);
    // Past the end of the disk.
    assert_eq!(request(&mut d, req::IN, DISK_BYTES / 512, 512, WRITE).0, status::IOERR);
    // Sector number that overflows.
    assert_eq!(request(&mut d, req::IN, u64::MAX, 512, WRITE).0, status::IOERR);
    // Not a whole sector.
    assert_eq!(request(&mut d, req::IN, 0, 100, WRITE).0, status::IOERR);
    // Wrong direction: a read into a device-readable buffer, a write from a writable one.
    assert_eq!(request(&mut d, req::IN, 0, 512, 0).0, status::IOERR);
    // (A readable buffer after the writable status is refused as a chain.)
    // Unknown request type.
    assert_eq!(request(&mut d, 0x1234, 0, 0, 0).0, status::UNSUPP);
    // Header shorter than 16 bytes.
    d.write_bytes(STATUS, &[0xee]);
    d.add_chain(0, 0, &[(HDR, 8, 0), (STATUS, 1, WRITE)]);
    d.kick(0);
    assert_eq!(d.read_u8(STATUS), status::IOERR);
    d.used(0);
    // Still serving.
    assert_eq!(request(&mut d, req::IN, 0, 512, WRITE).0, status::OK);
    assert!(!d.needs_reset());
}

#[test]
fn read_only_disk_refuses_writes() {
    let (f, mut d) = disk(true);
    d.write_bytes(DATA, &[0xab; 512]);
    assert_eq!(request(&mut d, req::OUT, 0, 512, 0).0, status::IOERR);
    let mut b = [0u8; 512];
    f.as_file().read_exact_at(&mut b, 0).unwrap();
    assert_eq!(b, [0u8; 512], "the image is untouched");
    assert_eq!(request(&mut d, req::IN, 0, 512, WRITE).0, status::OK);
}

#[test]
fn hostile_chains_are_dropped_not_followed() {
    let (_f, mut d) = disk(false);
    header(&d, req::IN, 0);

    // A loop: 0 -> 1 -> 0 -> ...
    d.set_desc(0, 0, HDR, 16, 1, 1);
    d.set_desc(0, 1, DATA, 512, 1 | WRITE, 0);
    d.publish(0, 0);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)], "a looping chain is dropped with length 0");

    // A next index past the table.
    d.set_desc(0, 0, HDR, 16, 1, 500);
    d.publish(0, 0);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)]);

    // A buffer outside guest memory.
    d.add_chain(0, 0, &[(HDR, 16, 0), (0xffff_ff00_0000, 512, WRITE), (STATUS, 1, WRITE)]);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)]);

    // A buffer straddling the end of guest memory.
    let end = common::driver::MEM_SIZE as u64;
    d.add_chain(0, 0, &[(HDR, 16, 0), (end - 256, 512, WRITE), (STATUS, 1, WRITE)]);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)]);

    // A device-readable buffer after a writable one.
    d.add_chain(0, 0, &[(HDR, 16, 0), (DATA, 512, WRITE), (STATUS, 1, 0)]);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)]);

    // No writable status byte.
    d.add_chain(0, 0, &[(HDR, 16, 0)]);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)]);

    // An indirect table of 200 descriptors: longer than any request.
    let table = DATA_BASE + 0x20_0000;
    for i in 0..200u16 {
        let base = table + u64::from(i) * 16;
        d.write_bytes(base, &DATA.to_le_bytes());
        d.write_bytes(base + 8, &512u32.to_le_bytes());
        d.write_bytes(base + 12, &(1u16 | WRITE).to_le_bytes());
        d.write_bytes(base + 14, &(i + 1).to_le_bytes());
    }
    d.set_desc(0, 0, table, 200 * 16, INDIRECT, 0);
    d.publish(0, 0);
    d.kick(0);
    assert_eq!(d.used(0), vec![(0, 0)]);

    // After all that, a good request still works.
    assert_eq!(request(&mut d, req::IN, 0, 512, WRITE).0, status::OK);
    assert!(!d.needs_reset());
}

#[test]
fn a_corrupt_available_ring_marks_the_device_broken_until_reset() {
    let (_f, mut d) = disk(false);
    assert_eq!(request(&mut d, req::IN, 0, 512, WRITE).0, status::OK);
    // The available index jumps more than a queue ahead.
    let idx = d.queues[0].avail_idx;
    d.set_avail_idx(0, idx.wrapping_add(100));
    d.kick(0);
    assert!(d.needs_reset(), "DEVICE_NEEDS_RESET must be set");
    assert!(!d.transport.is_active());
    // A broken device ignores further notifications.
    d.kick(0);
    assert!(d.used(0).is_empty());
    // The driver resets it and sets it up again; it serves again.
    d.init(1, VIRTIO_BLK_F_FLUSH, 16);
    assert!(!d.needs_reset());
    assert_eq!(request(&mut d, req::IN, 0, 512, WRITE).0, status::OK);
}

#[test]
fn queue_state_survives_save_and_restore() {
    let (f, mut d) = disk(false);
    d.write_bytes(DATA, &[0x11; 512]);
    for _ in 0..3 {
        assert_eq!(request(&mut d, req::OUT, 1, 512, 0).0, status::OK);
    }
    let saved = d.transport.save();
    assert!(saved.activated);
    assert_eq!((saved.queues[0].next_avail, saved.queues[0].next_used), (3, 3));
    // A new device on the same image, restored: the driver's rings go on.
    let block = Block::open(f.path(), false, "test-serial-0123456789").unwrap();
    d.save_and_restore(Box::new(block));
    assert!(d.transport.is_active());
    assert_eq!(d.transport.save(), saved, "virtio-blk restores to exactly the saved state");
    d.write_bytes(DATA, &[0u8; 512]);
    let (st, used) = request(&mut d, req::IN, 1, 512, WRITE);
    assert_eq!(st, status::OK);
    assert_eq!(used, vec![(0, 513)], "exactly one new used entry after the restore");
    assert_eq!(d.read_bytes(DATA, 512), vec![0x11; 512]);
    // A state for another device shape is refused.
    let other = vmm::devices::virtio::vsock::Vsock::new(3, &f.path().with_extension("sock")).unwrap();
    let interrupt = std::sync::Arc::new(vmm::devices::virtio::Interrupt::new(d.irq.try_clone().unwrap()));
    let err = vmm::devices::virtio::mmio::MmioTransport::restore(
        vmm::devices::virtio::mmio::TransportArgs { device: Box::new(other), mem: d.mem.clone(), interrupt },
        &saved,
    );
    assert!(err.is_err());
}

/// A driver on a copy-on-write disk: a 1 MiB raw base under a 4 MiB disk.
fn layered() -> (tempfile::TempDir, Vec<u8>, Driver) {
    use vmm::devices::virtio::block::{VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_WRITE_ZEROES};
    let dir = tempfile::tempdir().unwrap();
    let base_bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8 | 1).collect();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, &base_bytes).unwrap();
    let top = dir.path().join("top.delta");
    // A fresh top over the base, made and then opened as a VM's disk is.
    drop(tine_storage::LayeredDisk::create(Some(&base), 4 << 20, 16, &top).unwrap());
    let chain = vmm::DiskImage::Chain(tine_storage::ChainSpec { base: Some(base), frozen: vec![], top: Some(top) });
    let block = Block::open_image(&chain, "layered").unwrap();
    let d = Driver::new(Box::new(block), VIRTIO_BLK_F_FLUSH | VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES, 16);
    (dir, base_bytes, d)
}

/// Puts DISCARD/WRITE_ZEROES segments (sector, sectors, flags) at DATA.
fn segments(d: &Driver, segs: &[(u64, u32, u32)]) -> u32 {
    let mut b = Vec::new();
    for &(sector, n, flags) in segs {
        b.extend_from_slice(&sector.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
    }
    d.write_bytes(DATA, &b);
    b.len() as u32
}

#[test]
fn a_layered_disk_reads_through_writes_on_top_and_discards() {
    use vmm::devices::virtio::block::{MAX_DISCARD_SECTORS, MAX_DISCARD_SEG};
    let (dir, base, mut d) = layered();
    // Config space: capacity, then the discard and write-zeroes limits.
    assert_eq!(d.r(0x100), 8192);
    assert_eq!(d.r(0x100 + 36), MAX_DISCARD_SECTORS);
    assert_eq!(d.r(0x100 + 40), MAX_DISCARD_SEG);
    assert_eq!(d.r(0x100 + 44), 128, "discard alignment: one 64 KiB cluster");
    assert_eq!(d.r(0x100 + 48), MAX_DISCARD_SECTORS);
    assert_eq!(d.r(0x100 + 56) & 0xff, 1, "write zeroes may unmap");

    // Reads come from the base, and past its end are zeros.
    let (st, _) = request(&mut d, req::IN, 0, 4096, WRITE);
    assert_eq!(st, status::OK);
    assert_eq!(d.read_bytes(DATA, 4096), base[..4096]);
    assert_eq!(request(&mut d, req::IN, 4096, 4096, WRITE).0, status::OK);
    assert_eq!(d.read_bytes(DATA, 4096), vec![0; 4096]);

    // A write lands in the top; the base is untouched.
    d.write_bytes(DATA, &[0x77; 1024]);
    assert_eq!(request(&mut d, req::OUT, 3, 1024, 0).0, status::OK);
    assert_eq!(request(&mut d, req::IN, 0, 4096, WRITE).0, status::OK);
    let got = d.read_bytes(DATA, 4096);
    assert_eq!(&got[..1536], &base[..1536]);
    assert_eq!(&got[1536..2560], &[0x77; 1024][..]);
    assert_eq!(&got[2560..], &base[2560..4096]);
    assert_eq!(std::fs::read(dir.path().join("base.raw")).unwrap(), base);

    // DISCARD of two clusters and part of a third: the whole clusters read
    // as zeros over the base.
    let n = segments(&d, &[(0, 256 + 8, 0)]);
    assert_eq!(request(&mut d, req::DISCARD, 0, n, 0).0, status::OK);
    assert_eq!(request(&mut d, req::IN, 0, 4096, WRITE).0, status::OK);
    assert_eq!(d.read_bytes(DATA, 4096), vec![0; 4096]);
    assert_eq!(request(&mut d, req::IN, 256, 4096, WRITE).0, status::OK);
    assert_eq!(d.read_bytes(DATA, 4096), base[256 * 512..256 * 512 + 4096], "partial cluster left as it was");

    // WRITE_ZEROES, two segments, one with unmap: exact zeros.
    let n = segments(&d, &[(300, 5, 1), (1000, 1, 0)]);
    assert_eq!(request(&mut d, req::WRITE_ZEROES, 0, n, 0).0, status::OK);
    assert_eq!(request(&mut d, req::IN, 299, 7 * 512, WRITE).0, status::OK);
    let got = d.read_bytes(DATA, 7 * 512);
    assert_eq!(&got[..512], &base[299 * 512..300 * 512]);
    assert_eq!(&got[512..6 * 512], &[0; 5 * 512][..]);
    assert_eq!(&got[6 * 512..], &base[305 * 512..306 * 512]);
    assert_eq!(request(&mut d, req::IN, 1000, 512, WRITE).0, status::OK);
    assert_eq!(d.read_bytes(DATA, 512), vec![0; 512]);
    assert_eq!(request(&mut d, req::FLUSH, 0, 0, 0).0, status::OK);
    assert!(!d.needs_reset());
}

#[test]
fn bad_discard_and_write_zeroes_requests_fail_with_a_status() {
    use vmm::devices::virtio::block::{MAX_DISCARD_SECTORS, MAX_DISCARD_SEG};
    let (_dir, _base, mut d) = layered();
    const SECTORS: u64 = 8192;
    type Case = (u32, &'static [(u64, u32, u32)], u8);
    let cases: &[Case] = &[
        // The unmap flag on a discard; an unknown flag.
        (req::DISCARD, &[(0, 8, 1)], status::UNSUPP),
        (req::DISCARD, &[(0, 8, 2)], status::UNSUPP),
        (req::WRITE_ZEROES, &[(0, 8, 0x8000_0000)], status::UNSUPP),
        // Past the end, overflowing, too long.
        (req::DISCARD, &[(SECTORS - 4, 8, 0)], status::IOERR),
        (req::WRITE_ZEROES, &[(SECTORS, 1, 0)], status::IOERR),
        (req::DISCARD, &[(u64::MAX, 1, 0)], status::IOERR),
        (req::WRITE_ZEROES, &[(u64::MAX - 3, u32::MAX, 0)], status::IOERR),
        (req::DISCARD, &[(0, MAX_DISCARD_SECTORS + 1, 0)], status::IOERR),
        // A bad segment after a good one: nothing is applied.
        (req::DISCARD, &[(0, 8, 0), (SECTORS, 8, 0)], status::IOERR),
    ];
    for (i, &(kind, segs, want)) in cases.iter().enumerate() {
        let n = segments(&d, segs);
        assert_eq!(request(&mut d, kind, 0, n, 0).0, want, "case {i}");
    }
    // Too many segments; a length that is not whole segments; no segment;
    // a device-writable segment buffer.
    let many: Vec<(u64, u32, u32)> = (0..=u64::from(MAX_DISCARD_SEG)).map(|i| (i * 8, 8, 0)).collect();
    let n = segments(&d, &many);
    assert_eq!(request(&mut d, req::DISCARD, 0, n, 0).0, status::IOERR);
    segments(&d, &[(0, 8, 0)]);
    assert_eq!(request(&mut d, req::DISCARD, 0, 15, 0).0, status::IOERR);
    assert_eq!(request(&mut d, req::DISCARD, 0, 0, 0).0, status::IOERR);
    assert_eq!(request(&mut d, req::DISCARD, 0, 16, WRITE).0, status::IOERR);
    // Nothing above changed the disk: sector 0 still reads from the base.
    assert_eq!(request(&mut d, req::IN, 0, 512, WRITE).0, status::OK);
    assert_ne!(d.read_bytes(DATA, 512), vec![0; 512]);
    assert!(!d.needs_reset());
}

#[test]
fn a_read_only_disk_offers_no_discard_and_refuses_it() {
    let (_f, mut d) = disk(true);
    let n = segments(&d, &[(0, 8, 0)]);
    assert_eq!(request(&mut d, req::DISCARD, 0, n, 0).0, status::IOERR);
    assert_eq!(request(&mut d, req::WRITE_ZEROES, 0, n, 0).0, status::IOERR);
}
