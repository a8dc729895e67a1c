//! Lazy restore of guest RAM through userfaultfd.
//!
//! Guest RAM restored this way is anonymous private memory registered with a
//! userfaultfd in `MISSING` mode: the first touch of a page, by a vCPU (a
//! fault inside KVM) or by the VMM (a device reading guest memory), stops the
//! faulting thread until the [`Handler`] thread fills the page from the
//! snapshot's memory file with `UFFDIO_COPY`, or with `UFFDIO_ZEROPAGE` when
//! the page is all zeros (a hole of the sparse file) or the guest gave the
//! range back (`MADV_DONTNEED`/`MADV_REMOVE`, reported as
//! `UFFD_EVENT_REMOVE`).
//!
//! Source: the kernel's `Documentation/admin-guide/mm/userfaultfd.rst`,
//! `userfaultfd(2)` and `ioctl_userfaultfd(2)`.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::sync::lock;
use userfaultfd::{Event, EventBuffer, FeatureFlags, Uffd, UffdBuilder};
use vmm_sys_util::eventfd::EventFd;

/// The page size the handler fills pages with (bytes): x86_64 base pages.
pub const PAGE_SIZE: usize = 4096;

/// Most bytes [`Handler::prefetch`] reads and fills at once.
pub const PREFETCH_CHUNK: usize = 1 << 20;

/// `EAGAIN`s (the address space changing) one prefetch run retries.
const PREFETCH_RETRIES: u32 = 16;

/// How many userfaultfd messages one `read(2)` takes at most (messages).
const EVENT_BATCH: usize = 64;

/// How long the handler waits before retrying faults that the kernel
/// answered with `EAGAIN` (milliseconds).
const RETRY_MS: i32 = 1;

/// Errors of setting up the userfaultfd handler.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// Neither `/dev/userfaultfd` nor the `userfaultfd(2)` system call may be
    /// used by this process with kernel-fault handling (which KVM needs).
    #[error("userfaultfd is unavailable ({0}): run as root or allow /dev/userfaultfd / vm.unprivileged_userfaultfd=1")]
    Unavailable(String),
    /// The `UFFDIO_API` handshake failed, typically because the kernel lacks
    /// `UFFD_FEATURE_EVENT_REMOVE` (Linux 4.11 and later have it).
    #[error("the kernel's userfaultfd API refused the handshake ({0}): Linux 4.11 or later with UFFD_FEATURE_EVENT_REMOVE is needed")]
    Api(String),
    /// `UFFDIO_REGISTER` of a guest RAM region failed.
    #[error("cannot register guest memory at host address {start:#x} ({len} bytes) with userfaultfd: {reason}; the region must be an anonymous private mapping")]
    Register {
        /// Host virtual address of the region.
        start: usize,
        /// Length of the region in bytes.
        len: usize,
        /// What the kernel said.
        reason: String,
    },
    /// Creating the stop eventfd or spawning the handler thread failed.
    #[error("cannot start the userfaultfd handler: {0}")]
    Setup(#[source] std::io::Error),
}

/// One guest RAM region as the handler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Host virtual address of the region's first byte (page aligned).
    pub host_addr: usize,
    /// Length of the region in bytes (a multiple of [`PAGE_SIZE`]).
    pub len: usize,
    /// Offset in bytes of the region's first byte in the memory file.
    pub file_offset: u64,
}

/// The host address ranges of the memory file's bytes `[start, end)`, as
/// `(host address, length, file offset)`, clipped to `regions`.
pub(crate) fn host_slices(regions: &[Region], start: u64, end: u64) -> Vec<(usize, usize, u64)> {
    regions
        .iter()
        .filter_map(|r| {
            let (s, e) = (start.max(r.file_offset), end.min(r.file_offset + r.len as u64));
            (s < e).then(|| (r.host_addr + (s - r.file_offset) as usize, (e - s) as usize, s))
        })
        .collect()
}

