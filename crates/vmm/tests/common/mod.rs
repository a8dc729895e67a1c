pub mod driver;
pub mod vsock;
