//! Our initiator against our target: every admin and I/O command, both backends,
//! digests, pipelining.

mod common;

use std::sync::Arc;

use nearstore_initiator::{Controller, Data};
use nearstore_wire::opcode::{feature, io, lid};
use nearstore_wire::{Sqe, Status};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

async fn read_write_cycle(c: &Controller, nsid: u32) {
    let ns = c.identify_namespace(nsid).await.unwrap();
    let bs = ns.block_size();
    let mut q = c.io_queue(1).await.unwrap();
    // Small (in-capsule), large (R2T, several H2CData PDUs), and at the last LBA.
    for (slba, len) in [(0u64, bs as usize), (8, 128 * 1024), (ns.nsze - 2, 2 * bs as usize)] {
        let data = pattern(len, slba as u8);
        q.write(nsid, slba, &data, bs, false).await.unwrap();
        let back = q.read(nsid, slba, (len / bs as usize) as u32, bs).await.unwrap();
        assert!(back == data, "nsid {nsid} slba {slba} len {len}: data differs");
    }
    q.write(nsid, 100, &pattern(4 * bs as usize, 9), bs, true).await.unwrap();
    q.flush(nsid).await.unwrap();
    q.write_zeroes(nsid, 100, 2, false).await.unwrap();
    let back = q.read(nsid, 100, 4, bs).await.unwrap();
    assert!(back[..2 * bs as usize].iter().all(|&b| b == 0));
    assert_eq!(&back[2 * bs as usize..], &pattern(4 * bs as usize, 9)[2 * bs as usize..]);
    q.deallocate(nsid, &[(102, 1), (103, 1)]).await.unwrap();
    let back = q.read(nsid, 100, 4, bs).await.unwrap();
    assert!(back.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn memory_and_file_namespaces_read_back_what_was_written() {
    let env = common::start().await;
    let c = env.connect().await;
    assert_eq!(c.active_namespaces().await.unwrap(), vec![1, 2]);
    read_write_cycle(&c, 1).await;
    read_write_cycle(&c, 2).await;
}

#[tokio::test]
async fn digests_and_sqflow_disabled() {
    let env = common::start().await;
    for (hd, dd, nosq) in [(true, false, false), (false, true, false), (true, true, true)] {
        let mut o = env.opts();
        o.hdgst = hd;
        o.ddgst = dd;
        o.disable_sqflow = nosq;
        let c = Controller::connect(o).await.unwrap();
        read_write_cycle(&c, 1).await;
        read_write_cycle(&c, 2).await;
    }
}

#[tokio::test]
async fn pipelined_queue_depth_128() {
    let env = common::start().await;
    let mut o = env.opts();
    o.queue_depth = 128;
    let c = Controller::connect(o).await.unwrap();
    for nsid in [1u32, 2] {
        let bs = c.identify_namespace(nsid).await.unwrap().block_size() as usize;
        let mut ioq = c.io_queue(1).await.unwrap();
        let q = ioq.queue();
        let n = 512u64;
        let per = 4096 / bs as u32;
        // Writes: 128 in flight.
        let mut submitted = 0u64;
        let mut completed = 0u64;
        let mut max_in_flight = 0;
        while completed < n {
            while submitted < n && q.in_flight() < 128 {
                let d = pattern(4096, submitted as u8);
                q.submit(Sqe::rw(io::WRITE, nsid, submitted * per as u64, per, false), Data::Out(&d), submitted).unwrap();
                submitted += 1;
            }
            max_in_flight = max_in_flight.max(q.in_flight());
            q.poll(|_, cqe, _| {
                assert!(cqe.status.is_success(), "{}", cqe.status);
                completed += 1;
            })
            .await
            .unwrap();
        }
        assert_eq!(max_in_flight, 128);
        // Reads, checking each block's content by its tag.
        let (mut submitted, mut completed) = (0u64, 0u64);
        while completed < n {
            while submitted < n && q.in_flight() < 128 {
                q.submit(Sqe::rw(io::READ, nsid, submitted * per as u64, per, false), Data::In(4096), submitted).unwrap();
                submitted += 1;
            }
            q.poll(|tag, cqe, data| {
                assert!(cqe.status.is_success());
                assert!(data == pattern(4096, tag as u8), "block {tag}");
                completed += 1;
            })
            .await
            .unwrap();
        }
    }
    assert_eq!(env.target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "every command completed");
}

/// Large reads arriving together (all submitted before a completion is taken, so they
/// reach the target as one batch) while another queue overwrites half of what they read:
/// reads of 32 KiB and more stay in the namespace's memory and leave in the batch's one
/// writev (tcp.rs, `TcpTx::gather`). Each read gets its own data: exactly what was written
/// where nothing writes, and no torn block where the writer does (every block it writes is
/// one byte repeated). Of the read data nothing is copied into the send buffer except the
/// rest of a block where the socket cut a send short. Sizes around the threshold and up to
/// MDTS, with and without digests and the SUCCESS flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_large_reads_gets_each_reads_data_beside_a_writer() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let env = common::start().await;
    let mdts = 4096usize << nearstore_target::limits::MDTS;
    for len in [32 * 1024 - 512, 32 * 1024, 64 * 1024, mdts] {
        for (hd, dd, nosq) in [(false, false, false), (true, true, false), (false, true, true)] {
            let what = format!("{len} bytes, hdgst {hd}, ddgst {dd}, sqflow off {nosq}");
            let mut o = env.opts();
            o.hdgst = hd;
            o.ddgst = dd;
            o.disable_sqflow = nosq;
            o.queue_depth = 64;
            let c = Controller::connect(o).await.unwrap();
            let bs = c.identify_namespace(1).await.unwrap().block_size();
            let mut ioq = c.io_queue(1).await.unwrap();
            let (n, per) = (32u64, (len / bs as usize) as u64);
            // Reads 0..16 where nothing writes, 16..32 over the writer's blocks, which
            // start uniform too.
            for i in 0..n {
                let data = if i < n / 2 { pattern(len, i as u8) } else { vec![0x5a; len] };
                ioq.write(1, i * per, &data, bs, false).await.unwrap();
            }
            let stop = Arc::new(AtomicBool::new(false));
            let mut wq = c.io_queue(2).await.unwrap();
            let writer = tokio::spawn({
                let stop = stop.clone();
                async move {
                    let mut gen = 0u8;
                    while !stop.load(Relaxed) {
                        gen = gen.wrapping_add(1);
                        for i in n / 2..n {
                            let data: Vec<u8> = (0..len).map(|k| gen ^ (k / bs as usize) as u8).collect();
                            wq.write(1, i * per, &data, bs, false).await.unwrap();
                        }
                    }
                }
            });
            let copied_before = env.target.stats.tx_copied_bytes.load(Relaxed);
            let partial_before = env.target.stats.tx_partial_writes.load(Relaxed);
            for _round in 0..4 {
                let q = ioq.queue();
                for i in 0..n {
                    q.submit(Sqe::rw(io::READ, 1, i * per, per as u32, false), Data::In(len), i).unwrap();
                }
                let mut done = 0;
                while done < n {
                    q.poll(|tag, cqe, data| {
                        assert!(cqe.status.is_success(), "{what}: read {tag}: {}", cqe.status);
                        if tag < n / 2 {
                            assert!(data == pattern(len, tag as u8), "{what}: read {tag}: data differs");
                        } else {
                            for (b, blk) in data.chunks(bs as usize).enumerate() {
                                assert!(blk.iter().all(|&x| x == blk[0]), "{what}: read {tag}: block {b} is torn");
                            }
                        }
                        done += 1;
                    })
                    .await
                    .unwrap();
                }
            }
            stop.store(true, Relaxed);
            writer.await.unwrap();
            let copied = env.target.stats.tx_copied_bytes.load(Relaxed) - copied_before;
            let partial = env.target.stats.tx_partial_writes.load(Relaxed) - partial_before;
            let allowed = if len < 32 * 1024 { u64::MAX } else { partial * (bs as u64 - 1) };
            assert!(copied <= allowed, "{what}: {copied} bytes copied for {partial} short sends");
        }
    }
    assert_eq!(env.target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "every command completed");
}

#[tokio::test]
async fn io_errors_have_the_spec_status() {
    let env = common::start().await;
    let c = env.connect().await;
    let ns = c.identify_namespace(1).await.unwrap();
    let mut ioq = c.io_queue(1).await.unwrap();
    let q = ioq.queue();
    let mut mdts_read = Sqe::rw(io::READ, 1, 0, 512, false);
    mdts_read.set_cdw(12, 511);
    let mut bad_dsm = Sqe::new(io::DATASET_MANAGEMENT, 0);
    bad_dsm.set_nsid(1).set_cdw(11, 1 << 2);
    let mut dsm_range = vec![0u8; 16];
    dsm_range[4..8].copy_from_slice(&8u32.to_le_bytes());
    dsm_range[8..16].copy_from_slice(&(ns.nsze - 4).to_le_bytes());
    let cases: Vec<(&str, Sqe, Data, Status)> = vec![
        ("read past the end", Sqe::rw(io::READ, 1, ns.nsze - 1, 2, false), Data::In(1024), Status::LBA_OUT_OF_RANGE),
        ("write past the end", Sqe::rw(io::WRITE, 1, ns.nsze, 1, false), Data::Out(&[0; 512]), Status::LBA_OUT_OF_RANGE),
        ("slba overflow", Sqe::rw(io::READ, 1, u64::MAX, 1, false), Data::In(512), Status::LBA_OUT_OF_RANGE),
        ("unknown namespace", Sqe::rw(io::READ, 9, 0, 1, false), Data::In(512), Status::INVALID_NAMESPACE),
        ("broadcast flush", Sqe::new(io::FLUSH, 0).set_nsid(0xffff_ffff).to_owned(), Data::None, Status::INVALID_NAMESPACE),
        ("unknown opcode", Sqe::new(0x7e, 0).set_nsid(1).to_owned(), Data::None, Status::INVALID_OPCODE),
        ("length mismatch", Sqe::rw(io::READ, 1, 0, 2, false), Data::In(512), Status::DATA_SGL_LENGTH_INVALID),
        ("over MDTS", mdts_read, Data::In(512), Status::INVALID_FIELD),
        ("dsm range past the end", bad_dsm, Data::Out(&dsm_range), Status::LBA_OUT_OF_RANGE),
    ];
    for (what, sqe, data, want) in cases {
        let mut got = None;
        let cid = match q.submit(sqe, data, 7) {
            Ok(cid) => cid,
            Err(e) => panic!("{what}: {e}"),
        };
        q.wait(cid, |_, cqe, _| got = Some(cqe.status)).await.unwrap();
        let got = got.unwrap();
        assert_eq!((got.sct, got.sc), (want.sct, want.sc), "{what}: got {got}");
        assert!(got.dnr, "{what}: DNR expected");
    }
    // The queue still serves.
    ioq.write(1, 0, &[1; 512], 512, false).await.unwrap();
    // The error log shows the latest failure first.
    let log = c.get_log(lid::ERROR_INFORMATION, 0, 64, 0).await.unwrap();
    let e = nearstore_wire::log::ErrorEntry::decode(&log);
    assert_eq!(Status::from_field(e.status), Status::LBA_OUT_OF_RANGE.dnr());
    assert!(e.error_count >= cases_len());
    assert!(c.get_feature(feature::NUMBER_OF_QUEUES).await.is_ok());
    assert_eq!(env.target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "every command completed");
}

fn cases_len() -> u64 {
    9
}
