//! virtio-vsock driven by the test driver (tests/common/driver.rs) and by
//! real Unix sockets on the host side: the connection protocol, and what a
//! hostile guest can do to it. No KVM needed.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use common::driver::{Driver, DATA_BASE, WRITE};
use common::vsock::{guest_header, GUEST_CID};
use vmm::devices::virtio::vsock::muxer::{CONN_BUF, HOST_CID};
use vmm::devices::virtio::vsock::packet::{op, Header, HDR_LEN, MAX_PAYLOAD, SHUTDOWN_RCV, SHUTDOWN_SEND};
use vmm::devices::virtio::vsock::{Vsock, VIRTIO_VSOCK_EVENT_TRANSPORT_RESET};

const RXQ: usize = 0;
const TXQ: usize = 1;
const EVQ: usize = 2;
const QSIZE: u16 = 16;
const RX_BASE: u64 = DATA_BASE;
const RX_BUF: u32 = 4096;
const TX_BASE: u64 = DATA_BASE + 0x10_0000;
const EV_BASE: u64 = DATA_BASE + 0x20_0000;

struct Harness {
    _dir: tempfile::TempDir,
    uds: PathBuf,
    d: Driver,
    /// Give used RX buffers back to the device.
    refill: bool,
}

fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let vsock = Vsock::new(GUEST_CID, &uds).unwrap();
    let d = Driver::new(Box::new(vsock), 0, QSIZE);
    Harness { _dir: dir, uds, d, refill: true }
}

impl Harness {
    /// Gives the device `n` 4 KiB RX buffers.
    fn rx_buffers(&mut self, n: u16) {
        for i in 0..n {
            self.d.set_desc(RXQ, i, RX_BASE + u64::from(i) * u64::from(RX_BUF), RX_BUF, WRITE, 0);
            self.d.publish(RXQ, i);
        }
    }

    /// Sends a raw TX chain whose single readable buffer holds `bytes`.
    fn tx_raw(&mut self, bytes: &[u8]) {
        self.d.write_bytes(TX_BASE, bytes);
        self.d.add_chain(TXQ, 0, &[(TX_BASE, bytes.len() as u32, 0)]);
        self.d.kick(TXQ);
        assert_eq!(self.d.used(TXQ).len(), 1, "the TX chain was not consumed");
    }

    fn tx(&mut self, h: Header, payload: &[u8]) {
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(payload);
        self.tx_raw(&b);
    }

    /// Packets the device put in RX buffers since the last call; gives the
    /// used buffers back if `refill`.
    fn rx(&mut self) -> Vec<(Header, Vec<u8>)> {
        let mut out = Vec::new();
        for (id, len) in self.d.used(RXQ) {
            let addr = RX_BASE + u64::from(id) * u64::from(RX_BUF);
            assert!(len as usize >= HDR_LEN, "RX used length {len}");
            let raw: [u8; HDR_LEN] = self.d.read_bytes(addr, HDR_LEN).try_into().unwrap();
            let h = Header::from_bytes(&raw);
            let payload = self.d.read_bytes(addr + HDR_LEN as u64, len as usize - HDR_LEN);
            assert_eq!(payload.len(), h.len as usize);
            out.push((h, payload));
            if self.refill {
                self.d.publish(RXQ, id as u16);
            }
        }
        out
    }

    fn host_events(&mut self) {
        // Let the kernel's Unix sockets settle, then run the device's
        // host-side work as the event loop would.
        std::thread::sleep(Duration::from_millis(20));
        self.d.transport.process_events();
    }

    /// Guest connects to host port `port` (listener at `<uds>_<port>`);
    /// returns the host end.
    fn guest_connect(&mut self, guest_port: u32, port: u32) -> UnixStream {
        let l = UnixListener::bind(format!("{}_{port}", self.uds.display())).unwrap();
        self.tx(guest_header(op::REQUEST, guest_port, port, 0), &[]);
        let (s, _) = l.accept().unwrap();
        let rx = self.rx();
        assert_eq!(rx.len(), 1);
        assert_eq!((rx[0].0.op, rx[0].0.src_port, rx[0].0.dst_port), (op::RESPONSE, port, guest_port));
        s
    }
}

