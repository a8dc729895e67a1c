//! Published ports: a host address and port that the server listens on
//! for a sandbox's whole life and connects, one TCP connection for each
//! accepted one, to a port of the sandbox's guest (`sandbox_create {
//! ports: ["8080:80"] }`, microsandbox's and Docker's `-p` form). What a
//! sandbox publishes is part of its record, so a restart of the server
//! listens again; a branch child, a template and a snapshot publish
//! nothing (a host port names one sandbox).
//!
//! This module holds the mapping, its text form and its state;
//! the server's listeners (`tine::published_ports`) do the listening.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde::{Deserialize, Serialize};

/// Mappings one sandbox may publish, at most.
pub const MAX_PUBLISHED_PORTS: usize = 8;

/// One published port: `host` (address and port) → guest `guest_port`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PublishedPort {
    /// Where the server listens (`127.0.0.1:8080`).
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub host: SocketAddr,
    /// The guest port it connects to (1-65535).
    pub guest_port: u16,
    /// Whether the server listens on `host` now (false after a restart
    /// that could not take the address back: see `error`).
    #[serde(default)]
    pub listening: bool,
    /// Why the server does not listen on `host`, if it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A mapping that cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PortsError {
    /// Not `HOST_PORT:GUEST_PORT` or `ADDRESS:HOST_PORT:GUEST_PORT`.
    #[error(
        "port mapping {0:?}: write \"HOST_PORT:GUEST_PORT\" (\"8080:80\"), or \"ADDRESS:HOST_PORT:GUEST_PORT\" \
         (\"127.0.0.1:8080:80\", \"[::1]:8080:80\"), ports 1-65535"
    )]
    Syntax(String),
    /// More mappings than [`MAX_PUBLISHED_PORTS`].
    #[error("{0} port mappings: a sandbox publishes at most {MAX_PUBLISHED_PORTS}")]
    TooMany(usize),
    /// Two mappings of one host address and port.
    #[error("host port {0} is published twice")]
    Twice(SocketAddr),
}

/// Reads `HOST_PORT:GUEST_PORT` (the host side on `default_ip`) or
/// `ADDRESS:HOST_PORT:GUEST_PORT` (an IPv6 address in brackets).
///
/// Errors: [`PortsError::Syntax`].
pub fn parse_mapping(text: &str, default_ip: IpAddr) -> Result<PublishedPort, PortsError> {
    let bad = || PortsError::Syntax(text.chars().take(64).collect());
    let t = text.trim();
    let (host, guest) = t.rsplit_once(':').ok_or_else(bad)?;
    let guest_port = port(guest).ok_or_else(bad)?;
    let host = match host.rsplit_once(':') {
        None => SocketAddr::new(default_ip, port(host).ok_or_else(bad)?),
        Some((ip, p)) => {
            // An IPv6 address only in brackets: "::1:8080" is an address too.
            let ip: IpAddr = match ip.strip_prefix('[').and_then(|i| i.strip_suffix(']')) {
                Some(v6) => IpAddr::V6(v6.parse().map_err(|_| bad())?),
                None => IpAddr::V4(ip.parse().map_err(|_| bad())?),
            };
            SocketAddr::new(ip, port(p).ok_or_else(bad)?)
        }
    };
    Ok(PublishedPort { host, guest_port, listening: false, error: None })
}

/// Reads every mapping of `texts` ([`parse_mapping`]) and checks the set:
/// at most [`MAX_PUBLISHED_PORTS`], no host address twice.
///
/// Errors: [`PortsError`].
pub fn parse_mappings(texts: &[String], default_ip: IpAddr) -> Result<Vec<PublishedPort>, PortsError> {
    if texts.len() > MAX_PUBLISHED_PORTS {
        return Err(PortsError::TooMany(texts.len()));
    }
    let mut out: Vec<PublishedPort> = Vec::with_capacity(texts.len());
    for t in texts {
        let p = parse_mapping(t, default_ip)?;
        if out.iter().any(|o| o.host == p.host) {
            return Err(PortsError::Twice(p.host));
        }
        out.push(p);
    }
    Ok(out)
}

/// A port number 1-65535.
fn port(s: &str) -> Option<u16> {
    s.parse::<u16>().ok().filter(|p| *p != 0)
}

/// The loopback address, where ports are published unless the operator
/// allows others.
pub const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_read_as_microsandbox_and_docker_write_them() {
        let p = parse_mapping("8080:80", LOOPBACK).unwrap();
        assert_eq!((p.host, p.guest_port), ("127.0.0.1:8080".parse().unwrap(), 80));
        let p = parse_mapping(" 0.0.0.0:9000:9001 ", LOOPBACK).unwrap();
        assert_eq!((p.host, p.guest_port), ("0.0.0.0:9000".parse().unwrap(), 9001));
        let p = parse_mapping("[::1]:8443:443", LOOPBACK).unwrap();
        assert_eq!((p.host, p.guest_port), ("[::1]:8443".parse().unwrap(), 443));
        for bad in ["80", "0:80", "8080:0", "8080:70000", "x:80", "1.2.3:8080:80", "::1:8080:80", "", ":"] {
            assert!(matches!(parse_mapping(bad, LOOPBACK), Err(PortsError::Syntax(_))), "{bad}");
        }
        let twice = parse_mappings(&["8080:80".into(), "127.0.0.1:8080:81".into()], LOOPBACK);
        assert_eq!(twice, Err(PortsError::Twice("127.0.0.1:8080".parse().unwrap())));
        let many: Vec<String> = (0..=MAX_PUBLISHED_PORTS).map(|i| format!("{}:80", 9000 + i)).collect();
        assert_eq!(parse_mappings(&many, LOOPBACK), Err(PortsError::TooMany(MAX_PUBLISHED_PORTS + 1)));
    }
}
