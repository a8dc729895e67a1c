//! The device event loop: a thread that waits (epoll) on its virtio
//! devices' queue notification eventfds and runs their queue processing,
//! so device work never runs on a vCPU thread. A VM has one for its disks
//! and vsock device (`devices-<vm>`, seccomp [`ThreadKind::Devices`]) and,
//! with a network, a second one for the virtio-net device alone
//! (`net-<vm>`, [`ThreadKind::Net`]): a guest flooding its NIC slows only
//! that thread, never its disks or vsock.
//!
//! The thread sleeps unless a queue is notified or a device's host-side fd
//! ([`MmioTransport::epoll_fd`], e.g. the vsock muxer's sockets) has work
//! the device can do. A device's host-side fd is waited on only while the
//! device runs ([`MmioTransport::is_active`]): while the guest has not
//! activated it, or after it broke the protocol (DEVICE_NEEDS_RESET), that
//! fd may stay readable (epoll is level-triggered) and would wake the
//! thread for nothing, for ever. The loop re-checks after every event for
//! the device, and a device's activation notifies its first queue
//! ([`MmioTransport`]), so the fd is waited on again from then on.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::mmio::MmioTransport;
use crate::seccomp::ThreadKind;
use crate::sync::lock;

/// Token of the stop eventfd.
const STOP_TOKEN: u64 = u64::MAX;
/// Queue number in a token that means "the device's own epoll fd".
const DEVICE_FD: usize = 0xffff;
/// Events taken from epoll per wait.
const EVENTS_PER_WAIT: usize = 32;

/// Errors of the event loop's set-up.
#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    /// epoll or eventfd set-up failed.
    #[error("device event loop set-up failed: {0}")]
    Setup(#[source] std::io::Error),
    /// The thread could not be started.
    #[error("cannot start the device event loop thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// A running event loop; dropping it stops the thread.
pub struct EventLoop {
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

fn token(device: usize, queue: usize) -> u64 {
    ((device as u64) << 16) | queue as u64
}

impl EventLoop {
    /// Starts the loop over `devices`' queue notifications, on a thread
    /// named [`thread_name`]`(kind, name)` that installs `kind`'s seccomp
    /// filter first.
    ///
    /// Errors: [`EventLoopError`].
    pub fn spawn(
        name: &str,
        devices: Vec<Arc<Mutex<MmioTransport>>>,
        kind: ThreadKind,
    ) -> Result<Self, EventLoopError> {
        let epoll = Epoll::new().map_err(EventLoopError::Setup)?;
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(EventLoopError::Setup)?;
        epoll
            .ctl(ControlOperation::Add, stop.as_raw_fd(), EpollEvent::new(EventSet::IN, STOP_TOKEN))
            .map_err(EventLoopError::Setup)?;
        // The loop owns duplicates of the queue eventfds, so that draining
        // one does not need the device lock.
        let mut evts: Vec<Vec<EventFd>> = Vec::new();
        for (d, dev) in devices.iter().enumerate() {
            let dev = lock(dev);
            let mut mine = Vec::new();
            for (q, evt) in dev.queue_evts().iter().enumerate() {
                let dup = evt.try_clone().map_err(EventLoopError::Setup)?;
                epoll
                    .ctl(ControlOperation::Add, dup.as_raw_fd(), EpollEvent::new(EventSet::IN, token(d, q)))
                    .map_err(EventLoopError::Setup)?;
                mine.push(dup);
            }
            if let Some(fd) = dev.epoll_fd() {
                epoll
                    .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token(d, DEVICE_FD)))
                    .map_err(EventLoopError::Setup)?;
            }
            evts.push(mine);
        }
        let stop_dup = stop.try_clone().map_err(EventLoopError::Setup)?;
        let thread = std::thread::Builder::new()
            .name(thread_name(kind, name))
            .spawn(move || {
                crate::seccomp::install_or_log(kind);
                run(epoll, stop_dup, devices, evts)
            })
            .map_err(EventLoopError::Thread)?;
        Ok(EventLoop { stop, thread: Some(thread) })
    }
}

/// The name of an event loop thread of kind `kind` for VM `vm`:
/// `net-<vm>` for [`ThreadKind::Net`], else `devices-<vm>`.
pub fn thread_name(kind: ThreadKind, vm: &str) -> String {
    match kind {
        ThreadKind::Net => format!("net-{vm}"),
        _ => format!("devices-{vm}"),
    }
}

/// Waits on device `d`'s host-side fd only while the device runs (see the
/// module documentation); `armed[d]` is what is registered now.
fn arm_host_fd(epoll: &Epoll, armed: &mut [bool], d: usize, dev: &MmioTransport) {
    let Some(fd) = dev.epoll_fd() else { return };
    let want = dev.is_active();
    if armed.get(d).copied() == Some(want) {
        return;
    }
    let set = if want { EventSet::IN } else { EventSet::empty() };
    match epoll.ctl(ControlOperation::Modify, fd, EpollEvent::new(set, token(d, DEVICE_FD))) {
        Ok(()) => armed[d] = want,
        Err(e) => {
            tracing::error!("device event loop: cannot {} a device's host fd: {e}", if want { "arm" } else { "disarm" })
        }
    }
}

fn run(epoll: Epoll, _stop: EventFd, devices: Vec<Arc<Mutex<MmioTransport>>>, evts: Vec<Vec<EventFd>>) {
    let mut events = vec![EpollEvent::default(); EVENTS_PER_WAIT];
    // Registered with EPOLLIN at spawn.
    let mut armed = vec![true; devices.len()];
    for (d, dev) in devices.iter().enumerate() {
        arm_host_fd(&epoll, &mut armed, d, &lock(dev));
    }
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("device event loop: epoll_wait failed: {e}; devices stop");
                return;
            }
        };
        for ev in &events[..n] {
            let t = ev.data();
            if t == STOP_TOKEN {
                return;
            }
            let (d, q) = ((t >> 16) as usize, (t & 0xffff) as usize);
            if q == DEVICE_FD {
                if let Some(dev) = devices.get(d) {
                    let mut dev = lock(dev);
                    dev.process_events();
                    arm_host_fd(&epoll, &mut armed, d, &dev);
                }
                continue;
            }
            let (Some(evt), Some(dev)) = (evts.get(d).and_then(|v| v.get(q)), devices.get(d)) else { continue };
            // Drain the notification count; a spurious wake-up is harmless.
            let _ = evt.read();
            tracing::trace!(device = d, queue = q, "queue notification");
            let mut dev = lock(dev);
            dev.process_queue(q);
            arm_host_fd(&epoll, &mut armed, d, &dev);
        }
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
