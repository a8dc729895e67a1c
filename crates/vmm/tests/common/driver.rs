//! A virtio driver written for the tests: it programs a device's
//! virtio-mmio registers like the Linux driver does and writes descriptor
//! tables and rings into guest memory by hand, so tests can hand a device
//! anything a hostile guest could (virtio 1.2, sections 2.7 and 4.2).

#![allow(dead_code)]

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::devices::virtio::mmio::{reg, status, MmioTransport, TransportArgs};
use vmm::devices::virtio::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use vmm::devices::Persist;
use vmm_sys_util::eventfd::EventFd;

/// VIRTQ_DESC_F_NEXT.
pub const NEXT: u16 = 1;
/// VIRTQ_DESC_F_WRITE.
pub const WRITE: u16 = 2;
/// VIRTQ_DESC_F_INDIRECT.
pub const INDIRECT: u16 = 4;

/// Guest memory size of the harness (bytes).
pub const MEM_SIZE: usize = 16 << 20;
/// Where the harness's queues live.
pub const QUEUE_BASE: u64 = 0x1000;
/// Stride between queues' areas.
const QUEUE_STRIDE: u64 = 0x4000;
/// First GPA free for data buffers.
pub const DATA_BASE: u64 = 0x10_0000;

/// One queue as the driver sees it.
pub struct DriverQueue {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub avail_idx: u16,
    pub used_seen: u16,
}

pub struct Driver {
    pub mem: GuestMemoryMmap,
    pub transport: MmioTransport,
    pub irq: EventFd,
    pub queues: Vec<DriverQueue>,
}

