//! `info` and `reseed`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Instant;

use tine_protocol::{AgentError, AgentInfo, Reseed, MAX_ENTROPY_BYTES};

use crate::{AGENT_VERSION, PROTOCOL};

const fn ioc(dir: u64, ty: u8, nr: u8, size: u64) -> u64 {
    (dir << 30) | (size << 16) | ((ty as u64) << 8) | nr as u64
}
/// RNDADDENTROPY = _IOW('R', 0x03, int[2]) (include/uapi/linux/random.h).
const RNDADDENTROPY: u64 = ioc(1, b'R', 0x03, 8);
/// RNDRESEEDCRNG = _IO('R', 0x07).
const RNDRESEEDCRNG: u64 = ioc(0, b'R', 0x07, 0);
const _: () = assert!(RNDADDENTROPY == 0x4008_5203 && RNDRESEEDCRNG == 0x5207);

fn meminfo_kib(text: &str, key: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Agent and guest facts.
pub fn info(started: Instant) -> AgentInfo {
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut l = load.split_whitespace().map(|v| v.parse::<f32>().unwrap_or(0.0));
    // SAFETY: statvfs is plain data; all-zero is valid and the call fills it.
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid C string and `vfs` a valid out pointer.
    let ok = unsafe { libc::statvfs(c"/".as_ptr(), &mut vfs) } == 0;
    let (disk_total, disk_free) = if ok { (vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize) } else { (0, 0) };
    AgentInfo {
        agent_version: AGENT_VERSION.to_string(),
        protocol_version: PROTOCOL.version(),
        uptime_ms: started.elapsed().as_millis() as u64,
        mem_total: meminfo_kib(&mem, "MemTotal:") * 1024,
        mem_available: meminfo_kib(&mem, "MemAvailable:") * 1024,
        disk_total,
        disk_free,
        load: [l.next().unwrap_or(0.0), l.next().unwrap_or(0.0), l.next().unwrap_or(0.0)],
    }
}

/// Mixes `r.entropy` into the kernel RNG, forces a reseed of the CRNG so
/// that the next random bytes depend on it, and sets the wall clock.
pub fn reseed(r: &Reseed) -> Result<(), AgentError> {
    if r.entropy.is_empty() || r.entropy.len() > MAX_ENTROPY_BYTES {
        return Err(AgentError::InvalidRequest { reason: format!("entropy must be 1..={MAX_ENTROPY_BYTES} bytes") });
    }
    let io = |what: &str| AgentError::Io { message: format!("{what}: {}", std::io::Error::last_os_error()) };
    let dev = File::open("/dev/urandom").map_err(|e| AgentError::Io { message: format!("/dev/urandom: {e}") })?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let words = r.entropy.len().div_ceil(4);
    let mut pool = vec![0u32; 2 + words];
    pool[0] = (r.entropy.len() * 8) as u32;
    pool[1] = r.entropy.len() as u32;
    for (i, chunk) in r.entropy.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        pool[2 + i] = u32::from_ne_bytes(w);
    }
    // SAFETY: `pool` is a rand_pool_info with buf_size bytes after the
    // header, as RNDADDENTROPY reads it; the fd is /dev/urandom.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, pool.as_ptr()) } < 0 {
        return Err(io("RNDADDENTROPY"));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        return Err(io("RNDRESEEDCRNG"));
    }
    let ts = libc::timespec {
        tv_sec: (r.unix_time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (r.unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } < 0 {
        return Err(io("clock_settime"));
    }
    Ok(())
}
