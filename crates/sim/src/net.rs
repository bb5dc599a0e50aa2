//! The simulated network: a connection is a pair of [`SimStream`]s over one [`Link`], a
//! byte pipe each way with a window, a delivery delay per write chosen by the seed
//! (occasionally a stall), short reads and writes, and a reset that drops what is in
//! flight (a disconnect mid-command). Like TCP, a link never drops, duplicates or
//! reorders bytes: reordering happens between connections, by their delays.
//!
//! All waiting is on the runtime's clock, which the simulation pauses: a delay of a
//! second costs no real time.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use nearstore_transport::{Interest, Ready, Stream};
use parking_lot::Mutex;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::trace::Trace;

/// How a run's network behaves, chosen by the seed.
#[derive(Clone, Debug)]
pub struct NetProfile {
    /// Largest delivery delay of one write, in microseconds.
    pub delay_us_max: u64,
    /// Chance in a thousand that a write stalls (is delivered late), and for how long at most.
    pub stall_per_mille: u32,
    pub stall_ms_max: u64,
    /// Reads and writes take a random prefix of what they could (partial PDUs).
    pub short_io: bool,
    /// Bytes a direction holds in flight before writes would block (the socket buffer).
    pub window_bytes: usize,
}

/// A deliberate fault of the target's replies, to show the checker catches it: applied
/// to whole PDUs from the target, as if the target had written them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyBug {
    /// One completion capsule in `n` is sent twice.
    DuplicateCompletion(u32),
    /// One completion capsule in `n` is never sent.
    DropCompletion(u32),
}

/// One direction of a link.
#[derive(Default)]
struct Pipe {
    /// Bytes with the time they arrive, in order; arrival times never decrease.
    segments: VecDeque<(Instant, Vec<u8>)>,
    /// Bytes in `segments`.
    queued: usize,
    /// The writer closed its end: the reader sees end of stream once the bytes are read.
    closed: bool,
    /// Bytes of an incomplete PDU, when replies pass through a [`ReplyBug`].
    partial: Vec<u8>,
    completions: u32,
}

struct LinkState {
    /// [host to target, target to host]: side 0 is the host, it writes pipe 0.
    pipes: [Pipe; 2],
    reset: bool,
    rng: XorShiftRng,
    profile: NetProfile,
    bug: Option<ReplyBug>,
    /// Bytes read at either end so far.
    moved: u64,
}

/// A connection between the simulated host and the target.
pub struct Link {
    pub id: u32,
    state: Mutex<LinkState>,
    /// Wakes side 0 (host) or 1 (target) when its readiness may have changed.
    wake: [Notify; 2],
    trace: Trace,
}

impl Link {
    /// A new link; returns it with its host end and its target end.
    pub fn pair(id: u32, seed: u64, profile: NetProfile, bug: Option<ReplyBug>, trace: Trace) -> (Arc<Link>, SimStream, SimStream) {
        let state = LinkState { pipes: Default::default(), reset: false, rng: XorShiftRng::seed_from_u64(seed), profile, bug, moved: 0 };
        let link = Arc::new(Link { id, state: Mutex::new(state), wake: [Notify::new(), Notify::new()], trace });
        (link.clone(), SimStream { link: link.clone(), side: 0 }, SimStream { link, side: 1 })
    }

    /// Resets the connection: bytes in flight are lost, both ends see an error.
    pub fn cut(&self) {
        let mut s = self.state.lock();
        if s.reset {
            return;
        }
        s.reset = true;
        let lost: usize = s.pipes.iter().map(|p| p.queued).sum();
        s.pipes = Default::default();
        drop(s);
        self.trace.event(format_args!("net link {} reset, {lost} bytes in flight lost", self.id));
        self.wake_all();
    }

    pub fn is_cut(&self) -> bool {
        self.state.lock().reset
    }

    /// Bytes read at either end so far: whether the connection makes progress.
    pub fn moved(&self) -> u64 {
        self.state.lock().moved
    }

    fn wake_all(&self) {
        self.wake[0].notify_waiters();
        self.wake[1].notify_waiters();
    }
}

/// One end of a [`Link`].
pub struct SimStream {
    link: Arc<Link>,
    /// 0: the host's end; 1: the target's.
    side: usize,
}

