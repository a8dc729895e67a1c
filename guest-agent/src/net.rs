//! The guest's network set-up, done once by PID 1 after the mounts: `lo`
//! up, and when the VM has a NIC (`eth0`, the VMM's virtio-net) the fixed
//! addressing every sandbox shares: [`GUEST_ADDR`]/[`PREFIX_LEN`], MTU
//! [`MTU`], a default route via [`GATEWAY_ADDR`] and `/etc/resolv.conf`
//! naming [`DNS_ADDR`].
//!
//! Plain `ioctl`s on an `AF_INET` datagram socket (netdevice(7),
//! SIOCSIFADDR / SIOCSIFNETMASK / SIOCSIFMTU / SIOCSIFFLAGS, and route(4)'s
//! SIOCADDRT), so the image needs no tools for it. Nothing here is fatal:
//! errors go to the console and the agent starts anyway.
//!
//! The addresses are those of `crates/netstack/src/lib.rs` (`GUEST_ADDR`,
//! `GATEWAY_ADDR`, `DNS_ADDR`, `PREFIX_LEN`, `MTU`); the agent does not
//! depend on netstack, so they are repeated here and must stay equal.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The guest's address (netstack `GUEST_ADDR`).
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
/// The default gateway, the VMM's NAT (netstack `GATEWAY_ADDR`).
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// The resolver at the gateway (netstack `DNS_ADDR`).
pub const DNS_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 3);
/// Prefix length of the guest network, 10.0.2.0/24 (netstack `PREFIX_LEN`).
pub const PREFIX_LEN: u8 = 24;
/// The link MTU in bytes (netstack `MTU`).
pub const MTU: i32 = 65280;
/// The NIC's name: the first (only) Ethernet device the kernel finds.
pub const NIC: &str = "eth0";
/// The resolver file's path.
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// A failed step of the set-up.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// `socket(AF_INET, SOCK_DGRAM)` failed (no IPv4 in the kernel?).
    #[error("socket(AF_INET): {0}")]
    Socket(io::Error),
    /// An ioctl on an interface failed.
    #[error("{request} on {ifname}: {source}")]
    Ioctl {
        /// The request, by its name in netdevice(7) / route(4).
        request: &'static str,
        /// The interface.
        ifname: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// Writing `/etc/resolv.conf` failed.
    #[error("write /etc/resolv.conf: {0}")]
    ResolvConf(io::Error),
}

/// What [`set_up`] found and did.
#[derive(Debug, PartialEq, Eq)]
pub enum NetSetup {
    /// Only `lo` is up: the VM has no NIC (its network is disabled).
    LoopbackOnly,
    /// `lo` and [`NIC`] are up with the fixed addressing.
    Configured,
}

/// Brings `lo` up and, when [`NIC`] exists, configures it (see the module
/// doc). Logs each failed step to the console and goes on; returns what it
/// managed, or the first error that stopped it.
pub fn set_up() -> Result<NetSetup, NetError> {
    // SAFETY: socket(2) with constant arguments; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(NetError::Socket(io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    if let Err(e) = bring_up(&sock, "lo") {
        eprintln!("tine-agent init: network: {e}");
    }
    match interface_flags(&sock, NIC) {
        Err(NetError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::ENODEV) => {
            return Ok(NetSetup::LoopbackOnly)
        }
        Err(e) => return Err(e),
        Ok(_) => {}
    }
    configure_nic(&sock)?;
    write_resolv_conf()?;
    Ok(NetSetup::Configured)
}

/// Address, netmask, MTU, up, default route: in that order, as the route
/// needs the gateway on an up interface's subnet.
fn configure_nic(sock: &OwnedFd) -> Result<(), NetError> {
    let mut req = ifreq(NIC);
    req.ifr_ifru.ifru_addr = sockaddr_v4(GUEST_ADDR);
    ioctl(sock, libc::SIOCSIFADDR, "SIOCSIFADDR", NIC, &mut req)?;
    let mut req = ifreq(NIC);
    req.ifr_ifru.ifru_netmask = sockaddr_v4(netmask(PREFIX_LEN));
    ioctl(sock, libc::SIOCSIFNETMASK, "SIOCSIFNETMASK", NIC, &mut req)?;
    let mut req = ifreq(NIC);
    req.ifr_ifru.ifru_mtu = MTU;
    ioctl(sock, libc::SIOCSIFMTU, "SIOCSIFMTU", NIC, &mut req)?;
    bring_up(sock, NIC)?;

    // SAFETY: rtentry is plain data (integers, sockaddrs, a pointer) for
    // which all-zero is valid: no metric, no device, no MTU.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr_v4(GATEWAY_ADDR);
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    let mut dev = name_bytes(NIC);
    route.rt_dev = dev.as_mut_ptr();
    // SAFETY: SIOCADDRT reads a struct rtentry (route(4)); `route` is one,
    // and its rt_dev points at `dev`, a NUL-terminated name that outlives
    // the call.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &mut route) };
    if r < 0 {
        let source = io::Error::last_os_error();
        // Already there (a second set-up in the same kernel): fine.
        if source.raw_os_error() != Some(libc::EEXIST) {
            return Err(NetError::Ioctl { request: "SIOCADDRT", ifname: NIC, source });
        }
    }
    Ok(())
}

