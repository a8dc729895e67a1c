//! The virtio-mmio transport, virtio 1.2 section 4.2.2 (version 2, the
//! modern register layout). One [`MmioTransport`] per device, at its own
//! 4 KiB window of guest physical address space.
//!
//! Registers are 32 bits wide and must be accessed with aligned 32-bit
//! loads and stores; any other access to them is ignored (reads return
//! zero) and logged. The device config space starts at 0x100 and takes any
//! width.

use std::sync::Arc;

use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{Activation, Interrupt, VirtioDevice, VirtioError, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG};
use crate::devices::persist::Persist;
use crate::guest_warn;
use crate::log_limit::LogLimiter;

/// Size of each device's MMIO window (bytes).
pub const MMIO_WINDOW: u64 = 0x1000;
/// "virt" in little endian.
pub const MAGIC_VALUE: u32 = 0x7472_6976;
/// The modern virtio-mmio version.
pub const MMIO_VERSION: u32 = 2;
/// Vendor ID reported to the guest ("TINE").
pub const VENDOR_ID: u32 = 0x454e_4954;

/// Register offsets (section 4.2.2).
pub mod reg {
    #![allow(missing_docs)]
    pub const MAGIC_VALUE: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const SHM_LEN_LOW: u64 = 0x0b0;
    pub const SHM_LEN_HIGH: u64 = 0x0b4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Device status bits (section 2.1).
pub mod status {
    #![allow(missing_docs)]
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    pub const FAILED: u32 = 0x80;
}

/// The persisted state of a transport and its device's queues: what a
/// snapshot keeps so the device can go on where it was (virtqueue indices
/// included). Host-side resources (files, sockets) are the device's own.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportState {
    /// Device status register.
    pub status: u32,
    /// Features the driver accepted.
    pub driver_features: u64,
    /// DeviceFeaturesSel.
    pub device_features_select: u32,
    /// DriverFeaturesSel.
    pub driver_features_select: u32,
    /// QueueSel.
    pub queue_select: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
    /// Whether the device was activated (DRIVER_OK seen).
    pub activated: bool,
    /// Every queue: the live state of a running device, else the driver's
    /// configuration so far.
    #[serde(with = "saved_queues")]
    pub queues: Vec<QueueState>,
}

/// Serde for virtio-queue's `QueueState` (which has no serde support):
/// the same fields, by name, through serde's remote derive.
mod saved_queues {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use virtio_queue::QueueState;

    #[derive(Serialize, Deserialize)]
    #[serde(remote = "QueueState", deny_unknown_fields)]
    struct Saved {
        max_size: u16,
        next_avail: u16,
        next_used: u16,
        event_idx_enabled: bool,
        size: u16,
        ready: bool,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    }

