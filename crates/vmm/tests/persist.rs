//! Every device through [`Persist`]: driven into a state that is not its
//! initial one, saved, restored into a fresh device, and checked: the
//! restored device saves exactly the saved state and still works. The
//! virtio devices are driven by the test driver (tests/common/driver.rs)
//! over guest memory from vm-memory, the legacy devices through their
//! ports. No KVM needed.

mod common;

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::time::Duration;

use common::driver::{Driver, DATA_BASE, WRITE};
use common::vsock::{guest_header, GUEST_CID};
use vmm::devices::virtio::block::{req, status, Block, BlockArgs, VIRTIO_BLK_F_FLUSH};
use vmm::devices::virtio::vsock::packet::{op, Header, HDR_LEN};
use vmm::devices::virtio::vsock::{Vsock, VsockArgs};
use vmm::devices::{
    Console, LegacyDevices, Persist, PioEvent, SerialArgs, SerialPort, SerialPortState, COM1_PORT, I8042_PORT,
};
use vmm_sys_util::eventfd::EventFd;

/// Saves `device`, restores a new one from the state and `args`, and
/// checks the new one saves the same state; returns it.
fn round_trip<'a, P>(device: &P, args: P::ConstructorArgs) -> P
where
    P: Persist<'a>,
    P::State: PartialEq + std::fmt::Debug,
    P::Error: std::fmt::Debug,
{
    let state = device.save();
    // Through the snapshot's encoding, as a snapshot keeps it.
    let json = serde_json::to_vec(&state).unwrap();
    let decoded: P::State = serde_json::from_slice(&json).unwrap();
    assert_eq!(decoded, state, "the state survives its encoding");
    let restored = P::restore(args, &decoded).unwrap();
    assert_eq!(restored.save(), state, "the restored device saves the same state");
    restored
}

#[test]
fn virtio_blk_round_trip_and_a_request_after() {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(1 << 20).unwrap();
    let image = vmm::DiskImage::Raw { path: f.path().to_path_buf(), read_only: false };
    let args = || BlockArgs { image: &image, id: "persist-test" };
    let block = Block::restore(args(), &Default::default()).unwrap();
    let mut d = Driver::new(Box::new(block), VIRTIO_BLK_F_FLUSH, 16);
    // Two writes: the queue's indices move off zero.
    let (hdr, data, st) = (DATA_BASE, DATA_BASE + 0x1000, DATA_BASE + 0x2000);
    let request = |d: &mut Driver, kind: u32, data_flags: u16| {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&3u64.to_le_bytes());
        d.write_bytes(hdr, &h);
        d.write_bytes(st, &[0xee]);
        d.add_chain(0, 0, &[(hdr, 16, 0), (data, 512, data_flags), (st, 1, WRITE)]);
        d.kick(0);
        (d.read_u8(st), d.used(0))
    };
    d.write_bytes(data, &[0x5a; 512]);
    for _ in 0..2 {
        assert_eq!(request(&mut d, req::OUT, 0).0, status::OK);
    }
    let transport = d.transport.save();
    assert!(transport.activated);
    assert_eq!((transport.queues[0].next_avail, transport.queues[0].next_used), (2, 2));

    // The transport owns the running device; its state is empty, as any
    // Block's is (the virtqueue is the transport's): round-trip a twin.
    let old = Block::open(f.path(), false, "persist-test").unwrap();
    let new = round_trip(&old, args());
    drop(old);
    d.save_and_restore(Box::new(new));
    assert_eq!(d.transport.save(), transport, "the transport restores to exactly the saved state");
    d.write_bytes(data, &[0; 512]);
    let (s, used) = request(&mut d, req::IN, WRITE);
    assert_eq!(s, status::OK);
    assert_eq!(used, vec![(0, 513)], "one new used entry after the restore");
    assert_eq!(d.read_bytes(data, 512), vec![0x5a; 512]);
}

