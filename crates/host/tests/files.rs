//! Files on a real ext4 file system on a loop device, whose image a target exports: every
//! streaming operation gives the same result offloaded, pulled over NVMe/TCP and computed
//! locally, over files of many shapes; outputs written by the target read back through the
//! file system; a file changed during a call is detected. Needs root, loop devices and
//! mkfs.ext4 (CI runs as root); it fails, naming what is missing, without them.

mod common;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::Fs;
use nearstore_compute::{by_name, Build, Outcome, OPERATIONS};
use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_host::object::{map_file, MapError, Mapped};
use nearstore_host::{Host, How, Mode};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_testkit::text;

const NQN: &str = "nqn.2026-11.io.nearstore:hosttest";

async fn start_target(image: &Path) -> Endpoint {
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n",
        image.display()
    ))
    .unwrap();
    let t = Target::from_config(&cfg).unwrap();
    let addr = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    std::mem::forget(t);
    Endpoint { address: addr, nqn: NQN.into(), nsid: 1 }
}

/// Files of every shape the issue names.
fn make_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for (i, size) in [0usize, 1, 511, 512, 4097, 3 * 1024 * 1024 + 17].into_iter().enumerate() {
        let p = root.join(format!("plain-{size}"));
        std::fs::write(&p, text(size, i as u64)).unwrap();
        files.push(p);
    }
    // Sparse: data, a 5 MiB hole, data, and a hole at the end.
    let p = root.join("sparse");
    let f = File::create(&p).unwrap();
    f.write_all_at(&text(10_000, 7), 0).unwrap();
    f.write_all_at(&text(7_000, 8), 5 << 20).unwrap();
    f.set_len((7 << 20) + 333).unwrap();
    files.push(p);
    // Unwritten: 2 MiB fallocated, 10 KiB written in the middle.
    let p = root.join("unwritten");
    let f = File::create(&p).unwrap();
    assert_eq!(unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 2 << 20) }, 0);
    f.write_all_at(&text(10_240, 9), 300_000).unwrap();
    files.push(p);
    // Fragmented: two files grown a block at a time, alternately, each block synced.
    let (pa, pb) = (root.join("frag-a"), root.join("frag-b"));
    let (mut a, mut b) = (File::create(&pa).unwrap(), File::create(&pb).unwrap());
    for k in 0..150u64 {
        a.write_all(&text(4096, 100 + k)).unwrap();
        a.sync_data().unwrap();
        b.write_all(&text(4096, 1000 + k)).unwrap();
        b.sync_data().unwrap();
    }
    files.push(pa);
    files.push(pb);
    files
}

fn args_for(op: &str) -> Vec<u8> {
    match op {
        "search" => br#"{"pattern":"needle","max_offsets":100}"#.to_vec(),
        "regex-count" => br#"{"pattern":"ERR[O]R"}"#.to_vec(),
        "grep-count" => br#"{"pattern":"^ERROR"}"#.to_vec(),
        // The words of each line are its fields.
        "select" => br#"{"query":"SELECT COUNT(*), MIN(_1), MAX(_2), SUM(LENGTH(_1)) FROM t WHERE _1 <> 'lorem' OR _2 IS NULL","delimiter":" ","header":false}"#
            .to_vec(),
        _ => Vec::new(),
    }
}