    #[derive(Serialize)]
    struct Out<'a>(#[serde(with = "Saved")] &'a QueueState);

    #[derive(Deserialize)]
    struct In(#[serde(with = "Saved")] QueueState);

    pub fn serialize<S: Serializer>(queues: &[QueueState], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(queues.iter().map(Out))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<QueueState>, D::Error> {
        Ok(Vec::<In>::deserialize(d)?.into_iter().map(|q| q.0).collect())
    }
}

/// Errors of restoring a transport.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The state does not fit the device (queue count or sizes).
    #[error("saved state does not fit {device}: {reason}")]
    Mismatch {
        /// The device's name.
        device: &'static str,
        /// What does not fit.
        reason: String,
    },
    /// Re-creating the device's queues or eventfds failed.
    #[error(transparent)]
    Virtio(#[from] VirtioError),
}

/// What restoring a transport needs besides its [`TransportState`]: the
/// device (opened anew, host resources included), guest memory (with the
/// same contents as at the save) and the device's interrupt line.
pub struct TransportArgs {
    /// The device behind the transport.
    pub device: Box<dyn VirtioDevice>,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt line.
    pub interrupt: Arc<Interrupt>,
}

impl Persist<'_> for MmioTransport {
    type State = TransportState;
    type ConstructorArgs = TransportArgs;
    type Error = RestoreError;

    /// The transport's persisted state (see [`TransportState`]); the
    /// queues of a running device are the device's live ones
    /// ([`VirtioDevice::queue_states`]).
    fn save(&self) -> TransportState {
        let queues = match (self.activated, self.device.queue_states()) {
            (true, Some(live)) => live,
            _ => self.queues.iter().map(|q| q.state()).collect(),
        };
        TransportState {
            status: self.status,
            driver_features: self.driver_features,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            queue_select: self.queue_select,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            activated: self.activated,
            queues,
        }
    }

    /// Rebuilds a transport for `args.device` from `state` (same guest
    /// memory contents as when it was saved). An activated device is
    /// activated again on the saved queues (indices included), told it was
    /// restored ([`VirtioDevice::after_restore`]), and every queue is marked
    /// notified.
    ///
    /// Errors: [`RestoreError`].
    fn restore(args: TransportArgs, state: &TransportState) -> Result<Self, RestoreError> {
        let TransportArgs { device, mem, interrupt } = args;
        let name = device.name();
        let sizes = device.queue_max_sizes().to_vec();
        if sizes.len() != state.queues.len() || sizes.iter().zip(&state.queues).any(|(m, q)| *m != q.max_size) {
            return Err(RestoreError::Mismatch {
                device: name,
                reason: format!(
                    "queues {sizes:?} vs saved {:?}",
                    state.queues.iter().map(|q| q.max_size).collect::<Vec<_>>()
                ),
            });
        }
        let mut t = MmioTransport::new(device, mem, interrupt)?;
        let mut queues = Vec::with_capacity(state.queues.len());
        for (i, qs) in state.queues.iter().enumerate() {
            queues.push(
                Queue::try_from(*qs)
                    .map_err(|e| RestoreError::Mismatch { device: name, reason: format!("queue {i}: {e}") })?,
            );
        }
        t.queues = queues;
        t.status = state.status;
        t.driver_features = state.driver_features;
        t.device_features_select = state.device_features_select;
        t.driver_features_select = state.driver_features_select;
        t.queue_select = state.queue_select;
        t.config_generation = state.config_generation;
        if state.interrupt_status != 0 {
            t.interrupt.trigger(state.interrupt_status);
        }
        if state.activated && state.status & status::DEVICE_NEEDS_RESET == 0 {
            t.activate();
            t.after_restore();
            // Notifications the driver sent to the old eventfds just before
            // the save were never seen, and with EVENT_IDX it will not send
            // them again: have every queue processed once, and have the
            // driver look at its used rings.
            for evt in &t.queue_evts {
                let _ = evt.write(1);
            }
            t.interrupt.trigger(super::VIRTIO_MMIO_INT_VRING);
        }
        Ok(t)
    }
}

/// A virtio device and its transport state.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    status: u32,
    config_generation: u32,
    activated: bool,
    /// Guest-triggered log lines (shared per VM).
    log: Arc<LogLimiter>,
}

impl MmioTransport {
    /// The disk of the device behind this transport, if it is a block
    /// device ([`VirtioDevice::disk`]); holding the transport's lock keeps
    /// every request out meanwhile.
    pub fn disk(&mut self) -> Option<&mut dyn tine_storage::Disk> {
        self.device.disk()
    }

    /// Puts `disk` in the device slot behind this transport and returns
    /// the disk it held ([`VirtioDevice::swap_disk`]); then bumps
    /// ConfigGeneration and, when the driver runs the device, raises a
    /// configuration change interrupt (virtio 1.2 sections 4.2.2.1 and
    /// 2.5.1), on which it reads the new capacity.
    ///
    /// Errors: those of [`VirtioDevice::swap_disk`] (nothing changed).
    pub fn swap_disk(
        &mut self,
        disk: Box<dyn tine_storage::Disk>,
        path: &std::path::Path,
    ) -> Result<Box<dyn tine_storage::Disk>, super::block::BlockError> {
        let old = self.device.swap_disk(disk, path)?;
        self.config_generation = self.config_generation.wrapping_add(1);
        if self.activated {
            self.interrupt.trigger(VIRTIO_MMIO_INT_CONFIG);
        }
        Ok(old)
    }