impl SimStream {
    /// Readiness now, and when it may change by the clock alone (the next arrival).
    fn readiness(&self, now: Instant) -> (Ready, Option<Instant>) {
        let s = self.link.state.lock();
        if s.reset {
            return (Ready::READABLE | Ready::WRITABLE | Ready::READ_CLOSED | Ready::WRITE_CLOSED, None);
        }
        let incoming = &s.pipes[1 - self.side];
        let outgoing = &s.pipes[self.side];
        let mut r = Ready::EMPTY;
        let mut next = None;
        match incoming.segments.front() {
            Some((at, _)) if *at <= now => r |= Ready::READABLE,
            Some((at, _)) => next = Some(*at),
            None if incoming.closed => r |= Ready::READABLE | Ready::READ_CLOSED,
            None => {}
        }
        if outgoing.queued + outgoing.partial.len() < s.profile.window_bytes {
            r |= Ready::WRITABLE;
        }
        (r, next)
    }
}

impl AsRawFd for SimStream {
    /// No descriptor: -1. The transport uses a stream's descriptor only for sends that
    /// bypass the send buffer (`TxBuf::write_through`, whose writev then fails and copies
    /// the bytes into the buffer instead) and for `read_now`, overridden here.
    fn as_raw_fd(&self) -> RawFd {
        -1
    }
}

