//! One io_uring per connection for file and block backends.
//!
//! A connection pushes the reads, writes and flushes of a batch of commands as submission
//! entries, submits them with one syscall after the batch, and reaps completions from the
//! shared ring without a syscall: in its busy-poll loop, or after waking on the ring's
//! eventfd when it parks. Page-cache hits complete during the submit call itself. No
//! thread hand-off, so a target on one core does not share it with worker threads
//! (docs/benchmarks.md has the comparison with the worker pool).
//!
//! Every buffer an entry points to is owned by the connection's in-flight slot until the
//! entry's completion is reaped; a connection that closes waits for its entries first
//! ([`Ring::drain`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use tokio::io::unix::AsyncFd;

pub struct Ring {
    ring: IoUring,
    eventfd: Arc<AsyncFd<OwnedFd>>,
    /// Entries pushed and not yet reaped.
    in_flight: usize,
    /// Entries pushed and not yet submitted.
    unsubmitted: usize,
    /// Every entry goes to the kernel's io-wq workers (IOSQE_ASYNC) instead of being tried
    /// inline in the submit call: a page-cache hit is then copied there, not on the
    /// submitting thread.
    punt: bool,
}

/// A submission: what to do with which buffer, `user_data` coming back with its result.
pub enum Sub {
    Read { fd: RawFd, buf: *mut u8, len: u32, off: u64 },
    Write { fd: RawFd, buf: *const u8, len: u32, off: u64, dsync: bool },
    Fdatasync { fd: RawFd },
}

