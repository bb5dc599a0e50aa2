//! Search: a literal (count and first offsets, matches crossing chunk and extent borders
//! included), regular-expression matches within lines, and matching lines (grep -c).
//!
//! Patterns of every mode are 1 to [`PATTERN_BYTES_MAX`] bytes. A newline in a regular
//! expression separates patterns, as GNU grep reads it: a line matches if any does. A
//! literal search finds one literal, so a newline in it is refused (it could only match
//! across lines).

use memchr::memmem;
use regex::bytes::Regex;
use serde::Deserialize;

use crate::{parse_args, ComputeError, Context, Kernel, Outcome};

/// Longest pattern of every mode (a literal, or regular expressions with their
/// newlines), in bytes: far beyond what a person types, and it keeps the literal
/// search's carried tail and a compiled expression small.
pub const PATTERN_BYTES_MAX: usize = 4096;
/// Most match offsets a search returns (the count is always complete).
pub const OFFSETS_MAX: usize = 10_000;
/// Longest line the line-based kernels hold; a longer one is an error, never a wrong count.
pub const LINE_BYTES_MAX: usize = 16 << 20;
/// Largest compiled regular expression.
pub const REGEX_SIZE_MAX: usize = 1 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LiteralArgs {
    pattern: String,
    #[serde(default = "default_offsets")]
    max_offsets: usize,
}

fn default_offsets() -> usize {
    100
}

/// Leftmost non-overlapping matches, as `grep -o` finds them.
struct Literal {
    finder: memmem::Finder<'static>,
    m: usize,
    /// The last m - 1 bytes seen: where a match crossing into the next chunk starts.
    carry: Vec<u8>,
    window: Vec<u8>,
    /// Stream offset of the end of what has been seen.
    pos: u64,
    /// Matches must start here or later (non-overlapping).
    next: u64,
    count: u64,
    offsets: Vec<u64>,
    max_offsets: usize,
}

impl Literal {
    fn record(&mut self, start: u64) {
        if start < self.next {
            return;
        }
        self.count += 1;
        self.next = start + self.m as u64;
        if self.offsets.len() < self.max_offsets {
            self.offsets.push(start);
        }
    }
}

impl Kernel for Literal {
    fn update(&mut self, data: &[u8]) {
        let m = self.m;
        // Matches that start in the carried tail and end in this chunk.
        if !self.carry.is_empty() {
            let take = (m - 1).min(data.len());
            self.window.clear();
            self.window.extend_from_slice(&self.carry);
            self.window.extend_from_slice(&data[..take]);
            let base = self.pos - self.carry.len() as u64;
            let mut from = 0;
            while let Some(i) = self.finder.find(&self.window[from..]).map(|i| i + from) {
                if i >= self.carry.len() {
                    break;
                }
                self.record(base + i as u64);
                from = i + 1;
            }
        }
        // Matches inside this chunk, from where the last match ended.
        let skip = self.next.saturating_sub(self.pos).min(data.len() as u64) as usize;
        let finder = self.finder.clone();
        for i in finder.find_iter(&data[skip..]) {
            self.record(self.pos + (skip + i) as u64);
        }
        // Keep the last m - 1 bytes of the stream.
        if m > 1 {
            if data.len() >= m - 1 {
                self.carry.clear();
                self.carry.extend_from_slice(&data[data.len() - (m - 1)..]);
            } else {
                self.carry.extend_from_slice(data);
                let excess = self.carry.len().saturating_sub(m - 1);
                self.carry.drain(..excess);
            }
        }
        self.pos += data.len() as u64;
    }

    fn finish(self: Box<Self>) -> Result<Outcome, ComputeError> {
        Ok(Outcome::Search { count: self.count, offsets: self.offsets })
    }
}

/// Every mode's pattern is 1 to PATTERN_BYTES_MAX bytes.
fn check_length(op: &'static str, pattern: &str) -> Result<(), ComputeError> {
    if pattern.is_empty() || pattern.len() > PATTERN_BYTES_MAX {
        return Err(ComputeError::BadArguments {
            op,
            message: format!("pattern: must be 1 to {PATTERN_BYTES_MAX} bytes, not {}", pattern.len()),
        });
    }
    Ok(())
}