/// Writes `nameserver <DNS_ADDR>` to `/etc/resolv.conf` unless it already
/// says exactly that (the image ships it, so the overlay's upper layer, and
/// with it the sandbox's diff, normally stays without a copy).
fn write_resolv_conf() -> Result<(), NetError> {
    let want = resolv_conf();
    if std::fs::read_to_string(RESOLV_CONF).is_ok_and(|have| have == want) {
        return Ok(());
    }
    // A symlink (systemd-resolved style) would point outside: replace it.
    let _ = std::fs::remove_file(RESOLV_CONF);
    std::fs::write(RESOLV_CONF, want).map_err(NetError::ResolvConf)
}

/// The text of `/etc/resolv.conf` (resolv.conf(5)).
pub fn resolv_conf() -> String {
    format!("nameserver {DNS_ADDR}\n")
}

/// Sets IFF_UP on `ifname`, keeping its other flags.
fn bring_up(sock: &OwnedFd, ifname: &'static str) -> Result<(), NetError> {
    let flags = interface_flags(sock, ifname)?;
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    let mut req = ifreq(ifname);
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    ioctl(sock, libc::SIOCSIFFLAGS, "SIOCSIFFLAGS", ifname, &mut req)
}

/// The interface's flags (SIOCGIFFLAGS); ENODEV when there is no such
/// interface.
fn interface_flags(sock: &OwnedFd, ifname: &'static str) -> Result<libc::c_short, NetError> {
    let mut req = ifreq(ifname);
    ioctl(sock, libc::SIOCGIFFLAGS, "SIOCGIFFLAGS", ifname, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the union's ifru_flags member.
    Ok(unsafe { req.ifr_ifru.ifru_flags })
}

fn ioctl(
    sock: &OwnedFd,
    request: libc::c_ulong,
    name: &'static str,
    ifname: &'static str,
    req: &mut libc::ifreq,
) -> Result<(), NetError> {
    // SAFETY: every request passed here is an interface ioctl of
    // netdevice(7) that reads or writes one struct ifreq, which `req` is.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), request, req as *mut libc::ifreq) };
    if r < 0 {
        return Err(NetError::Ioctl { request: name, ifname, source: io::Error::last_os_error() });
    }
    Ok(())
}

/// An ifreq naming `ifname`, the rest zero.
fn ifreq(ifname: &str) -> libc::ifreq {
    // SAFETY: ifreq is a name array and a union of plain data (sockaddrs,
    // integers, a pointer); all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    req.ifr_name = name_bytes(ifname);
    req
}

/// `name` as a NUL-terminated IFNAMSIZ array (cut to IFNAMSIZ - 1 bytes).
fn name_bytes(name: &str) -> [libc::c_char; libc::IFNAMSIZ] {
    let mut out = [0 as libc::c_char; libc::IFNAMSIZ];
    for (d, b) in out.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *d = b as libc::c_char;
    }
    out
}

/// `addr` as the generic sockaddr the ioctls take: a sockaddr_in (ip(7))
/// with port 0, its address in network byte order in sa_data[2..6].
fn sockaddr_v4(addr: Ipv4Addr) -> libc::sockaddr {
    let mut sa_data = [0 as libc::c_char; 14];
    for (d, o) in sa_data[2..6].iter_mut().zip(addr.octets()) {
        *d = o as libc::c_char;
    }
    libc::sockaddr { sa_family: libc::AF_INET as libc::sa_family_t, sa_data }
}

/// The netmask of a prefix length (0..=32; longer is /32).
fn netmask(prefix_len: u8) -> Ipv4Addr {
    let bits = u32::MAX.checked_shl(32 - u32::from(prefix_len.min(32))).unwrap_or(0);
    Ipv4Addr::from(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_matches_libc_sockaddr_in() {
        let sa = sockaddr_v4(GUEST_ADDR);
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(GUEST_ADDR.octets()) },
            sin_zero: [0; 8],
        };
        assert_eq!(std::mem::size_of_val(&sa), std::mem::size_of_val(&sin));
        // SAFETY: both are 16-byte plain-data structs, read as bytes.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts((&sa as *const libc::sockaddr).cast::<u8>(), 16),
                std::slice::from_raw_parts((&sin as *const libc::sockaddr_in).cast::<u8>(), 16),
            )
        };
        assert_eq!(a, b);
    }

    #[test]
    fn netmasks() {
        assert_eq!(netmask(PREFIX_LEN), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::UNSPECIFIED);
        assert_eq!(netmask(32), Ipv4Addr::BROADCAST);
        assert_eq!(netmask(200), Ipv4Addr::BROADCAST);
        assert_eq!(netmask(1), Ipv4Addr::new(128, 0, 0, 0));
    }

    #[test]
    fn names_are_nul_terminated_and_cut() {
        let n = name_bytes("eth0");
        assert_eq!(&n[..5], &[b'e' as libc::c_char, b't' as _, b'h' as _, b'0' as _, 0]);
        let long = name_bytes("a-very-long-interface-name");
        assert_eq!(long[libc::IFNAMSIZ - 1], 0);
        assert_eq!(long[libc::IFNAMSIZ - 2], b't' as libc::c_char);
    }

    #[test]
    fn resolv_conf_names_the_gateway_dns() {
        assert_eq!(resolv_conf(), "nameserver 10.0.2.3\n");
    }
}
