//! LIKE in bounded time: `%` any run of characters, `_` one character, an escape
//! character making the next one literal.
//!
//! The pattern is cut at its `%`s into segments of literal characters and `_`. Without a
//! `%` the text must match the one segment exactly. Otherwise the first segment must match
//! at the start, the last at the end, and each segment between them is searched for
//! leftmost, in order, from where the one before ended: taking the leftmost occurrence
//! never loses a match, since any later placement leaves less text to the segments after
//! it. Each search runs the bit-parallel Shift-And automaton of its segment (`_` sets
//! its bit for every character), and the searches together read every character of the
//! text at most once. So a text of n characters costs at most n x ceil(s / 64) word
//! operations, s the longest segment, plus the pattern's length to compile: a 1 MiB
//! record against an 8 KiB query's pattern is at most 2^20 x 128 steps, never the
//! n x m (or exponential) of backtracking. The work is counted on the command's
//! [`Meter`], which stops it when the command is cancelled or out of time.

use crate::{ComputeError, Meter};

/// Bytes of tables one compiled pattern may hold (its masks): a pattern that comes from
/// the data (`x LIKE y`) can be a whole record long, and its tables grow with its length
/// times its distinct characters.
pub const TABLE_BYTES_MAX: usize = 16 << 20;

/// One run of literal characters and `_` between two `%`.
#[derive(Clone, Debug)]
struct Segment {
    /// The characters (folded with ILIKE); None for `_`.
    chars: Vec<Option<char>>,
    /// Shift-And masks: bit j of a character's mask is set where position j accepts it.
    /// `any` is the mask of the `_` positions (what any other character gets).
    any: Vec<u64>,
    /// ASCII characters' masks, by index into `masks` (0: `any`).
    ascii: [u32; 128],
    /// Other characters, sorted, with their mask's index.
    others: Vec<(char, u32)>,
    masks: Vec<Vec<u64>>,
}

impl Segment {
    fn new(chars: Vec<Option<char>>) -> Segment {
        let words = chars.len().div_ceil(64).max(1);
        let mut any = vec![0u64; words];
        for (j, c) in chars.iter().enumerate() {
            if c.is_none() {
                any[j / 64] |= 1 << (j % 64);
            }
        }
        let mut s = Segment { chars: Vec::new(), any: any.clone(), ascii: [0; 128], others: Vec::new(), masks: vec![any] };
        for (j, c) in chars.iter().enumerate() {
            let Some(c) = *c else { continue };
            let i = match s.index(c) {
                0 => {
                    s.masks.push(s.any.clone());
                    let i = (s.masks.len() - 1) as u32;
                    if c.is_ascii() {
                        s.ascii[c as usize] = i;
                    } else {
                        let at = s.others.partition_point(|(o, _)| *o < c);
                        s.others.insert(at, (c, i));
                    }
                    i
                }
                i => i,
            };
            s.masks[i as usize][j / 64] |= 1 << (j % 64);
        }
        s.chars = chars;
        s
    }

    fn index(&self, c: char) -> u32 {
        if c.is_ascii() {
            self.ascii[c as usize]
        } else {
            self.others.binary_search_by(|(o, _)| o.cmp(&c)).map(|i| self.others[i].1).unwrap_or(0)
        }
    }

    fn accepts(&self, j: usize, c: char) -> bool {
        self.chars[j].is_none_or(|p| p == c)
    }

    /// The byte offset in `text` just past the leftmost occurrence, if any.
    fn find(&self, text: &str, fold: impl Fn(char) -> char, meter: &mut Meter) -> Result<Option<usize>, ComputeError> {
        let n = self.chars.len();
        if n == 0 {
            return Ok(Some(0));
        }
        let words = self.any.len();
        let (last_word, last_bit) = ((n - 1) / 64, 1u64 << ((n - 1) % 64));
        let mut d = vec![0u64; words];
        for (at, c) in text.char_indices() {
            meter.work(words as u64)?;
            let mask = &self.masks[self.index(fold(c)) as usize];
            let mut carry = 1u64;
            for (w, m) in d.iter_mut().zip(mask) {
                let next = (*w << 1) | carry;
                carry = *w >> 63;
                *w = next & m;
            }
            if d[last_word] & last_bit != 0 {
                return Ok(Some(at + c.len_utf8()));
            }
        }
        Ok(None)
    }
}