fn outcomes(r: &nearstore_host::Report) -> Vec<Outcome> {
    r.files.iter().map(|f| f.outcome.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_pulled_and_local_results_are_identical_over_many_file_shapes() {
    let fs = Fs::new(128);
    let ep = start_target(&fs.image).await;
    let files = make_files(&fs.mnt);
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, ep.clone()).unwrap();
    // The shapes are what they claim to be.
    let frag = match map_file(&fs.mnt.join("frag-a"), &devices).unwrap() {
        Mapped::Offload(f) => f,
        Mapped::Local { reason, .. } => panic!("frag-a falls back: {reason}"),
    };
    assert!(frag.object.extents.len() >= 10, "frag-a has only {} extents", frag.object.extents.len());
    let Mapped::Offload(sparse) = map_file(&fs.mnt.join("sparse"), &devices).unwrap() else { panic!("sparse falls back") };
    assert!(sparse.object.extents.iter().any(|e| e.is_zeros()));
    let Mapped::Offload(unw) = map_file(&fs.mnt.join("unwritten"), &devices).unwrap() else { panic!("unwritten falls back") };
    assert!(unw.snapshot.extents.iter().any(|e| e.flags & nearstore_host::fiemap::flags::UNWRITTEN != 0));

    let mut host = Host::new(devices);
    for op in OPERATIONS.iter().filter(|o| matches!(o.build, Build::Stream(_) | Build::Either { .. })) {
        let args = args_for(op.name);
        let mut files = files.clone();
        if op.name == "select" {
            // A hole of megabytes is one record of NULs, longer than a record may be: the
            // same refusal in every mode.
            let big_holes: Vec<PathBuf> = files.iter().filter(|f| f.ends_with("sparse") || f.ends_with("unwritten")).cloned().collect();
            files.retain(|f| !big_holes.contains(f));
            for f in &big_holes {
                for mode in [Mode::Offload, Mode::Pull, Mode::Local] {
                    let e = host.run(op, &args, std::slice::from_ref(f), mode).await.unwrap_err().to_string();
                    assert!(e.contains("a record longer than 1048576 bytes"), "{} {mode:?}: {e}", f.display());
                }
            }
        }
        let off = host.run(op, &args, &files, Mode::Offload).await.unwrap();
        let pull = host.run(op, &args, &files, Mode::Pull).await.unwrap();
        let local = host.run(op, &args, &files, Mode::Local).await.unwrap();
        assert!(
            off.files.iter().all(|f| f.how == How::Offloaded),
            "{}: {:?}",
            op.name,
            off.files.iter().map(|f| &f.how).collect::<Vec<_>>()
        );
        assert!(pull.files.iter().all(|f| f.how == How::Pulled));
        assert_eq!(outcomes(&off), outcomes(&local), "{} offloaded vs local", op.name);
        assert_eq!(outcomes(&pull), outcomes(&local), "{} pulled vs local", op.name);
        // And the local kernel over the file's bytes read plainly.
        for (f, o) in files.iter().zip(outcomes(&local)) {
            assert_eq!(nearstore_compute::run(op.name, &args, [&std::fs::read(f).unwrap()[..]]).unwrap(), o);
        }
        if op.name == "crc32c" {
            // A checksum's wire bytes are a tiny part of the data; pulling moves it all.
            assert!(off.wire_received * 100 < off.bytes_processed, "offloaded received {} of {}", off.wire_received, off.bytes_processed);
            // Pulling moves every data byte (holes and unwritten extents are not read).
            let data_bytes: u64 = files
                .iter()
                .map(|f| match map_file(f, &host.devices).unwrap() {
                    Mapped::Offload(fo) => fo.object.pieces().filter(|p| !p.is_zeros()).map(|p| p.len).sum::<u64>(),
                    Mapped::Local { .. } => 0,
                })
                .sum();
            assert!(pull.wire_received >= data_bytes, "pulled received {} of {data_bytes} data bytes", pull.wire_received);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_written_by_the_target_read_back_through_the_file_system() {
    let fs = Fs::new(64);
    let ep = start_target(&fs.image).await;
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, ep).unwrap();
    let input = fs.mnt.join("in");
    let data = text(2_000_003, 5);
    std::fs::write(&input, &data).unwrap();
    // Read the output's old content into the page cache first: it must not be what we see.
    let out = fs.mnt.join("out");
    std::fs::write(&out, vec![b'x'; 3 << 20]).unwrap();
    let _ = std::fs::read(&out).unwrap();
    let mut host = Host::new(devices);
    let r =
        host.transform(by_name("copy").unwrap(), b"", std::slice::from_ref(&input), &out, data.len() as u64, Mode::Offload).await.unwrap();
    assert_eq!(r.files[0].how, How::Offloaded);
    assert_eq!(r.files[0].outcome, Outcome::Written { input: data.len() as u64, output: data.len() as u64 });
    let back = std::fs::read(&out).unwrap();
    let first_diff = back.iter().zip(&data).position(|(a, b)| a != b);
    assert!(
        back == data,
        "the output file reads back as the input: {} vs {} bytes, first difference at {first_diff:?}, {:?}",
        back.len(),
        data.len(),
        &back[..16]
    );
    assert!(r.wire_sent + r.wire_received < 64 * 1024, "copy moved {} bytes over the wire", r.wire_sent + r.wire_received);
    // Locally, the same file.
    let out2 = fs.mnt.join("out2");
    let r = host.transform(by_name("copy").unwrap(), b"", &[input], &out2, data.len() as u64, Mode::Local).await.unwrap();
    assert_eq!(r.files[0].how, How::Local("--local".into()));
    assert!(std::fs::read(&out2).unwrap() == data);

    // select's rows, written by the target into a file next to its input, read back as
    // the host writes them locally.
    let csv = fs.mnt.join("t.csv");
    let mut rows = b"k,v\n".to_vec();
    for i in 0..50_000 {
        rows.extend_from_slice(format!("{i},\"v {}\"\n", i % 7).as_bytes());
    }
    std::fs::write(&csv, &rows).unwrap();
    let args = br#"{"query":"SELECT v, k * 2 AS twice FROM s3object WHERE k % 3 = 0","output_format":"jsonl"}"#;
    let select = by_name("select").unwrap();
    let (o1, o2) = (fs.mnt.join("rows-off"), fs.mnt.join("rows-local"));
    let r = host.transform(select, args, std::slice::from_ref(&csv), &o1, rows.len() as u64, Mode::Offload).await.unwrap();
    assert_eq!(r.files[0].how, How::Offloaded);
    let l = host.transform(select, args, std::slice::from_ref(&csv), &o2, rows.len() as u64, Mode::Local).await.unwrap();
    assert_eq!(r.files[0].outcome, l.files[0].outcome);
    let (a, b) = (std::fs::read(&o1).unwrap(), std::fs::read(&o2).unwrap());
    assert_eq!(a.len() as u64, r.files[0].outcome.output_bytes().unwrap());
    assert!(a == b, "the target's rows read back as the host's: {} vs {} bytes", a.len(), b.len());
    assert!(a.starts_with(b"{\"v\":\"v 0\",\"twice\":0}\n"), "{:?}", String::from_utf8_lossy(&a[..40]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_during_a_call_and_foreign_file_systems() {
    let fs = Fs::new(64);
    let ep = start_target(&fs.image).await;
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, ep).unwrap();
    let p = fs.mnt.join("moving");
    std::fs::write(&p, text(100_000, 1)).unwrap();
    let Mapped::Offload(fo) = map_file(&p, &devices).unwrap() else { panic!("falls back") };
    fo.verify().unwrap();
    OpenOptions::new().append(true).open(&p).unwrap().write_all(b"more").unwrap();
    match fo.verify() {
        Err(MapError::Changed { what, .. }) => assert_eq!(what, "size"),
        r => panic!("a grown file passed verification: {r:?}"),
    }
    std::fs::write(&p, text(100_004, 2)).unwrap();
    assert!(matches!(fo.verify(), Err(MapError::Changed { .. })));
    // A file on tmpfs is not on any namespace: computed locally, with the reason.
    let shm = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    std::fs::write(shm.path(), b"hello").unwrap();
    let mut host = Host::new(devices);
    let r = host.run(by_name("crc32c").unwrap(), b"", &[shm.path().into(), p.clone()], Mode::Offload).await.unwrap();
    match &r.files[0].how {
        How::Local(reason) => assert!(reason.contains("no single block device"), "{reason}"),
        h => panic!("tmpfs file was {h:?}"),
    }
    assert_eq!(r.files[1].how, How::Offloaded);
    // A directory is refused with its name.
    let e = host.run(by_name("crc32c").unwrap(), b"", std::slice::from_ref(&fs.mnt), Mode::Offload).await.unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compress_decompress_sort_and_merge_on_the_target_equal_the_host() {
    let fs = Fs::new(128);
    let ep = start_target(&fs.image).await;
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, ep).unwrap();
    let mut host = Host::new(devices);
    let m = &fs.mnt;
    // Inputs: text lines, and 100-byte records with 10-byte keys (TeraSort's shape).
    std::fs::write(m.join("text"), text(3_000_001, 3)).unwrap();
    let recs = |seed: u64, n: usize| -> Vec<u8> {
        let mut s = seed | 1;
        (0..n * 100)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    };
    std::fs::write(m.join("r1"), recs(1, 20_000)).unwrap();
    std::fs::write(m.join("r2"), recs(2, 7_000)).unwrap();
    let rec_args = br#"{"record_size":100,"key_length":10}"#;
    // (operation, arguments, inputs, output)
    let steps: Vec<(&str, &[u8], Vec<&str>, &str)> = vec![
        ("compress", br#"{"level":5}"#, vec!["text"], "text.zst"),
        ("decompress", b"", vec!["text.zst"], "text.back"),
        ("sort", b"", vec!["text"], "text.sorted"),
        ("sort", rec_args, vec!["r1"], "r1.sorted"),
        ("sort", rec_args, vec!["r2"], "r2.sorted"),
        ("merge", rec_args, vec!["r1.sorted", "r2.sorted"], "merged"),
        ("sort", rec_args, vec!["r1", "r2"], "sorted-whole"),
    ];
    for (op, args, inputs, out) in steps {
        let op = by_name(op).unwrap();
        let inputs: Vec<PathBuf> = inputs.iter().map(|i| m.join(i)).collect();
        let cap = nearstore_host::output_capacity(op, &inputs).unwrap();
        let r = host.transform(op, args, &inputs, &m.join(out), cap, Mode::Offload).await.unwrap();
        assert_eq!(r.files[0].how, How::Offloaded, "{}", op.name);
        assert!(r.wire_sent + r.wire_received < 64 * 1024, "{} moved {} bytes", op.name, r.wire_sent + r.wire_received);
        let local = m.join(format!("{out}.local"));
        let l = host.transform(op, args, &inputs, &local, cap, Mode::Local).await.unwrap();
        assert_eq!(r.files[0].outcome.result(), l.files[0].outcome.result(), "{}", op.name);
        assert!(
            std::fs::read(m.join(out)).unwrap() == std::fs::read(&local).unwrap(),
            "{}: the target's output reads back as the host's",
            op.name
        );
    }
    let text_bytes = std::fs::read(m.join("text")).unwrap();
    assert!(std::fs::read(m.join("text.back")).unwrap() == text_bytes, "compress then decompress gives the file back");
    assert!(zstd::decode_all(&std::fs::read(m.join("text.zst")).unwrap()[..]).unwrap() == text_bytes, "zstd reads our frames");
    assert!(
        std::fs::read(m.join("merged")).unwrap() == std::fs::read(m.join("sorted-whole")).unwrap(),
        "merge of sorted pieces = sort of all"
    );
    // sort -C agrees: the lines come out in byte order, every line kept.
    let sorted = std::fs::read(m.join("text.sorted")).unwrap();
    let lines: Vec<&[u8]> = sorted.split(|&b| b == b'\n').collect();
    assert!(lines[..lines.len() - 1].windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(sorted.len(), text_bytes.len() + 1, "every byte, and a newline for the last line");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transforms_give_the_same_files_offloaded_and_local_over_every_shape() {
    let fs = Fs::new(256);
    let ep = start_target(&fs.image).await;
    let files = make_files(&fs.mnt);
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, ep).unwrap();
    let mut host = Host::new(devices);
    for op in ["copy", "compress", "sort"] {
        let op = by_name(op).unwrap();
        for f in &files {
            let inputs = std::slice::from_ref(f);
            let cap = nearstore_host::output_capacity(op, inputs).unwrap();
            let name = f.file_name().unwrap().to_str().unwrap();
            let (off, local) = (fs.mnt.join(format!("{name}.{}.off", op.name)), fs.mnt.join(format!("{name}.{}.local", op.name)));
            let r = host.transform(op, b"", inputs, &off, cap, Mode::Offload).await;
            let l = host.transform(op, b"", inputs, &local, cap, Mode::Local).await;
            match (r, l) {
                (Ok(r), Ok(l)) => {
                    assert_eq!(r.files[0].how, How::Offloaded, "{} {name}", op.name);
                    assert_eq!(r.files[0].outcome.result(), l.files[0].outcome.result(), "{} {name}", op.name);
                    assert!(std::fs::read(&off).unwrap() == std::fs::read(&local).unwrap(), "{} {name}: output files differ", op.name);
                }
                // Sorting a file whose hole is one line of megabytes of NULs: refused alike.
                (Err(r), Err(l)) => {
                    assert_eq!(op.name, "sort", "{name}: {r}");
                    assert!(r.to_string().contains("more than 1048576") && l.to_string().contains("more than 1048576"), "{r} / {l}");
                }
                (r, l) => {
                    panic!("{} {name}: offloaded {:?}, local {:?}", op.name, r.err().map(|e| e.to_string()), l.err().map(|e| e.to_string()))
                }
            }
            let _ = (std::fs::remove_file(&off), std::fs::remove_file(&local));
        }
    }
}

/// A failed transform leaves no output it created, offloaded and local: a sort the
/// target refuses (a line over the 1 MiB bound) and a decompress of an input that is not
/// zstd. An output that was there before the call keeps its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transform_leaves_no_output_and_keeps_an_existing_one() {
    let fs = Fs::new(64);
    let ep = start_target(&fs.image).await;
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, ep).unwrap();
    let mut host = Host::new(devices);
    let m = &fs.mnt;
    let mut long = vec![b'x'; 2 << 20];
    long.push(b'\n');
    std::fs::write(m.join("long-line"), &long).unwrap();
    std::fs::write(m.join("not-zstd"), text(300_000, 5)).unwrap();
    // (operation, input, capacity, what the error says)
    let cases: &[(&str, &str, u64, &str)] = &[("sort", "long-line", 4 << 20, "more than 1048576"), ("decompress", "not-zstd", 8 << 20, "")];
    for &(op, input, cap, says) in cases {
        let op = by_name(op).unwrap();
        let inputs = vec![m.join(input)];
        for mode in [Mode::Offload, Mode::Local] {
            let out = m.join(format!("{input}.{mode:?}.out"));
            let e = host.transform(op, b"", &inputs, &out, cap, mode).await.expect_err("the call fails");
            assert!(e.to_string().contains(says), "{} {mode:?}: {e}", op.name);
            assert!(!out.exists(), "{} {mode:?}: a failed call left {}", op.name, out.display());
            let existing = b"the user's file\n";
            std::fs::write(&out, existing).unwrap();
            host.transform(op, b"", &inputs, &out, cap, mode).await.expect_err("the call fails");
            assert_eq!(std::fs::read(&out).unwrap(), existing, "{} {mode:?}: an existing output changed", op.name);
            let dir: Vec<_> = std::fs::read_dir(m).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert!(dir.iter().all(|n| !n.to_string_lossy().starts_with('.')), "{} {mode:?}: left {dir:?}", op.name);
            std::fs::remove_file(&out).unwrap();
        }
    }
}

/// A caller acting with its own file-system credentials on one thread (the FUSE mount,
/// for its user) has the files that cannot be offloaded computed on that thread: a file
/// only root may read is refused to it. On a blocking thread of the runtime, as the CLI
/// computes them, the same file is read with the process's credentials.
#[test]
fn local_files_are_computed_with_the_calling_threads_credentials() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"root's only\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let op = by_name("sha256").unwrap();
    // A runtime whose blocking thread this (root) thread made, as the mount's runtime has
    // them: a thread made by the caller's would inherit the caller's credentials.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.block_on(async { tokio::task::spawn_blocking(|| ()).await }).unwrap();
    // (computed on the calling thread, whether the file is read).
    for (on_caller, read) in [(false, true), (true, false)] {
        let (secret, rt) = (secret.clone(), rt.handle().clone());
        let r = std::thread::spawn(move || {
            // SAFETY: raw syscalls changing only this thread's file-system credentials.
            unsafe {
                libc::syscall(libc::SYS_setfsgid, 65534);
                libc::syscall(libc::SYS_setfsuid, 65534);
            }
            let mut host = Host::new(DeviceMap::default());
            host.local_on_caller = on_caller;
            rt.block_on(host.run(op, &[], &[secret], Mode::Local)).map(|r| r.files.len())
        })
        .join()
        .unwrap();
        assert_eq!(r.is_ok(), read, "computed on the calling thread {on_caller}: {r:?}");
        if let Err(e) = r {
            assert!(e.to_string().contains("ermission denied"), "{e}");
        }
    }
}
