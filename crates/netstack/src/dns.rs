//! The resolver at [`crate::DNS_ADDR`]. STUB: the stack helper writes it.
