//! virtio devices over the virtio-mmio transport (virtio 1.2, section
//! 4.2; modern interface only).
//!
//! Every device has the same shape: a type implementing [`VirtioDevice`]
//! (its features, config space, activation and queue processing), wrapped
//! in an [`mmio::MmioTransport`] that the vCPUs drive through MMIO exits.
//! Queue notifications arrive on ioeventfds that KVM signals without
//! leaving the kernel; the [`crate::event_loop`] thread drains them and
//! calls [`VirtioDevice::process_queue`]. Interrupts go out through
//! [`Interrupt`], an irqfd.

pub mod block;
pub mod chain;
pub mod mmio;
pub mod net;
pub mod vsock;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// `VIRTIO_F_VERSION_1` (bit 32): the modern interface, required.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// `VIRTIO_RING_F_EVENT_IDX` (bit 29): interrupt and notification suppression.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// Interrupt status bit: a used buffer was added (section 4.2.2).
pub const VIRTIO_MMIO_INT_VRING: u32 = 1;
/// Interrupt status bit: the configuration changed (or the device needs a reset).
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 2;

/// Errors of virtio devices.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// The driver broke the protocol; the device stops until reset.
    #[error("virtio device {device}: {reason}; the device is marked broken until the driver resets it")]
    Broken {
        /// The device's name.
        device: &'static str,
        /// What the driver did.
        reason: String,
    },
    /// Activation failed (bad queue set-up).
    #[error("virtio device {device} cannot be activated: {reason}")]
    Activate {
        /// The device's name.
        device: &'static str,
        /// Why.
        reason: String,
    },
    /// A host resource failed (eventfd, file).
    #[error("virtio device {device}: {source}")]
    Io {
        /// The device's name.
        device: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A device's interrupt line: the interrupt status register's bits and
/// the irqfd that raises the line (edge, through KVM's IOAPIC).
pub struct Interrupt {
    irqfd: EventFd,
    status: AtomicU32,
}

impl Interrupt {
    /// An interrupt that signals `irqfd`.
    pub fn new(irqfd: EventFd) -> Self {
        Interrupt { irqfd, status: AtomicU32::new(0) }
    }

    /// Sets `bits` in the status register and raises the line.
    pub fn trigger(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("cannot signal a virtio irqfd: {e}");
        }
    }

    /// The InterruptStatus register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// InterruptACK: clears `bits`.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Clears every bit (device reset).
    pub fn reset(&self) {
        self.status.store(0, Ordering::SeqCst);
    }
}

/// What a device gets when the driver sets DRIVER_OK.
pub struct Activation {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The queues as the driver configured them (index = queue index).
    pub queues: Vec<Queue>,
    /// Features the driver accepted.
    pub acked_features: u64,
}

