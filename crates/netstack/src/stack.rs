//! The NAT on smoltcp. STUB: the stack helper writes it.
