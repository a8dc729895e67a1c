//! The [`Persist`] trait: how a device saves its state into a snapshot and
//! is rebuilt from it (the shape of Firecracker's `Persist<'a>`).
//!
//! Each device (and device transport) names three types: the serde state
//! it keeps in a snapshot, the host-side arguments a restore needs that a
//! snapshot cannot hold (files, eventfds, guest memory, the console), and
//! the error of a restore. Host resources never go into the state.

/// A device whose state can be saved into a snapshot and restored from it.
///
/// `'a` is the lifetime of borrowed restore arguments, for devices that
/// restore from references.
pub trait Persist<'a>: Sized {
    /// What a snapshot keeps of the device (serde, in the snapshot's JSON
    /// payload).
    type State: serde::Serialize + serde::de::DeserializeOwned;
    /// What a restore needs besides the state: host-side resources.
    type ConstructorArgs;
    /// Why a restore failed.
    type Error;

    /// The device's state now. Called with the VM paused and the device
    /// locked, so the state is consistent with guest memory.
    fn save(&self) -> Self::State;

    /// Rebuilds the device from `state` (saved by [`Persist::save`] of the
    /// same device type) and the host-side `args`.
    ///
    /// Errors: `Self::Error` when the state does not fit the device or a
    /// host resource fails.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
