//! Connections from the host into a sandbox's guest ports: what preview
//! URLs and port forwards stand on.
//!
//! [`Manager::connect_port`] makes the sandbox run (waking a hibernated
//! one, resuming a paused one, as a call does) and asks its network
//! ([`NetControl::connect_inbound`]) for a TCP connection from the
//! gateway into the guest's port. The [`PortConnection`] it returns holds
//! the sandbox busy while it lives: a sandbox serving a connection is not
//! idle, so neither the idle timeout nor memory pressure hibernates it
//! under the connection.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use netstack::control::NetControl;

use super::sandbox::BusyGuard;
use super::{Manager, Sandbox, SandboxError};
use crate::lock;

/// An open connection into a guest port; the sandbox counts as busy until
/// it is dropped.
pub struct PortConnection {
    stream: UnixStream,
    lease: PortLease,
}

impl std::fmt::Debug for PortConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortConnection").field("sandbox", &self.lease.0.sandbox().id).finish_non_exhaustive()
    }
}

impl PortConnection {
    /// The connection's bytes, both ways (see
    /// [`NetControl::connect_inbound`]: shut down for writing to send the
    /// guest a FIN; end of stream before any byte means the guest refused
    /// or did not answer), and the lease that keeps the sandbox busy: keep
    /// it as long as the stream is in use.
    pub fn into_parts(self) -> (UnixStream, PortLease) {
        (self.stream, self.lease)
    }
}

/// Keeps a sandbox busy (not idle) while a connection into it lives.
pub struct PortLease(BusyGuard<Arc<Sandbox>>);

impl PortLease {
    /// Records a use of the sandbox now (traffic on the connection).
    pub fn touch(&self) {
        self.0.sandbox().touch();
    }
}

impl Manager {
    /// A TCP connection into sandbox `id`'s guest `port` (1-65535), from
    /// the gateway's address: the sandbox is woken or resumed first.
    ///
    /// Errors: [`SandboxError::NotFound`], [`SandboxError::NoNetwork`],
    /// [`SandboxError::Starting`], [`SandboxError::NotRunning`], the wake's
    /// errors (quotas, memory), [`SandboxError::Inbound`] (port 0, too
    /// many connections waiting).
    pub async fn connect_port(&self, id: &str, port: u16) -> Result<PortConnection, SandboxError> {
        let sb = self.get(id)?;
        let control: Arc<NetControl> = lock(&sb.net).clone().ok_or(SandboxError::NoNetwork)?;
        let busy = sb.mark_busy_owned();
        self.wake_for_use(&sb, "a connection into the guest").await?;
        // A merge may have given the sandbox its winner's network meanwhile.
        let control = lock(&sb.net).clone().unwrap_or(control);
        let stream = control.connect_inbound(port)?;
        Ok(PortConnection { stream, lease: PortLease(busy) })
    }
}
