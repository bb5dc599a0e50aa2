//! `nearstore mount` as a user runs it: a process serving the mount until unmounted. A
//! result read through `.nearstore/SPEC/file` is what the compute verb prints for the same
//! file, computed on the target, and so is the verb run on the mount's path; unmounting waits while a file is open. Needs root, loop
//! devices, mkfs.ext4 and /dev/fuse; fails naming what is missing.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ok, target_on_free_port, Fs, Proc, Target};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn mounted(mnt: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").unwrap().lines().any(|l| l.split(' ').nth(4) == Some(p(mnt)))
}

/// Waits for `cond`, up to `secs`: a bound several times what it takes on a loaded machine.
fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < end, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `nearstore mount` process; unmounted (lazily) and killed when dropped, passed or failed.
struct Mount {
    child: Child,
    mnt: PathBuf,
    log: PathBuf,
}

impl Mount {
    fn start(args: &[&str], source: &Path, mnt: &Path, log: PathBuf) -> Mount {
        assert!(Path::new("/dev/fuse").exists(), "this test needs /dev/fuse (the fuse kernel module)");
        let child = Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .arg("mount")
            .args(args)
            .args([source, mnt])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting nearstore mount");
        let mut m = Mount { child, mnt: mnt.into(), log };
        wait_for(30, "the mount", || {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!("nearstore mount exited ({status}): {}", m.log());
            }
            mounted(mnt)
        });
        m
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: a signal to our own child.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, sig) }, 0);
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn xattr(path: &Path, name: &str) -> Option<String> {
    let (c, n) = (std::ffi::CString::new(p(path)).unwrap(), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid C strings and a buffer of buf.len() bytes.
    let r = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (r >= 0).then(|| String::from_utf8_lossy(&buf[..r as usize]).into_owned())
}

#[test]
fn results_through_the_mount_are_the_clis_and_unmount_waits_for_open_files() {
    let fs = Fs::new(64);
    let rows: String = (0..3000).map(|i| format!("{i},{},{}\n", ["Oslo", "Lima", "Kyiv"][i % 3], i * 7 % 101)).collect();
    std::fs::write(fs.mnt.join("orders.csv"), format!("id,city,amount\n{rows}")).unwrap();
    let lines: String = (0..20_000).map(|i| if i % 7 == 0 { format!("ERROR disk {i}\n") } else { format!("ok {i}\n") }).collect();
    std::fs::write(fs.mnt.join("app.log"), &lines).unwrap();
    let t = Target::start(&["--namespace", p(&fs.image)]);
    let map = fs.dir.path().join("map.toml");
    let entry = format!(
        "[[namespace]]\naddress = \"{}\"\nnqn = \"nqn.2026-11.io.nearstore:disk0\"\nnsid = 1\nfile = \"{}\"\n",
        t.addr,
        p(&fs.image)
    );
    std::fs::write(&map, entry).unwrap();
    let mnt = fs.dir.path().join("view");
    std::fs::create_dir(&mnt).unwrap();
    let mount = Mount::start(&["--map", p(&map)], &fs.mnt, &mnt, fs.dir.path().join("mount.log"));

    let query = "SELECT city, COUNT(*), SUM(amount) FROM s3object GROUP BY city ORDER BY city";
    // (spec, file, the verb's arguments, how its output becomes the mount's text)
    type Cut = fn(&str) -> String;
    let cases: &[(&str, &str, &[&str], Cut)] = &[
        ("sha256", "app.log", &["checksum", "-a", "sha256"], |o| format!("{}\n", o.split_whitespace().next().unwrap())),
        ("crc32c", "orders.csv", &["checksum", "-a", "crc32c"], |o| format!("{}\n", o.split_whitespace().next().unwrap())),
        ("grep:^ERROR", "app.log", &["grep", "-c", "^ERROR"], |o| format!("{}\n", o.trim().rsplit(':').next().unwrap())),
        ("wc", "app.log", &["wc"], |o| format!("{}\n", o.split_whitespace().take(3).collect::<Vec<_>>().join(" "))),
        (&*format!("select:{query}").leak(), "orders.csv", &["select", query], str::to_string),
    ];
    for (spec, file, verb, cut) in cases {
        let path = fs.mnt.join(file);
        let args: Vec<&str> = verb.iter().copied().chain(["--offload-only", "--map", p(&map), p(&path)]).collect();
        let want = cut(&ok(&args));
        // The verb on the mount's path: the mount names the file's extents (its ioctl,
        // docs/fuse.md "FIEMAP"), and the verb offloads as on the source.
        let through = mnt.join(file);
        let on_mount: Vec<&str> = verb.iter().copied().chain(["--offload-only", "--map", p(&map), p(&through)]).collect();
        assert_eq!(cut(&ok(&on_mount)), want, "{spec} over {file}: the verb on the mount's path and on the source's");
        let result = mnt.join(".nearstore").join(spec).join(file);
        let got = std::fs::read_to_string(&result).unwrap_or_else(|e| panic!("{spec}: {e}: {}", mount.log()));
        assert_eq!(got, want, "{spec} over {file}: the mount's result and the CLI's");
        assert_eq!(xattr(&result, "user.nearstore.offloaded").as_deref(), Some("1"), "{spec}: computed on the target");
        // `nearstore attach`: the operation attached to an O_DIRECT descriptor of the file
        // through the ioctl, then through the attribute, its reads the same result.
        for how in [&[][..], &["--xattr"]] {
            let args: Vec<&str> = ["attach"].into_iter().chain(how.iter().copied()).chain([p(&through), spec]).collect();
            let o = common::nearstore(&args);
            assert!(o.status.success(), "{args:?}: {o:?}: {}", mount.log());
            assert_eq!(String::from_utf8_lossy(&o.stdout), want, "{args:?}");
            assert!(String::from_utf8_lossy(&o.stderr).contains("computed on the target"), "{args:?}: {o:?}");
        }
    }
    // Outside a mount the ioctl is not known (ENOTTY), and an unknown operation is refused
    // by the mount (EINVAL), each named.
    let (_, e) = common::fails(&["attach", p(&fs.mnt.join("app.log")), "sha256"]);
    assert!(e.contains("attaching sha256") && e.contains("ioctl"), "{e}");
    let (_, e) = common::fails(&["attach", p(&mnt.join("app.log")), "nosuchop"]);
    assert!(e.contains("attaching nosuchop") && e.contains("Invalid argument"), "{e}");
    // A file no target exports (on a tmpfs inside the source): attach computes it in the
    // mount and says why on standard error, the reason the attribute gives.
    let mem = fs.mnt.join("mem");
    std::fs::create_dir(&mem).unwrap();
    let _tmpfs = nearstore_testkit::Mounted::new(&["-t", "tmpfs", "-o", "size=16m", "tmpfs"], &mem);
    std::fs::write(mem.join("f"), &lines).unwrap();
    let mem_f = mnt.join("mem/f");
    for how in [&[][..], &["--xattr"]] {
        let args: Vec<&str> = ["attach"].into_iter().chain(how.iter().copied()).chain([p(&mem_f), "grep:^ERROR"]).collect();
        let o = common::nearstore(&args);
        assert!(o.status.success(), "{args:?}: {o:?}: {}", mount.log());
        assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{}\n", lines.lines().filter(|l| l.starts_with("ERROR")).count()));
        let e = String::from_utf8_lossy(&o.stderr);
        let result = mnt.join(".nearstore/grep:^ERROR/mem/f");
        assert_eq!(std::fs::read(&result).unwrap(), o.stdout, "the result path's");
        let why = xattr(&result, "user.nearstore.offloaded").unwrap_or_else(|| panic!("{}", std::io::Error::last_os_error()));
        let why = why.strip_prefix("0 ").unwrap_or_else(|| panic!("not offloaded, and why: {why}"));
        assert!(why.len() > 16 && e.contains(&format!("computed on this host (not offloaded: {why})")), "{args:?}: {e}");
    }
    // Transforms: the output the mount writes beside the file is the CLI verb's output of
    // the same file. (spec, file, the verb with IN and OUT, the output's name beside the file)
    let into = format!("select-into:{query}");
    let transforms: &[(&str, &str, &[&str], &str)] = &[
        ("compress", "app.log", &["compress", "IN", "OUT"], "app.log.zst"),
        ("sort", "app.log", &["sort", "IN", "--into", "OUT"], "app.log.sorted"),
        (into.as_str(), "orders.csv", &["select", query, "IN", "--into", "OUT"], "orders.csv.select.csv"),
    ];
    for (spec, file, verb, output) in transforms {
        let (input, out) = (fs.mnt.join(file), fs.mnt.join(format!("cli-{output}")));
        let args: Vec<&str> = verb
            .iter()
            .map(|a| {
                if *a == "IN" {
                    p(&input)
                } else if *a == "OUT" {
                    p(&out)
                } else {
                    *a
                }
            })
            .collect();
        ok(&args);
        let result = mnt.join(".nearstore").join(spec).join(file);
        let report = std::fs::read_to_string(&result).unwrap_or_else(|e| panic!("{spec}: {e}: {}", mount.log()));
        let got = std::fs::read(mnt.join(output)).unwrap();
        assert_eq!(report, format!("{output} {}\n", got.len()), "{spec}");
        assert!(got == std::fs::read(&out).unwrap(), "{spec} over {file}: the mount's output and the CLI's");
        assert_eq!(xattr(&result, "user.nearstore.offloaded").as_deref(), Some("1"), "{spec}: computed on the target");
    }
    // The file itself still reads as its bytes.
    assert_eq!(std::fs::read_to_string(mnt.join("app.log")).unwrap(), lines);

    // Busy: umount fails while a file is open, and the mount goes on serving; so does a
    // SIGTERM, which says why in the log.
    let open = std::fs::File::open(mnt.join("app.log")).unwrap();
    let o = Command::new("umount").arg(&mnt).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("busy"), "{o:?}");
    mount.signal(libc::SIGTERM);
    wait_for(30, "the log line of a busy unmount", || mount.log().contains("cannot unmount"));
    assert!(mounted(&mnt));
    assert_eq!(std::fs::read_to_string(mnt.join("app.log")).unwrap(), lines, "served after the refusal");
    // Closed: unmounted, and the process ends by itself.
    drop(open);
    let o = Command::new("umount").arg(&mnt).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let mut mount = mount;
    let end = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = mount.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < end, "nearstore mount still runs after the unmount: {}", mount.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}: {}", mount.log());
    assert!(mount.log().contains("unmounted"), "{}", mount.log());
}