#[test]
fn vsock_round_trip_and_a_packet_after() {
    const RXQ: usize = 0;
    const TXQ: usize = 1;
    const EVQ: usize = 2;
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let args = || VsockArgs { cid: GUEST_CID, uds_path: &uds };
    let mut d = Driver::new(Box::new(Vsock::new(GUEST_CID, &uds).unwrap()), 0, 16);
    let (rx_base, tx_base, ev_base) = (DATA_BASE, DATA_BASE + 0x10_0000, DATA_BASE + 0x20_0000);
    let give_rx = |d: &mut Driver| {
        for i in 0..16u16 {
            d.set_desc(RXQ, i, rx_base + u64::from(i) * 4096, 4096, WRITE, 0);
            d.publish(RXQ, i);
        }
    };
    let tx = |d: &mut Driver, h: Header, payload: &[u8]| {
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(payload);
        d.write_bytes(tx_base, &b);
        d.add_chain(TXQ, 0, &[(tx_base, b.len() as u32, 0)]);
        d.kick(TXQ);
        assert_eq!(d.used(TXQ).len(), 1);
    };
    let rx_ops = |d: &mut Driver| -> Vec<u16> {
        d.used(RXQ)
            .into_iter()
            .map(|(id, _)| {
                let raw: [u8; HDR_LEN] = d.read_bytes(rx_base + u64::from(id) * 4096, HDR_LEN).try_into().unwrap();
                d.publish(RXQ, id as u16);
                Header::from_bytes(&raw).op
            })
            .collect()
    };
    let connect = |d: &mut Driver, guest_port: u32, port: u32| {
        let l = UnixListener::bind(format!("{}_{port}", uds.display())).unwrap();
        tx(d, guest_header(op::REQUEST, guest_port, port, 0), &[]);
        let (s, _) = l.accept().unwrap();
        assert_eq!(rx_ops(d), vec![op::RESPONSE]);
        s
    };
    // A connection and some traffic: the queues move off zero.
    give_rx(&mut d);
    let mut s = connect(&mut d, 1234, 6000);
    tx(&mut d, guest_header(op::RW, 1234, 6000, 2), b"hi");
    let mut got = [0u8; 2];
    s.read_exact(&mut got).unwrap();
    d.set_desc(EVQ, 0, ev_base, 8, WRITE, 0);
    d.publish(EVQ, 0);
    let transport = d.transport.save();
    assert!(transport.queues[TXQ].next_avail >= 2);

    // The transport owns the running device; its state is empty, as any
    // Vsock's is (the virtqueues are the transport's): round-trip a twin.
    let new = {
        let old = Vsock::new(GUEST_CID, &dir.path().join("other.vsock")).unwrap();
        round_trip(&old, args())
    };
    d.save_and_restore(Box::new(new));
    let mut after = d.transport.save();
    // The restore signals TRANSPORT_RESET on the event queue (one used
    // event buffer): the only difference to the saved state.
    assert_eq!(d.used(EVQ), vec![(0, 4)]);
    after.queues[EVQ].next_avail = transport.queues[EVQ].next_avail;
    after.queues[EVQ].next_used = transport.queues[EVQ].next_used;
    after.interrupt_status = transport.interrupt_status;
    assert_eq!(after, transport);
    // The guest acknowledges the reset, then a new connection carries a packet.
    d.set_desc(EVQ, 1, ev_base, 8, WRITE, 0);
    d.publish(EVQ, 1);
    d.kick(EVQ);
    let mut s = connect(&mut d, 1235, 6001);
    tx(&mut d, guest_header(op::RW, 1235, 6001, 3), b"new");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = [0u8; 3];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"new");
}

fn console() -> Console {
    Console::new(None, false).unwrap()
}

fn evt() -> EventFd {
    EventFd::new(libc::EFD_NONBLOCK).unwrap()
}

// UART register offsets (16550).
/// Receive buffer (read) / transmit holding (write).
const RBR: u8 = 0;
/// Interrupt enable.
const IER: u8 = 1;
/// Line control.
const LCR: u8 = 3;
/// Line status.
const LSR: u8 = 5;
/// Scratch.
const SCR: u8 = 7;

#[test]
fn serial_registers_and_buffered_input_survive() {
    let irq = evt();
    let mut serial: SerialPort = vm_superio::Serial::new(vmm::devices::IrqTrigger(irq.try_clone().unwrap()), console());
    serial.write(LCR, 0x1b).unwrap(); // 8 bits, even parity
    serial.write(IER, 0x01).unwrap(); // received-data interrupt
    serial.write(SCR, 0xa5).unwrap();
    serial.enqueue_raw_bytes(b"typed").unwrap();
    let state: SerialPortState = serial.save();
    assert_eq!((state.0.line_control, state.0.interrupt_enable, state.0.scratch), (0x1b, 0x01, 0xa5));
    assert_eq!(state.0.in_buffer, b"typed");

    let irq2 = evt();
    let mut restored = round_trip(&serial, SerialArgs { irq: irq2.try_clone().unwrap(), console: console() });
    // Data waiting with its interrupt enabled: the restore raises it.
    assert!(irq2.read().unwrap() >= 1);
    assert_eq!(restored.read(LCR), 0x1b);
    assert_eq!(restored.read(IER), 0x01);
    assert_eq!(restored.read(SCR), 0xa5);
    let mut input = Vec::new();
    while restored.read(LSR) & 1 != 0 {
        input.push(restored.read(RBR));
    }
    assert_eq!(input, b"typed");
    // Output still reaches the console.
    restored.write(LCR, 0x03).unwrap();
    restored.write(RBR, b'!').unwrap();
    assert_eq!(restored.writer().tail().contents(), b"!");
}

#[test]
fn legacy_devices_round_trip_through_their_ports() {
    let mut devices = LegacyDevices::new(evt(), console());
    devices.pio_write(COM1_PORT + u16::from(LCR), &[0x1b]);
    devices.pio_write(COM1_PORT + u16::from(IER), &[0x02]);
    devices.pio_write(COM1_PORT + u16::from(SCR), &[0x3c]);
    let state = devices.save();
    assert_ne!(state, Default::default(), "the devices left their initial state");

    let mut restored = round_trip(&devices, SerialArgs { irq: evt(), console: console() });
    let mut b = [0u8];
    for (reg, want) in [(LCR, 0x1b), (IER, 0x02), (SCR, 0x3c)] {
        restored.pio_read(COM1_PORT + u16::from(reg), &mut b);
        assert_eq!(b[0], want, "register {reg}");
    }
    // The i8042 keeps no registers (vm-superio 0.8: reads are 0); its
    // reset line still works after the restore.
    restored.pio_read(I8042_PORT, &mut b);
    assert_eq!(b[0], 0);
    assert_eq!(restored.pio_write(I8042_PORT + 4, &[0xfe]), Some(PioEvent::Reset));
}