impl Driver {
    /// Wraps `device` in a transport over fresh guest memory, negotiates
    /// `features` (VERSION_1 always) and sets up every queue with `size`
    /// entries, then sets DRIVER_OK.
    pub fn new(device: Box<dyn VirtioDevice>, features: u64, size: u16) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
        let nq = device.queue_max_sizes().len();
        let transport = MmioTransport::new(device, mem.clone(), interrupt).unwrap();
        let mut d = Driver { mem, transport, irq, queues: Vec::new() };
        d.init(nq, features, size);
        d
    }

    /// Resets the device and sets it up again (section 3.1.1).
    pub fn init(&mut self, nq: usize, features: u64, size: u16) {
        let d = self;
        d.queues.clear();
        // Fresh rings: zero the queue areas.
        d.write_bytes(QUEUE_BASE, &vec![0u8; nq * QUEUE_STRIDE as usize]);
        d.w(reg::STATUS, 0);
        d.w(reg::STATUS, status::ACKNOWLEDGE);
        d.w(reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        let want = features | VIRTIO_F_VERSION_1;
        d.w(reg::DRIVER_FEATURES_SEL, 0);
        d.w(reg::DRIVER_FEATURES, want as u32);
        d.w(reg::DRIVER_FEATURES_SEL, 1);
        d.w(reg::DRIVER_FEATURES, (want >> 32) as u32);
        d.w(reg::STATUS, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK);
        assert_ne!(d.r(reg::STATUS) & status::FEATURES_OK, 0, "device refused features {want:#x}");
        for q in 0..nq {
            let base = QUEUE_BASE + q as u64 * QUEUE_STRIDE;
            let dq =
                DriverQueue { size, desc: base, avail: base + 0x1000, used: base + 0x2000, avail_idx: 0, used_seen: 0 };
            d.w(reg::QUEUE_SEL, q as u32);
            assert!(d.r(reg::QUEUE_NUM_MAX) >= u32::from(size));
            d.w(reg::QUEUE_NUM, u32::from(size));
            d.w(reg::QUEUE_DESC_LOW, dq.desc as u32);
            d.w(reg::QUEUE_DESC_HIGH, 0);
            d.w(reg::QUEUE_DRIVER_LOW, dq.avail as u32);
            d.w(reg::QUEUE_DRIVER_HIGH, 0);
            d.w(reg::QUEUE_DEVICE_LOW, dq.used as u32);
            d.w(reg::QUEUE_DEVICE_HIGH, 0);
            d.w(reg::QUEUE_READY, 1);
            d.queues.push(dq);
        }
        d.w(reg::STATUS, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert!(d.transport.is_active(), "device did not activate");
    }

    /// Saves the transport's state and replaces it with `device` restored
    /// from that state, on the same guest memory and interrupt line.
    pub fn save_and_restore(&mut self, device: Box<dyn VirtioDevice>) {
        let state = self.transport.save();
        let interrupt = Arc::new(Interrupt::new(self.irq.try_clone().unwrap()));
        self.transport =
            MmioTransport::restore(TransportArgs { device, mem: self.mem.clone(), interrupt }, &state).unwrap();
    }

    pub fn w(&mut self, offset: u64, v: u32) {
        self.transport.write(offset, &v.to_le_bytes());
    }

    pub fn r(&mut self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.transport.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    /// Writes descriptor `index` of queue `q`.
    pub fn set_desc(&self, q: usize, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let base = self.queues[q].desc + u64::from(index) * 16;
        self.mem.write_obj(addr, GuestAddress(base)).unwrap();
        self.mem.write_obj(len, GuestAddress(base + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(base + 12)).unwrap();
        self.mem.write_obj(next, GuestAddress(base + 14)).unwrap();
    }

    /// Writes a chain of `(addr, len, flags)` at descriptors `first..`,
    /// linking them with NEXT, and makes it available. Returns the head.
    pub fn add_chain(&mut self, q: usize, first: u16, bufs: &[(u64, u32, u16)]) -> u16 {
        for (i, &(addr, len, flags)) in bufs.iter().enumerate() {
            let idx = first + i as u16;
            let more = i + 1 < bufs.len();
            self.set_desc(q, idx, addr, len, flags | if more { NEXT } else { 0 }, if more { idx + 1 } else { 0 });
        }
        self.publish(q, first);
        first
    }

    /// Puts `head` in the available ring and bumps its index.
    pub fn publish(&mut self, q: usize, head: u16) {
        let dq = &mut self.queues[q];
        let slot = dq.avail + 4 + u64::from(dq.avail_idx % dq.size) * 2;
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        dq.avail_idx = dq.avail_idx.wrapping_add(1);
        self.mem.write_obj(dq.avail_idx, GuestAddress(dq.avail + 2)).unwrap();
    }

    /// Sets the available index to any value (hostile).
    pub fn set_avail_idx(&mut self, q: usize, idx: u16) {
        self.queues[q].avail_idx = idx;
        self.mem.write_obj(idx, GuestAddress(self.queues[q].avail + 2)).unwrap();
    }

    /// Notifies queue `q` and lets the device process it, as the event
    /// loop does.
    pub fn kick(&mut self, q: usize) {
        self.transport.process_queue(q);
    }

    /// New used-ring entries `(id, len)` since the last call.
    pub fn used(&mut self, q: usize) -> Vec<(u32, u32)> {
        let dq = &mut self.queues[q];
        let idx: u16 = self.mem.read_obj(GuestAddress(dq.used + 2)).unwrap();
        let mut out = Vec::new();
        while dq.used_seen != idx {
            let e = dq.used + 4 + u64::from(dq.used_seen % dq.size) * 8;
            let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
            out.push((id, len));
            dq.used_seen = dq.used_seen.wrapping_add(1);
        }
        out
    }

    /// Whether the device set DEVICE_NEEDS_RESET.
    pub fn needs_reset(&mut self) -> bool {
        self.r(reg::STATUS) & status::DEVICE_NEEDS_RESET != 0
    }

    pub fn read_u8(&self, gpa: u64) -> u8 {
        self.mem.read_obj(GuestAddress(gpa)).unwrap()
    }

    pub fn write_bytes(&self, gpa: u64, b: &[u8]) {
        self.mem.write_slice(b, GuestAddress(gpa)).unwrap();
    }

    pub fn read_bytes(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_slice(&mut v, GuestAddress(gpa)).unwrap();
        v
    }
}
