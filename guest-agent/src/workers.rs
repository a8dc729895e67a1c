//! The threads requests run on, kept for the next request: up to
//! [`MAX_IDLE`] wait idle, and a request that finds none idle gets a new
//! thread, so requests in flight are never limited or queued behind each
//! other (an `exec` may run for minutes beside a file read).
//!
//! Starting and joining a thread costs 100-240 ms in a guest whose kernel
//! is emulated (docs/hosts.md: its stack's first touches and the system
//! calls around clone(2)), on every request when each had its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, OnceLock};

/// A request's work.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// At most this many threads wait for work; one that finishes past it
/// exits.
pub const MAX_IDLE: usize = 8;

struct Pool {
    jobs: Sender<Job>,
    queue: Mutex<Receiver<Job>>,
    /// Threads waiting for a job, less the jobs sent to them and not yet
    /// taken.
    idle: AtomicUsize,
}

impl Pool {
    fn new() -> Pool {
        let (jobs, queue) = channel();
        Pool { jobs, queue: Mutex::new(queue), idle: AtomicUsize::new(0) }
    }

    fn run(&'static self, job: Job) -> std::io::Result<()> {
        if self.idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            // The receiver lives as long as the pool: a send cannot fail;
            // if it did, the job comes back and gets a thread.
            match self.jobs.send(job) {
                Ok(()) => return Ok(()),
                Err(e) => return self.spawn(e.0),
            }
        }
        self.spawn(job)
    }

    fn spawn(&'static self, job: Job) -> std::io::Result<()> {
        std::thread::Builder::new().name("req".into()).spawn(move || self.work(job)).map(drop)
    }

    /// A thread's life: its first job, then jobs from the queue while no
    /// more than [`MAX_IDLE`] threads wait.
    fn work(&'static self, first: Job) {
        first();
        loop {
            if self.idle.fetch_add(1, Ordering::SeqCst) >= MAX_IDLE {
                self.idle.fetch_sub(1, Ordering::SeqCst);
                return;
            }
            let job = self.queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
            match job {
                Ok(job) => job(),
                Err(_) => return,
            }
        }
    }
}

/// The agent's pool.
fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(Pool::new)
}

/// Runs `job` on an idle thread, or on a new one when none is idle.
///
/// Errors: the thread could not be started (the job is dropped unrun).
pub fn run(job: Job) -> std::io::Result<()> {
    pool().run(job)
}

/// The end of a job started with [`start`], to wait for.
pub struct Done(Receiver<()>);

impl Done {
    /// Waits until the job has returned (or panicked).
    pub fn wait(self) {
        let _ = self.0.recv();
    }
}

/// [`run`]s `job` and returns its [`Done`], to wait for its end as one
/// would join a thread of its own.
///
/// Errors: as [`run`].
pub fn start(job: impl FnOnce() + Send + 'static) -> std::io::Result<Done> {
    let (finished, done) = channel::<()>();
    run(Box::new(move || {
        job();
        drop(finished);
    }))?;
    Ok(Done(done))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;
    use std::time::Duration;

    use super::*;

    /// Jobs in flight at once each get a thread (none waits for another),
    /// and the threads that finish are reused: later jobs run on threads
    /// that ran earlier ones.
    #[test]
    fn concurrent_jobs_each_get_a_thread_and_threads_are_reused() {
        // A pool of the test's own (the agent's is shared by this binary's
        // tests).
        let pool: &'static Pool = Box::leak(Box::new(Pool::new()));
        let n = 4;
        let (started_tx, started_rx) = channel();
        let (release_tx, release_rx) = channel::<()>();
        let release_rx = std::sync::Arc::new(Mutex::new(release_rx));
        for _ in 0..n {
            let (started_tx, release_rx) = (started_tx.clone(), release_rx.clone());
            pool.run(Box::new(move || {
                started_tx.send(std::thread::current().id()).unwrap();
                // Held until the test lets one go.
                let _ = release_rx.lock().unwrap().recv();
            }))
            .unwrap();
        }
        // All n run at once: none waits for another to end.
        let first: Vec<_> = (0..n).map(|_| started_rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        for _ in 0..n {
            release_tx.send(()).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.idle.load(Ordering::SeqCst) < n && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (tx, rx) = channel();
        pool.run(Box::new(move || tx.send(std::thread::current().id()).unwrap())).unwrap();
        let reused = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(first.contains(&reused), "{reused:?} is a new thread, not one of {first:?}");
    }
}
