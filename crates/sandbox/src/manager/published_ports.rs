//! A sandbox's published host ports as the manager keeps them: set once
//! after its create, their listening state as the server's listeners
//! report it, kept in its record ([`crate::published_ports`]).

use std::net::SocketAddr;

use super::{Manager, SandboxError};
use crate::lock;
use crate::published_ports::PublishedPort;

impl Manager {
    /// Sets the host ports published for sandbox `id` (the server listens
    /// on them already) and writes its record.
    ///
    /// Errors: [`SandboxError::NotFound`].
    pub fn set_published_ports(&self, id: &str, ports: Vec<PublishedPort>) -> Result<(), SandboxError> {
        let sb = self.get(id)?;
        *lock(&sb.ports) = ports;
        self.record_in_background(&sb);
        Ok(())
    }

    /// The host ports published for sandbox `id` (none for an unknown id).
    pub fn published_ports(&self, id: &str) -> Vec<PublishedPort> {
        self.get(id).map(|sb| lock(&sb.ports).clone()).unwrap_or_default()
    }

    /// Records whether the server listens on `host` for sandbox `id`
    /// (`Err`: why not); the record is written when the state changed.
    pub fn set_published_port_state(&self, id: &str, host: SocketAddr, state: Result<(), String>) {
        let Ok(sb) = self.get(id) else { return };
        let changed = {
            let mut ports = lock(&sb.ports);
            let Some(p) = ports.iter_mut().find(|p| p.host == host) else { return };
            let (listening, error) = match state {
                Ok(()) => (true, None),
                Err(e) => (false, Some(e)),
            };
            let changed = p.listening != listening || p.error != error;
            (p.listening, p.error) = (listening, error);
            changed
        };
        if changed {
            self.record_in_background(&sb);
        }
    }

    /// The sandboxes that publish host ports, with their ports.
    pub fn all_published_ports(&self) -> Vec<(String, Vec<PublishedPort>)> {
        lock(&self.sandboxes)
            .values()
            .filter_map(|sb| {
                let ports = lock(&sb.ports);
                (!ports.is_empty()).then(|| (sb.id.clone(), ports.clone()))
            })
            .collect()
    }
}
