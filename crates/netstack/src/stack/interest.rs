//! The events one host socket has registered in the stack's epoll set
//! (epoll(7), level-triggered): a socket is registered only while it is
//! waited on, so a ready fd that nobody reads never wakes the stack again
//! and again.

use std::os::fd::RawFd;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

/// What a host socket has registered now (empty: not in the set).
#[derive(Debug, Default)]
pub(super) struct Interest(u32);

impl Interest {
    /// Registers exactly `want` for `fd` under `token` (adding, modifying
    /// or deleting the registration); on an epoll error the registration
    /// is left as it was and tried again at the next call.
    pub(super) fn set(&mut self, epoll: &Epoll, fd: RawFd, token: u64, want: EventSet) {
        let bits = want.bits();
        if bits == self.0 {
            return;
        }
        let op = if self.0 == 0 {
            ControlOperation::Add
        } else if bits == 0 {
            ControlOperation::Delete
        } else {
            ControlOperation::Modify
        };
        if epoll.ctl(op, fd, EpollEvent::new(want, token)).is_ok() {
            self.0 = bits;
        }
    }

    /// Removes `fd` from the set if it is there (before the fd closes).
    pub(super) fn clear(&mut self, epoll: &Epoll, fd: RawFd) {
        self.set(epoll, fd, 0, EventSet::empty());
        self.0 = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    fn ready(epoll: &Epoll) -> Vec<(u64, u32)> {
        let mut events = vec![EpollEvent::default(); 4];
        let n = epoll.wait(0, &mut events).unwrap();
        events[..n].iter().map(|e| (e.data(), e.events())).collect()
    }

    #[test]
    fn only_what_is_wanted_wakes_the_set() {
        let epoll = Epoll::new().unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut interest = Interest::default();
        // Writable at once.
        interest.set(&epoll, b.as_raw_fd(), 7, EventSet::OUT);
        assert_eq!(ready(&epoll), vec![(7, EventSet::OUT.bits())]);
        // Readable only once there is something to read.
        interest.set(&epoll, b.as_raw_fd(), 7, EventSet::IN);
        assert!(ready(&epoll).is_empty());
        a.write_all(b"x").unwrap();
        assert_eq!(ready(&epoll), vec![(7, EventSet::IN.bits())]);
        // Not waited on: the unread byte wakes nothing.
        interest.set(&epoll, b.as_raw_fd(), 7, EventSet::empty());
        assert!(ready(&epoll).is_empty());
        interest.set(&epoll, b.as_raw_fd(), 8, EventSet::IN);
        assert_eq!(ready(&epoll), vec![(8, EventSet::IN.bits())]);
        interest.clear(&epoll, b.as_raw_fd());
        assert!(ready(&epoll).is_empty());
        // Registered again from nothing.
        interest.set(&epoll, b.as_raw_fd(), 9, EventSet::IN);
        assert_eq!(ready(&epoll), vec![(9, EventSet::IN.bits())]);
    }
}