pub fn literal(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    let a: LiteralArgs = parse_args("search", args)?;
    let bad = |message: String| ComputeError::BadArguments { op: "search", message };
    check_length("search", &a.pattern)?;
    if a.pattern.contains('\n') {
        return Err(bad("pattern: a newline: search finds one literal (grep -F with several patterns: one search each)".into()));
    }
    if a.max_offsets > OFFSETS_MAX {
        return Err(bad(format!("max_offsets: at most {OFFSETS_MAX}")));
    }
    let m = a.pattern.len();
    Ok(Box::new(Literal {
        finder: memmem::Finder::new(a.pattern.as_bytes()).into_owned(),
        m,
        carry: Vec::with_capacity(m),
        window: Vec::with_capacity(2 * m),
        pos: 0,
        next: 0,
        count: 0,
        offsets: Vec::new(),
        max_offsets: a.max_offsets,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegexArgs {
    pattern: String,
}

/// Runs a regular expression over each line (without its newline), as grep does.
struct Lines {
    op: &'static str,
    re: Regex,
    /// Count every match (regex-count) or every matching line (grep-count).
    every_match: bool,
    partial: Vec<u8>,
    pos: u64,
    count: u64,
    error: Option<ComputeError>,
}

impl Lines {
    fn line(&mut self, line: &[u8]) {
        if self.every_match {
            self.count += self.re.find_iter(line).count() as u64;
        } else {
            self.count += self.re.is_match(line) as u64;
        }
    }
}

impl Kernel for Lines {
    fn update(&mut self, data: &[u8]) {
        if self.error.is_some() {
            return;
        }
        let mut rest = data;
        if !self.partial.is_empty() {
            match memchr::memchr(b'\n', rest) {
                Some(i) => {
                    let mut line = std::mem::take(&mut self.partial);
                    line.extend_from_slice(&rest[..i]);
                    self.line(&line);
                    line.clear();
                    self.partial = line;
                    rest = &rest[i + 1..];
                }
                None => {
                    self.partial.extend_from_slice(rest);
                    rest = &[];
                }
            }
        }
        let mut start = 0;
        for i in memchr::memchr_iter(b'\n', rest) {
            self.line(&rest[start..i]);
            start = i + 1;
        }
        self.partial.extend_from_slice(&rest[start..]);
        self.pos += data.len() as u64;
        if self.partial.len() > LINE_BYTES_MAX {
            let offset = self.pos - self.partial.len() as u64;
            self.error = Some(ComputeError::LineTooLong { op: self.op, limit: LINE_BYTES_MAX, offset });
            self.partial = Vec::new();
        }
    }

    fn finish(mut self: Box<Self>) -> Result<Outcome, ComputeError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if !self.partial.is_empty() {
            let last = std::mem::take(&mut self.partial);
            self.line(&last);
        }
        Ok(Outcome::Count { count: self.count })
    }
}

fn lines(op: &'static str, args: &[u8], every_match: bool) -> Result<Box<dyn Kernel>, ComputeError> {
    let a: RegexArgs = parse_args(op, args)?;
    check_length(op, &a.pattern)?;
    let compile = |p: &str| regex::bytes::RegexBuilder::new(p).size_limit(REGEX_SIZE_MAX).build();
    // GNU grep: one pattern per line (an empty one matches every line), any matching.
    let parts: Vec<&str> = a.pattern.split('\n').collect();
    let re = if let [one] = &parts[..] {
        compile(one).map_err(|e| ComputeError::BadArguments { op, message: format!("pattern: {e}") })?
    } else {
        for (i, p) in parts.iter().enumerate() {
            compile(p).map_err(|e| ComputeError::BadArguments { op, message: format!("pattern line {}: {e}", i + 1) })?;
        }
        let any: Vec<String> = parts.iter().map(|p| format!("(?:{p})")).collect();
        compile(&any.join("|")).map_err(|e| ComputeError::BadArguments { op, message: format!("pattern: {e}") })?
    };
    Ok(Box::new(Lines { op, re, every_match, partial: Vec::new(), pos: 0, count: 0, error: None }))
}

pub fn regex_count(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    lines("regex-count", args, true)
}

pub fn grep_count(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    lines("grep-count", args, false)
}

#[cfg(test)]
mod tests {
    use crate::{run, ComputeError, Outcome};

    #[test]
    fn literal_across_chunks_and_non_overlapping() {
        let args = br#"{"pattern":"aba"}"#;
        // "ababa": leftmost non-overlapping finds one match at 0 (not 2).
        assert_eq!(run("search", args, [&b"ababa"[..]]).unwrap(), Outcome::Search { count: 1, offsets: vec![0] });
        // The same split at every place.
        for cut in 0..=5 {
            let s = b"ababa";
            assert_eq!(run("search", args, [&s[..cut], &s[cut..]]).unwrap(), Outcome::Search { count: 1, offsets: vec![0] });
        }
        assert_eq!(
            run("search", br#"{"pattern":"xy"}"#, [&b"x"[..], b"y", b"x", b"", b"yxy"]).unwrap(),
            Outcome::Search { count: 3, offsets: vec![0, 2, 4] }
        );
    }

    #[test]
    fn lines_across_chunks() {
        let data = b"foo bar\nbaz\nfoofoo\nlast foo";
        let args = br#"{"pattern":"fo+"}"#;
        for cut in 0..data.len() {
            assert_eq!(run("regex-count", args, [&data[..cut], &data[cut..]]).unwrap(), Outcome::Count { count: 4 });
            assert_eq!(run("grep-count", args, [&data[..cut], &data[cut..]]).unwrap(), Outcome::Count { count: 3 });
        }
        // ^ and $ anchor at line borders.
        assert_eq!(run("grep-count", br#"{"pattern":"^baz$"}"#, [&data[..]]).unwrap(), Outcome::Count { count: 1 });
    }

    #[test]
    fn newlines_separate_patterns_as_gnu_grep_reads_them() {
        let data = b"x\ny\nab\nxab\n";
        for (op, pattern, want) in [
            ("grep-count", "a\nx", 3),
            ("grep-count", "^y$\n^ab$", 2),
            // A trailing newline is an empty pattern: every line matches.
            ("grep-count", "q\n", 4),
            ("regex-count", "a\nx", 4),
            ("regex-count", "b\nab", 2),
        ] {
            let args = serde_json::json!({ "pattern": pattern }).to_string();
            assert_eq!(run(op, args.as_bytes(), [&data[..]]).unwrap(), Outcome::Count { count: want }, "{op} {pattern:?}");
        }
        let e = run("grep-count", br#"{"pattern":"a\n("}"#, [&data[..]]).unwrap_err().to_string();
        assert!(e.contains("pattern line 2"), "{e}");
        let e = run("search", br#"{"pattern":"a\nb"}"#, [&data[..]]).unwrap_err().to_string();
        assert!(e.contains("pattern: a newline"), "{e}");
    }

    #[test]
    fn pattern_length_limits_in_every_mode() {
        let max = super::PATTERN_BYTES_MAX;
        let data = "a".repeat(max + 1);
        for op in ["search", "regex-count", "grep-count"] {
            for (len, ok) in [(0, false), (1, true), (max, true), (max + 1, false)] {
                let args = serde_json::json!({ "pattern": "a".repeat(len) }).to_string();
                match run(op, args.as_bytes(), [data.as_bytes()]) {
                    Ok(o) => {
                        assert!(ok, "{op}: {len} bytes accepted");
                        // Non-overlapping matches in the one line of max + 1 bytes.
                        let n = (max + 1) as u64 / len as u64;
                        let count = match o {
                            Outcome::Search { count, .. } | Outcome::Count { count } => count,
                            o => panic!("{o:?}"),
                        };
                        assert_eq!(count, if op == "grep-count" { 1 } else { n }, "{op} {len}");
                    }
                    Err(e) => {
                        assert!(!ok, "{op}: {len} bytes refused: {e}");
                        assert!(e.to_string().contains(&format!("pattern: must be 1 to {max} bytes, not {len}")), "{e}");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_arguments_name_the_field() {
        for (op, args, want) in [
            ("search", &br#"{"pattern":""}"#[..], "pattern"),
            ("search", br#"{"pattern":"a","max_offsets":100000}"#, "max_offsets"),
            ("search", br#"{"patern":"a"}"#, "patern"),
            ("search", b"not json", "search"),
            ("grep-count", br#"{"pattern":"("}"#, "pattern"),
            ("regex-count", br#"{"pattern":"a{100000}{100000}"}"#, "pattern"),
        ] {
            let e = run(op, args, [&b""[..]]).unwrap_err();
            assert!(matches!(e, ComputeError::BadArguments { .. }), "{op} {e}");
            assert!(e.to_string().contains(want), "{op}: {e} should name {want}");
        }
    }
}
