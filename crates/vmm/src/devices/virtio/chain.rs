//! Descriptor chains as a hostile driver may write them: parsed into
//! bounded lists of segments, every segment checked against guest memory.
//!
//! virtio-queue's chain iterator ends early, without saying why, on a loop
//! (its time-to-live is the queue size), on a `next` index past the table,
//! on an unreadable descriptor and on a chain longer than 4 GiB. A chain
//! whose last yielded descriptor still has `VIRTQ_DESC_F_NEXT` was cut
//! short that way, and is refused here.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryMmap};

/// One descriptor: a guest buffer and its direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// GPA of the buffer.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
    /// Device-writable (`VIRTQ_DESC_F_WRITE`).
    pub writable: bool,
}

/// A validated chain: its head index (for the used ring) and segments.
#[derive(Clone, Debug)]
pub struct ParsedChain {
    /// Index of the head descriptor.
    pub head: u16,
    /// The descriptors, in chain order.
    pub segments: Vec<Segment>,
}

/// Why a chain was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The chain loops, is longer than the queue, points past the table or
    /// could not be read.
    #[error("descriptor chain {head} is cut short (a loop, a bad next index or an unreadable descriptor)")]
    Truncated {
        /// The head index.
        head: u16,
    },
    /// More segments than the device takes.
    #[error("descriptor chain {head} has more than {max} descriptors")]
    TooLong {
        /// The head index.
        head: u16,
        /// The device's limit.
        max: usize,
    },
    /// A buffer lies (partly) outside guest memory.
    #[error("descriptor chain {head}: buffer at GPA {addr:#x} of {len} bytes is outside guest memory")]
    OutsideMemory {
        /// The head index.
        head: u16,
        /// The buffer's GPA.
        addr: u64,
        /// Its length.
        len: u32,
    },
    /// A device-writable buffer comes before a device-readable one (the
    /// spec puts all readable descriptors first, section 2.7.4.2).
    #[error("descriptor chain {head}: a device-readable descriptor follows a device-writable one")]
    BadOrder {
        /// The head index.
        head: u16,
    },
}

/// Parses `chain` into at most `max_segments` segments, each inside guest
/// memory `mem`, readable ones first.
pub fn parse_chain<M>(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<M>,
    max_segments: usize,
) -> Result<ParsedChain, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let head = chain.head_index();
    let mut segments = Vec::new();
    let mut last_has_next = false;
    let mut seen_writable = false;
    for desc in chain {
        if segments.len() == max_segments {
            return Err(ChainError::TooLong { head, max: max_segments });
        }
        last_has_next = desc.has_next();
        let seg = Segment { addr: GuestAddress(desc.addr().0), len: desc.len(), writable: desc.is_write_only() };
        if seg.writable {
            seen_writable = true;
        } else if seen_writable {
            return Err(ChainError::BadOrder { head });
        }
        if seg.len > 0 && !GuestMemoryBackend::check_range(mem, seg.addr, seg.len as usize) {
            return Err(ChainError::OutsideMemory { head, addr: seg.addr.0, len: seg.len });
        }
        segments.push(seg);
    }
    if segments.is_empty() || last_has_next {
        return Err(ChainError::Truncated { head });
    }
    Ok(ParsedChain { head, segments })
}