impl Region {
    fn contains(&self, addr: usize) -> bool {
        addr >= self.host_addr && addr - self.host_addr < self.len
    }
}

/// Pages the handler has filled so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UffdStats {
    /// Pages (of [`PAGE_SIZE`] bytes) filled from the memory file with `UFFDIO_COPY`.
    pub pages_copied: u64,
    /// Pages (of [`PAGE_SIZE`] bytes) filled with `UFFDIO_ZEROPAGE`: all-zero
    /// pages of the file, holes, and ranges the guest gave back.
    pub pages_zeroed: u64,
}

/// State shared by a [`Handler`] and its thread.
#[derive(Default)]
struct Shared {
    pages_copied: AtomicU64,
    pages_zeroed: AtomicU64,
    /// Why the thread stopped serving faults, if it stopped on an error.
    error: Mutex<Option<String>>,
}

/// The userfaultfd of one VM's guest RAM and the thread (`uffd-<name>`)
/// serving its page faults from the memory file.
///
/// Dropping it stops and joins the thread, then closes the userfaultfd,
/// which unregisters the regions. The regions must stay mapped until then.
pub struct Handler {
    /// Kept here, not only in the thread, so that a thread that stopped on an
    /// error leaves the regions registered: faults on pages it did not fill
    /// then wait (interruptibly, so the VM can still be stopped) instead of
    /// silently reading zeros, which is what an unregistered anonymous page
    /// gives.
    uffd: Arc<Uffd>,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Handler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handler")
            .field("uffd", &self.uffd.as_raw_fd())
            .field("stats", &self.stats())
            .field("error", &self.error())
            .finish()
    }
}