/// A virtio device behind an MMIO transport.
pub trait VirtioDevice: Send {
    /// Short name for logs ("virtio-blk").
    fn name(&self) -> &'static str;
    /// The virtio device ID (section 5).
    fn device_type(&self) -> u32;
    /// The maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// The features the device offers, [`VIRTIO_F_VERSION_1`] included.
    fn avail_features(&self) -> u64;
    /// Reads the device config space at `offset` (bytes past 0x100).
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device config space; read-only fields ignore writes.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts the device with the driver's queues.
    ///
    /// Errors: [`VirtioError::Activate`].
    fn activate(&mut self, activation: Activation, interrupt: std::sync::Arc<Interrupt>) -> Result<(), VirtioError>;
    /// Returns the device to its pre-activation state (drops the queues).
    fn reset(&mut self);
    /// Processes the available buffers of queue `index` after a notification.
    ///
    /// Errors: [`VirtioError::Broken`] when the driver broke the protocol.
    fn process_queue(&mut self, index: usize) -> Result<(), VirtioError>;
    /// An fd the event loop should wait on for host-side work (readable
    /// when [`VirtioDevice::process_events`] has something to do).
    fn epoll_fd(&self) -> Option<RawFd> {
        None
    }
    /// Handles host-side work signalled on [`VirtioDevice::epoll_fd`].
    ///
    /// Errors: [`VirtioError::Broken`] when the driver broke the protocol.
    fn process_events(&mut self) -> Result<(), VirtioError> {
        Ok(())
    }
    /// The live state of the queues of a running device (`None` before
    /// activation), for [`mmio::TransportState`].
    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>>;
    /// Shares the VM's limiter of guest-triggered log lines with the
    /// device (see [`crate::log_limit`]); a device starts with one of its own.
    fn set_log_limiter(&mut self, _log: std::sync::Arc<crate::log_limit::LogLimiter>) {}
    /// The disk behind a block device (`None` for other devices), to flush
    /// or checkpoint it while its transport is locked.
    fn disk(&mut self) -> Option<&mut dyn tine_storage::Disk> {
        None
    }
    /// Puts `disk` (named `path` in errors) in this device slot and returns
    /// the disk it held ([`block::Block::swap_disk`]); the transport tells
    /// the guest.
    ///
    /// Errors: [`block::BlockError::NotASlot`] (every device but a block
    /// slot), and those of [`block::Block::swap_disk`].
    fn swap_disk(
        &mut self,
        disk: Box<dyn tine_storage::Disk>,
        path: &std::path::Path,
    ) -> Result<Box<dyn tine_storage::Disk>, block::BlockError> {
        let _ = (disk, path);
        Err(block::BlockError::NotASlot)
    }
    /// Called after the VM was restored from a snapshot: host-side state
    /// did not survive (vsock resets its transport).
    ///
    /// Errors: [`VirtioError::Broken`] when the driver broke the protocol.
    fn after_restore(&mut self) -> Result<(), VirtioError> {
        Ok(())
    }
}

/// Drains queue `queue`: hands every available descriptor chain to
/// `handle`, which returns the number of bytes it wrote into the chain's
/// buffers, and puts the chain in the used ring with that length. Keeps
/// driver notifications off while draining and publishes `avail_event`
/// when done (required with `VIRTIO_RING_F_EVENT_IDX`, section 2.7.10),
/// re-checking for buffers that raced with it. Raises `interrupt` if the
/// driver wants one.
///
/// Errors: [`VirtioError::Broken`] if the rings are corrupt (an available
/// index more than a queue ahead, a ring outside guest memory).
pub fn drain_queue<F>(
    device: &'static str,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    interrupt: &Interrupt,
    handle: F,
) -> Result<(), VirtioError>
where
    F: FnMut(DescriptorChain<&GuestMemoryMmap>) -> u32,
{
    drain_queue_while(device, queue, mem, interrupt, || true, handle)
}

/// [`drain_queue`], taking chains only while `more()` says so.
pub fn drain_queue_while<W, F>(
    device: &'static str,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    interrupt: &Interrupt,
    mut more: W,
    mut handle: F,
) -> Result<(), VirtioError>
where
    W: FnMut() -> bool,
    F: FnMut(DescriptorChain<&GuestMemoryMmap>) -> u32,
{
    let broken = |reason: String| VirtioError::Broken { device, reason };
    let mut used_any = false;
    while more() {
        queue.disable_notification(mem).map_err(|e| broken(format!("available ring: {e}")))?;
        while more() {
            let mut iter = queue.iter(mem).map_err(|e| broken(format!("available ring: {e}")))?;
            let Some(chain) = iter.next() else { break };
            let head = chain.head_index();
            let len = handle(chain);
            queue.add_used(mem, head, len).map_err(|e| broken(format!("used ring: {e}")))?;
            used_any = true;
        }
        if !queue.enable_notification(mem).map_err(|e| broken(format!("available ring: {e}")))? {
            break;
        }
    }
    if used_any && queue.needs_notification(mem).map_err(|e| broken(format!("used event: {e}")))? {
        interrupt.trigger(VIRTIO_MMIO_INT_VRING);
    }
    Ok(())
}

/// Reads `data.len()` bytes at `offset` of a config space held in `config`
/// (out-of-range bytes read as zero).
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o))
            .copied()
            .unwrap_or(0);
    }
}
