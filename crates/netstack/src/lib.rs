//! The user-space network of a sandbox: everything between the guest's
//! virtio-net device and the host's sockets, with no TAP device, no root
//! and no change to the host's firewall.
//!
//! - [`stack`]: a NAT on the smoltcp TCP/IP stack (its parts: the link to
//!   the guest, admission, TCP, UDP; see its module doc). The guest's Ethernet
//!   frames go into a smoltcp interface that accepts every destination
//!   address ("any IP"); each guest TCP connection ends there and is spliced
//!   to a non-blocking host socket. UDP to the gateway's DNS address goes to
//!   [`dns`]. No host connection is ever shared between sandboxes.
//! - [`dns`]: the resolver at [`DNS_ADDR`]: static host entries from the
//!   server config, else the query is forwarded to the host's resolvers
//!   (`/etc/resolv.conf`); answers feed the address-to-name map that domain
//!   rules use.
//! - [`policy`]: the egress policy (allow/deny by domain and CIDR, the
//!   always-denied ranges) and its verdicts.
//! - [`sniff`]: what a connection's first bytes are: a TLS ClientHello
//!   (its SNI) or an HTTP/1.x request head.
//! - [`http`]: HTTP/1.x request heads and a plain-HTTP connection's bytes
//!   taken request by request.
//! - [`host_name`]: the one form host names are compared in.
//! - [`log`]: the bounded per-sandbox network log.
//! - [`rate`]: token buckets for the rates of new connections and DNS
//!   queries.
//! - [`control`]: what the sandbox manager holds per sandbox: the live
//!   policy (changeable while the guest runs) and the log.
//!
//! Guest addressing is the same in every sandbox ([`GUEST_ADDR`],
//! [`GATEWAY_ADDR`], [`DNS_ADDR`], [`PREFIX_LEN`]), so snapshots, templates
//! and branch children need no change; each VM has its own [`stack::NetStack`].

pub mod control;
pub mod dns;
pub mod host_name;
pub mod http;
pub mod log;
pub mod policy;
pub mod rate;
pub mod sniff;
pub mod stack;

use std::net::Ipv4Addr;

/// The guest's MAC address (locally administered, unicast).
pub const GUEST_MAC: [u8; 6] = [0x02, 0x54, 0x00, 0x12, 0x34, 0x56];
/// The gateway's MAC address (the NAT's side of the link).
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x54, 0x00, 0x12, 0x34, 0x02];
/// The guest's IPv4 address.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
/// The gateway (the NAT). TCP connections to it go to the host's loopback
/// (127.0.0.1), and are judged by the policy as loopback.
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// The DNS resolver the guest uses (UDP port 53).
pub const DNS_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 3);
/// The guest network's prefix length (10.0.2.0/24).
pub const PREFIX_LEN: u8 = 24;
/// The link MTU (bytes of IP packet per Ethernet frame): 64 KiB less
/// 256, the largest IPv4 packet (RFC 791: total length is 16 bits) rounded
/// down. The link is virtual, so nothing on it needs Ethernet's 1500; with
/// no segmentation offload on the virtio-net device, large frames are
/// what cut the guest's per-frame kernel work (in `docs/hosts.md`: upload
/// 14x, download 4x on a nested-KVM host). The guest learns it from the
/// device's config (`VIRTIO_NET_F_MTU`, virtio 1.2 §5.1.4) and the agent
/// sets it on the interface; smoltcp's segments follow the guest's MSS.
pub const MTU: usize = 65280;
