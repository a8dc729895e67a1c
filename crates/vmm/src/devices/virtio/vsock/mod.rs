//! virtio-vsock (virtio 1.2, section 5.10) in user space: the guest gets a
//! context ID (CID); the host end is the [`muxer::Muxer`]'s Unix sockets.
//!
//! Queues: 0 RX (host to guest), 1 TX (guest to host), 2 event. Packets
//! with bad lengths, unknown types or foreign CIDs are dropped with a log
//! line or answered with RST; a corrupt ring marks the device broken.

pub mod muxer;
pub mod packet;

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::chain::{parse_chain, Segment};
use super::{
    Activation, Interrupt, VirtioDevice, VirtioError, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING,
    VIRTIO_RING_F_EVENT_IDX,
};
use crate::devices::persist::Persist;
use crate::guest_warn;
use crate::log_limit::LogLimiter;
use muxer::{Muxer, MuxerError};
use packet::{Header, HDR_LEN, MAX_PAYLOAD};

/// virtio device ID of a socket device.
pub const VIRTIO_ID_VSOCK: u32 = 19;
/// Queue size offered.
pub const QUEUE_SIZE: u16 = 256;
/// Most descriptors in one packet.
pub const MAX_SEGMENTS: usize = 64;
/// Event: the transport was reset; the guest drops its connections
/// (section 5.10.6.7). Sent after a snapshot restore.
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;
/// Lowest CID a guest may have (0-2 are reserved).
pub const MIN_GUEST_CID: u64 = 3;

const RXQ: usize = 0;
const TXQ: usize = 1;
const EVQ: usize = 2;
/// Longest wait for a guest to acknowledge `TRANSPORT_RESET` before held
/// host connections go ahead anyway.
const RESET_ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A virtio-vsock device.
pub struct Vsock {
    cid: u64,
    config: [u8; 8],
    queue_sizes: [u16; 3],
    muxer: Muxer,
    running: Option<Running>,
    buf: Vec<u8>,
    pending_reset_event: bool,
    /// After a reset event was delivered: the event queue's available
    /// index then, and when (see `check_reset_ack`).
    reset_ack: Option<(std::num::Wrapping<u16>, std::time::Instant)>,
    /// Guest-triggered log lines (shared per VM).
    log: Arc<LogLimiter>,
}

struct Running {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    interrupt: Arc<Interrupt>,
}

/// Copies `out.len()` bytes starting `skip` bytes into the chain's
/// readable segments; returns how many were available.
fn gather(mem: &GuestMemoryMmap, segs: &[Segment], mut skip: usize, out: &mut [u8]) -> usize {
    let mut done = 0;
    for s in segs.iter().filter(|s| !s.writable) {
        let len = s.len as usize;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(out.len() - done);
        if mem.read_slice(&mut out[done..done + n], GuestAddress(s.addr.0 + skip as u64)).is_err() {
            return done;
        }
        done += n;
        skip = 0;
        if done == out.len() {
            break;
        }
    }
    done
}

/// Writes `data` across the chain's writable segments from byte `skip`;
/// returns how many bytes fit.
fn scatter(mem: &GuestMemoryMmap, segs: &[Segment], mut skip: usize, data: &[u8]) -> usize {
    let mut done = 0;
    for s in segs.iter().filter(|s| s.writable) {
        let len = s.len as usize;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(data.len() - done);
        if mem.write_slice(&data[done..done + n], GuestAddress(s.addr.0 + skip as u64)).is_err() {
            return done;
        }
        done += n;
        skip = 0;
        if done == data.len() {
            break;
        }
    }
    done
}

impl Vsock {
    /// A device for a guest with context ID `cid` whose host end listens on
    /// `uds_path`.
    ///
    /// Errors: [`MuxerError`].
    pub fn new(cid: u64, uds_path: &Path) -> Result<Self, MuxerError> {
        Ok(Vsock {
            cid,
            config: cid.to_le_bytes(),
            queue_sizes: [QUEUE_SIZE; 3],
            muxer: Muxer::new(uds_path, cid)?,
            running: None,
            buf: vec![0; MAX_PAYLOAD as usize],
            pending_reset_event: false,
            reset_ack: None,
            log: Arc::new(LogLimiter::default()),
        })
    }

    /// The guest's context ID.
    pub fn cid(&self) -> u64 {
        self.cid
    }
}

/// The persisted state of a virtio-vsock device: empty. Its virtqueues
/// are saved by its transport ([`super::mmio::TransportState`], through
/// [`VirtioDevice::queue_states`]); its connections are host sockets,
/// which do not survive a restore: a restored device drops them and
/// tells the guest with `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`
/// ([`VirtioDevice::after_restore`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockState {}

