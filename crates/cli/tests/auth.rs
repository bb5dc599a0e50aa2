//! In-band authentication through the binary: `gen-dhchap-key` prints secrets the target and
//! the verbs take, and every verb that connects authenticates with `--dhchap-secret` and
//! `--dhchap-ctrl-secret` as nvme-cli's do; wrong secrets are refused with a message.

mod common;

use common::{fails, nearstore, ok, Target};

const NQN: &str = "nqn.2026-11.io.nearstore:disk0";
const HOST: &str = "nqn.2014-08.org.example:keyed";

fn key(args: &[&str]) -> String {
    let mut a = vec!["gen-dhchap-key"];
    a.extend_from_slice(args);
    ok(&a).trim().to_string()
}

/// The options of gen-dhchap-key, one case a line: what it prints starts as nvme-cli's do
/// and parses back; bad values are usage errors or errors naming them.
#[test]
fn gen_dhchap_key_prints_secrets() {
    let cases: [(&[&str], &str, usize); 5] = [
        (&[], "DHHC-1:00:", 32),
        (&["--key-length", "64"], "DHHC-1:00:", 64),
        (&["--hmac", "1", "--nqn", HOST], "DHHC-1:01:", 32),
        (&["-m", "2", "-n", HOST], "DHHC-1:02:", 48),
        (&["--hmac", "3"], "DHHC-1:03:", 64),
    ];
    for (args, prefix, len) in cases {
        let k = key(args);
        assert!(k.starts_with(prefix) && k.ends_with(':'), "{args:?}: {k}");
        let parsed: nearstore_dhchap::Secret = k.parse().unwrap_or_else(|e| panic!("{args:?}: {k}: {e}"));
        assert_eq!(parsed.transformed("x").len(), len, "{args:?}");
        assert_ne!(key(args), k, "{args:?}: a new secret every time");
    }
    let usage = nearstore(&["gen-dhchap-key", "--hmac", "4"]);
    assert_eq!(usage.status.code(), Some(2));
    let (_, err) = fails(&["gen-dhchap-key", "--hmac", "1", "--key-length", "64"]);
    assert!(err.contains("--hmac 1 --key-length 64"), "{err}");
}

/// A target whose subsystem has one keyed host, bidirectional; the verbs with the right
/// secrets read and write, with wrong or missing ones they are refused, one case a line.
#[test]
fn verbs_authenticate_with_their_secrets() {
    let host_key = key(&[]);
    let ctrl_key = key(&["--hmac", "1", "--nqn", NQN]);
    let other = key(&[]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\n[[subsystem.host]]\nnqn = \"{HOST}\"\n\
             dhchap_key = \"{host_key}\"\ndhchap_ctrl_key = \"{ctrl_key}\"\ndhchap_dhgroup = \"ffdhe2048\"\n\
             [[subsystem.namespace]]\nnsid = 1\nmemory = \"16MiB\"\n"
        ),
    )
    .unwrap();
    let t = Target::start(&["--config", cfg.to_str().unwrap()]);
    let addr = t.addr.to_string();
    let data = dir.path().join("block");
    std::fs::write(&data, vec![0x42u8; 4096]).unwrap();
    let back = dir.path().join("back");
    let base = ["-a", addr.as_str(), "--hostnqn", HOST];
    let with =
        |verb: &[&str], secrets: &[&str]| -> Vec<String> { verb.iter().chain(&base).chain(secrets).map(|s| s.to_string()).collect() };
    let (d, b) = (data.to_str().unwrap(), back.to_str().unwrap());
    let both = ["--dhchap-secret", host_key.as_str(), "--dhchap-ctrl-secret", ctrl_key.as_str()];
    let run = |args: Vec<String>| nearstore(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for verb in [&["list"][..], &["id-ctrl"], &["write", "--data", d], &["read", "--data-size", "4096", "--data", b]] {
        for secrets in [&both[..2], &both[..]] {
            let o = run(with(verb, secrets));
            assert!(o.status.success(), "{verb:?} {secrets:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
    }
    assert_eq!(std::fs::read(&back).unwrap(), vec![0x42u8; 4096]);
    let refused: [(&[&str], &str); 4] = [
        (&[], "requires host nqn.2014-08.org.example:keyed to authenticate"),
        (&["--dhchap-secret", &other], "refused by the target: authentication failed"),
        (&["--dhchap-secret", &host_key, "--dhchap-ctrl-secret", &other], "did not prove it holds the controller secret"),
        (&["--dhchap-secret", "DHHC-1:00:AAAA:"], "the key and its CRC are 3 bytes"),
    ];
    for (secrets, needle) in refused {
        let o = run(with(&["list"], secrets));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(matches!(o.status.code(), Some(1) | Some(2)), "{secrets:?}: {:?} {err}", o.status);
        assert!(err.contains(needle), "{secrets:?}: {err}");
        assert!(!err.contains(&host_key[10..30]), "a secret is never printed: {err}");
    }
    let usage = nearstore(&["list", "-a", &addr, "--dhchap-ctrl-secret", &ctrl_key]);
    assert_eq!(usage.status.code(), Some(2), "a controller secret needs the host's");
}

/// discover takes the secrets too: the discovery controller asks no host to authenticate,
/// so a secret alone changes nothing, and a controller secret it cannot prove is refused.
#[test]
fn discover_takes_the_secrets() {
    let t = Target::with_discovery(&["--memory", "16MiB"]);
    let disc = t.discovery.expect("a discovery listener").to_string();
    let k = key(&[]);
    let out = ok(&["discover", "-a", &disc, "--dhchap-secret", &k]);
    assert!(out.contains(NQN), "{out}");
    let (_, err) = fails(&["discover", "-a", &disc, "--dhchap-secret", &k, "--dhchap-ctrl-secret", &key(&[])]);
    assert!(err.contains("refused by the target: authentication failed"), "{err}");
}
