//! Where the serial console's output goes: a per-VM log file, optionally
//! this process's stdout, and an in-memory tail (the last
//! [`TAIL_BYTES`] bytes) for error reports and waiters.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::DeviceError;
use crate::sync::{lock, wait_timeout};

/// Bytes of console output kept in memory.
pub const TAIL_BYTES: usize = 64 * 1024;

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

    /// The last `n` lines of the tail.
    pub fn last_lines(&self, n: usize) -> String {
        let text = self.text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
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

/// The serial console's writer.
pub struct Console {
    log: Option<File>,
    stdout: bool,
    tail: ConsoleTail,
}

impl Console {
    /// A console that appends to `log` (created if missing) and, when
    /// `stdout` is set, copies to this process's stdout.
    ///
    /// Errors: [`DeviceError::ConsoleLog`].
    pub fn new(log: Option<&Path>, stdout: bool) -> Result<Self, DeviceError> {
        let log = match log {
            Some(path) => Some(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
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
            let _ = f.write_all(buf);
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
        assert_eq!(tail.last_lines(1), "END");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 100_005);
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