/// What restoring a virtio-vsock device needs: the arguments of [`Vsock::new`].
pub struct VsockArgs<'a> {
    /// The guest's context ID.
    pub cid: u64,
    /// Where the host end listens.
    pub uds_path: &'a Path,
}

impl<'a> Persist<'a> for Vsock {
    type State = VsockState;
    type ConstructorArgs = VsockArgs<'a>;
    type Error = MuxerError;

    fn save(&self) -> VsockState {
        VsockState {}
    }

    /// A new device listening on `args.uds_path` ([`Vsock::new`]); the
    /// transport's restore then activates it on the saved virtqueues and
    /// resets its transport.
    ///
    /// Errors: [`MuxerError`].
    fn restore(args: VsockArgs<'a>, _state: &VsockState) -> Result<Self, MuxerError> {
        Vsock::new(args.cid, args.uds_path)
    }
}

impl Vsock {
    /// Drops every connection and tells the guest with
    /// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` (on its event queue, now or as
    /// soon as it has a buffer there). Used after a snapshot restore.
    pub fn transport_reset(&mut self) -> Result<(), VirtioError> {
        self.muxer.reset_all();
        // New host connections wait until the guest has handled the event
        // (it resets every connection it has when it does).
        self.muxer.hold_host_connections();
        self.reset_ack = None;
        self.pending_reset_event = true;
        self.deliver_event()
    }

    /// Releases held host connections once the guest has handled the
    /// reset event: Linux refills the event queue right after handling an
    /// event, so its available index moving past the one seen at delivery
    /// is the acknowledgement. A guest that never acknowledges gets them
    /// after [`RESET_ACK_TIMEOUT`].
    fn check_reset_ack(&mut self) {
        let Some((seen, since)) = self.reset_ack else { return };
        let Some(Running { mem, queues, .. }) = self.running.as_ref() else { return };
        let now = queues[EVQ].avail_idx(mem, std::sync::atomic::Ordering::Acquire).ok();
        let acked = now.is_some_and(|n| n != seen);
        if acked || since.elapsed() >= RESET_ACK_TIMEOUT {
            if acked {
                tracing::debug!("virtio-vsock: the guest handled the transport reset after {:?}", since.elapsed());
            } else {
                guest_warn!(self.log, "virtio-vsock: the guest did not acknowledge the transport reset in {RESET_ACK_TIMEOUT:?}; releasing host connections");
            }
            self.reset_ack = None;
            self.muxer.release_host_connections();
        }
    }

    fn deliver_event(&mut self) -> Result<(), VirtioError> {
        let Some(Running { mem, queues, interrupt }) = self.running.as_mut() else { return Ok(()) };
        if !self.pending_reset_event {
            return Ok(());
        }
        let delivered = std::cell::Cell::new(false);
        let log = &self.log;
        super::drain_queue_while(
            "virtio-vsock",
            &mut queues[EVQ],
            mem,
            interrupt,
            || !delivered.get(),
            |chain| {
                let len = match parse_chain(mem, chain, MAX_SEGMENTS) {
                    Ok(p) => scatter(mem, &p.segments, 0, &VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le_bytes()),
                    Err(e) => {
                        guest_warn!(log, "virtio-vsock: event queue: {e}");
                        0
                    }
                };
                if len == 4 {
                    delivered.set(true);
                }
                len as u32
            },
        )?;
        if delivered.get() {
            self.pending_reset_event = false;
            let q = &queues[EVQ];
            let avail = q.avail_idx(mem, std::sync::atomic::Ordering::Acquire).unwrap_or_default();
            self.reset_ack = Some((avail, std::time::Instant::now()));
            // Ask for a notification when the guest adds a buffer beyond
            // the ones it has posted: it refills right after handling the
            // event. (`avail_event` follows the used ring, virtio 1.2
            // §2.7.10; with EVENT_IDX the driver consults it before
            // notifying, and it is behind by the buffers not consumed.)
            let avail_event = q.used_ring() + 4 + 8 * u64::from(q.size());
            let _ = mem.write_obj(avail.0, GuestAddress(avail_event));
        }
        Ok(())
    }

    fn process_tx(&mut self) -> Result<(), VirtioError> {
        let Some(Running { mem, queues, interrupt }) = self.running.as_mut() else { return Ok(()) };
        let mem = &*mem;
        let muxer = &mut self.muxer;
        let buf = &mut self.buf;
        let log = &self.log;
        super::drain_queue("virtio-vsock", &mut queues[TXQ], mem, interrupt, |chain| {
            let parsed = match parse_chain(mem, chain, MAX_SEGMENTS) {
                Ok(p) => p,
                Err(e) => {
                    guest_warn!(log, "virtio-vsock: TX {e}; packet dropped");
                    return 0;
                }
            };
            let mut raw = [0u8; HDR_LEN];
            if gather(mem, &parsed.segments, 0, &mut raw) != HDR_LEN {
                guest_warn!(log, "virtio-vsock: TX packet shorter than its header; dropped");
                return 0;
            }
            let hdr = Header::from_bytes(&raw);
            if hdr.len > MAX_PAYLOAD {
                guest_warn!(
                    log,
                    "virtio-vsock: TX packet claims {} bytes of payload (max {MAX_PAYLOAD}); dropped",
                    hdr.len
                );
                return 0;
            }
            let payload = &mut buf[..hdr.len as usize];
            if gather(mem, &parsed.segments, HDR_LEN, payload) != payload.len() {
                guest_warn!(
                    log,
                    "virtio-vsock: TX packet claims {} bytes of payload but carries fewer; dropped",
                    hdr.len
                );
                return 0;
            }
            muxer.from_guest(&hdr, payload);
            0
        })
    }