impl Handler {
    /// Creates a userfaultfd (close-on-exec, non-blocking, kernel faults
    /// included, `UFFD_FEATURE_EVENT_REMOVE` required), registers every
    /// region in `MISSING` mode and starts the thread `uffd-<name>` that fills
    /// faulting pages from `file`: page `p` of region `r` comes from file
    /// offset `r.file_offset + p * PAGE_SIZE`.
    ///
    /// Errors: [`UffdError::Unavailable`], [`UffdError::Api`],
    /// [`UffdError::Register`], [`UffdError::Setup`].
    ///
    /// # Safety
    ///
    /// Every region must be an anonymous private mapping owned by the caller,
    /// not yet touched (or touched only with contents the caller does not
    /// care about), that nothing else treats as zero-filled memory, and that
    /// stays mapped until the returned `Handler` is dropped: the kernel fills
    /// its missing pages with the file's contents behind the caller's back.
    pub unsafe fn start(name: &str, file: File, regions: &[Region]) -> Result<Handler, UffdError> {
        let uffd = Arc::new(create_uffd()?);
        for r in regions {
            uffd.register(r.host_addr as *mut libc::c_void, r.len).map_err(|e| UffdError::Register {
                start: r.host_addr,
                len: r.len,
                reason: e.to_string(),
            })?;
        }
        let stop = EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).map_err(UffdError::Setup)?;
        let shared = Arc::new(Shared::default());
        let worker = Worker {
            uffd: uffd.clone(),
            stop: stop.try_clone().map_err(UffdError::Setup)?,
            file,
            regions: regions.to_vec(),
            removed: RemovedRanges::default(),
            shared: shared.clone(),
            buf: Box::new(PageBuf([0; PAGE_SIZE])),
        };
        let thread = std::thread::Builder::new()
            .name(format!("uffd-{name}"))
            .spawn(move || {
                crate::seccomp::install_or_log(crate::seccomp::ThreadKind::Uffd);
                worker.run()
            })
            .map_err(UffdError::Setup)?;
        Ok(Handler { uffd, stop, thread: Some(thread), shared })
    }

    /// Pages filled so far. A fill is counted just after the ioctl that
    /// filled the page (and woke the faulting thread) returns, so a thread
    /// that just read a page may briefly see the count without it.
    pub fn stats(&self) -> UffdStats {
        UffdStats {
            pages_copied: self.shared.pages_copied.load(Ordering::Relaxed),
            pages_zeroed: self.shared.pages_zeroed.load(Ordering::Relaxed),
        }
    }

    /// Fills the pages of `ranges` (byte ranges `(offset, len)` of the
    /// memory file's layout, page-aligned) ahead of their first touch: the
    /// file is read in runs of up to [`PREFETCH_CHUNK`] bytes, all-zero
    /// pages become `UFFDIO_ZEROPAGE` runs and the rest `UFFDIO_COPY` runs,
    /// each ioctl filling many pages at once (the handler thread fills one
    /// page per fault). Pages already there (a fault served first) are
    /// skipped; waiters are woken. Call it before the guest runs: ranges the
    /// guest gave back later must not be refilled from the file. Returns the
    /// pages filled; what fails is left to fault in as usual (logged).
    ///
    /// `regions` and `file` are the ones the handler was started with.
    pub fn prefetch(&self, file: &File, regions: &[Region], ranges: &[(u64, u64)]) -> u64 {
        let mut buf = vec![PageBuf([0; PAGE_SIZE]); PREFETCH_CHUNK / PAGE_SIZE];
        let mut filled = 0;
        for &(offset, len) in ranges {
            let (mut at, end) = (offset, offset.saturating_add(len));
            while at < end {
                let Some(r) = regions.iter().find(|r| at >= r.file_offset && at < r.file_offset + r.len as u64) else {
                    tracing::warn!("userfaultfd prefetch: offset {at:#x} is outside guest RAM");
                    break;
                };
                let n = (end - at).min(r.file_offset + r.len as u64 - at).min(PREFETCH_CHUNK as u64) as usize;
                let pages = n / PAGE_SIZE;
                if pages == 0 {
                    break;
                }
                let bytes = &mut buf[..pages];
                // SAFETY: `PageBuf` is a plain `[u8; PAGE_SIZE]` (repr(C)),
                // so `pages` of them are `pages * PAGE_SIZE` initialized bytes.
                let raw = unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<u8>(), pages * PAGE_SIZE) };
                if let Err(e) = file.read_exact_at(raw, at) {
                    tracing::warn!("userfaultfd prefetch: cannot read the memory file at {at:#x}: {e}");
                    break;
                }
                let host = r.host_addr + (at - r.file_offset) as usize;
                // Runs of zero and non-zero pages, each filled by one ioctl.
                let mut p = 0;
                while p < pages {
                    let zero = is_zero(&bytes[p].0);
                    let mut q = p + 1;
                    while q < pages && is_zero(&bytes[q].0) == zero {
                        q += 1;
                    }
                    let src = bytes[p].0.as_ptr();
                    filled += self.fill_run(host + p * PAGE_SIZE, (q - p) * PAGE_SIZE, (!zero).then_some(src));
                    p = q;
                }
                at += (pages * PAGE_SIZE) as u64;
            }
        }
        filled
    }

    /// Fills `len` bytes at host address `dst` (a run inside a registered
    /// region) from `src` with `UFFDIO_COPY`, or with zero pages for `None`;
    /// skips pages already present. Returns the pages filled.
    fn fill_run(&self, dst: usize, len: usize, src: Option<*const u8>) -> u64 {
        let (mut done, mut filled, mut retries) = (0usize, 0u64, 0);
        while done < len {
            let at = (dst + done) as *mut libc::c_void;
            let r = match src {
                // SAFETY: [dst, dst + len) lies in a registered region, which
                // `Handler::start`'s contract keeps mapped; `src` points to
                // `len` readable bytes of the caller's buffer, only read.
                Some(src) => unsafe { self.uffd.copy(src.add(done).cast(), at, len - done, true) },
                // SAFETY: as above for the destination.
                None => unsafe { self.uffd.zeropage(at, len - done, true) },
            };
            match r {
                Ok(n) if n > 0 => {
                    done += n;
                    filled += (n / PAGE_SIZE) as u64;
                }
                Ok(_) => done += PAGE_SIZE,
                Err(userfaultfd::Error::PartiallyCopied(n)) if retries < PREFETCH_RETRIES => {
                    done += n;
                    filled += (n / PAGE_SIZE) as u64;
                    retries += 1;
                }
                Err(e) => match errno(&e) {
                    // A fault was served first: the page is there.
                    Some(libc::EEXIST) => done += PAGE_SIZE,
                    _ => {
                        tracing::warn!("userfaultfd prefetch at {at:p} stopped: {e:?}");
                        break;
                    }
                },
            }
        }
        let counter = if src.is_some() { &self.shared.pages_copied } else { &self.shared.pages_zeroed };
        counter.fetch_add(filled, Ordering::Relaxed);
        filled
    }

    /// Why the handler thread stopped serving page faults, if it stopped on
    /// an error (it is also logged). Faults on pages not yet filled then
    /// wait until the VM is stopped.
    pub fn error(&self) -> Option<String> {
        lock(&self.shared.error).clone()
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            tracing::error!("cannot signal the userfaultfd handler thread to stop: {e}");
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the userfaultfd handler thread panicked");
            }
        }
        // `self.uffd` closes now that the thread is gone: the kernel
        // unregisters the ranges.
    }
}

