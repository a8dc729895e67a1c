//! The host end of virtio-vsock: Unix sockets in the style of
//! Firecracker's hybrid vsock.
//!
//! - Host-initiated: a client connects to the VM's socket `uds_path` and
//!   sends `CONNECT <port>\n`; the muxer sends the guest a REQUEST to that
//!   port and, on the guest's RESPONSE, answers `OK <host port>\n`. Then
//!   the Unix stream carries the connection's bytes.
//! - Guest-initiated: a REQUEST to host port P connects to `<uds_path>_P`.
//!
//! Flow control is virtio's (section 5.10.6.3): the muxer advertises
//! [`CONN_BUF`] bytes of receive buffer per connection, holds at most that
//! much guest data not yet written to the Unix stream, and reads from the
//! Unix stream only as much as the guest has credit for and only when the
//! device has an RX buffer to put it in. So neither a flooding guest nor a
//! guest that never reads makes host memory grow.
//!
//! Nor does any guest make the device thread spin: a Unix stream is in the
//! epoll set only for what the muxer can act on now (readability while it
//! has no unread data flagged, writability while guest data waits), and it
//! leaves the set when it hangs up or errs (`EPOLLHUP`/`EPOLLERR` are
//! reported whatever the interest, so a closed stream left registered would
//! wake the thread for ever). Connections that wait on the guest time out
//! ([`CONNECT_TIMEOUT`], [`HALF_CLOSED_TIMEOUT`]), checked by a timer that
//! ticks ([`TICK`]) only while such a connection exists.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use crate::guest_warn;
use crate::log_limit::LogLimiter;

use super::packet::{op, Header, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM};

/// The host's context ID.
pub const HOST_CID: u64 = 2;
/// Receive buffer advertised per connection (bytes).
pub const CONN_BUF: u32 = 256 * 1024;
/// Most connections at once per VM.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most control packets waiting for RX buffers.
pub const MAX_PENDING_CONTROL: usize = 4096;
/// Longest `CONNECT <port>\n` line (bytes).
const MAX_HANDSHAKE: usize = 32;
/// Host ports of host-initiated connections are taken from
/// `[FIRST_LOCAL_PORT, u32::MAX]`.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// Where a muxer starts giving out host ports: a random point of the range.
/// A guest restored from a snapshot (or branched) still holds the
/// connections of the VM it was saved from until it has handled
/// `TRANSPORT_RESET`; a new connection reusing one of their port pairs
/// would be taken for the old one (a restored guest ignored the first
/// `CONNECT` that way). Starting at a random point makes such a reuse
/// improbable (a few old connections among 3 * 2^30 ports).
fn first_local_port() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    FIRST_LOCAL_PORT + (random % u64::from(u32::MAX - FIRST_LOCAL_PORT)) as u32
}
/// How long a host-initiated connection waits for the guest's RESPONSE
/// (or RST) to its REQUEST before the muxer gives up: it closes the host
/// stream and sends the guest an RST (virtio 1.2, section 5.10.6.4 leaves
/// the wait to the implementation; Linux's own connect timeout is 2 s,
/// `VSOCK_DEFAULT_CONNECT_TIMEOUT`). Generous, for slow nested guests.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection one side of which has shut down (the host stream
/// reached EOF and the guest was sent SHUTDOWN, or the guest sent SHUTDOWN
/// for one direction) may go without any packet or byte moving on it
/// before the muxer resets it (RST to the guest, host stream closed).
/// Virtio 1.2, section 5.10.6.6: "If no VIRTIO_VSOCK_OP_RST response is
/// received within an implementation-specific amount of time, a
/// VIRTIO_VSOCK_OP_RST packet is sent to forcibly disconnect the socket"
/// (Linux waits 8 s, `VSOCK_CLOSE_TIMEOUT`).
pub const HALF_CLOSED_TIMEOUT: Duration = Duration::from_secs(30);
/// Period of the timeout timer while a connection can time out (or host
/// connections are held); the timer is off otherwise. Timeouts fire up to
/// one tick late.
pub const TICK: Duration = Duration::from_secs(1);
const LISTENER_TOKEN: u64 = u64::MAX;
const TIMER_TOKEN: u64 = u64::MAX - 1;
const EVENTS_PER_WAIT: usize = 64;

/// (host port, guest port).
type Key = (u32, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Host-initiated; REQUEST sent, waiting for the guest's RESPONSE.
    Connecting,
    Established,
}

