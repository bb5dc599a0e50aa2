//! The transport under NVMe/TCP: a byte stream that can be polled for readiness and read
//! or written without blocking, plus the page-aligned buffers the data path uses.
//!
//! Command handling is written against [`Stream`], so the same target and initiator code
//! runs over TCP and over an in-process Unix socket pair in tests (no ports, no races
//! with other processes).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::future::Future;
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

pub use tokio::io::{Interest, Ready};

/// A connected, non-blocking byte stream.
pub trait Stream: std::os::fd::AsRawFd + Send + Sync + 'static {
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send;
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
    /// Writes from several buffers in one non-blocking writev(2), as [`try_write`](Self::try_write)
    /// does from one (WouldBlock marks the stream not writable until the runtime sees it
    /// writable again). By default only the first non-empty buffer is written: a short write,
    /// which callers handle anyway.
    fn try_write_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match bufs.iter().find(|b| !b.is_empty()) {
            Some(b) => self.try_write(b),
            None => Ok(0),
        }
    }
    /// Reads without consulting the runtime's readiness cache: a plain non-blocking
    /// recv(2). Busy-polling loops use it, because the cache only learns of new data when
    /// the runtime polls epoll, which is exactly the wake-up a busy-poll is there to avoid.
    fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for buf.len() writable bytes; the fd is this open socket.
        let n = unsafe { libc::recv(self.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
    /// The peer's address, for logs.
    fn peer(&self) -> String;
}

impl Stream for tokio::net::TcpStream {
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send {
        tokio::net::TcpStream::ready(self, interest)
    }
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        tokio::net::TcpStream::try_read(self, buf)
    }
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        tokio::net::TcpStream::try_write(self, buf)
    }
    fn try_write_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        tokio::net::TcpStream::try_write_vectored(self, bufs)
    }
    fn peer(&self) -> String {
        self.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into())
    }
}

impl Stream for tokio::net::UnixStream {
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send {
        tokio::net::UnixStream::ready(self, interest)
    }
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        tokio::net::UnixStream::try_read(self, buf)
    }
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        tokio::net::UnixStream::try_write(self, buf)
    }
    fn try_write_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        tokio::net::UnixStream::try_write_vectored(self, bufs)
    }
    fn peer(&self) -> String {
        "unix-socketpair".into()
    }
}

pub const PAGE: usize = 4096;

/// A fixed-capacity, page-aligned, zero-initialised byte buffer with a length.
///
/// Page alignment matters on this machine kind: a cached pread into a buffer at page + 16
/// bytes measured 6x slower than into an aligned one (shared/MEASURED.md), and O_DIRECT
/// requires it.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(cap: usize) -> AlignedBuf {
        let cap = cap.max(PAGE).div_ceil(PAGE) * PAGE;
        let layout = Layout::from_size_align(cap, PAGE).expect("valid layout");
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("out of memory");
        AlignedBuf { ptr, cap, len: 0 }
    }
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// Sets the length; bytes past the old length keep whatever they held before.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "AlignedBuf length {len} over capacity {}", self.cap);
        self.len = len;
    }
    /// The whole capacity, for reads that fill the buffer.
    pub fn spare(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap bytes, initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.cap, PAGE)) }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: len <= cap, memory initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: len <= cap, memory initialised, exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A receive buffer: bytes in `[start, end)` are received and not yet consumed.
pub struct RxBuf {
    buf: AlignedBuf,
    start: usize,
    end: usize,
}