/// The userfaultfd features this kernel supports: the `UFFD_FEATURE_*` bits
/// the `UFFDIO_API` handshake reports (bits this crate has no name for are
/// kept). Opens and closes a userfaultfd of its own (user-mode faults only,
/// which needs no privilege since Linux 5.11).
///
/// Errors: [`UffdError::Unavailable`], [`UffdError::Api`].
pub fn supported_features() -> Result<FeatureFlags, UffdError> {
    let fd = match open_dev(libc::O_CLOEXEC) {
        Ok(fd) => fd,
        Err(dev) => new_by_syscall(libc::O_CLOEXEC | sys::UFFD_USER_MODE_ONLY)
            .map_err(|e| UffdError::Unavailable(format!("/dev/userfaultfd: {dev}; userfaultfd(2): {e}")))?,
    };
    Ok(FeatureFlags::from_bits_retain(api(&fd, 0)?))
}

/// A userfaultfd for [`Handler::start`]: through `/dev/userfaultfd` (which
/// the crate tries first) or, if that device exists but may not be opened,
/// through `userfaultfd(2)`, which `vm.unprivileged_userfaultfd=1` or
/// `CAP_SYS_PTRACE` allows.
fn create_uffd() -> Result<Uffd, UffdError> {
    create_uffd_with(FeatureFlags::EVENT_REMOVE)
}

/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM` (Linux 5.19): write protection of
/// shmem (memfd) and hugetlbfs memory, not only anonymous memory.
pub const FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;

/// A userfaultfd (close-on-exec, non-blocking, kernel faults included)
/// for write protection: `UFFD_FEATURE_PAGEFAULT_FLAG_WP`, plus
/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM` where the kernel has it, enabled.
///
/// Errors: [`UffdError::Unavailable`], [`UffdError::Api`] (a kernel
/// without write protection: before Linux 5.7).
pub fn create_wp_uffd() -> Result<Uffd, UffdError> {
    let mut features = FeatureFlags::PAGEFAULT_FLAG_WP;
    if supported_features()?.bits() & FEATURE_WP_HUGETLBFS_SHMEM != 0 {
        features |= FeatureFlags::from_bits_retain(FEATURE_WP_HUGETLBFS_SHMEM);
    }
    create_uffd_with(features)
}