impl Stream for SimStream {
    async fn ready(&self, interest: Interest) -> io::Result<Ready> {
        loop {
            let notified = self.link.wake[self.side].notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (r, next) = self.readiness(Instant::now());
            let wanted = (interest.is_readable() && (r.is_readable() || r.is_read_closed()))
                || (interest.is_writable() && (r.is_writable() || r.is_write_closed()));
            if wanted {
                return Ok(r);
            }
            match next {
                Some(at) => {
                    tokio::select! {
                        biased;
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let now = Instant::now();
        let mut s = self.link.state.lock();
        if s.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        let mut want = buf.len();
        if s.profile.short_io && want > 1 {
            want = s.rng.random_range(1..=want);
        }
        let pipe = &mut s.pipes[1 - self.side];
        let mut n = 0;
        while n < want {
            let Some((at, seg)) = pipe.segments.front_mut() else { break };
            if *at > now {
                break;
            }
            let k = seg.len().min(want - n);
            buf[n..n + k].copy_from_slice(&seg[..k]);
            seg.drain(..k);
            if seg.is_empty() {
                pipe.segments.pop_front();
            }
            n += k;
        }
        pipe.queued -= n;
        let eof = n == 0 && pipe.closed && pipe.segments.is_empty();
        s.moved += n as u64;
        drop(s);
        if n > 0 {
            // Room in the window: the writer may go on.
            self.link.wake[1 - self.side].notify_waiters();
            return Ok(n);
        }
        if eof {
            return Ok(0);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        let now = Instant::now();
        let mut guard = self.link.state.lock();
        let s = &mut *guard;
        if s.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        let pipe = &s.pipes[self.side];
        let room = s.profile.window_bytes.saturating_sub(pipe.queued + pipe.partial.len());
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut n = buf.len().min(room);
        if s.profile.short_io && n > 1 {
            n = s.rng.random_range(1..=n);
        }
        let mut delay = Duration::from_micros(s.rng.random_range(0..=s.profile.delay_us_max));
        if s.profile.stall_per_mille > 0 && s.rng.random_range(0..1000) < s.profile.stall_per_mille {
            delay += Duration::from_millis(s.rng.random_range(1..=s.profile.stall_ms_max));
        }
        let bug = if self.side == 1 { s.bug } else { None };
        let pipe = &mut s.pipes[self.side];
        // Arrival times never go back: TCP keeps the bytes of a connection in order.
        let at = pipe.segments.back().map_or(now + delay, |(last, _)| (*last).max(now + delay));
        let bytes = match bug {
            None => buf[..n].to_vec(),
            Some(bug) => mutate_replies(pipe, &buf[..n], bug),
        };
        if !bytes.is_empty() {
            pipe.queued += bytes.len();
            pipe.segments.push_back((at, bytes));
        }
        drop(guard);
        self.link.wake[1 - self.side].notify_waiters();
        Ok(n)
    }

    fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.try_read(buf)
    }

    fn peer(&self) -> String {
        format!("sim-link-{}", self.link.id)
    }
}

impl Drop for SimStream {
    /// Closing an end: the peer reads what was sent, then end of stream.
    fn drop(&mut self) {
        self.link.state.lock().pipes[self.side].closed = true;
        self.link.wake_all();
    }
}

/// Passes the target's bytes through `bug` a whole PDU at a time: returns the bytes to
/// deliver now (complete PDUs, altered), keeping an incomplete PDU's bytes in the pipe.
fn mutate_replies(pipe: &mut Pipe, bytes: &[u8], bug: ReplyBug) -> Vec<u8> {
    pipe.partial.extend_from_slice(bytes);
    let mut out = Vec::new();
    loop {
        // The common header: type, flags, hlen, pdo, then the PDU length (LE u32).
        if pipe.partial.len() < 8 {
            break;
        }
        let plen = u32::from_le_bytes(pipe.partial[4..8].try_into().expect("4 bytes")) as usize;
        if plen < 8 || pipe.partial.len() < plen {
            break;
        }
        let pdu: Vec<u8> = pipe.partial.drain(..plen).collect();
        let completion = pdu[0] == nearstore_wire::pdu::PduType::CapsuleResp as u8;
        if completion {
            pipe.completions += 1;
        }
        match bug {
            ReplyBug::DuplicateCompletion(n) if completion && pipe.completions.is_multiple_of(n) => {
                out.extend_from_slice(&pdu);
                out.extend_from_slice(&pdu);
            }
            ReplyBug::DropCompletion(n) if completion && pipe.completions.is_multiple_of(n) => {}
            _ => out.extend_from_slice(&pdu),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(short_io: bool, window_bytes: usize) -> NetProfile {
        NetProfile { delay_us_max: 5000, stall_per_mille: 100, stall_ms_max: 50, short_io, window_bytes }
    }

    fn paused<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime").block_on(f)
    }

    /// Sends `data` from the host's end and reads it at the target's.
    async fn carry(short_io: bool, window_bytes: usize, data: &[u8]) -> Vec<u8> {
        let (_link, host, target) = Link::pair(0, 7, profile(short_io, window_bytes), None, Trace::new(false));
        let send = async {
            let mut sent = 0;
            while sent < data.len() {
                host.ready(Interest::WRITABLE).await.unwrap();
                match host.try_write(&data[sent..]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            }
            drop(host);
        };
        let receive = async {
            let mut got = Vec::new();
            let mut buf = [0u8; 1000];
            loop {
                target.ready(Interest::READABLE).await.unwrap();
                match target.try_read(&mut buf) {
                    Ok(0) => return got,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            }
        };
        tokio::join!(send, receive).1
    }

    #[test]
    fn bytes_arrive_in_order_then_the_end_of_the_stream() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        for (short_io, window) in [(false, 1 << 20), (true, 300), (true, 4096), (false, 1)] {
            assert_eq!(paused(carry(short_io, window, &data)), data, "short_io {short_io}, window {window}");
        }
    }

    #[test]
    fn a_cut_loses_what_is_in_flight_and_fails_both_ends() {
        paused(async {
            let (link, host, target) = Link::pair(0, 7, profile(false, 1 << 20), None, Trace::new(false));
            host.try_write(b"lost").unwrap();
            link.cut();
            assert!(link.is_cut());
            let r = target.ready(Interest::READABLE).await.unwrap();
            assert!(r.is_read_closed());
            assert_eq!(target.try_read(&mut [0; 8]).unwrap_err().kind(), io::ErrorKind::ConnectionReset);
            assert_eq!(host.try_write(b"x").unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        });
    }

    /// A CapsuleResp-shaped PDU: type 5, its length at byte 4, `tag` after.
    fn resp(tag: u8) -> Vec<u8> {
        let mut p = vec![5, 0, 24, 0, 24, 0, 0, 0];
        p.resize(24, tag);
        p
    }

    #[test]
    fn reply_bugs_act_on_whole_completions_split_across_writes() {
        let c2h = {
            let mut p = vec![7, 0, 24, 0, 30, 0, 0, 0];
            p.resize(30, 9);
            p
        };
        let stream = [resp(1), c2h.clone(), resp(2), resp(3)].concat();
        let cases: &[(ReplyBug, Vec<u8>)] = &[
            (ReplyBug::DuplicateCompletion(2), [resp(1), c2h.clone(), resp(2), resp(2), resp(3)].concat()),
            (ReplyBug::DropCompletion(3), [resp(1), c2h.clone(), resp(2)].concat()),
        ];
        for (bug, want) in cases {
            let mut pipe = Pipe::default();
            let mut out = Vec::new();
            // In pieces of 7 bytes: PDUs are reassembled before the bug sees them.
            for piece in stream.chunks(7) {
                out.extend(mutate_replies(&mut pipe, piece, *bug));
            }
            assert_eq!(&out, want, "{bug:?}");
        }
    }
}