/// A compiled LIKE (or ILIKE) pattern.
#[derive(Clone, Debug)]
pub struct Like {
    /// The segments between `%`s: one when there is no `%`.
    segments: Vec<Segment>,
    case_insensitive: bool,
    /// The most its tables and characters hold, in bytes.
    bytes: usize,
}

/// The most bytes a pattern's compiled form holds, found without allocating: per
/// segment, its characters and a mask of ceil(len / 64) words for `_` and for each
/// distinct character (at most the 128 ASCII ones plus its other characters). An escaped
/// `%` is a character of its segment, as [`Like::new`] reads it, not a break.
pub fn table_bytes(pattern: &str, escape: Option<char>) -> usize {
    let mut total = 0usize;
    let (mut len, mut other) = (0usize, 0usize);
    let mut end = |len: usize, other: usize| {
        let distinct = len.min(128 + other);
        total = total.saturating_add((distinct + 1).saturating_mul(len.div_ceil(64).max(1) * 8 + 24) + len * 4 + 600);
    };
    let mut it = pattern.chars();
    while let Some(mut c) = it.next() {
        if c == '%' {
            end(len, other);
            (len, other) = (0, 0);
            continue;
        }
        if Some(c) == escape {
            let Some(n) = it.next() else { break };
            c = n;
        }
        len += 1;
        other += !c.is_ascii() as usize;
    }
    end(len, other);
    total
}

/// ILIKE compares characters by their simple lowercase mapping (a character whose
/// lowercase is several characters compares as itself).
fn fold(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    let mut l = c.to_lowercase();
    match (l.next(), l.next()) {
        (Some(one), None) => one,
        _ => c,
    }
}

impl Like {
    /// Compiles a pattern; refuses one ending in its escape character, and one whose
    /// tables would pass `table_max` bytes (at most TABLE_BYTES_MAX), before they are
    /// made.
    pub fn new(pattern: &str, escape: Option<char>, case_insensitive: bool, table_max: usize) -> Result<Like, String> {
        let bytes = table_bytes(pattern, escape);
        let table_max = table_max.min(TABLE_BYTES_MAX);
        if bytes > table_max {
            let head: String = pattern.chars().take(40).collect();
            return Err(format!("LIKE pattern '{head}...' needs {bytes} bytes of tables, more than the {table_max} it may use"));
        }
        let f = |c: char| if case_insensitive { fold(c) } else { c };
        let mut segments = vec![Vec::new()];
        let mut it = pattern.chars();
        while let Some(c) = it.next() {
            let seg = segments.last_mut().expect("one segment at least");
            if Some(c) == escape {
                let n = it.next().ok_or_else(|| format!("LIKE pattern '{pattern}' ends with its escape character"))?;
                seg.push(Some(f(n)));
            } else if c == '%' {
                segments.push(Vec::new());
            } else if c == '_' {
                seg.push(None);
            } else {
                seg.push(Some(f(c)));
            }
        }
        Ok(Like { segments: segments.into_iter().map(Segment::new).collect(), case_insensitive, bytes })
    }

