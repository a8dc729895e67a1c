//! Locking that survives a poisoned mutex: the one place the VMM decides
//! that a panic on another thread does not make shared state unusable.
//!
//! Every lock in the VMM guards state that stays consistent between
//! statements (counters, queues, device registers), so a thread that
//! panicked while holding it leaves nothing half-written that later users
//! could misread; refusing the lock would only turn one failure into many.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Locks `m`, taking the guard even if another thread panicked holding it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv` with `guard` (see [`Condvar::wait`]), ignoring poison.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv` with `guard` for at most `timeout` (see
/// [`Condvar::wait_timeout`]), ignoring poison; spurious wake-ups and
/// time-outs both just return the guard.
pub fn wait_timeout<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, timeout).unwrap_or_else(|e| e.into_inner()).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_survives_poison() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