struct Conn {
    stream: UnixStream,
    state: State,
    /// Guest data not yet written to the stream (at most CONN_BUF bytes).
    pending: VecDeque<u8>,
    /// Bytes of guest data written to the stream (our fwd_cnt).
    fwd_cnt: u32,
    /// fwd_cnt as last told to the guest.
    fwd_cnt_sent: u32,
    /// The guest's receive buffer and consumed count.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    rx_cnt: u32,
    /// The stream has data (or EOF) to read.
    readable: bool,
    /// The stream reached EOF; SHUTDOWN sent to the guest.
    local_eof: bool,
    /// SHUTDOWN flags the guest sent.
    peer_shutdown: u32,
    /// Epoll interest currently registered.
    interest: u32,
    /// Whether the stream is in the epoll set (it leaves on hang-up or error).
    registered: bool,
    /// When the connection last changed state or moved a packet or byte
    /// (the timeouts count from here).
    active_at: Instant,
}

impl Conn {
    fn new(stream: UnixStream, state: State) -> Self {
        Conn {
            stream,
            state,
            pending: VecDeque::new(),
            fwd_cnt: 0,
            fwd_cnt_sent: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            rx_cnt: 0,
            readable: false,
            local_eof: false,
            peer_shutdown: 0,
            interest: 0,
            registered: false,
            active_at: Instant::now(),
        }
    }

    /// When the connection times out if nothing moves, if it can.
    fn deadline(&self) -> Option<Instant> {
        if self.state == State::Connecting {
            Some(self.active_at + CONNECT_TIMEOUT)
        } else if self.local_eof || self.peer_shutdown != 0 {
            Some(self.active_at + HALF_CLOSED_TIMEOUT)
        } else {
            None
        }
    }

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc.saturating_sub(self.rx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    fn wanted_interest(&self) -> u32 {
        let mut i = 0;
        if !self.readable && !self.local_eof && self.state == State::Established {
            i |= EventSet::IN.bits();
        }
        if !self.pending.is_empty() {
            i |= EventSet::OUT.bits();
        }
        i
    }
}

/// Errors of muxer set-up.
#[derive(Debug, thiserror::Error)]
pub enum MuxerError {
    /// The Unix socket cannot be created.
    #[error("cannot listen on the vsock Unix socket {path}: {source}")]
    Listen {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// epoll set-up failed.
    #[error("vsock epoll set-up failed: {0}")]
    Epoll(#[source] std::io::Error),
    /// The timeout timer cannot be created.
    #[error("vsock timer set-up failed: {0}")]
    Timer(#[source] std::io::Error),
}

/// The host end of one VM's vsock device.
pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    conns: BTreeMap<Key, Conn>,
    by_fd: HashMap<RawFd, Key>,
    handshakes: HashMap<RawFd, (UnixStream, Vec<u8>)>,
    control: VecDeque<Header>,
    next_local_port: u32,
    /// Where the RX round robin resumes.
    rr_cursor: Option<Key>,
    /// (device, inode) of the socket file this muxer bound.
    socket_id: Option<(u64, u64)>,
    /// While the guest has not yet handled a transport reset: host
    /// connections whose handshake is done, waiting to be requested.
    held: Option<Vec<(UnixStream, u32)>>,
    /// The timeout timer (non-blocking, in `epoll`).
    timer: TimerFd,
    /// Whether `timer` ticks.
    ticking: bool,
    /// Guest-triggered log lines (shared per VM).
    log: std::sync::Arc<LogLimiter>,
}

impl Muxer {
    /// Listens on `uds_path` (replacing a stale socket file) for a guest
    /// with context ID `guest_cid`.
    ///
    /// Errors: [`MuxerError`].
    pub fn new(uds_path: &Path, guest_cid: u64) -> Result<Self, MuxerError> {
        let listen_err = |source| MuxerError::Listen { path: uds_path.to_path_buf(), source };
        match std::fs::remove_file(uds_path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(listen_err(e)),
        }
        let listener = UnixListener::bind(uds_path).map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        let socket_id = std::fs::metadata(uds_path).ok().map(|m| (m.dev(), m.ino()));
        let epoll = Epoll::new().map_err(MuxerError::Epoll)?;
        epoll
            .ctl(ControlOperation::Add, listener.as_raw_fd(), EpollEvent::new(EventSet::IN, LISTENER_TOKEN))
            .map_err(MuxerError::Epoll)?;
        let timer = TimerFd::new().map_err(|e| MuxerError::Timer(std::io::Error::from_raw_os_error(e.errno())))?;
        // Non-blocking: re-arming clears a pending expiry that epoll may
        // already have reported, and the read must not then block.
        nix::fcntl::fcntl(timer.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))
            .map_err(|e| MuxerError::Timer(e.into()))?;
        epoll
            .ctl(ControlOperation::Add, timer.as_raw_fd(), EpollEvent::new(EventSet::IN, TIMER_TOKEN))
            .map_err(MuxerError::Epoll)?;
        Ok(Muxer {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            epoll,
            conns: BTreeMap::new(),
            by_fd: HashMap::new(),
            handshakes: HashMap::new(),
            control: VecDeque::new(),
            next_local_port: first_local_port(),
            rr_cursor: None,
            socket_id,
            held: None,
            timer,
            ticking: false,
            log: Default::default(),
        })
    }

    /// Shares the VM's limiter of guest-triggered log lines.
    pub fn set_log_limiter(&mut self, log: std::sync::Arc<LogLimiter>) {
        self.log = log;
    }

    /// The fd that is readable when a Unix socket needs attention.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Number of open connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    fn header(&self, key: Key, op: u16) -> Header {
        let fwd_cnt = self.conns.get(&key).map_or(0, |c| c.fwd_cnt);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.0,
            dst_port: key.1,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: CONN_BUF,
            fwd_cnt,
        }
    }