fn create_uffd_with(features: FeatureFlags) -> Result<Uffd, UffdError> {
    let built = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        // KVM touches guest RAM from the kernel (get_user_pages): those
        // faults must reach the handler too, not fail with EFAULT.
        .user_mode_only(false)
        .require_features(features)
        .create();
    let dev_error = match built {
        Ok(uffd) => return Ok(uffd),
        Err(userfaultfd::Error::OpenDevUserfaultfd(e)) => e,
        Err(userfaultfd::Error::SystemError(errno)) => {
            let e = std::io::Error::from(errno);
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => UffdError::Unavailable(format!("userfaultfd: {e}")),
                _ => UffdError::Api(e.to_string()),
            });
        }
        Err(e) => return Err(UffdError::Api(e.to_string())),
    };
    let fd = new_by_syscall(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .map_err(|e| UffdError::Unavailable(format!("/dev/userfaultfd: {dev_error}; userfaultfd(2): {e}")))?;
    api(&fd, features.bits())?;
    // SAFETY: `fd` is a userfaultfd we own and hand over; `Uffd` closes it.
    Ok(unsafe { Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) })
}

/// A new userfaultfd from `/dev/userfaultfd` (`USERFAULTFD_IOC_NEW`), with
/// the `userfaultfd(2)` `flags`.
fn open_dev(flags: i32) -> std::io::Result<OwnedFd> {
    let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/userfaultfd")?;
    // SAFETY: USERFAULTFD_IOC_NEW takes the flags by value and returns a new
    // fd; no memory is passed.
    let fd = unsafe { sys::new_uffd(dev.as_raw_fd(), flags) }.map_err(std::io::Error::from)?;
    // SAFETY: the ioctl returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new userfaultfd from the `userfaultfd(2)` system call.
fn new_by_syscall(flags: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: the system call takes the flags by value; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the system call returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The `UFFDIO_API` handshake enabling `features`; returns every feature
/// the kernel supports.
fn api(fd: &OwnedFd, features: u64) -> Result<u64, UffdError> {
    let mut arg = sys::UffdioApi { api: sys::UFFD_API, features, ioctls: 0 };
    // SAFETY: `arg` is a live, properly laid out `struct uffdio_api` the
    // kernel reads and writes back.
    unsafe { sys::uffdio_api(fd.as_raw_fd(), &mut arg) }
        .map_err(|e| UffdError::Api(std::io::Error::from(e).to_string()))?;
    Ok(arg.features)
}

/// The raw userfaultfd ABI (`include/uapi/linux/userfaultfd.h`) the crate
/// does not expose: the handshake's reply and the device ioctl.
mod sys {
    /// `UFFD_API`.
    pub const UFFD_API: u64 = 0xaa;
    /// `UFFD_USER_MODE_ONLY`: handle user-mode faults only.
    pub const UFFD_USER_MODE_ONLY: i32 = 1;

    /// `struct uffdio_api`.
    #[repr(C)]
    pub struct UffdioApi {
        pub api: u64,
        pub features: u64,
        pub ioctls: u64,
    }

    nix::ioctl_readwrite!(
        /// `UFFDIO_API`.
        uffdio_api, 0xaa, 0x3f, UffdioApi
    );
    nix::ioctl_write_int_bad!(
        /// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd`: takes the
        /// `userfaultfd(2)` flags, returns a new userfaultfd.
        new_uffd,
        nix::request_code_none!(0xaa, 0x00)
    );
}

/// A page-aligned page buffer, so `UFFDIO_COPY` reads one source page.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct PageBuf([u8; PAGE_SIZE]);

/// Host address ranges `[start, end)` the guest gave back (`UFFD_EVENT_REMOVE`),
/// sorted and merged: a later fault there must see zeros, not the snapshot.
#[derive(Debug, Default)]
struct RemovedRanges(BTreeMap<usize, usize>);

impl RemovedRanges {
    fn insert(&mut self, mut start: usize, mut end: usize) {
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.0.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
                self.0.remove(&s);
            }
        }
        while let Some((&s, &e)) = self.0.range(start..=end).next() {
            end = end.max(e);
            self.0.remove(&s);
        }
        self.0.insert(start, end);
    }

    fn contains(&self, addr: usize) -> bool {
        self.0.range(..=addr).next_back().is_some_and(|(_, &end)| addr < end)
    }
}

