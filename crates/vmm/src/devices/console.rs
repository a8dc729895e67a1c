//! Where the serial console's output goes: a per-VM log file, optionally
//! this process's stdout, and an in-memory tail (the last
//! [`TAIL_BYTES`] bytes) for error reports and waiters.
//!
//! The log file is bounded, since the guest decides how much it writes: it
//! holds at most its limit ([`CONSOLE_LOG_MAX_BYTES`] by default); when a
//! write would pass it, the file is renamed to `<name>.1` (replacing the
//! previous one) and a new one started. So a VM's console takes at most
//! twice the limit on disk.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::DeviceError;
use crate::sync::{lock, wait_timeout};

/// Bytes of console output kept in memory.
pub const TAIL_BYTES: usize = 64 * 1024;
/// Default size limit of a console log file (bytes): 4 MiB, then one
/// rotation to `<name>.1`.
pub const CONSOLE_LOG_MAX_BYTES: u64 = 4 << 20;

#[derive(Default)]
struct TailInner {
    bytes: VecDeque<u8>,
    /// Total bytes ever written.
    total: u64,
}

/// The last [`TAIL_BYTES`] bytes of a console, shared between the device
/// and its observers.
#[derive(Clone, Default)]
pub struct ConsoleTail(Arc<(Mutex<TailInner>, Condvar)>);

impl ConsoleTail {
    fn push(&self, buf: &[u8]) {
        let (tail, cv) = &*self.0;
        let mut t = lock(tail);
        t.bytes.extend(buf);
        let excess = t.bytes.len().saturating_sub(TAIL_BYTES);
        t.bytes.drain(..excess);
        t.total += buf.len() as u64;
        cv.notify_all();
    }

    /// A copy of the tail.
    pub fn contents(&self) -> Vec<u8> {
        let t = lock(&self.0 .0);
        t.bytes.iter().copied().collect()
    }

    /// The tail as text, invalid UTF-8 replaced.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.contents()).into_owned()
    }

    /// The last `n` lines of the tail, for error messages and logs: each
    /// line prefixed with `"  | "` and its control characters escaped
    /// ([`crate::log_limit::escape`]), so guest text cannot pass for a
    /// log line of the host's or move a terminal's cursor.
    pub fn last_lines(&self, n: usize) -> String {
        let text = self.text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..]
            .iter()
            .map(|l| format!("  | {}", crate::log_limit::escape(l)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until the tail contains `needle` or `timeout` passes; returns
    /// whether it was found.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (tail, cv) = &*self.0;
        let mut t = lock(tail);
        loop {
            let (a, b) = t.bytes.as_slices();
            let hay = [a, b].concat();
            if String::from_utf8_lossy(&hay).contains(needle) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            t = wait_timeout(cv, t, deadline - now);
        }
    }
}

/// A size-limited log file, rotated once (see the module documentation).
struct LogFile {
    path: PathBuf,
    file: File,
    /// Bytes in `file`.
    len: u64,
    max: u64,
}

impl LogFile {
    fn open(path: &Path, max: u64) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let len = file.metadata()?.len();
        Ok(LogFile { path: path.to_path_buf(), file, len, max: max.max(1) })
    }

    /// Moves the file to `<name>.1` and starts a new one.
    fn rotate(&mut self) -> std::io::Result<()> {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        std::fs::rename(&self.path, &old)?;
        self.file = OpenOptions::new().create(true).append(true).open(&self.path)?;
        self.len = 0;
        Ok(())
    }

    fn write(&mut self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            if self.len >= self.max {
                self.rotate()?;
            }
            let room = usize::try_from(self.max - self.len).unwrap_or(usize::MAX);
            let n = buf.len().min(room);
            self.file.write_all(&buf[..n])?;
            self.len += n as u64;
            buf = &buf[n..];
        }
        Ok(())
    }
}

/// The serial console's writer.
pub struct Console {
    log: Option<LogFile>,
    stdout: bool,
    tail: ConsoleTail,
}