    fn push_control(&mut self, h: Header) {
        if self.control.len() >= MAX_PENDING_CONTROL {
            guest_warn!(
                self.log,
                "virtio-vsock: {} control packets wait for RX buffers; dropping op {} to port {}",
                self.control.len(),
                h.op,
                h.dst_port
            );
            return;
        }
        self.control.push_back(h);
    }

    /// Whether the stream of connection (host port, guest port) is in the
    /// epoll set.
    pub fn is_registered(&self, key: (u32, u32)) -> bool {
        self.conns.get(&key).is_some_and(|c| c.registered)
    }

    /// The (host port, guest port) of every open connection.
    pub fn connection_keys(&self) -> Vec<(u32, u32)> {
        self.conns.keys().copied().collect()
    }

    /// Whether the timeout timer ticks.
    pub fn timer_ticking(&self) -> bool {
        self.ticking
    }

    /// Starts the timeout timer if it is off.
    fn start_tick(&mut self) {
        if !self.ticking {
            match self.timer.reset(TICK, Some(TICK)) {
                Ok(()) => self.ticking = true,
                Err(e) => tracing::warn!("virtio-vsock: cannot arm the timeout timer: {e}"),
            }
        }
    }

    /// Marks connection `key` active now; starts the timer if it can time out.
    fn touch(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        c.active_at = Instant::now();
        if c.deadline().is_some() {
            self.start_tick();
        }
    }

    /// Resets every connection whose timeout ([`CONNECT_TIMEOUT`],
    /// [`HALF_CLOSED_TIMEOUT`]) passed by `now` (RST to the guest, host
    /// stream closed), and stops the timer when nothing can time out any
    /// more (no such connection, no held host connections). The timer
    /// calls this with the current time.
    pub fn expire(&mut self, now: Instant) {
        let mut timed = false;
        let mut expired = Vec::new();
        for (k, c) in &self.conns {
            match c.deadline() {
                Some(d) if d <= now => expired.push((*k, c.state)),
                Some(_) => timed = true,
                None => {}
            }
        }
        for (key, state) in expired {
            let why = if state == State::Connecting {
                "the guest did not answer the REQUEST in time"
            } else {
                "half-closed for too long"
            };
            self.reset_conn(key, why);
        }
        if !timed && self.held.is_none() && self.ticking {
            match self.timer.clear() {
                Ok(()) => self.ticking = false,
                Err(e) => tracing::warn!("virtio-vsock: cannot stop the timeout timer: {e}"),
            }
        }
    }

    fn update_interest(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if !c.registered {
            return;
        }
        let want = c.wanted_interest();
        if want != c.interest {
            let fd = c.stream.as_raw_fd();
            let ev = EpollEvent::new(EventSet::from_bits_truncate(want), fd as u64);
            if let Err(e) = self.epoll.ctl(ControlOperation::Modify, fd, ev) {
                tracing::warn!("virtio-vsock: epoll modify: {e}");
            }
            c.interest = want;
        }
    }