    fn process_rx(&mut self) -> Result<(), VirtioError> {
        let Some(Running { mem, queues, interrupt }) = self.running.as_mut() else { return Ok(()) };
        let mem = &*mem;
        let muxer = &mut self.muxer;
        let buf = &mut self.buf;
        let log = &self.log;
        let broken = |reason: String| VirtioError::Broken { device: "virtio-vsock", reason };
        let q = &mut queues[RXQ];
        let mut used_any = false;
        while muxer.has_rx() {
            let mut iter = q.iter(mem).map_err(|e| broken(format!("RX available ring: {e}")))?;
            let Some(chain) = iter.next() else {
                // No buffer: ask to be told when the guest adds one, and
                // re-check for one that raced in.
                if q.enable_notification(mem).map_err(|e| broken(format!("RX ring: {e}")))? {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            let used = match parse_chain(mem, chain, MAX_SEGMENTS) {
                Ok(p) => {
                    let room: usize = p.segments.iter().filter(|s| s.writable).map(|s| s.len as usize).sum();
                    if room < HDR_LEN {
                        guest_warn!(log, "virtio-vsock: RX buffer of {room} bytes cannot hold a header; dropped");
                        0
                    } else {
                        let cap = (room - HDR_LEN).min(buf.len());
                        match muxer.next_rx(&mut buf[..cap]) {
                            Some((hdr, n)) => {
                                let h = scatter(mem, &p.segments, 0, &hdr.to_bytes());
                                let d = scatter(mem, &p.segments, HDR_LEN, &buf[..n]);
                                (h + d) as u32
                            }
                            None => {
                                // Nothing after all: give the buffer back.
                                q.go_to_previous_position();
                                break;
                            }
                        }
                    }
                }
                Err(e) => {
                    guest_warn!(log, "virtio-vsock: RX {e}; buffer dropped");
                    0
                }
            };
            q.add_used(mem, head, used).map_err(|e| broken(format!("RX used ring: {e}")))?;
            used_any = true;
        }
        if used_any && q.needs_notification(mem).map_err(|e| broken(format!("RX used event: {e}")))? {
            interrupt.trigger(VIRTIO_MMIO_INT_VRING);
        }
        Ok(())
    }
}

impl VirtioDevice for Vsock {
    fn name(&self) -> &'static str {
        "virtio-vsock"
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!("virtio-vsock: config write at {offset:#x} ignored (read-only)");
    }

    fn activate(&mut self, activation: Activation, interrupt: Arc<Interrupt>) -> Result<(), VirtioError> {
        if activation.queues.len() != 3 || activation.queues.iter().any(|q| !q.ready()) {
            return Err(VirtioError::Activate {
                device: "virtio-vsock",
                reason: "the RX, TX and event queues must all be ready".into(),
            });
        }
        self.running = Some(Running { mem: activation.mem, queues: activation.queues, interrupt });
        Ok(())
    }

    fn reset(&mut self) {
        self.running = None;
        self.muxer.reset_all();
    }

    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        self.running.as_ref().map(|r| r.queues.iter().map(|q| q.state()).collect())
    }

    fn process_queue(&mut self, index: usize) -> Result<(), VirtioError> {
        match index {
            TXQ => {
                self.process_tx()?;
                self.process_rx()
            }
            RXQ => self.process_rx(),
            EVQ => {
                self.deliver_event()?;
                self.check_reset_ack();
                self.process_rx()
            }
            _ => Ok(()),
        }
    }

    fn epoll_fd(&self) -> Option<RawFd> {
        Some(self.muxer.epoll_fd())
    }

    fn set_log_limiter(&mut self, log: Arc<LogLimiter>) {
        self.muxer.set_log_limiter(log.clone());
        self.log = log;
    }

    fn process_events(&mut self) -> Result<(), VirtioError> {
        self.muxer.process_host_events();
        self.check_reset_ack();
        self.process_rx()
    }

    fn after_restore(&mut self) -> Result<(), VirtioError> {
        self.transport_reset()
    }
}
