//! `wc`: bytes, lines (newline characters) and words, as GNU wc (coreutils 9.1) counts
//! them in the C locale: a word starts at a printable byte that is not a space (0x21 to
//! 0x7e) and ends at a space, tab, newline, vertical tab, form feed or carriage return;
//! any other byte (NUL, other control bytes, DEL, bytes from 0x80) neither starts nor
//! ends one.

use crate::{no_args, ComputeError, Context, Kernel, Outcome};

#[derive(Default)]
struct Wc {
    bytes: u64,
    lines: u64,
    words: u64,
    in_word: bool,
}

/// What a byte does to words.
#[derive(Clone, Copy, PartialEq)]
enum Class {
    /// Ends a word.
    Space,
    /// Starts or continues one.
    Word,
    /// Neither: the word state stays as it was.
    Other,
}

const CLASS: [Class; 256] = {
    let mut t = [Class::Other; 256];
    let mut b = 0x21;
    while b <= 0x7e {
        t[b] = Class::Word;
        b += 1;
    }
    let spaces = [b' ', b'\t', b'\n', 0x0b, 0x0c, b'\r'];
    let mut i = 0;
    while i < spaces.len() {
        t[spaces[i] as usize] = Class::Space;
        i += 1;
    }
    t
};

impl Kernel for Wc {
    fn update(&mut self, data: &[u8]) {
        self.bytes += data.len() as u64;
        self.lines += memchr::memchr_iter(b'\n', data).count() as u64;
        let mut in_word = self.in_word;
        let mut words = 0;
        for &b in data {
            match CLASS[b as usize] {
                Class::Word => {
                    words += !in_word as u64;
                    in_word = true;
                }
                Class::Space => in_word = false,
                Class::Other => {}
            }
        }
        self.words += words;
        self.in_word = in_word;
    }

    fn finish(self: Box<Self>) -> Result<Outcome, ComputeError> {
        Ok(Outcome::Wc { bytes: self.bytes, lines: self.lines, words: self.words })
    }
}

pub fn build(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    no_args("wc", args)?;
    Ok(Box::<Wc>::default())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::process::{Command, Stdio};

    use crate::{run, Outcome};

    fn words(data: &[u8]) -> u64 {
        match run("wc", b"", [data]).unwrap() {
            Outcome::Wc { words, .. } => words,
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn counts_like_wc() {
        let text = b"one two\tthree\n  four\n\nfive";
        assert_eq!(run("wc", b"", [&text[..]]).unwrap(), Outcome::Wc { bytes: 26, lines: 3, words: 5 });
        // A word split across chunks counts once.
        assert_eq!(run("wc", b"", [&b"ab"[..], b"cd ef"]).unwrap(), Outcome::Wc { bytes: 7, lines: 0, words: 2 });
        assert_eq!(run("wc", b"", [&b""[..]]).unwrap(), Outcome::Wc { bytes: 0, lines: 0, words: 0 });
        // Bytes that are neither printable nor spaces join what surrounds them.
        for (data, want) in [
            (&b"a\x00b"[..], 1),
            (b"\x00", 0),
            (b"\x80\xff", 0),
            (b"a\x80 b", 2),
            (b" \x01 ", 0),
            (b"\x01a\x7f", 1),
            (b"a\xa0b", 1),
            (b"a\x0bb\x0cc\rd", 4),
            (b"\xc3\xa9t\xc3\xa9", 1),
        ] {
            assert_eq!(words(data), want, "{data:?}");
        }
    }

    /// GNU wc in the C locale over the same bytes: (lines, words, bytes).
    fn gnu_wc(data: &[u8]) -> (u64, u64, u64) {
        let mut child = Command::new("wc")
            .arg("-lwc")
            .env("LC_ALL", "C")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("this test needs GNU coreutils' wc in PATH");
        child.stdin.take().expect("stdin").write_all(data).expect("writing to wc");
        let out = child.wait_with_output().expect("wc runs");
        assert!(out.status.success(), "wc failed");
        let n: Vec<u64> =
            String::from_utf8(out.stdout).expect("wc prints text").split_whitespace().map(|w| w.parse().expect("a count")).collect();
        (n[0], n[1], n[2])
    }

    #[test]
    fn agrees_with_gnu_wc_in_the_c_locale_on_random_bytes() {
        let mut s = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        // Any byte, and a mix rich in the bytes that matter: spaces, controls, NUL, high bytes.
        let mixed = b" \t\n\x0b\x0c\r\x00\x01\x1f\x7f\x80\xa0\xffaZ~!";
        for round in 0..64 {
            let len = (next() % 5000) as usize;
            let data: Vec<u8> =
                (0..len).map(|_| if round % 2 == 0 { next() as u8 } else { mixed[(next() % mixed.len() as u64) as usize] }).collect();
            let (lines, words, bytes) = gnu_wc(&data);
            let cut = len / 3;
            assert_eq!(run("wc", b"", [&data[..cut], &data[cut..]]).unwrap(), Outcome::Wc { bytes, lines, words }, "round {round}");
        }
    }
}