/// `nearstore mount --hostnqn --dhchap-secret`: the mount connects as that host, with its
/// key, so a target that admits only that keyed host serves its operations; a mount as
/// another host gets EACCES for the result and says why in its log.
#[test]
fn the_mount_connects_as_its_host_with_its_secret() {
    const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";
    const HOST: &str = "nqn.2026-11.io.nearstore:fuse-mount-host";
    const SUB: &str = "nqn.2026-11.io.nearstore:disk0";
    let fs = Fs::new(64);
    let lines: String = (0..5000).map(|i| format!("line {i}\n")).collect();
    std::fs::write(fs.mnt.join("app.log"), &lines).unwrap();
    let cfg = fs.dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{SUB}\"\n[[subsystem.host]]\nnqn = \"{HOST}\"\n\
             dhchap_key = \"{KEY}\"\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n",
            p(&fs.image)
        ),
    )
    .unwrap();
    let t = Target::start(&["--config", p(&cfg)]);
    let map = fs.dir.path().join("map.toml");
    std::fs::write(&map, format!("[[namespace]]\naddress = \"{}\"\nnqn = \"{SUB}\"\nnsid = 1\nfile = \"{}\"\n", t.addr, p(&fs.image)))
        .unwrap();
    let want = ok(&["checksum", "-a", "sha256", "--local", p(&fs.mnt.join("app.log"))]);
    let want = format!("{}\n", want.split_whitespace().next().unwrap());
    let key_file = fs.dir.path().join("host.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    std::fs::set_permissions(&key_file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // (name, the mount's identity, what reading the result gives)
    let cases: [(&str, &[&str], Result<&str, std::io::ErrorKind>); 3] = [
        ("keyed", &["--hostnqn", HOST, "--dhchap-secret", KEY], Ok(want.as_str())),
        ("keyed-from-a-file", &["--hostnqn", HOST, "--dhchap-secret-file", p(&key_file)], Ok(want.as_str())),
        ("stranger", &["--hostnqn", "nqn.2026-11.io.nearstore:stranger"], Err(std::io::ErrorKind::PermissionDenied)),
    ];
    for (name, identity, want) in cases {
        let mnt = fs.dir.path().join(name);
        std::fs::create_dir(&mnt).unwrap();
        let args: Vec<&str> = ["--map", p(&map)].into_iter().chain(identity.iter().copied()).collect();
        let mount = Mount::start(&args, &fs.mnt, &mnt, fs.dir.path().join(format!("{name}.log")));
        let got = std::fs::read_to_string(mnt.join(".nearstore/sha256/app.log")).map_err(|e| e.kind());
        assert_eq!(got.as_deref().map_err(|e| *e), want, "{name}: {}", mount.log());
        // A secret on the command line is warned about; from a file it is not on it.
        assert_eq!(mount.log().contains("secret on the command line"), identity.contains(&"--dhchap-secret"), "{name}: {}", mount.log());
        if want.is_err() {
            wait_for(30, "the refusal in the log", || mount.log().contains("refused by the target to this mount's host"));
        } else {
            assert_eq!(xattr(&mnt.join(".nearstore/sha256/app.log"), "user.nearstore.offloaded").as_deref(), Some("1"), "{name}");
        }
    }
}