    fn add_conn(&mut self, key: Key, mut conn: Conn) {
        let fd = conn.stream.as_raw_fd();
        match self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::empty(), fd as u64)) {
            Ok(()) => conn.registered = true,
            Err(e) => tracing::warn!("virtio-vsock: epoll add: {e}"),
        }
        self.by_fd.insert(fd, key);
        self.conns.insert(key, conn);
        self.update_interest(key);
        self.touch(key);
    }

    /// Takes connection `key`'s stream out of the epoll set for good (it
    /// hung up or erred: epoll would report that on every wait).
    fn deregister(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if c.registered {
            let fd = c.stream.as_raw_fd();
            let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
            c.registered = false;
            c.interest = 0;
        }
    }

    fn remove_conn(&mut self, key: Key, why: &str) {
        if let Some(c) = self.conns.remove(&key) {
            tracing::debug!(
                host_port = key.0,
                guest_port = key.1,
                pending = c.pending.len(),
                "virtio-vsock: connection closed: {why}"
            );
            let fd = c.stream.as_raw_fd();
            if c.registered {
                let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
            }
            self.by_fd.remove(&fd);
        }
    }

    /// Closes the connection and tells the guest (RST).
    fn reset_conn(&mut self, key: Key, why: &str) {
        let h = self.header(key, op::RST);
        self.remove_conn(key, why);
        self.push_control(h);
    }

    /// Closes every connection without telling the guest (the device
    /// sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET instead).
    pub fn reset_all(&mut self) {
        let keys: Vec<Key> = self.conns.keys().copied().collect();
        for k in keys {
            self.remove_conn(k, "transport reset");
        }
        for (fd, _) in self.handshakes.drain() {
            let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
        }
        self.control.clear();
        if let Some(held) = self.held.as_mut() {
            held.clear();
        }
        self.expire(Instant::now());
    }

    /// Handles a packet the guest sent (TX queue); `payload` holds
    /// `hdr.len` bytes.
    pub fn from_guest(&mut self, hdr: &Header, payload: &[u8]) {
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID {
            guest_warn!(
                self.log,
                "virtio-vsock: packet from CID {} to CID {} dropped (guest is {})",
                hdr.src_cid,
                hdr.dst_cid,
                self.guest_cid
            );
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.op != op::RW {
            tracing::debug!(?hdr, "virtio-vsock: from guest");
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.active_at = Instant::now();
        }
        if hdr.type_ != TYPE_STREAM {
            if hdr.op != op::RST {
                self.push_control(self.header(key, op::RST));
            }
            return;
        }
        match hdr.op {
            op::REQUEST => self.guest_connect(key),
            op::RESPONSE => match self.conns.get_mut(&key) {
                Some(c) if c.state == State::Connecting => {
                    c.state = State::Established;
                    let ok = format!("OK {}\n", key.0);
                    if let Err(e) = c.stream.write_all(ok.as_bytes()) {
                        self.reset_conn(key, &format!("writing OK: {e}"));
                    } else {
                        self.update_interest(key);
                    }
                }
                _ => self.push_control(self.header(key, op::RST)),
            },
            op::RW => self.guest_data(key, payload),
            op::CREDIT_UPDATE => {}
            op::CREDIT_REQUEST => {
                if self.conns.contains_key(&key) {
                    self.send_credit_update(key);
                } else {
                    self.push_control(self.header(key, op::RST));
                }
            }
            op::SHUTDOWN => self.guest_shutdown(key, hdr.flags),
            op::RST => self.remove_conn(key, "RST from the guest"),
            other => {
                guest_warn!(self.log, "virtio-vsock: unknown op {other} from the guest; connection reset");
                self.reset_conn(key, "unknown op");
            }
        }
        // Every packet carries the guest's credit; a REQUEST's applies to
        // the connection it just created.
        if let Some(c) = self.conns.get_mut(&key) {
            c.peer_buf_alloc = hdr.buf_alloc;
            c.peer_fwd_cnt = hdr.fwd_cnt;
        }
    }

    fn send_credit_update(&mut self, key: Key) {
        let h = self.header(key, op::CREDIT_UPDATE);
        if let Some(c) = self.conns.get_mut(&key) {
            c.fwd_cnt_sent = c.fwd_cnt;
        }
        self.push_control(h);
    }

    fn guest_connect(&mut self, key: Key) {
        if self.conns.contains_key(&key) || self.conns.len() >= MAX_CONNECTIONS {
            guest_warn!(
                self.log,
                "virtio-vsock: guest connection to port {} refused (duplicate or {} connections)",
                key.0,
                self.conns.len()
            );
            self.push_control(self.header(key, op::RST));
            return;
        }
        let path = format!("{}_{}", self.uds_path.display(), key.0);
        match UnixStream::connect(&path).and_then(|s| s.set_nonblocking(true).map(|()| s)) {
            Ok(stream) => {
                self.add_conn(key, Conn::new(stream, State::Established));
                self.push_control(self.header(key, op::RESPONSE));
            }
            Err(e) => {
                tracing::debug!("virtio-vsock: guest connection to {path}: {e}");
                self.push_control(self.header(key, op::RST));
            }
        }
    }

    fn guest_data(&mut self, key: Key, payload: &[u8]) {
        let Some(c) = self.conns.get_mut(&key) else {
            self.push_control(self.header(key, op::RST));
            return;
        };
        if c.state != State::Established || c.peer_shutdown & SHUTDOWN_SEND != 0 {
            self.reset_conn(key, "data on a connection not open for it");
            return;
        }
        if c.pending.len() + payload.len() > CONN_BUF as usize {
            guest_warn!(self.log, "virtio-vsock: guest port {} sent past its credit; connection reset", key.1);
            self.reset_conn(key, "credit exceeded");
            return;
        }
        let mut written = 0;
        if c.pending.is_empty() {
            match c.stream.write(payload) {
                Ok(n) => written = n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => {
                    self.reset_conn(key, &format!("write: {e}"));
                    return;
                }
            }
        }
        c.pending.extend(&payload[written..]);
        c.fwd_cnt = c.fwd_cnt.wrapping_add(written as u32);
        self.after_forward(key);
    }

    /// After bytes went to the stream: credit update when the guest's view
    /// of our free space got small, and epoll interest.
    fn after_forward(&mut self, key: Key) {
        let Some(c) = self.conns.get(&key) else { return };
        if c.fwd_cnt.wrapping_sub(c.fwd_cnt_sent) >= CONN_BUF / 4 {
            self.send_credit_update(key);
        }
        self.update_interest(key);
    }

    fn guest_shutdown(&mut self, key: Key, flags: u32) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        c.peer_shutdown |= flags & (SHUTDOWN_RCV | SHUTDOWN_SEND);
        if c.peer_shutdown & SHUTDOWN_SEND != 0 && c.pending.is_empty() {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
        if c.peer_shutdown == SHUTDOWN_RCV | SHUTDOWN_SEND {
            // Both directions closed: finish with RST (section 5.10.6.6).
            self.reset_conn(key, "guest shut down both directions");
        } else {
            self.touch(key);
        }
    }

    /// Handles what the Unix sockets reported (non-blocking).
    pub fn process_host_events(&mut self) {
        let mut events = [EpollEvent::default(); EVENTS_PER_WAIT];
        let n = match self.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("virtio-vsock: epoll_wait: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == LISTENER_TOKEN {
                self.accept();
                continue;
            }
            if token == TIMER_TOKEN {
                // Non-blocking: nothing to read if a re-arm cleared it.
                let _ = self.timer.wait();
                self.expire(Instant::now());
                continue;
            }
            let fd = token as RawFd;
            if self.handshakes.contains_key(&fd) {
                self.handshake(fd);
                continue;
            }
            let Some(&key) = self.by_fd.get(&fd) else { continue };
            let set = ev.event_set();
            let gone = set.intersects(EventSet::HANG_UP | EventSet::ERROR);
            if set.intersects(EventSet::OUT) || (gone && self.conns.get(&key).is_some_and(|c| !c.pending.is_empty())) {
                self.flush_pending(key);
            }
            if gone {
                // Reported whatever the interest: out of the set for good;
                // reading the stream (EOF or the error) finishes it.
                self.deregister(key);
                if self.conns.get(&key).is_some_and(|c| c.state == State::Connecting) {
                    self.reset_conn(key, "the host end hung up before the guest answered");
                    continue;
                }
            }
            if set.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR) {
                if let Some(c) = self.conns.get_mut(&key) {
                    c.readable = true;
                }
                self.update_interest(key);
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.handshakes.len() + self.conns.len() >= MAX_CONNECTIONS
                        || stream.set_nonblocking(true).is_err()
                    {
                        tracing::warn!("virtio-vsock: host connection refused ({} connections)", self.conns.len());
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    if self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, fd as u64)).is_ok() {
                        self.handshakes.insert(fd, (stream, Vec::new()));
                        // The line may be there already.
                        self.handshake(fd);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("virtio-vsock: accept: {e}");
                    return;
                }
            }
        }
    }

    /// Reads the `CONNECT <port>\n` line one byte at a time (so no byte of
    /// the connection's data is taken by mistake).
    fn handshake(&mut self, fd: RawFd) {
        let Some((stream, line)) = self.handshakes.get_mut(&fd) else { return };
        let mut byte = [0u8; 1];
        let done = loop {
            match stream.read(&mut byte) {
                Ok(0) => break Err("closed before CONNECT"),
                Ok(_) if byte[0] == b'\n' => break Ok(()),
                Ok(_) if line.len() >= MAX_HANDSHAKE => break Err("CONNECT line too long"),
                Ok(_) => line.push(byte[0]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => break Err("read error"),
            }
        };
        let Some((stream, line)) = self.handshakes.remove(&fd) else { return };
        let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
        let port = done.and_then(|()| {
            std::str::from_utf8(&line)
                .ok()
                .and_then(|l| l.trim_end_matches('\r').strip_prefix("CONNECT "))
                .and_then(|p| p.trim().parse::<u32>().ok())
                .ok_or("expected CONNECT <port>")
        });
        let port = match port {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!("virtio-vsock: host connection dropped: {why}");
                return;
            }
        };
        match self.held.as_mut() {
            Some(held) => held.push((stream, port)),
            None => self.request(stream, port),
        }
    }

    /// Starts a host-initiated connection: a REQUEST to guest `port`.
    fn request(&mut self, stream: UnixStream, port: u32) {
        let local = self.alloc_local_port(port);
        let key = (local, port);
        self.add_conn(key, Conn::new(stream, State::Connecting));
        self.push_control(self.header(key, op::REQUEST));
    }

    /// Holds new host connections (their CONNECT is read and kept) until
    /// [`Muxer::release_host_connections`]: a guest that has not handled
    /// `TRANSPORT_RESET` yet would reset them with its old connections.
    pub fn hold_host_connections(&mut self) {
        self.held.get_or_insert_with(Vec::new);
        // The device checks for the guest's acknowledgement (or its
        // timeout) on every host event: the timer provides them.
        self.start_tick();
    }

    /// Whether host connections are being held.
    pub fn holding(&self) -> bool {
        self.held.is_some()
    }

    /// Sends the REQUESTs of every held connection and stops holding.
    pub fn release_host_connections(&mut self) {
        for (stream, port) in self.held.take().unwrap_or_default() {
            self.request(stream, port);
        }
    }

    fn alloc_local_port(&mut self, peer: u32) -> u32 {
        loop {
            let p = self.next_local_port;
            self.next_local_port = self.next_local_port.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.contains_key(&(p, peer)) {
                return p;
            }
        }
    }

    fn flush_pending(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        while !c.pending.is_empty() {
            let (a, _) = c.pending.as_slices();
            match c.stream.write(a) {
                Ok(0) => break,
                Ok(n) => {
                    c.pending.drain(..n);
                    c.fwd_cnt = c.fwd_cnt.wrapping_add(n as u32);
                    c.active_at = Instant::now();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => {
                    self.reset_conn(key, &format!("flush: {e}"));
                    return;
                }
            }
        }
        if c.pending.is_empty() && c.peer_shutdown & SHUTDOWN_SEND != 0 {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
        self.after_forward(key);
    }

    /// Whether [`Muxer::next_rx`] may have something.
    pub fn has_rx(&self) -> bool {
        !self.control.is_empty() || self.conns.values().any(|c| c.readable && c.peer_credit() > 0)
    }

    /// The next packet for the guest's RX queue: its header, with up to
    /// `buf.len()` bytes of payload read into `buf`. `None` when nothing is
    /// ready.
    pub fn next_rx(&mut self, buf: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(mut h) = self.control.pop_front() {
            if let Some(c) = self.conns.get(&(h.src_port, h.dst_port)) {
                h.fwd_cnt = c.fwd_cnt;
            }
            return Some((h, 0));
        }
        // Round robin over readable connections the guest has credit for.
        let keys: Vec<Key> = match self.rr_cursor {
            Some(cur) => self
                .conns
                .range((std::ops::Bound::Excluded(cur), std::ops::Bound::Unbounded))
                .chain(self.conns.range(..=cur))
                .filter(|(_, c)| c.readable && c.peer_credit() > 0)
                .map(|(k, _)| *k)
                .collect(),
            None => self.conns.iter().filter(|(_, c)| c.readable && c.peer_credit() > 0).map(|(k, _)| *k).collect(),
        };
        for key in keys {
            let c = self.conns.get_mut(&key)?;
            let want = buf.len().min(c.peer_credit() as usize);
            if want == 0 {
                continue;
            }
            match c.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    c.readable = false;
                    c.local_eof = true;
                    let mut h = self.header(key, op::SHUTDOWN);
                    h.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
                    self.update_interest(key);
                    self.touch(key);
                    self.rr_cursor = Some(key);
                    return Some((h, 0));
                }
                Ok(n) => {
                    c.rx_cnt = c.rx_cnt.wrapping_add(n as u32);
                    c.active_at = Instant::now();
                    let mut h = self.header(key, op::RW);
                    h.len = n as u32;
                    self.rr_cursor = Some(key);
                    return Some((h, n));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    c.readable = false;
                    self.update_interest(key);
                }
                Err(e) => {
                    let h = self.header(key, op::RST);
                    self.remove_conn(key, &format!("read: {e}"));
                    return Some((h, 0));
                }
            }
        }
        None
    }
}

