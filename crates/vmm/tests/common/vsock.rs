//! Packets as a guest's virtio-vsock driver writes them (virtio 1.2,
//! section 5.10.6), for the device tests.

#![allow(dead_code)]

use vmm::devices::virtio::vsock::muxer::HOST_CID;
use vmm::devices::virtio::vsock::packet::{Header, TYPE_STREAM};

/// The guest's context ID in the device tests.
pub const GUEST_CID: u64 = 3;

/// A stream packet header from the guest (`GUEST_CID`, `src_port`) to the
/// host (`dst_port`) with `len` payload bytes; it advertises a 1 MiB
/// receive buffer and nothing consumed yet.
pub fn guest_header(op: u16, src_port: u32, dst_port: u32, len: u32) -> Header {
    Header {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 1 << 20,
        fwd_cnt: 0,
    }
}