/// How serving one fault went.
enum Served {
    Done,
    /// The kernel said `EAGAIN` (the address space is changing, e.g. a
    /// `REMOVE` event is not read yet): retry after reading events.
    Retry,
}

/// The handler thread's state.
struct Worker {
    uffd: Arc<Uffd>,
    stop: EventFd,
    file: File,
    regions: Vec<Region>,
    removed: RemovedRanges,
    shared: Arc<Shared>,
    buf: Box<PageBuf>,
}

impl Worker {
    fn run(mut self) {
        if let Err(e) = self.serve_until_stopped() {
            tracing::error!(
                "userfaultfd handler stopped: {e}; guest RAM pages not yet restored can no longer be filled"
            );
            *lock(&self.shared.error) = Some(e);
        }
        let s = (self.shared.pages_copied.load(Ordering::Relaxed), self.shared.pages_zeroed.load(Ordering::Relaxed));
        tracing::debug!(pages_copied = s.0, pages_zeroed = s.1, "userfaultfd handler done");
    }

    /// The event loop; returns on stop, or with the error that ended it.
    fn serve_until_stopped(&mut self) -> Result<(), String> {
        let mut events = EventBuffer::new(EVENT_BATCH);
        let mut retry: Vec<usize> = Vec::new();
        loop {
            let mut fds = [
                libc::pollfd { fd: self.uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let timeout = if retry.is_empty() { -1 } else { RETRY_MS };
            // SAFETY: `fds` is a live array of two pollfds for the duration
            // of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(format!("poll: {e}"));
            }
            if fds[1].revents != 0 {
                return Ok(());
            }
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                return Err(format!("poll reported {:#x} on the userfaultfd", fds[0].revents));
            }
            if fds[0].revents & libc::POLLIN != 0 {
                self.drain(&mut events, &mut retry)?;
            }
            let pending = std::mem::take(&mut retry);
            for addr in pending {
                if let Served::Retry = self.serve(addr)? {
                    retry.push(addr);
                }
            }
        }
    }

    /// Reads and handles every queued event, in order.
    fn drain(&mut self, events: &mut EventBuffer, retry: &mut Vec<usize>) -> Result<(), String> {
        loop {
            let uffd = self.uffd.clone();
            let batch = uffd.read_events(events).map_err(|e| format!("reading userfaultfd events: {e}"))?;
            let mut count = 0;
            for event in batch {
                count += 1;
                match event {
                    Ok(Event::Pagefault { addr, .. }) => {
                        if let Served::Retry = self.serve(addr as usize)? {
                            retry.push(addr as usize);
                        }
                    }
                    Ok(Event::Remove { start, end }) => self.removed.insert(start as usize, end as usize),
                    Ok(other) => tracing::warn!("userfaultfd: ignoring event {other:?}"),
                    Err(e) => tracing::warn!("userfaultfd: ignoring an event: {e}"),
                }
            }
            if count < EVENT_BATCH {
                return Ok(());
            }
        }
    }

