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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

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
const LISTENER_TOKEN: u64 = u64::MAX;
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
        })
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
            tracing::warn!(
                "virtio-vsock: {} control packets wait for RX buffers; dropping op {} to port {}",
                self.control.len(),
                h.op,
                h.dst_port
            );
            return;
        }
        self.control.push_back(h);
    }

    fn update_interest(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
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

    fn add_conn(&mut self, key: Key, conn: Conn) {
        let fd = conn.stream.as_raw_fd();
        if let Err(e) = self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::empty(), fd as u64)) {
            tracing::warn!("virtio-vsock: epoll add: {e}");
        }
        self.by_fd.insert(fd, key);
        self.conns.insert(key, conn);
        self.update_interest(key);
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
            let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
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
    }

    /// Handles a packet the guest sent (TX queue); `payload` holds
    /// `hdr.len` bytes.
    pub fn from_guest(&mut self, hdr: &Header, payload: &[u8]) {
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID {
            tracing::warn!(
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
                tracing::warn!("virtio-vsock: unknown op {other} from the guest; connection reset");
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
            tracing::warn!(
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
            tracing::warn!("virtio-vsock: guest port {} sent past its credit; connection reset", key.1);
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
            let fd = token as RawFd;
            if self.handshakes.contains_key(&fd) {
                self.handshake(fd);
                continue;
            }
            let Some(&key) = self.by_fd.get(&fd) else { continue };
            let set = ev.event_set();
            if set.intersects(EventSet::OUT) {
                self.flush_pending(key);
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
                    self.rr_cursor = Some(key);
                    return Some((h, 0));
                }
                Ok(n) => {
                    c.rx_cnt = c.rx_cnt.wrapping_add(n as u32);
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