/// A DH-HMAC-CHAP secret file that group or others may reach is refused before anything is
/// mounted, as ssh refuses such a key (the error names the file and the fix, never the
/// secret); one that is its owner's alone is taken.
#[test]
fn a_secret_file_others_may_reach_is_refused() {
    const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";
    let dir = tempfile::tempdir().unwrap();
    let (key, host_key, absent) = (dir.path().join("key"), dir.path().join("host.key"), dir.path().join("absent"));
    std::fs::write(&host_key, format!("{KEY}\n")).unwrap();
    std::fs::set_permissions(&host_key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // (mode, refused)
    let cases = [(0o600, false), (0o400, false), (0o640, true), (0o604, true), (0o644, true), (0o620, true), (0o602, true)];
    for flag in ["--dhchap-secret-file", "--dhchap-ctrl-secret-file"] {
        for (mode, refused) in cases {
            std::fs::write(&key, format!("{KEY}\n")).unwrap();
            std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
            let mut args = vec!["mount"];
            if flag != "--dhchap-secret-file" {
                args.extend(["--dhchap-secret-file", p(&host_key)]);
            }
            // A mount point that does not exist: a secret taken fails there, after parsing.
            args.extend([flag, p(&key), p(dir.path()), p(&absent)]);
            let o = common::nearstore(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!err.contains("DHHC-1"), "{flag} {mode:o}: the secret in the error: {err}");
            if refused {
                assert_eq!(o.status.code(), Some(2), "{flag} {mode:o}: {err}");
                assert!(err.contains(&format!("mode {mode:04o}")) && err.contains("chmod 600"), "{flag} {mode:o}: {err}");
            } else {
                assert_eq!(o.status.code(), Some(1), "{flag} {mode:o}: {err}");
                assert!(err.contains("absent") && !err.contains("chmod"), "{flag} {mode:o}: {err}");
            }
        }
    }
}

/// `nearstore target --config FILE` on a free port, its configuration `config(address)`
/// written to `file` (common::target_on_free_port).
fn config_target(file: &Path, config: impl Fn(&str) -> String) -> Proc {
    target_on_free_port(|addr| {
        std::fs::write(file, config(&addr.to_string())).unwrap();
        vec!["--discovery".into(), "none".into(), "--config".into(), p(file).into()]
    })
    .0
}

/// The first field of a checksum verb's line, as the mount reads it.
fn first_field(o: &str) -> String {
    format!("{}\n", o.split_whitespace().next().unwrap_or(""))
}

/// `nearstore mount --target-config`: a target exporting two file systems (the second
/// mounted inside the first in the source directory); each file's result through the
/// mount is the CLI's with the same configuration, computed on the target.
#[test]
fn the_mount_with_a_target_config_offloads_each_namespace_it_names() {
    let (a, b) = (Fs::new(64), Fs::new(64));
    let lines: String = (0..20_000).map(|i| if i % 9 == 0 { format!("ERROR {i}\n") } else { format!("ok {i}\n") }).collect();
    std::fs::write(a.mnt.join("app.log"), &lines).unwrap();
    let rows: String = (0..3000).map(|i| format!("{i},{}\n", ["Oslo", "Lima", "Kyiv"][i % 3])).collect();
    std::fs::write(b.mnt.join("orders.csv"), format!("id,city\n{rows}")).unwrap();
    // A second file system in the source directory: b bind-mounted inside a.
    std::fs::create_dir(a.mnt.join("b")).unwrap();
    let _inner = nearstore_testkit::Mounted::new(&["--bind", p(&b.mnt)], &a.mnt.join("b"));
    let cfg = a.dir.path().join("target.toml");
    let _t = config_target(&cfg, |addr| {
        let sub = |name: &str, image: &Path| {
            format!(
                "[[subsystem]]\nnqn = \"nqn.2026-11.io.nearstore:{name}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n",
                p(image)
            )
        };
        format!("[[listener]]\naddress = \"{addr}\"\n{}{}", sub("fuse-a", &a.image), sub("fuse-b", &b.image))
    });
    let mnt = a.dir.path().join("view");
    std::fs::create_dir(&mnt).unwrap();
    let mount = Mount::start(&["--target-config", p(&cfg)], &a.mnt, &mnt, a.dir.path().join("mount.log"));
    let query = "SELECT city, COUNT(*) FROM s3object GROUP BY city ORDER BY city";
    // (spec, file in the source, the verb, how its output becomes the mount's text)
    type Cut = fn(&str) -> String;
    let select = format!("select:{query}");
    let cases: [(&str, &str, Vec<&str>, Cut); 4] = [
        ("sha256", "app.log", vec!["checksum", "-a", "sha256"], first_field),
        ("sha256", "b/orders.csv", vec!["checksum", "-a", "sha256"], first_field),
        ("grep:^ERROR", "app.log", vec!["grep", "-c", "^ERROR"], |o| format!("{}\n", o.trim().rsplit(':').next().unwrap())),
        (&select, "b/orders.csv", vec!["select", query], str::to_string),
    ];
    for (spec, file, verb, cut) in cases {
        let source = a.mnt.join(file);
        let args: Vec<&str> = verb.iter().copied().chain(["--offload-only", "--target-config", p(&cfg), p(&source)]).collect();
        let want = cut(&ok(&args));
        let result = mnt.join(".nearstore").join(spec).join(file);
        let got = std::fs::read_to_string(&result).unwrap_or_else(|e| panic!("{spec} {file}: {e}: {}", mount.log()));
        assert_eq!(got, want, "{spec} over {file}: the mount's result and the CLI's");
        assert_eq!(xattr(&result, "user.nearstore.offloaded").as_deref(), Some("1"), "{spec} over {file}: computed on the target");
    }
}

/// Established TCP connections to 127.0.0.1:`port` from this network namespace (their
/// client ends): how many operations of the mount wait on a target.
fn connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|l| l.split_whitespace().nth(2) == Some(remote.as_str()) && l.split_whitespace().nth(3) == Some("01"))
        .count()
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: a signal to a child of this test.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
}

