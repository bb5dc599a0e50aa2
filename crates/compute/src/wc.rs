//! `wc`: bytes, lines (newline characters) and words (runs of bytes that are not ASCII
//! white space), as GNU wc counts them in the C locale.

use crate::{no_args, ComputeError, Context, Kernel, Outcome};

#[derive(Default)]
struct Wc {
    bytes: u64,
    lines: u64,
    words: u64,
    in_word: bool,
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

impl Kernel for Wc {
    fn update(&mut self, data: &[u8]) {
        self.bytes += data.len() as u64;
        self.lines += memchr::memchr_iter(b'\n', data).count() as u64;
        let mut in_word = self.in_word;
        let mut words = 0;
        for &b in data {
            let space = is_space(b);
            words += (!space && !in_word) as u64;
            in_word = !space;
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
    use crate::{run, Outcome};

    #[test]
    fn counts_like_wc() {
        let text = b"one two\tthree\n  four\n\nfive";
        assert_eq!(run("wc", b"", [&text[..]]).unwrap(), Outcome::Wc { bytes: 26, lines: 3, words: 5 });
        // A word split across chunks counts once.
        assert_eq!(run("wc", b"", [&b"ab"[..], b"cd ef"]).unwrap(), Outcome::Wc { bytes: 7, lines: 0, words: 2 });
        assert_eq!(run("wc", b"", [&b""[..]]).unwrap(), Outcome::Wc { bytes: 0, lines: 0, words: 0 });
    }
}
