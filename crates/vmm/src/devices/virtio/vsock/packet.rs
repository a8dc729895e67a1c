//! The virtio-vsock packet header (virtio 1.2, section 5.10.6):
//! 44 bytes, little endian, followed by `len` bytes of payload.

/// Header length in bytes.
pub const HDR_LEN: usize = 44;
/// Largest payload accepted in one packet (bytes); Linux sends at most
/// 64 KiB (VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PAYLOAD: u32 = 64 * 1024;

/// `type`: stream socket (the only type offered).
pub const TYPE_STREAM: u16 = 1;

/// Operations (`op`).
pub mod op {
    #![allow(missing_docs)]
    pub const INVALID: u16 = 0;
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
}

/// SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;

/// A packet header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Source context ID.
    pub src_cid: u64,
    /// Destination context ID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length in bytes.
    pub len: u32,
    /// Socket type ([`TYPE_STREAM`]).
    pub type_: u16,
    /// Operation (see [`op`]).
    pub op: u16,
    /// Operation flags (SHUTDOWN).
    pub flags: u32,
    /// The sender's receive buffer size (bytes).
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

impl Header {
    /// Decodes a header.
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or([0; 2]));
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1024,
            dst_port: 5000,
            len: 4096,
            type_: TYPE_STREAM,
            op: op::RW,
            flags: 0,
            buf_alloc: 262_144,
            fwd_cnt: 77,
        };
        let b = h.to_bytes();
        assert_eq!(Header::from_bytes(&b), h);
        assert_eq!(&b[24..28], &4096u32.to_le_bytes());
        assert_eq!(&b[30..32], &op::RW.to_le_bytes());
    }
}