/// A stalled target (SIGSTOPped: its kernel still completes TCP handshakes, the process
/// answers nothing): an operation on a file it exports waits, while the files of another
/// target are computed and every file reads, lists and stats; at most
/// COMPUTE_IN_FLIGHT_MAX (16) operations wait at once and the next fails with EAGAIN at
/// once; each waiting one fails with EIO after `--op-timeout`; then the mount serves on,
/// the stalled target's files too once it answers, and unmounts.
#[test]
fn a_stalled_target_fails_its_operations_after_op_timeout_and_the_mount_serves_on() {
    const OP_TIMEOUT: u64 = 20;
    let (a, b) = (Fs::new(64), Fs::new(64));
    let lines: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
    std::fs::write(a.mnt.join("app.log"), &lines).unwrap();
    std::fs::write(b.mnt.join("b.log"), "stalled\n".repeat(1000)).unwrap();
    // A second file system in the source directory: b bind-mounted inside a.
    std::fs::create_dir(a.mnt.join("b")).unwrap();
    let _inner = nearstore_testkit::Mounted::new(&["--bind", p(&b.mnt)], &a.mnt.join("b"));
    let (ta, tb) = (Target::start(&["--namespace", p(&a.image)]), Target::start(&["--namespace", p(&b.image)]));
    let map = a.dir.path().join("map.toml");
    let entry = |t: &Target, image: &Path| {
        format!("[[namespace]]\naddress = \"{}\"\nnqn = \"nqn.2026-11.io.nearstore:disk0\"\nnsid = 1\nfile = \"{}\"\n", t.addr, p(image))
    };
    std::fs::write(&map, format!("{}{}", entry(&ta, &a.image), entry(&tb, &b.image))).unwrap();
    let mnt = a.dir.path().join("view");
    std::fs::create_dir(&mnt).unwrap();
    let timeout = OP_TIMEOUT.to_string();
    let mount = Mount::start(&["--map", p(&map), "--op-timeout", &timeout], &a.mnt, &mnt, a.dir.path().join("mount.log"));
    let want_a = first_field(&ok(&["checksum", "-a", "sha256", "--offload-only", "--map", p(&map), p(&a.mnt.join("app.log"))]));
    let want_b = first_field(&ok(&["checksum", "-a", "sha256", "--local", p(&b.mnt.join("b.log"))]));
    let result_a = mnt.join(".nearstore/sha256/app.log");
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| e.raw_os_error());
    assert_eq!(read(&result_a), Ok(want_a.clone()), "before the stall: {}", mount.log());

    signal(tb.pid(), libc::SIGSTOP);
    let port = tb.addr.port();
    let stalled = || {
        let p = mnt.join(".nearstore/sha256/b/b.log");
        std::thread::spawn(move || {
            let start = Instant::now();
            (std::fs::read_to_string(p).map_err(|e| e.raw_os_error()), start.elapsed())
        })
    };
    // One file's operation waits on the stalled target...
    let first = stalled();
    wait_for(60, "the mount's connection to the stalled target", || connections_to(port) >= 1);
    // ... while the other target's files are computed, and every file is served.
    assert_eq!(read(&result_a), Ok(want_a.clone()), "another target's file while one stalls: {}", mount.log());
    assert_eq!(read(&mnt.join("b/b.log")), Ok("stalled\n".repeat(1000)), "the stalled target's file reads from the source");
    assert!(std::fs::read_dir(mnt.join("b")).unwrap().any(|e| e.unwrap().file_name() == "b.log"));
    assert!(!first.is_finished(), "the stalled operation waits for --op-timeout ({OP_TIMEOUT} s)");
    // At most 16 wait at once: the next operation is refused at once.
    let more: Vec<_> = (0..15).map(|_| stalled()).collect();
    wait_for(60, "16 operations waiting on the stalled target", || connections_to(port) >= 16);
    assert_eq!(read(&result_a), Err(Some(libc::EAGAIN)), "a 17th operation: {}", mount.log());
    assert!(mount.log().contains("operations are computing already"), "{}", mount.log());
    // Each waiting one fails with EIO after --op-timeout, within a bound several times it.
    for t in std::iter::once(first).chain(more) {
        wait_for(6 * OP_TIMEOUT, "a stalled operation's end", || t.is_finished());
        let (r, took) = t.join().unwrap();
        assert_eq!(r, Err(Some(libc::EIO)), "{}", mount.log());
        assert!(took >= Duration::from_secs(OP_TIMEOUT - 2), "it failed after {took:?}, not after waiting --op-timeout");
    }
    assert!(mount.log().contains("operation failed"), "{}", mount.log());
    // The mount serves on: the other target's files, and the stalled one's once it answers.
    assert_eq!(read(&result_a), Ok(want_a), "after the stall: {}", mount.log());
    signal(tb.pid(), libc::SIGCONT);
    assert_eq!(read(&mnt.join(".nearstore/sha256/b/b.log")), Ok(want_b), "the target answers again: {}", mount.log());
    // And it unmounts: nothing of the stalled operations holds it.
    let o = Command::new("umount").arg(&mnt).output().unwrap();
    assert!(o.status.success(), "{o:?}: {}", mount.log());
    let mut mount = mount;
    wait_for(30, "nearstore mount's exit after the unmount", || mount.child.try_wait().unwrap().is_some());
    assert!(mount.child.wait().unwrap().success(), "{}", mount.log());
}

