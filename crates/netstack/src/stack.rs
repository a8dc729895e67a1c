//! The NAT on smoltcp: guest Ethernet frames in and out, host sockets
//! behind.
//!
//! STUB: the lead wrote the signatures; the stack helper writes the NAT
//! (see /work/wt/DESIGN-15.md).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::control::NetControl;

/// Server-level settings of every sandbox's stack.
#[derive(Clone, Debug)]
pub struct StackConfig {
    /// Where DNS queries are forwarded (default: the `nameserver` lines of
    /// `/etc/resolv.conf`, port 53).
    pub dns_upstreams: Vec<SocketAddr>,
    /// Names the gateway's DNS answers itself (A records), before asking
    /// upstream: for operators and tests.
    pub static_hosts: BTreeMap<String, IpAddr>,
    /// Open TCP connections plus UDP flows per sandbox, at most.
    pub max_connections: usize,
    /// Buffer per direction per connection (bytes).
    pub tcp_buffer_bytes: usize,
    /// Frames queued toward the guest, at most.
    pub max_guest_frames: usize,
}

/// Errors of the stack's set-up.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// epoll, timerfd or a socket could not be created.
    #[error("network stack set-up failed: {0}")]
    Setup(#[source] std::io::Error),
}

/// Counters of one stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackStats {
    /// TCP connections plus UDP flows open now.
    pub open_connections: usize,
    /// Connections refused because of `max_connections`.
    pub refused_by_cap: u64,
    /// Guest frames dropped (malformed or over a limit).
    pub frames_dropped: u64,
}

/// One sandbox's NAT.
pub struct NetStack {
    _p: (),
}

impl NetStack {
    /// A stack with no connections.
    ///
    /// Errors: [`StackError::Setup`].
    pub fn new(_config: StackConfig, _control: Arc<NetControl>) -> Result<Self, StackError> {
        todo!("stack helper")
    }
    /// Takes one Ethernet frame from the guest; `false`: queue full, retry later.
    pub fn send_frame(&mut self, _frame: &[u8]) -> bool {
        todo!("stack helper")
    }
    /// The next frame for the guest (not removed).
    pub fn peek_frame(&self) -> Option<&[u8]> {
        todo!("stack helper")
    }
    /// Removes the frame [`NetStack::peek_frame`] returned.
    pub fn pop_frame(&mut self) {
        todo!("stack helper")
    }
    /// Runs the stack: guest frames, host sockets, timers.
    pub fn poll(&mut self) {
        todo!("stack helper")
    }
    /// Readable (level-triggered) when [`NetStack::poll`] has work.
    pub fn epoll_fd(&self) -> RawFd {
        todo!("stack helper")
    }
    /// Drops every connection and flow (after a restore).
    pub fn reset(&mut self) {
        todo!("stack helper")
    }
    /// Counters.
    pub fn stats(&self) -> StackStats {
        todo!("stack helper")
    }
}

// LEAD-TEMP: replaced by the stack helper's.
impl Default for StackConfig {
    fn default() -> Self {
        todo!("stack helper")
    }
}
