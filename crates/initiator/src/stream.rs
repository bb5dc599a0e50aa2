//! Streams of blocks over one queue: [`PieceReader`] reads byte ranges of a namespace in
//! order with many reads in flight, [`PieceWriter`] writes a byte stream into ranges with
//! many writes in flight. The host pulls objects and copies runs between targets with
//! them; a target reads its peers' extents with them.

use std::collections::{HashMap, VecDeque};

use nearstore_wire::compute::Extent;
use nearstore_wire::opcode::io;
use nearstore_wire::{Sqe, Status};
use tokio::net::TcpStream;

use crate::{Data, Error, QueuePair, Result};

/// Bytes per Read or Write command.
pub const IO_BYTES: u64 = 128 * 1024;
/// Commands in flight per stream.
pub const DEPTH: usize = 32;

fn failed(what: &str, status: Status) -> Error {
    Error::Status { what: what.into(), status, cqe: Default::default() }
}

/// Reads pieces (namespace byte offsets and lengths, block-aligned starts; runs of zeros
/// are not read) and hands their bytes out in order, [`IO_BYTES`] at a time.
pub struct PieceReader<'q> {
    qp: &'q mut QueuePair<TcpStream>,
    nsid: u32,
    block: u64,
    /// Commands in order: (namespace offset or ZEROS, bytes to read, bytes of the stream).
    cmds: Vec<(u64, u64, u64)>,
    next_submit: usize,
    next_deliver: usize,
    /// Completed reads waiting for their turn (None: a run of zeros).
    ready: HashMap<usize, Option<Vec<u8>>>,
    /// Buffers to reuse: nothing is allocated per read once DEPTH buffers exist.
    spare: Vec<Vec<u8>>,
    current: Option<Vec<u8>>,
    in_flight: usize,
    depth: usize,
    zeros: Vec<u8>,
}

impl<'q> PieceReader<'q> {
    pub fn new(qp: &'q mut QueuePair<TcpStream>, nsid: u32, block: u64, pieces: impl IntoIterator<Item = Extent>) -> PieceReader<'q> {
        let mut cmds = Vec::new();
        for p in pieces {
            let mut at = 0;
            while at < p.len {
                let n = (p.len - at).min(IO_BYTES);
                let off = if p.is_zeros() { p.offset } else { p.offset + at };
                cmds.push((off, n.div_ceil(block) * block, n));
                at += n;
            }
        }
        PieceReader {
            qp,
            nsid,
            block,
            cmds,
            next_submit: 0,
            next_deliver: 0,
            ready: HashMap::new(),
            spare: Vec::new(),
            current: None,
            in_flight: 0,
            depth: DEPTH,
            zeros: Vec::new(),
        }
    }

    /// At most `depth` reads in flight (the stream's buffer memory: depth x [`IO_BYTES`]).
    pub fn depth(mut self, depth: usize) -> Self {
        self.depth = depth.max(1);
        self
    }

    /// The next bytes in order, or None at the end.
    pub async fn next(&mut self) -> Result<Option<&[u8]>> {
        if let Some(b) = self.current.take() {
            self.spare.push(b);
        }
        loop {
            if self.next_deliver >= self.cmds.len() {
                return Ok(None);
            }
            while self.in_flight < self.depth && self.next_submit < self.cmds.len() {
                let (off, len, _) = self.cmds[self.next_submit];
                if off == nearstore_wire::compute::ZEROS {
                    self.ready.insert(self.next_submit, None);
                } else {
                    let sqe = Sqe::rw(io::READ, self.nsid, off / self.block, (len / self.block) as u32, false);
                    self.qp.submit(sqe, Data::In(len as usize), self.next_submit as u64)?;
                    self.in_flight += 1;
                }
                self.next_submit += 1;
            }
            if let Some(b) = self.ready.remove(&self.next_deliver) {
                let n = self.cmds[self.next_deliver].2 as usize;
                self.next_deliver += 1;
                let b = match b {
                    Some(b) => b,
                    None => {
                        if self.zeros.len() < n {
                            self.zeros = vec![0; IO_BYTES as usize];
                        }
                        let mut b = self.spare.pop().unwrap_or_default();
                        b.clear();
                        b.extend_from_slice(&self.zeros[..n]);
                        b
                    }
                };
                let b = self.current.insert(b);
                b.truncate(n);
                return Ok(Some(&b[..]));
            }
            let (ready, spare) = (&mut self.ready, &mut self.spare);
            let mut status = None;
            let n = self
                .qp
                .poll(|tag, cqe, data| {
                    if !cqe.status.is_success() {
                        status = Some(cqe.status);
                    }
                    let mut b = spare.pop().unwrap_or_default();
                    b.clear();
                    b.extend_from_slice(data);
                    ready.insert(tag as usize, Some(b));
                })
                .await?;
            self.in_flight -= n;
            if let Some(s) = status {
                return Err(failed("a Read", s));
            }
        }
    }
}

/// Writes a byte stream into pieces (namespace byte ranges, whole blocks) in order; the
/// last block is padded with zeros. [`PieceWriter::finish`] waits for every write and
/// flushes.
pub struct PieceWriter<'q> {
    qp: &'q mut QueuePair<TcpStream>,
    nsid: u32,
    block: u64,
    pieces: VecDeque<Extent>,
    capacity: u64,
    buf: Vec<u8>,
    written: u64,
    in_flight: usize,
}