impl RxBuf {
    pub fn new(cap: usize) -> RxBuf {
        let mut buf = AlignedBuf::new(cap);
        let c = buf.capacity();
        buf.set_len(c);
        RxBuf { buf, start: 0, end: 0 }
    }
    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }
    pub fn consume(&mut self, n: usize) {
        self.start += n;
        debug_assert!(self.start <= self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }
    /// Reads what the stream has without blocking. Returns Ok(0) at end of stream,
    /// Err(WouldBlock) when nothing is there. Compacts first when the tail is full.
    pub fn fill<S: Stream>(&mut self, s: &S) -> io::Result<usize> {
        self.fill_with(|b| s.try_read(b))
    }

    /// Like [`fill`](Self::fill) but with [`Stream::read_now`], for busy-polling.
    pub fn fill_now<S: Stream>(&mut self, s: &S) -> io::Result<usize> {
        self.fill_with(|b| s.read_now(b))
    }

    fn fill_with(&mut self, read: impl FnOnce(&mut [u8]) -> io::Result<usize>) -> io::Result<usize> {
        if self.end == self.buf.len() {
            if self.start == 0 {
                return Err(io::Error::other("receive buffer full: PDU larger than the buffer"));
            }
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

/// A send buffer: PDUs are appended to `buf`; `sent` bytes of it are on the wire.
#[derive(Default)]
pub struct TxBuf {
    pub buf: Vec<u8>,
    sent: usize,
}

impl TxBuf {
    pub fn with_capacity(cap: usize) -> TxBuf {
        TxBuf { buf: Vec::with_capacity(cap), sent: 0 }
    }
    pub fn pending(&self) -> usize {
        self.buf.len() - self.sent
    }
    /// Writes as much as the stream takes without blocking. Ok(true) when all is sent.
    pub fn flush<S: Stream>(&mut self, s: &S) -> io::Result<bool> {
        while self.sent < self.buf.len() {
            match s.try_write(&self.buf[self.sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = self.compact();
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
        self.buf.clear();
        self.sent = 0;
        Ok(true)
    }

    /// Drops the bytes already sent once they are at least as many as those still
    /// pending: each byte is moved at most once, and the buffer never holds more than
    /// twice what is pending (after a partial send the sent prefix would otherwise stay
    /// until the buffer drains completely, and the buffer grow without bound).
    /// Returns how many bytes it dropped (positions in `buf` move back by as many).
    pub fn compact(&mut self) -> usize {
        if self.sent > 0 && self.sent >= self.pending() {
            let n = self.sent;
            self.buf.drain(..n);
            self.sent = 0;
            return n;
        }
        0
    }
    /// Where the unsent bytes start in `buf`.
    pub fn sent(&self) -> usize {
        self.sent
    }

    /// Marks the bytes of `buf` before `at` as sent, by a send that interleaved other data
    /// with them; [`compact`](Self::compact) drops them.
    pub fn set_sent(&mut self, at: usize) {
        assert!(at >= self.sent && at <= self.buf.len(), "sent mark {at} outside {}..={}", self.sent, self.buf.len());
        self.sent = at;
    }

    /// Writes everything, waiting for the stream as needed.
    pub async fn flush_all<S: Stream>(&mut self, s: &S) -> io::Result<()> {
        while !self.flush(s)? {
            s.ready(Interest::WRITABLE).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned() {
        let mut b = AlignedBuf::new(10);
        assert_eq!(b.capacity(), PAGE);
        assert_eq!(b.spare().as_ptr() as usize % PAGE, 0);
        b.set_len(10);
        assert_eq!(&b[..], &[0u8; 10]);
    }

    #[tokio::test]
    async fn rx_tx_over_socketpair() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let mut tx = TxBuf::default();
        tx.buf.extend_from_slice(&[7u8; 10000]);
        tx.flush_all(&a).await.unwrap();
        let mut rx = RxBuf::new(4096 * 4);
        let mut got = 0;
        while got < 10000 {
            b.ready(Interest::READABLE).await.unwrap();
            match rx.fill(&b) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(rx.data(), &[7u8; 10000][..]);
        rx.consume(10000);
        assert!(rx.data().is_empty());
    }

    #[tokio::test]
    async fn a_slow_reader_does_not_grow_the_send_buffer_without_bound() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let mut tx = TxBuf::default();
        let mut rx = RxBuf::new(1 << 16);
        let mut most = 0;
        let mut received = 0;
        let chunk = vec![3u8; 100_000];
        for _ in 0..200 {
            // Keep about 1 MB pending, as the target does, while the reader takes 64 KiB
            // at a time.
            if tx.pending() < 1_000_000 {
                tx.buf.extend_from_slice(&chunk);
            }
            if !tx.flush(&a).unwrap() {
                // Let the runtime see the socket become writable again.
                let _ = tokio::time::timeout(std::time::Duration::from_millis(1), a.writable()).await;
            }
            most = most.max(tx.buf.len());
            if let Ok(n) = rx.fill_now(&b) {
                received += n;
                rx.consume(n);
            }
        }
        assert!(received > 1_000_000, "the reader got {received} bytes");
        assert!(most <= 2 * (1_000_000 + chunk.len()), "send buffer held {most} bytes");
    }

    #[tokio::test]
    async fn vectored_writes_keep_order_and_report_what_they_took() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let parts: [&[u8]; 3] = [b"head", &[9u8; 100_000], b"tail"];
        let mut wire = Vec::new();
        let mut rx = RxBuf::new(1 << 18);
        let (mut i, mut skip) = (0, 0);
        while i < parts.len() {
            let iov: Vec<io::IoSlice> =
                std::iter::once(&parts[i][skip..]).chain(parts[i + 1..].iter().copied()).map(io::IoSlice::new).collect();
            match a.try_write_vectored(&iov) {
                Ok(mut n) => {
                    while n > 0 {
                        let k = n.min(parts[i].len() - skip);
                        (skip, n) = (skip + k, n - k);
                        if skip == parts[i].len() {
                            (i, skip) = (i + 1, 0);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            if let Ok(n) = rx.fill_now(&b) {
                wire.extend_from_slice(&rx.data()[..n]);
                rx.consume(n);
            }
        }
        while wire.len() < 100_008 {
            b.ready(Interest::READABLE).await.unwrap();
            if let Ok(n) = rx.fill(&b) {
                wire.extend_from_slice(&rx.data()[..n]);
                rx.consume(n);
            }
        }
        assert_eq!(wire, parts.concat());
    }
}