/// docs/fuse.md's shell blocks run as printed, in order, by tests/readme/run.sh (as
/// README.md's are), with this build's `nearstore` first on PATH (`--bin`).
#[test]
fn the_shell_blocks_of_the_fuse_docs_run_as_printed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = Path::new(env!("CARGO_BIN_EXE_nearstore")).parent().unwrap().to_path_buf();
    let o = Command::new("bash")
        .arg(root.join("tests/readme/run.sh"))
        .args(["--bin", p(&bin)])
        .arg(root.join("docs/fuse.md"))
        .env_remove("NEARSTORE_README_TEST")
        .output()
        .expect("running tests/readme/run.sh");
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.contains("1 passed"), "{out}\n{err}");
    assert!(err.contains("6 of 8 sh blocks"), "every block but the FIEMAP library's and the benchmark's runs: {err}");
    // What the blocks print, as their comments say: the logs they write (line j of app{n}.log
    // an ERROR when 7n divides j), their SHA-256 by sha256sum, the counts of ^ERROR and
    // timeout lines, the select's groups (in the order first seen), where it was computed, the compressed output's name.
    let log = |n: u64| -> String {
        (1..=100_000u64).map(|j| if j % (7 * n) != 0 { format!("INFO ok {j}\n") } else { format!("ERROR timeout {j}\n") }).collect()
    };
    let mut sum = Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    sum.stdin.take().unwrap().write_all(log(1).as_bytes()).unwrap();
    let sha = String::from_utf8(sum.wait_with_output().unwrap().stdout).unwrap().split(' ').next().unwrap().to_string();
    let errors = 100_000 / 7;
    let want = format!(
        "INFO ok 1\nINFO ok 2\nINFO ok 3\n{sha}\n{errors}\ncity,COUNT(*)\nOslo,2\nLima,1\n1\n\
         {errors}\n{sha}\n\
         {errors} view/logs/app1.log\n{} view/logs/app2.log\n{} view/logs/app3.log\n\
         app1.log.zst ",
        100_000 / 14,
        100_000 / 21
    );
    let printed = out.strip_prefix("listening on 127.0.0.1:4434\n").unwrap_or(&out);
    assert!(printed.starts_with(&want), "the blocks print what their comments say:\n{out}\nwanted first:\n{want}");
    let size: u64 = printed[want.len()..].lines().next().unwrap().parse().unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(size > 0 && size < log(1).len() as u64 / 4, "app1.log.zst {size}");
}