impl Drop for Muxer {
    fn drop(&mut self) {
        // Remove the socket file only if it is still ours: a device
        // restored in place has bound a new socket at the same path.
        let current = std::fs::metadata(&self.uds_path).ok().map(|m| (m.dev(), m.ino()));
        if current.is_some() && current == self.socket_id {
            let _ = std::fs::remove_file(&self.uds_path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GUEST_CID: u64 = 3;

    fn guest(op: u16, src_port: u32, dst_port: u32) -> Header {
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 1 << 20,
            fwd_cnt: 0,
        }
    }

    /// Whether the muxer's epoll fd would wake the device thread now.
    fn wakes(m: &Muxer) -> bool {
        let outer = Epoll::new().unwrap();
        outer.ctl(ControlOperation::Add, m.epoll_fd(), EpollEvent::new(EventSet::IN, 1)).unwrap();
        let mut ev = [EpollEvent::default(); 1];
        outer.wait(0, &mut ev).unwrap() > 0
    }

    /// Every packet the muxer has for the guest now.
    fn drain(m: &mut Muxer) -> Vec<Header> {
        let mut buf = vec![0u8; 4096];
        std::iter::from_fn(|| m.next_rx(&mut buf).map(|(h, _)| h)).collect()
    }

    /// A muxer with a guest connection from guest port 1234 to host port
    /// 6000; returns the host end.
    fn connected(dir: &Path) -> (Muxer, UnixStream) {
        let uds = dir.join("vm.vsock");
        let mut m = Muxer::new(&uds, GUEST_CID).unwrap();
        let l = UnixListener::bind(format!("{}_6000", uds.display())).unwrap();
        m.from_guest(&guest(op::REQUEST, 1234, 6000), &[]);
        let (s, _) = l.accept().unwrap();
        assert_eq!(drain(&mut m).iter().map(|h| h.op).collect::<Vec<_>>(), vec![op::RESPONSE]);
        (m, s)
    }

    #[test]
    fn a_closed_host_stream_leaves_the_epoll_set() {
        let dir = tempfile::tempdir().unwrap();
        let (mut m, s) = connected(dir.path());
        let key = (6000, 1234);
        assert!(m.is_registered(key));
        assert!(!wakes(&m), "an idle connection must not wake the device thread");
        drop(s);
        assert!(wakes(&m));
        m.process_host_events();
        assert!(!m.is_registered(key), "a hung-up stream stays in the epoll set");
        assert!(!wakes(&m), "EPOLLHUP keeps waking the device thread");
        // The guest learns of it; the connection waits for its RST.
        let rx = drain(&mut m);
        assert_eq!((rx.len(), rx[0].op, rx[0].flags), (1, op::SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND));
        assert_eq!(m.connections(), 1);
        m.from_guest(&guest(op::RST, 1234, 6000), &[]);
        assert_eq!(m.connections(), 0);
        assert!(!wakes(&m));
    }

    #[test]
    fn a_closed_host_stream_with_a_guest_that_takes_nothing_stays_quiet() {
        let dir = tempfile::tempdir().unwrap();
        let (mut m, s) = connected(dir.path());
        // The guest grants no credit and never reads.
        let mut h = guest(op::CREDIT_UPDATE, 1234, 6000);
        h.buf_alloc = 0;
        m.from_guest(&h, &[]);
        (&s).write_all(b"data the guest cannot take").unwrap();
        drop(s);
        m.process_host_events();
        assert!(!m.has_rx());
        assert!(!wakes(&m), "a stream the guest cannot be sent from must not wake the device thread");
    }

    #[test]
    fn an_unanswered_host_connection_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let mut m = Muxer::new(&uds, GUEST_CID).unwrap();
        let mut c = UnixStream::connect(&uds).unwrap();
        c.write_all(b"CONNECT 7000\n").unwrap();
        m.process_host_events();
        let rx = drain(&mut m);
        assert_eq!((rx.len(), rx[0].op, rx[0].dst_port), (1, op::REQUEST, 7000));
        let key = (rx[0].src_port, 7000);
        assert!(m.timer_ticking(), "a connecting connection needs the timer");
        let start = Instant::now();
        m.expire(start + CONNECT_TIMEOUT - Duration::from_secs(1));
        assert_eq!(m.connection_keys(), vec![key], "timed out early");
        m.expire(start + CONNECT_TIMEOUT + TICK);
        assert_eq!(m.connections(), 0);
        let rx = drain(&mut m);
        assert_eq!((rx.len(), rx[0].op, rx[0].src_port, rx[0].dst_port), (1, op::RST, key.0, 7000));
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(c.read(&mut [0u8; 8]).unwrap(), 0, "the host client sees EOF");
        assert!(!m.timer_ticking(), "nothing left to time out: the timer stops");
        // A late RESPONSE gets an RST.
        let mut late = guest(op::RESPONSE, 7000, key.0);
        late.dst_port = key.0;
        m.from_guest(&late, &[]);
        assert_eq!(drain(&mut m).iter().map(|h| h.op).collect::<Vec<_>>(), vec![op::RST]);
    }

    #[test]
    fn a_host_client_that_gives_up_before_the_answer_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let mut m = Muxer::new(&uds, GUEST_CID).unwrap();
        let mut c = UnixStream::connect(&uds).unwrap();
        c.write_all(b"CONNECT 7000\n").unwrap();
        m.process_host_events();
        assert_eq!(drain(&mut m)[0].op, op::REQUEST);
        drop(c);
        m.process_host_events();
        assert_eq!(m.connections(), 0);
        assert_eq!(drain(&mut m).iter().map(|h| h.op).collect::<Vec<_>>(), vec![op::RST]);
        assert!(!wakes(&m));
    }

