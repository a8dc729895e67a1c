pub mod driver;
pub mod threads;
pub mod vsock;