    /// Fills the page holding host address `addr`. `Err` only for what the
    /// handler cannot recover from.
    fn serve(&mut self, addr: usize) -> Result<Served, String> {
        let page = addr & !(PAGE_SIZE - 1);
        let Some(region) = self.regions.iter().find(|r| r.contains(page)) else {
            tracing::error!("userfaultfd: fault at {addr:#x} outside guest RAM");
            return Ok(Served::Done);
        };
        let zero = if self.removed.contains(page) {
            true
        } else {
            let offset = region.file_offset + (page - region.host_addr) as u64;
            self.file
                .read_exact_at(&mut self.buf.0, offset)
                .map_err(|e| format!("cannot read the memory file at offset {offset:#x}: {e}"))?;
            is_zero(&self.buf.0)
        };
        let dst = page as *mut libc::c_void;
        let result = if zero {
            // SAFETY: `dst` is a page of a registered region (checked above),
            // which `Handler::start`'s contract keeps mapped; the kernel
            // installs the zero page only if the page is still missing.
            unsafe { self.uffd.zeropage(dst, PAGE_SIZE, true) }.map(|_| ())
        } else {
            // SAFETY: as above for `dst`; the source is our own page-sized
            // buffer, which the kernel only reads.
            unsafe { self.uffd.copy(self.buf.0.as_ptr().cast(), dst, PAGE_SIZE, true) }.map(|_| ())
        };
        match result {
            Ok(()) => {
                let counter = if zero { &self.shared.pages_zeroed } else { &self.shared.pages_copied };
                counter.fetch_add(1, Ordering::Relaxed);
                Ok(Served::Done)
            }
            Err(e) => match errno(&e) {
                // Another fault on the same page was served first: the page
                // is there; wake whoever still waits for it.
                Some(libc::EEXIST) => {
                    if let Err(e) = self.uffd.wake(dst, PAGE_SIZE) {
                        tracing::warn!("userfaultfd: UFFDIO_WAKE at {page:#x}: {e}");
                    }
                    Ok(Served::Done)
                }
                Some(libc::EAGAIN) => Ok(Served::Retry),
                // The range was unmapped meanwhile (ENOENT) or the process
                // is exiting (ESRCH): nobody waits for this page any more.
                Some(libc::ENOENT) | Some(libc::ESRCH) => {
                    tracing::warn!("userfaultfd: page {page:#x} went away before it was filled: {e:?}");
                    Ok(Served::Done)
                }
                _ => Err(format!("cannot fill guest page at host address {page:#x}: {e:?}")),
            },
        }
    }
}

/// The errno inside a userfaultfd crate error, if any.
fn errno(e: &userfaultfd::Error) -> Option<i32> {
    match e {
        userfaultfd::Error::CopyFailed(n)
        | userfaultfd::Error::ZeropageFailed(n)
        | userfaultfd::Error::SystemError(n) => Some(*n as i32),
        userfaultfd::Error::PartiallyCopied(_) => Some(libc::EAGAIN),
        _ => None,
    }
}

/// Whether a page holds only zero bytes.
fn is_zero(page: &[u8; PAGE_SIZE]) -> bool {
    page.chunks_exact(16).all(|c| u128::from_ne_bytes(c.try_into().unwrap_or([1; 16])) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_ranges_merge_and_lookup() {
        let mut r = RemovedRanges::default();
        r.insert(0x1000, 0x3000);
        r.insert(0x5000, 0x6000);
        assert!(r.contains(0x1000) && r.contains(0x2fff) && !r.contains(0x3000) && !r.contains(0xfff));
        assert!(r.contains(0x5000) && !r.contains(0x4000));
        // Touching and overlapping ranges merge into one.
        r.insert(0x3000, 0x5800);
        assert_eq!(r.0.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(), vec![(0x1000, 0x6000)]);
        r.insert(0x8000, 0x9000);
        r.insert(0x0, 0x10000);
        assert_eq!(r.0.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(), vec![(0x0, 0x10000)]);
        r.insert(0x2000, 0x2000);
        assert_eq!(r.0.len(), 1);
    }

    #[test]
    fn zero_check() {
        let mut p = [0u8; PAGE_SIZE];
        assert!(is_zero(&p));
        p[PAGE_SIZE - 1] = 1;
        assert!(!is_zero(&p));
    }

    /// Prints what this kernel's userfaultfd supports (`--nocapture`).
    #[test]
    fn reports_kernel_features() {
        let features = match supported_features() {
            Ok(f) => f,
            Err(e) => {
                eprintln!("SKIP: userfaultfd unavailable: {e}");
                return;
            }
        };
        println!("userfaultfd features: {:#x} {:?}", features.bits(), features);
        println!(
            "EVENT_REMOVE: {}, PAGEFAULT_FLAG_WP: {}",
            features.contains(FeatureFlags::EVENT_REMOVE),
            features.contains(FeatureFlags::PAGEFAULT_FLAG_WP)
        );
        assert!(features.contains(FeatureFlags::EVENT_REMOVE));
    }
}