    /// The most bytes it holds ([`table_bytes`] of its pattern).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether `text` matches, in at most len(text) x ceil(longest segment / 64) steps
    /// counted on `meter`.
    pub fn matches(&self, text: &str, meter: &mut Meter) -> Result<bool, ComputeError> {
        let ci = self.case_insensitive;
        let f = move |c: char| if ci { fold(c) } else { c };
        let (first, rest) = self.segments.split_first().expect("one segment at least");
        // The first segment at the start.
        let mut chars = text.char_indices();
        for j in 0..first.chars.len() {
            meter.work(1)?;
            match chars.next() {
                Some((_, c)) if first.accepts(j, f(c)) => {}
                _ => return Ok(false),
            }
        }
        let start = chars.next().map_or(text.len(), |(at, _)| at);
        let Some((last, middle)) = rest.split_last() else {
            // No `%`: the text is exactly the first segment.
            return Ok(start == text.len());
        };
        // The last segment at the end, not overlapping the first.
        let mut end = text.len();
        let mut back = text[start..].char_indices().rev();
        for j in (0..last.chars.len()).rev() {
            meter.work(1)?;
            match back.next() {
                Some((at, c)) if last.accepts(j, f(c)) => end = start + at,
                _ => return Ok(false),
            }
        }
        // The segments between, leftmost each, in order.
        let mut at = start;
        for s in middle {
            match s.find(&text[at..end], f, meter)? {
                Some(past) => at += past,
                None => return Ok(false),
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Stop;

    /// The reference: LIKE as an anchored regular expression.
    fn like_regex(pattern: &str, escape: Option<char>, ci: bool) -> regex::Regex {
        let mut re = String::from(if ci { "(?is)^" } else { "(?s)^" });
        let mut chars = pattern.chars();
        while let Some(c) = chars.next() {
            if Some(c) == escape {
                re.push_str(&regex::escape(chars.next().expect("escaped").encode_utf8(&mut [0; 4])));
            } else if c == '%' {
                re.push_str(".*");
            } else if c == '_' {
                re.push('.');
            } else {
                re.push_str(&regex::escape(c.encode_utf8(&mut [0; 4])));
            }
        }
        re.push('$');
        regex::Regex::new(&re).unwrap()
    }

    fn m(text: &str, pattern: &str, escape: Option<char>, ci: bool) -> bool {
        Like::new(pattern, escape, ci, TABLE_BYTES_MAX).unwrap().matches(text, &mut Stop::default().meter()).unwrap()
    }

    #[test]
    fn matches_as_sql_says() {
        for (s, p, want) in [
            ("hello", "h%o", true),
            ("hello", "h_llo", true),
            ("hello", "H%", false),
            ("hello", "%ll%", true),
            ("hello", "%x%", false),
            ("50%", "50!%", true),
            ("500", "50!%", false),
            ("a\nb", "a_b", true),
            ("", "%", true),
            ("", "_", false),
            ("", "", true),
            ("a", "", false),
            ("aaa", "%a%a%a%", true),
            ("aa", "%a%a%a%", false),
            // The first and last segments must not overlap.
            ("ab", "ab%ab", false),
            ("aba", "ab%ba", false),
            ("abba", "ab%ba", true),
            ("été", "_t_", true),
            ("xaaab", "%a_b", true),
            ("abcabd", "%ab_", true),
            ("abcab", "%a_c%b", true),
        ] {
            assert_eq!(m(s, p, Some('!'), false), want, "{s:?} LIKE {p:?}");
            assert_eq!(like_regex(p, Some('!'), false).is_match(s), want, "reference: {s:?} LIKE {p:?}");
        }
        assert!(m("HeLLo", "hello", None, true));
        assert!(m("ÉTÉ", "été", None, true));
        assert!(Like::new("ab!", Some('!'), false, TABLE_BYTES_MAX).unwrap_err().contains("ends with its escape"));
    }

    #[test]
    fn agrees_with_the_regex_reference_on_random_cases() {
        let mut s = 0x2545f4914f6cdd1du64;
        let mut next = move |n: u64| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s % n
        };
        let alphabet = ['a', 'b', 'A', 'é', '%', '_'];
        for _ in 0..20_000 {
            let text: String = (0..next(12)).map(|_| alphabet[next(4) as usize]).collect();
            let pattern: String = (0..next(8)).map(|_| alphabet[next(6) as usize]).collect();
            // Segments over 64 characters too, now and then.
            let (text, pattern) = if next(50) == 0 { (text.repeat(20), format!("%{}%", "a_".repeat(40))) } else { (text, pattern) };
            for ci in [false, true] {
                assert_eq!(
                    m(&text, &pattern, None, ci),
                    like_regex(&pattern, None, ci).is_match(&text),
                    "{text:?} LIKE {pattern:?} ci {ci}"
                );
            }
        }
    }

    #[test]
    fn adversarial_patterns_take_linear_steps() {
        // 1 MiB of 'a' against patterns that make backtracking matchers quadratic or
        // exponential: the steps stay within n x ceil(s / 64) plus the anchored ends.
        let text = "a".repeat(1 << 20);
        let n = text.len() as u64;
        let long = format!("%{}b%", "a".repeat(4000));
        let unders = format!("%{}b", "_".repeat(3000));
        let many = "%a".repeat(2000) + "%b";
        for (pattern, longest) in [(&long, 4001u64), (&unders, 3001), (&many, 1), (&"%a%a%a%a%a%b%".to_string(), 1)] {
            let mut meter = Stop::default().meter();
            assert!(!Like::new(pattern, None, false, TABLE_BYTES_MAX).unwrap().matches(&text, &mut meter).unwrap(), "{}", &pattern[..20]);
            let bound = n * longest.div_ceil(64) + pattern.len() as u64;
            assert!(meter.steps() <= bound, "{}: {} steps, bound {bound}", &pattern[..20], meter.steps());
        }
    }

    #[test]
    fn a_cancelled_match_stops_within_the_check_interval() {
        let text = "a".repeat(1 << 20);
        let stop = Stop::default();
        stop.cancel();
        let mut meter = stop.meter();
        let like = Like::new(&format!("%{}b%", "a".repeat(4000)), None, false, TABLE_BYTES_MAX).unwrap();
        assert_eq!(like.matches(&text, &mut meter), Err(ComputeError::Cancelled));
        assert!(meter.steps() <= crate::STOP_CHECK_WORK + 64, "{} steps", meter.steps());
    }

    /// What a compiled pattern's tables take.
    fn held(like: &Like) -> usize {
        like.segments.iter().map(|s| s.masks.iter().map(|m| m.len() * 8 + 24).sum::<usize>() + s.chars.len() * 4 + s.others.len() * 8).sum()
    }

    #[test]
    fn tables_are_bounded() {
        let huge: String = (0..200_000u32).filter_map(|i| char::from_u32(0x4e00 + i % 20_000)).collect();
        assert!(Like::new(&huge, None, false, TABLE_BYTES_MAX).unwrap_err().contains("bytes of tables"));
        // What a pattern says it holds covers what its tables take.
        let p = "%ab_é%".repeat(300) + &"x_".repeat(500);
        let like = Like::new(&p, None, false, TABLE_BYTES_MAX).unwrap();
        assert!(held(&like) <= like.bytes(), "{} > {}", held(&like), like.bytes());
        assert!(Like::new(&p, None, false, like.bytes() - 1).is_err());
        // Escaped `%`s join one long segment of distinct characters: counted as such, not
        // as many short segments (a pattern from the data could otherwise take far more
        // than it was charged).
        let escaped: String = (0..20_000u32).filter_map(|i| char::from_u32(0x4e00 + i)).flat_map(|c| [c, '!', '%']).collect();
        // One segment of 40,000 characters, 20,129 masks of 625 words: about 100 MB, where
        // 20,000 short segments would be 14 MB.
        assert!(table_bytes(&escaped, Some('!')) > 5 * table_bytes(&escaped, None));
        assert!(table_bytes(&escaped, Some('!')) > 64 << 20);
        assert!(Like::new(&escaped, Some('!'), false, TABLE_BYTES_MAX).unwrap_err().contains("bytes of tables"));
        let small: String = escaped.chars().take(3 * 300).collect();
        let like = Like::new(&small, Some('!'), false, TABLE_BYTES_MAX).unwrap();
        assert!(held(&like) <= like.bytes(), "{} > {}", held(&like), like.bytes());
    }
}
