//! What the two file systems of the crate comparison share: their command line and the
//! file they serve.

/// `NAME MOUNTPOINT SIZE_BYTES [--threads N]`: the mount point, the file's bytes (byte i
/// is i % 251 + 1: no page of it all zeros), and the threads (`threads` when not given).
/// Prints `usage` and exits 2 on anything else.
pub fn args(usage: &str, threads: usize) -> (String, Vec<u8>, usize) {
    let fail = || -> ! {
        eprintln!("{usage}");
        std::process::exit(2)
    };
    let args: Vec<String> = std::env::args().collect();
    let (mountpoint, size, n) = match args.as_slice() {
        [_, m, s] => (m, s, None),
        [_, m, s, flag, n] if flag == "--threads" => (m, s, Some(n)),
        _ => fail(),
    };
    let size: usize = size.parse().unwrap_or_else(|_| fail());
    let threads = match n {
        None => threads,
        Some(n) => n.parse().ok().filter(|&n| n >= 1).unwrap_or_else(|| fail()),
    };
    (mountpoint.clone(), (0..size).map(|i| (i % 251) as u8 + 1).collect(), threads)
}