    /// Wraps `device`; `interrupt` is its line. Creates one notification
    /// eventfd per queue (see [`MmioTransport::queue_evts`]).
    ///
    /// Errors: [`VirtioError::Io`] if an eventfd cannot be created.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<Self, VirtioError> {
        let name = device.name();
        let mut queues = Vec::new();
        let mut queue_evts = Vec::new();
        for &max in device.queue_max_sizes() {
            queues.push(
                Queue::new(max)
                    .map_err(|e| VirtioError::Activate { device: name, reason: format!("queue size {max}: {e}") })?,
            );
            queue_evts
                .push(EventFd::new(libc::EFD_NONBLOCK).map_err(|source| VirtioError::Io { device: name, source })?);
        }
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            queue_evts,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            activated: false,
            log: Arc::new(LogLimiter::default()),
        })
    }

    /// Raises the device's interrupt again if the driver has anything to
    /// look at (an activated device, or status bits set). For a restored
    /// VM once its interrupt controllers and LAPICs hold their saved state:
    /// an interrupt raised before (as [`MmioTransport::restore`] does) can
    /// be lost when `KVM_SET_IRQCHIP` or `KVM_SET_LAPIC` overwrite the
    /// state it reached. A spurious interrupt is harmless: the driver reads
    /// InterruptStatus and its used rings.
    pub fn reassert_interrupt(&self) {
        let mut bits = self.interrupt.status();
        if self.activated {
            bits |= super::VIRTIO_MMIO_INT_VRING;
        }
        if bits != 0 {
            self.interrupt.trigger(bits);
        }
    }

    /// Shares the VM's limiter of guest-triggered log lines with the
    /// transport and its device.
    pub fn set_log_limiter(&mut self, log: Arc<LogLimiter>) {
        self.device.set_log_limiter(log.clone());
        self.log = log;
    }

    /// The per-queue notification eventfds, to register as KVM ioeventfds
    /// on QueueNotify (datamatch = queue index) and to poll.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device's interrupt.
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// The device's name.
    pub fn name(&self) -> &'static str {
        self.device.name()
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the device is running (DRIVER_OK and not broken).
    pub fn is_active(&self) -> bool {
        self.activated && self.status & status::DEVICE_NEEDS_RESET == 0
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    fn queues_configurable(&self) -> bool {
        self.status & status::FEATURES_OK != 0 && self.status & status::DRIVER_OK == 0
    }

    /// Marks the device broken: DEVICE_NEEDS_RESET and a config interrupt
    /// (section 2.1.2); it processes nothing until the driver resets it.
    /// A running device is reset at once ([`VirtioDevice::reset`]), so its
    /// host side lets go too (vsock closes its host connections: their
    /// clients see EOF instead of waiting on a device that will not move).
    pub fn mark_broken(&mut self, err: &VirtioError) {
        guest_warn!(self.log, "{err}");
        self.status |= status::DEVICE_NEEDS_RESET;
        if self.activated {
            self.device.reset();
        }
        self.interrupt.trigger(VIRTIO_MMIO_INT_CONFIG);
    }

    /// Processes queue `index` after a notification, if the device runs.
    pub fn process_queue(&mut self, index: usize) {
        if !self.is_active() {
            return;
        }
        if let Err(e) = self.device.process_queue(index) {
            self.mark_broken(&e);
        }
    }

    /// The device's host-side fd, if it has one (see [`VirtioDevice::epoll_fd`]).
    pub fn epoll_fd(&self) -> Option<std::os::fd::RawFd> {
        self.device.epoll_fd()
    }

    /// Runs the device's host-side work, if the device runs.
    pub fn process_events(&mut self) {
        if !self.is_active() {
            return;
        }
        if let Err(e) = self.device.process_events() {
            self.mark_broken(&e);
        }
    }

    /// Tells the device the VM was restored (see [`VirtioDevice::after_restore`]).
    pub fn after_restore(&mut self) {
        if !self.is_active() {
            return;
        }
        if let Err(e) = self.device.after_restore() {
            self.mark_broken(&e);
        }
    }

    fn reset(&mut self) {
        if self.activated {
            self.device.reset();
        }
        self.activated = false;
        self.status = 0;
        self.queue_select = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.driver_features = 0;
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt.reset();
    }

    fn set_status(&mut self, value: u32) {
        use status::*;
        if value == 0 {
            self.reset();
            return;
        }
        // The driver only adds bits (section 3.1.1); refuse anything else.
        if value & self.status != self.status {
            guest_warn!(
                self.log,
                "{}: driver cleared status bits ({:#x} -> {value:#x}); ignored",
                self.name(),
                self.status
            );
            return;
        }
        let new = value & !self.status;
        if new & FEATURES_OK != 0 {
            let avail = self.device.avail_features();
            if self.driver_features & !avail != 0 || self.driver_features & VIRTIO_F_VERSION_1 == 0 {
                guest_warn!(
                    self.log,
                    "{}: driver accepted features {:#x} of {avail:#x} (VERSION_1 is required); FEATURES_OK refused",
                    self.name(),
                    self.driver_features
                );
                self.status = value & !FEATURES_OK;
                return;
            }
        }
        if new & DRIVER_OK != 0 {
            if value & FEATURES_OK == 0 {
                guest_warn!(self.log, "{}: DRIVER_OK before FEATURES_OK; ignored", self.name());
                return;
            }
            self.status = value;
            self.activate();
            return;
        }
        self.status = value;
    }

    fn activate(&mut self) {
        let name = self.name();
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                let err =
                    VirtioError::Activate { device: name, reason: format!("queue {i} is not inside guest memory") };
                self.mark_broken(&err);
                return;
            }
        }
        let event_idx = self.driver_features & super::VIRTIO_RING_F_EVENT_IDX != 0;
        let mut queues = Vec::with_capacity(self.queues.len());
        for (i, q) in self.queues.iter().enumerate() {
            match Queue::try_from(q.state()) {
                Ok(mut q) => {
                    q.set_event_idx(event_idx);
                    queues.push(q);
                }
                Err(e) => {
                    let err = VirtioError::Activate { device: name, reason: format!("queue {i}: {e}") };
                    self.mark_broken(&err);
                    return;
                }
            }
        }
        let activation = Activation { mem: self.mem.clone(), queues, acked_features: self.driver_features };
        match self.device.activate(activation, self.interrupt.clone()) {
            Ok(()) => {
                self.activated = true;
                // Wake the event loop so that it waits on the device's
                // host-side fd from now on (see crate::event_loop); the
                // extra queue processing is harmless.
                if let Some(evt) = self.queue_evts.first() {
                    let _ = evt.write(1);
                }
            }
            Err(e) => self.mark_broken(&e),
        }
    }

    /// Handles a guest read of `data.len()` bytes at `offset` in the window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.device.read_config(offset - reg::CONFIG, data);
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            guest_warn!(self.log, "{}: {}-byte read at register offset {offset:#x} ignored", self.name(), data.len());
            data.fill(0);
            return;
        }
        let v: u32 = match offset {
            reg::MAGIC_VALUE => MAGIC_VALUE,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_select {
                0 => self.device.avail_features() as u32,
                1 => (self.device.avail_features() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt.status(),
            reg::STATUS => self.status,
            // No shared memory regions: length -1 (section 4.2.2).
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH => u32::MAX,
            reg::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        };
        tracing::trace!("{}: read {offset:#x} -> {v:#x}", self.name());
        data.copy_from_slice(&v.to_le_bytes());
    }

    /// Handles a guest write of `data` at `offset` in the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            if self.status & status::DRIVER != 0 {
                self.device.write_config(offset - reg::CONFIG, data);
                self.config_generation = self.config_generation.wrapping_add(1);
            }
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            guest_warn!(self.log, "{}: {}-byte write at register offset {offset:#x} ignored", self.name(), data.len());
            return;
        }
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        tracing::trace!("{}: write {offset:#x} <- {v:#x}", self.name());
        let configurable = self.queues_configurable();
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_select = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_select = v,
            reg::DRIVER_FEATURES => {
                if self.status & status::DRIVER != 0 && self.status & status::FEATURES_OK == 0 {
                    match self.driver_features_select {
                        0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v),
                        1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32),
                        _ => {}
                    }
                }
            }
            reg::QUEUE_SEL => self.queue_select = v,
            reg::QUEUE_NUM if configurable => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(v as u16);
                }
            }
            reg::QUEUE_READY if configurable => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(v == 1);
                }
            }
            reg::QUEUE_DESC_LOW
            | reg::QUEUE_DESC_HIGH
            | reg::QUEUE_DRIVER_LOW
            | reg::QUEUE_DRIVER_HIGH
            | reg::QUEUE_DEVICE_LOW
            | reg::QUEUE_DEVICE_HIGH
                if configurable =>
            {
                if let Some(q) = self.selected_queue() {
                    let (lo, hi) = if offset.is_multiple_of(8) { (Some(v), None) } else { (None, Some(v)) };
                    match offset & !7 {
                        reg::QUEUE_DESC_LOW => q.set_desc_table_address(lo, hi),
                        reg::QUEUE_DRIVER_LOW => q.set_avail_ring_address(lo, hi),
                        _ => q.set_used_ring_address(lo, hi),
                    }
                }
            }
            reg::QUEUE_NOTIFY => {
                // Normally KVM's ioeventfd catches this write; without one,
                // forward it the same way.
                tracing::trace!("{}: QueueNotify {v} by MMIO exit (no ioeventfd)", self.name());
                if let Some(evt) = self.queue_evts.get(v as usize) {
                    let _ = evt.write(1);
                }
            }
            reg::INTERRUPT_ACK => self.interrupt.ack(v),
            reg::STATUS => self.set_status(v),
            _ => tracing::debug!("{}: write of {v:#x} to register {offset:#x} ignored", self.name()),
        }
    }
}
