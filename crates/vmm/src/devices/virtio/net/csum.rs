//! Internet checksums (RFC 1071) for virtio-net's checksum offload:
//! completing the partial checksum of a frame the guest sent with
//! `VIRTIO_NET_HDR_F_NEEDS_CSUM` (virtio 1.2, section 5.1.6.2), and
//! verifying the TCP/UDP checksum of a frame for the guest before the
//! device marks it `VIRTIO_NET_HDR_F_DATA_VALID` (section 5.1.6.4).
//!
//! Every offset comes from the guest or from a frame's own headers and is
//! bounds-checked; nothing here panics on any input.

/// Why a partial checksum cannot be completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CsumError {
    /// `csum_start` or `csum_start + csum_offset + 2` lies past the frame.
    #[error("checksum at csum_start {start} + csum_offset {offset} lies outside the {len}-byte frame")]
    OutOfRange {
        /// `csum_start` (bytes from the frame's start).
        start: u16,
        /// `csum_offset` (bytes from `csum_start`).
        offset: u16,
        /// The frame's length (bytes).
        len: usize,
    },
}

/// The ones' complement sum (RFC 1071, section 4.1) of `data` taken as
/// big-endian 16-bit words (an odd last byte padded with zero), added to
/// `initial`; not folded.
pub fn sum(data: &[u8], initial: u64) -> u64 {
    let mut acc = initial;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

/// Folds a sum from [`sum`] into 16 bits (end-around carry).
pub fn fold(mut acc: u64) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// Completes a partial checksum in place: the ones' complement of the sum
/// of `frame[start..]` (the guest already put the pseudo-header's sum in
/// the checksum field, which is part of that range) is stored big-endian
/// at `start + offset`. A result of zero is stored as 0xffff (its other
/// representation, required for UDP, RFC 768), as Linux does.
///
/// Errors: [`CsumError::OutOfRange`] if the field or `start` lies past
/// the frame; the frame is then unchanged.
pub fn complete_partial(frame: &mut [u8], start: u16, offset: u16) -> Result<(), CsumError> {
    let len = frame.len();
    let s = usize::from(start);
    let field = s + usize::from(offset);
    if s >= len || field + 2 > len {
        return Err(CsumError::OutOfRange { start, offset, len });
    }
    let folded = !fold(sum(&frame[s..], 0));
    let value = if folded == 0 { 0xffff } else { folded };
    frame[field..field + 2].copy_from_slice(&value.to_be_bytes());
    Ok(())
}

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;

/// Whether `frame` (Ethernet II) carries a TCP or UDP segment, over IPv4
/// (unfragmented, valid header checksum) or IPv6 (no extension headers),
/// whose checksum is correct (RFC 793, RFC 768, RFC 8200 section 8.1).
/// `false` for anything else, including UDP over IPv4 without a checksum
/// and malformed or truncated headers.
pub fn l4_checksum_valid(frame: &[u8]) -> bool {
    let Some(ethertype) = frame.get(12..14).map(|b| u16::from_be_bytes([b[0], b[1]])) else { return false };
    let ip = &frame[14.min(frame.len())..];
    match ethertype {
        ETHERTYPE_IPV4 => ipv4_valid(ip),
        ETHERTYPE_IPV6 => ipv6_valid(ip),
        _ => false,
    }
}

fn ipv4_valid(ip: &[u8]) -> bool {
    let Some(&vihl) = ip.first() else { return false };
    let ihl = usize::from(vihl & 0x0f) * 4;
    if vihl >> 4 != 4 || ihl < 20 || ip.len() < ihl {
        return false;
    }
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    // Fragments (more fragments set, or a non-zero offset) are not checked.
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    if total < ihl || total > ip.len() || frag & 0x3fff != 0 || fold(sum(&ip[..ihl], 0)) != 0xffff {
        return false;
    }
    let proto = ip[9];
    let l4 = &ip[ihl..total];
    if proto == PROTO_UDP && l4.get(6..8) == Some(&[0, 0]) {
        return false;
    }
    let pseudo = sum(&ip[12..20], u64::from(proto) + l4.len() as u64);
    l4_valid(proto, l4, pseudo)
}

fn ipv6_valid(ip: &[u8]) -> bool {
    if ip.len() < 40 || ip[0] >> 4 != 6 {
        return false;
    }
    let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let Some(l4) = ip.get(40..40 + payload) else { return false };
    let proto = ip[6];
    let pseudo = sum(&ip[8..40], u64::from(proto) + l4.len() as u64);
    l4_valid(proto, l4, pseudo)
}

fn l4_valid(proto: u8, l4: &[u8], pseudo: u64) -> bool {
    let min = match proto {
        PROTO_TCP => 20,
        PROTO_UDP => 8,
        _ => return false,
    };
    l4.len() >= min && fold(sum(l4, pseudo)) == 0xffff
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 1071 section 3's example: the words 0001 f203 f4f5 f6f7 sum
    /// to ddf2 (folded).
    #[test]
    fn rfc1071_example() {
        assert_eq!(fold(sum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7], 0)), 0xddf2);
        // Odd length: the last byte is the high half of a word.
        assert_eq!(fold(sum(&[0x01], 0)), 0x0100);
    }

    /// An Ethernet + IPv4 + UDP frame 10.0.2.15:1000 -> 10.0.2.2:53 with
    /// `payload`, checksum field set to the pseudo-header sum (what a
    /// guest with checksum offload sends).
    fn udp_frame(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        let total = (20 + 8 + payload.len()) as u16;
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, PROTO_UDP, 0, 0, 10, 0, 2, 15, 10, 0, 2, 2];
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        let hc = !fold(sum(&ip, 0));
        ip[10..12].copy_from_slice(&hc.to_be_bytes());
        let ulen = (8 + payload.len()) as u16;
        let pseudo = fold(sum(&ip[12..20], u64::from(PROTO_UDP) + u64::from(ulen)));
        f.extend_from_slice(&ip);
        f.extend_from_slice(&1000u16.to_be_bytes());
        f.extend_from_slice(&53u16.to_be_bytes());
        f.extend_from_slice(&ulen.to_be_bytes());
        f.extend_from_slice(&pseudo.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn completed_partial_checksum_verifies() {
        for payload in [&b""[..], b"a", b"hello world", &[0xff; 333]] {
            let mut f = udp_frame(payload);
            assert!(!l4_checksum_valid(&f), "a partial checksum is not a valid one");
            complete_partial(&mut f, 34, 6).unwrap();
            assert!(l4_checksum_valid(&f), "payload {payload:?}");
            // One flipped bit anywhere in the UDP part is caught.
            let mut bad = f.clone();
            *bad.last_mut().unwrap() ^= 1;
            assert!(!l4_checksum_valid(&bad) || payload.is_empty());
        }
    }

    #[test]
    fn out_of_range_fields_are_refused() {
        let mut f = udp_frame(b"x");
        let before = f.clone();
        let len = f.len();
        for (start, offset) in [(len as u16, 0), (34, u16::MAX), (u16::MAX, u16::MAX), ((len - 1) as u16, 0)] {
            assert_eq!(complete_partial(&mut f, start, offset), Err(CsumError::OutOfRange { start, offset, len }));
        }
        assert_eq!(f, before);
        assert!(complete_partial(&mut f, (len - 2) as u16, 0).is_ok());
    }

    #[test]
    fn malformed_frames_are_not_valid() {
        let good = {
            let mut f = udp_frame(b"abc");
            complete_partial(&mut f, 34, 6).unwrap();
            f
        };
        for n in 0..good.len() {
            assert!(!l4_checksum_valid(&good[..n]), "truncated to {n}");
        }
        let mut frag = good.clone();
        frag[14 + 6] = 0x20; // more fragments
        assert!(!l4_checksum_valid(&frag));
        let mut nocsum = good.clone();
        nocsum[40..42].copy_from_slice(&[0, 0]);
        assert!(!l4_checksum_valid(&nocsum));
    }
}