#[test]
fn guest_initiated_connection_carries_data_both_ways() {
    let mut h = harness();
    h.rx_buffers(QSIZE);
    let mut s = h.guest_connect(1234, 6000);
    h.tx(guest_header(op::RW, 1234, 6000, 5), b"hello");
    let mut got = [0u8; 5];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello");

    s.write_all(b"world").unwrap();
    h.host_events();
    let rx = h.rx();
    assert_eq!(rx.len(), 1);
    assert_eq!((rx[0].0.op, rx[0].0.dst_port, &rx[0].1[..]), (op::RW, 1234, &b"world"[..]));
    assert_eq!(rx[0].0.fwd_cnt, 5, "the device reports the 5 bytes it forwarded");

    // Host closes: the guest gets SHUTDOWN (both directions).
    drop(s);
    h.host_events();
    let rx = h.rx();
    assert_eq!(rx.len(), 1);
    assert_eq!((rx[0].0.op, rx[0].0.flags), (op::SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND));
    assert!(!h.d.needs_reset());
}

#[test]
fn a_refused_guest_connection_gets_rst() {
    let mut h = harness();
    h.rx_buffers(4);
    h.tx(guest_header(op::REQUEST, 1, 7777, 0), &[]); // nobody listens on <uds>_7777
    let rx = h.rx();
    assert_eq!(rx.len(), 1);
    assert_eq!(rx[0].0.op, op::RST);
}

#[test]
fn host_initiated_connection_uses_the_connect_handshake() {
    let mut h = harness();
    h.rx_buffers(QSIZE);
    let mut s = UnixStream::connect(&h.uds).unwrap();
    s.write_all(b"CONNECT 7000\n").unwrap();
    h.host_events();
    let rx = h.rx();
    assert_eq!(rx.len(), 1);
    let req = rx[0].0;
    assert_eq!((req.op, req.src_cid, req.dst_cid, req.dst_port), (op::REQUEST, HOST_CID, GUEST_CID, 7000));
    assert!(req.src_port >= 1 << 30);
    // The guest accepts.
    let mut resp = guest_header(op::RESPONSE, 7000, req.src_port, 0);
    resp.dst_port = req.src_port;
    h.tx(resp, &[]);
    let mut line = [0u8; 64];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let n = s.read(&mut line).unwrap();
    assert_eq!(std::str::from_utf8(&line[..n]).unwrap(), format!("OK {}\n", req.src_port));
}

#[test]
fn a_bad_handshake_closes_the_socket() {
    let mut h = harness();
    h.rx_buffers(4);
    let mut s = UnixStream::connect(&h.uds).unwrap();
    s.write_all(b"HELLO THERE\n").unwrap();
    h.host_events();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 8];
    assert_eq!(s.read(&mut b).unwrap(), 0, "the muxer must close a bad handshake");
    assert!(h.rx().is_empty(), "no REQUEST for a bad handshake");
    // A line that never ends is cut off too.
    let mut s = UnixStream::connect(&h.uds).unwrap();
    s.write_all(&[b'C'; 100]).unwrap();
    h.host_events();
    h.host_events();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.read(&mut b).unwrap_or(0), 0);
}

#[test]
fn malformed_packets_are_dropped_and_the_device_goes_on() {
    let mut h = harness();
    h.rx_buffers(QSIZE);
    let mut s = h.guest_connect(1234, 6000);
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 64];

    // A payload length past the maximum.
    h.tx(guest_header(op::RW, 1234, 6000, MAX_PAYLOAD + 1), b"xx");
    // A payload length larger than the packet carries.
    h.tx(guest_header(op::RW, 1234, 6000, 1000), b"only ten b");
    // Shorter than a header.
    h.tx_raw(&[0u8; 20]);
    // From another GUEST_CID.
    let mut foreign = guest_header(op::RW, 1234, 6000, 3);
    foreign.src_cid = 99;
    h.tx(foreign, b"bad");
    assert_eq!(s.read(&mut b).unwrap_err().kind(), ErrorKind::WouldBlock, "nothing may reach the host");

    // Datagram type: answered with RST.
    let mut dgram = guest_header(op::RW, 5, 6001, 0);
    dgram.type_ = 2;
    h.tx(dgram, &[]);
    let rx = h.rx();
    assert_eq!(rx.len(), 1);
    assert_eq!((rx[0].0.op, rx[0].0.dst_port), (op::RST, 5));

    // The connection still works.
    h.tx(guest_header(op::RW, 1234, 6000, 2), b"ok");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(s.read(&mut b).unwrap(), 2);

    // An unknown op resets the connection.
    h.tx(guest_header(99, 1234, 6000, 0), &[]);
    let rx = h.rx();
    assert_eq!(rx.len(), 1);
    assert_eq!(rx[0].0.op, op::RST);
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.read(&mut b).unwrap(), 0, "the host end is closed");
    assert!(!h.d.needs_reset());
}

