//! `nearstore mount` as a user runs it: a process serving the mount until unmounted. A
//! result read through `.nearstore/SPEC/file` is what the compute verb prints for the same
//! file, computed on the target, and so is the verb run on the mount's path; unmounting waits while a file is open. Needs root, loop
//! devices, mkfs.ext4 and /dev/fuse; fails naming what is missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ok, Fs, Target};

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