impl<'q> PieceWriter<'q> {
    pub fn new(qp: &'q mut QueuePair<TcpStream>, nsid: u32, block: u64, pieces: impl IntoIterator<Item = Extent>) -> PieceWriter<'q> {
        let pieces: VecDeque<Extent> = pieces.into_iter().collect();
        let capacity = pieces.iter().map(|p| p.len).sum();
        PieceWriter { qp, nsid, block, pieces, capacity, buf: Vec::new(), written: 0, in_flight: 0 }
    }

    pub async fn write(&mut self, data: &[u8]) -> Result<()> {
        if self.written + data.len() as u64 > self.capacity {
            return Err(Error::Invalid(format!(
                "{} bytes do not fit the output's {} bytes",
                self.written + data.len() as u64,
                self.capacity
            )));
        }
        self.written += data.len() as u64;
        self.buf.extend_from_slice(data);
        self.drain(false).await
    }

    /// Submits what is buffered as whole commands (a command is as long as the piece and
    /// [`IO_BYTES`] allow; at the end, whatever is left). The buffer holds whole blocks
    /// whenever a command is cut from it: pieces are whole blocks, and `finish` pads it.
    async fn drain(&mut self, all: bool) -> Result<()> {
        let mut at = 0;
        while let Some(&p) = self.pieces.front() {
            let full = p.len.min(IO_BYTES) as usize;
            let n = full.min(self.buf.len() - at);
            if n == 0 || (!all && n < full) {
                break;
            }
            if self.in_flight >= DEPTH {
                self.wait_one().await?;
            }
            let sqe = Sqe::rw(io::WRITE, self.nsid, p.offset / self.block, (n as u64 / self.block) as u32, false);
            // The queue copies the data into its own buffer: no allocation here.
            self.qp.submit(sqe, Data::Out(&self.buf[at..at + n]), 0)?;
            self.in_flight += 1;
            let p = self.pieces.front_mut().expect("still there");
            p.offset += n as u64;
            p.len -= n as u64;
            if p.len == 0 {
                self.pieces.pop_front();
            }
            at += n;
        }
        self.buf.drain(..at);
        Ok(())
    }

    async fn wait_one(&mut self) -> Result<()> {
        let mut status = None;
        let n = self
            .qp
            .poll(|_, cqe, _| {
                if !cqe.status.is_success() {
                    status = Some(cqe.status);
                }
            })
            .await?;
        self.in_flight -= n;
        match status {
            Some(s) => Err(failed("a Write", s)),
            None => Ok(()),
        }
    }

    /// Writes the tail, waits for every write, and flushes the namespace: the bytes
    /// written.
    pub async fn finish(mut self) -> Result<u64> {
        let padded = (self.buf.len() as u64).div_ceil(self.block) * self.block;
        self.buf.resize(padded as usize, 0);
        self.drain(true).await?;
        while self.in_flight > 0 {
            self.wait_one().await?;
        }
        let mut s = Sqe::new(io::FLUSH, 0);
        s.set_nsid(self.nsid);
        self.qp.submit(s, Data::None, 0)?;
        self.in_flight = 1;
        self.wait_one().await?;
        Ok(self.written)
    }
}