impl Console {
    /// A console that appends to `log` (created if missing; at most
    /// [`CONSOLE_LOG_MAX_BYTES`], see [`Console::with_limit`]) and, when
    /// `stdout` is set, copies to this process's stdout.
    ///
    /// Errors: [`DeviceError::ConsoleLog`].
    pub fn new(log: Option<&Path>, stdout: bool) -> Result<Self, DeviceError> {
        Self::with_limit(log, stdout, CONSOLE_LOG_MAX_BYTES)
    }

    /// [`Console::new`] with a log file of at most `max_bytes` bytes (then
    /// rotated to `<name>.1`, so at most twice that on disk).
    ///
    /// Errors: [`DeviceError::ConsoleLog`].
    pub fn with_limit(log: Option<&Path>, stdout: bool, max_bytes: u64) -> Result<Self, DeviceError> {
        let log = match log {
            Some(path) => Some(
                LogFile::open(path, max_bytes)
                    .map_err(|source| DeviceError::ConsoleLog { path: path.to_path_buf(), source })?,
            ),
            None => None,
        };
        Ok(Console { log, stdout, tail: ConsoleTail::default() })
    }

    /// The shared tail.
    pub fn tail(&self) -> ConsoleTail {
        self.tail.clone()
    }
}

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tail.push(buf);
        // A full disk or a closed stdout must not stop the guest: the
        // console is best effort beyond the in-memory tail.
        if let Some(f) = self.log.as_mut() {
            if let Err(e) = f.write(buf) {
                // Stop rather than grow a file that cannot be rotated.
                tracing::warn!("console log {}: {e}; no more console output is logged to it", f.path.display());
                self.log = None;
            }
        }
        if self.stdout {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(buf);
            if buf.contains(&b'\n') {
                let _ = out.flush();
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes_and_the_log_gets_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut c = Console::new(Some(&path), false).unwrap();
        let chunk = vec![b'x'; 1000];
        for _ in 0..100 {
            c.write_all(&chunk).unwrap();
        }
        c.write_all(b"\nEND\n").unwrap();
        let tail = c.tail();
        assert_eq!(tail.contents().len(), TAIL_BYTES);
        assert!(tail.text().ends_with("\nEND\n"));
        assert_eq!(tail.last_lines(1), "  | END");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 100_005);
        c.write_all(b"evil\x1b[2K\r2025-01-01 WARN forged\n").unwrap();
        assert_eq!(c.tail().last_lines(1), "  | evil\\u{1b}[2K\\r2025-01-01 WARN forged");
    }

    #[test]
    fn the_log_is_rotated_once_at_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(&path, vec![b'o'; 600]).unwrap();
        let mut c = Console::with_limit(Some(&path), false, 1000).unwrap();
        // 600 old bytes + 10_000 new ones, in odd-sized writes.
        for i in 0..1000u32 {
            c.write_all(format!("{:09}\n", i).as_bytes()).unwrap();
        }
        let cur = std::fs::read(&path).unwrap();
        let old = std::fs::read(dir.path().join("console.log.1")).unwrap();
        assert!(cur.len() <= 1000 && old.len() == 1000, "{} {}", cur.len(), old.len());
        assert!(!dir.path().join("console.log.1.1").exists());
        // The newest bytes are in the current file, continuing the rotated one.
        assert!(cur.ends_with(b"000000999\n"));
        let all = [old, cur].concat();
        let expected: Vec<u8> = (0..1000u32).flat_map(|i| format!("{:09}\n", i).into_bytes()).collect();
        assert!(expected.ends_with(&all), "the two files hold the last bytes written, in order");
        // 10_600 bytes in all: ten full files, 600 bytes in the current one.
        assert_eq!(all.len(), 1600);
    }

    #[test]
    fn wait_for_sees_later_output() {
        let mut c = Console::new(None, false).unwrap();
        let tail = c.tail();
        let t = std::thread::spawn(move || tail.wait_for("MARK", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        c.write_all(b"...MA").unwrap();
        c.write_all(b"RK...").unwrap();
        assert!(t.join().unwrap());
        assert!(!c.tail().wait_for("ABSENT", Duration::from_millis(10)));
    }
}