#[test]
fn a_guest_sending_past_its_credit_is_reset() {
    let mut h = harness();
    h.rx_buffers(QSIZE);
    let s = h.guest_connect(1234, 6000); // the host never reads
    let payload = vec![0x5a; MAX_PAYLOAD as usize];
    let mut sent = 0usize;
    let mut reset = false;
    // The kernel's socket buffer takes some; then the muxer holds at most
    // CONN_BUF; past that the connection must be reset.
    for _ in 0..200 {
        h.tx(guest_header(op::RW, 1234, 6000, MAX_PAYLOAD), &payload);
        sent += payload.len();
        if h.rx().iter().any(|(p, _)| p.op == op::RST) {
            reset = true;
            break;
        }
    }
    assert!(reset, "no RST after {sent} bytes with the host not reading");
    assert!(sent <= 8 * CONN_BUF as usize + (4 << 20), "reset came late: {sent} bytes");
    drop(s);
}

#[test]
fn a_guest_that_never_reads_rx_does_not_make_the_host_buffer() {
    let mut h = harness();
    // Connect with one RX buffer for the RESPONSE, then give no more.
    h.refill = false;
    h.rx_buffers(1);
    let s = h.guest_connect(1234, 6000);
    s.set_nonblocking(true).unwrap();
    let chunk = vec![1u8; 64 * 1024];
    let mut written = 0usize;
    for _ in 0..256 {
        match (&s).write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
        h.host_events();
    }
    // The device read nothing it could not deliver: the host's writes
    // stopped at the kernel's socket buffer.
    assert!(written < 4 << 20, "{written} bytes were absorbed");
    assert!(h.rx().is_empty());
    // When buffers come, data flows (at most what fits).
    h.refill = true;
    h.rx_buffers(QSIZE);
    h.d.kick(RXQ);
    let rx = h.rx();
    assert!(!rx.is_empty() && rx.iter().all(|(p, d)| p.op == op::RW && !d.is_empty()));
}

#[test]
fn transport_reset_event_after_restore() {
    let mut h = harness();
    h.rx_buffers(QSIZE);
    let mut s = h.guest_connect(1234, 6000);
    // An event buffer.
    h.d.set_desc(EVQ, 0, EV_BASE, 8, WRITE, 0);
    h.d.publish(EVQ, 0);
    h.d.transport.after_restore();
    let used = h.d.used(EVQ);
    assert_eq!(used, vec![(0, 4)]);
    let id = u32::from_le_bytes(h.d.read_bytes(EV_BASE, 4).try_into().unwrap());
    assert_eq!(id, VIRTIO_VSOCK_EVENT_TRANSPORT_RESET);
    // Host ends of old connections are closed.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 4];
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

#[test]
fn a_restored_device_resets_the_transport_and_takes_new_connections() {
    let mut h = harness();
    h.rx_buffers(QSIZE);
    let mut old = h.guest_connect(1234, 6000);
    h.d.set_desc(EVQ, 0, EV_BASE, 8, WRITE, 0);
    h.d.publish(EVQ, 0);
    // Restore into a new device (the muxer listens on the same path).
    let vsock = Vsock::new(GUEST_CID, &h.uds).unwrap();
    h.d.save_and_restore(Box::new(vsock));
    assert_eq!(h.d.used(EVQ), vec![(0, 4)], "TRANSPORT_RESET after restore");
    // Connections of before are gone.
    old.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(old.read(&mut b).unwrap(), 0);
    // The host socket still exists (the old device did not remove the
    // new one's) and host-initiated connections work.
    let mut c = UnixStream::connect(&h.uds).expect("the vsock socket survives a restore");
    c.write_all(b"CONNECT 7000\n").unwrap();
    h.host_events();
    // Held until the guest has handled the reset: its old connections with
    // the same ports would otherwise take the REQUEST, or the reset kill it.
    assert!(h.rx().iter().all(|(p, _)| p.op != op::REQUEST), "no REQUEST before the guest acknowledges the reset");
    // The guest handles the event and gives the buffer back (as Linux
    // does), which releases the held connection.
    h.d.set_desc(EVQ, 1, EV_BASE, 8, WRITE, 0);
    h.d.publish(EVQ, 1);
    h.d.kick(EVQ);
    assert!(h.rx().iter().any(|(p, _)| p.op == op::REQUEST && p.dst_port == 7000));
    // New connections work, on the restored rings.
    let mut s = h.guest_connect(1235, 6002);
    h.tx(guest_header(op::RW, 1235, 6002, 3), b"new");
    let mut got = [0u8; 3];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"new");
}