impl Ring {
    pub fn new(entries: u32) -> io::Result<Ring> {
        let ring = IoUring::new(entries)?;
        // SAFETY: plain syscall; the fd is checked and then owned.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: efd is a fresh descriptor nobody else owns.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        // SAFETY: an OwnedFd stays open and the same descriptor for as long as it lives.
        let eventfd = unsafe { AsyncFd::register(efd) }.map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Ring { ring, eventfd: Arc::new(eventfd), in_flight: 0, unsubmitted: 0, punt: false })
    }

    /// Sends every entry from now on to the kernel's workers (IOSQE_ASYNC): the submitting
    /// thread no longer copies page-cache hits inside the submit, at the cost of a
    /// hand-off to a kernel thread per entry.
    pub fn set_punt(&mut self, punt: bool) {
        self.punt = punt;
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues one operation. The buffer must stay valid and untouched until its
    /// completion is reaped.
    ///
    /// # Safety
    /// `buf` points to `len` bytes that live, unmoved, until the completion for
    /// `user_data` has been returned by [`reap`](Self::reap).
    pub unsafe fn push(&mut self, sub: Sub, user_data: u64) -> io::Result<()> {
        let e: squeue::Entry = match sub {
            Sub::Read { fd, buf, len, off } => opcode::Read::new(types::Fd(fd), buf, len).offset(off).build(),
            Sub::Write { fd, buf, len, off, dsync } => {
                let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                opcode::Write::new(types::Fd(fd), buf, len).offset(off).rw_flags(flags).build()
            }
            Sub::Fdatasync { fd } => opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC).build(),
        };
        let e = e.user_data(user_data);
        let e = if self.punt { e.flags(squeue::Flags::ASYNC) } else { e };
        // SAFETY: the caller keeps the buffer alive until the completion (see above).
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            // Submission queue full: hand what is queued to the kernel first.
            self.submit()?;
        }
        self.in_flight += 1;
        self.unsubmitted += 1;
        Ok(())
    }

    /// Hands every queued entry to the kernel, without waiting.
    pub fn submit(&mut self) -> io::Result<()> {
        if self.unsubmitted == 0 {
            return Ok(());
        }
        loop {
            match self.ring.submit() {
                Ok(n) => {
                    self.unsubmitted -= n.min(self.unsubmitted);
                    if self.unsubmitted == 0 {
                        return Ok(());
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // Completion queue full: the caller reaps, then submits again.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) || e.raw_os_error() == Some(libc::EAGAIN) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// True when completions wait in the ring; no syscall.
    pub fn has_completions(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    /// Calls `f(user_data, result)` for up to `max` completions that have arrived; no
    /// syscall. The rest stay in the ring.
    pub fn reap(&mut self, max: usize, mut f: impl FnMut(u64, i32)) -> usize {
        let mut n = 0;
        for c in self.ring.completion().take(max) {
            n += 1;
            f(c.user_data(), c.result());
        }
        self.in_flight -= n;
        n
    }

    /// Something that resolves once a completion may have arrived.
    pub fn waker(&self) -> Arc<AsyncFd<OwnedFd>> {
        self.eventfd.clone()
    }

    /// Waits until every pushed entry has completed, dropping the results: a closing
    /// connection calls this before it frees the buffers the entries point to.
    pub fn drain(&mut self) {
        let _ = self.submit();
        while self.in_flight > 0 {
            let _ = self.ring.submit_and_wait(1);
            self.reap(usize::MAX, |_, _| {});
        }
    }
}

/// Idle io_urings of ended compute commands, kept for the next ones of the same target
/// (`offload::IoContext`): making a ring costs io_uring_setup, its mmaps and an eventfd
/// registered with the runtime. A ring's eventfd belongs to the runtime it was made on, so
/// a pool serves one runtime: it goes with that runtime in the `IoContext`. At most
/// [`limits::COMPUTE_RINGS_IDLE_MAX`](crate::limits::COMPUTE_RINGS_IDLE_MAX) wait; one
/// comes back only idle, every entry reaped (`dev::Channel::recycle`).
pub struct RingPool {
    idle: parking_lot::Mutex<Vec<Ring>>,
    max: usize,
    created: AtomicU64,
}

impl RingPool {
    pub fn new(max: usize) -> RingPool {
        RingPool { idle: parking_lot::Mutex::new(Vec::with_capacity(max)), max, created: AtomicU64::new(0) }
    }

    /// An idle ring, or a new one of `entries` entries, counted ([`created`](Self::created)).
    pub fn take(&self, entries: u32) -> io::Result<Box<Ring>> {
        if let Some(r) = self.idle.lock().pop() {
            return Ok(Box::new(r));
        }
        let r = Box::new(Ring::new(entries)?);
        self.created.fetch_add(1, Relaxed);
        Ok(r)
    }

    /// Keeps `ring` for another command when it is idle and fewer than the pool's most
    /// wait; else it is closed (after its entries, if any). Returns whether it was kept.
    pub fn give(&self, ring: Box<Ring>) -> bool {
        if ring.in_flight > 0 || ring.unsubmitted > 0 {
            return false;
        }
        let mut idle = self.idle.lock();
        if idle.len() >= self.max {
            return false;
        }
        idle.push(*ring);
        true
    }

    /// Rings this pool has made.
    pub fn created(&self) -> u64 {
        self.created.load(Relaxed)
    }

    /// Rings waiting for a command.
    pub fn idle(&self) -> usize {
        self.idle.lock().len()
    }
}

/// Resolves when the eventfd was signalled, and resets it.
pub async fn wait(efd: &AsyncFd<OwnedFd>) -> io::Result<()> {
    loop {
        let mut g = efd.readable().await?;
        let r = g.try_io(|fd| {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into v from an eventfd we own.
            let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
        match r {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.drain();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nearstore_transport::AlignedBuf;
    use std::os::unix::fs::FileExt;

    #[tokio::test]
    async fn read_write_sync_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.path().join("x")).unwrap();
        f.set_len(1 << 20).unwrap();
        let mut r = Ring::new(8).unwrap();
        let mut w = AlignedBuf::new(8192);
        w.set_len(8192);
        w.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        // SAFETY: w lives until the completion is reaped below.
        unsafe { r.push(Sub::Write { fd: f.as_raw_fd(), buf: w.as_ptr(), len: 8192, off: 4096, dsync: true }, 7).unwrap() };
        r.submit().unwrap();
        let mut got = Vec::new();
        while got.is_empty() {
            wait(&r.waker()).await.unwrap();
            r.reap(usize::MAX, |u, res| got.push((u, res)));
        }
        assert_eq!(got, vec![(7, 8192)]);
        let mut back = vec![0u8; 8192];
        f.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(&back[..], &w[..]);
        let mut rb = AlignedBuf::new(4096);
        rb.set_len(4096);
        // SAFETY: rb lives until drained below.
        unsafe {
            r.push(Sub::Read { fd: f.as_raw_fd(), buf: rb.as_mut_ptr(), len: 4096, off: 8192 }, 8).unwrap();
            r.push(Sub::Fdatasync { fd: f.as_raw_fd() }, 9).unwrap();
        }
        r.submit().unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            wait(&r.waker()).await.unwrap();
            r.reap(usize::MAX, |u, res| got.push((u, res)));
        }
        got.sort();
        assert_eq!(got, vec![(8, 4096), (9, 0)]);
        assert_eq!(&rb[..], &w[4096..]);
        // Errors come back as negative errno.
        // SAFETY: no buffer.
        unsafe { r.push(Sub::Fdatasync { fd: -1 }, 10).unwrap() };
        r.submit().unwrap();
        let mut got = Vec::new();
        while got.is_empty() {
            wait(&r.waker()).await.unwrap();
            r.reap(usize::MAX, |u, res| got.push((u, res)));
        }
        assert_eq!(got, vec![(10, -libc::EBADF)]);
        assert_eq!(r.in_flight(), 0);
    }
}