    #[test]
    fn half_closed_connections_time_out() {
        let dir = tempfile::tempdir().unwrap();
        // The guest shuts down its sending side and then goes silent.
        let (mut m, mut s) = connected(dir.path());
        assert!(!m.timer_ticking(), "an open connection needs no timer");
        let mut h = guest(op::SHUTDOWN, 1234, 6000);
        h.flags = SHUTDOWN_SEND;
        m.from_guest(&h, &[]);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "the host end sees the guest's EOF");
        assert!(m.timer_ticking());
        let start = Instant::now();
        m.expire(start + HALF_CLOSED_TIMEOUT - Duration::from_secs(1));
        assert_eq!(m.connections(), 1, "timed out early");
        m.expire(start + HALF_CLOSED_TIMEOUT + TICK);
        assert_eq!(m.connections(), 0);
        assert_eq!(drain(&mut m).iter().map(|h| h.op).collect::<Vec<_>>(), vec![op::RST]);
        assert!(!m.timer_ticking());

        // The host closes and the guest never answers the SHUTDOWN with RST.
        let dir = tempfile::tempdir().unwrap();
        let (mut m, s) = connected(dir.path());
        drop(s);
        m.process_host_events();
        assert_eq!(drain(&mut m)[0].op, op::SHUTDOWN);
        m.expire(Instant::now() + HALF_CLOSED_TIMEOUT + TICK);
        assert_eq!(m.connections(), 0);
        assert_eq!(drain(&mut m).iter().map(|h| h.op).collect::<Vec<_>>(), vec![op::RST]);
    }

    #[test]
    fn traffic_keeps_a_half_closed_connection() {
        let dir = tempfile::tempdir().unwrap();
        let (mut m, s) = connected(dir.path());
        let mut h = guest(op::SHUTDOWN, 1234, 6000);
        h.flags = SHUTDOWN_SEND;
        m.from_guest(&h, &[]);
        // The host still sends: each byte that moves restarts the clock.
        (&s).write_all(b"reply").unwrap();
        m.process_host_events();
        let before = Instant::now();
        let mut buf = [0u8; 64];
        assert_eq!(m.next_rx(&mut buf).map(|(h, n)| (h.op, n)), Some((op::RW, 5)));
        m.expire(before + HALF_CLOSED_TIMEOUT - Duration::from_millis(500));
        assert_eq!(m.connections(), 1);
    }
}
