//! A strict, allocation-free pull reader for the frames on the hot paths.
//!
//! serde spends most of a frame's cost matching field names and ignoring the members no one
//! looks at (`id`, `model`, `created`, ...). This reader walks the bytes once, hands back
//! keys and raw value spans, and validates everything it skips as strictly as serde would,
//! so a frame it accepts is one serde accepts too. Anything surprising (an escaped key, a
//! duplicate field, a value of an unexpected type, malformed JSON) is [`Bail`]: the caller
//! then takes its serde path, which produces the same result or the precise error. The
//! reader never has to explain a failure, so it stays small and fast.

use std::borrow::Cow;

/// The reader declines this frame; the serde path decides what it is.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct Bail;

pub type R<T> = Result<T, Bail>;

/// serde_json's own nesting limit: deeper frames go to serde, which reports it.
const MAX_DEPTH: u32 = 128;

// Bytes that end a run of plain string content: quote, backslash, control characters.
const fn string_stops() -> [bool; 256] {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 0x20 {
        t[i] = true;
        i += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
}
static STOPS: [bool; 256] = string_stops();

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Index of the first quote, backslash or control byte at or after `j` (or `b.len()`).
/// Eight bytes a step: a lane's high bit is set where the byte is below 0x20 or equals a
/// quote or backslash (lanes past the first hit may be false positives; only the first
/// counts). Bytes of multi-byte UTF-8 characters are >= 0x80 and never match.
#[inline]
fn find_stop(b: &[u8], mut j: usize) -> usize {
    while let Some(chunk) = b.get(j..j + 8) {
        let x = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
        let q = x ^ (ONES * u64::from(b'"'));
        let bs = x ^ (ONES * u64::from(b'\\'));
        let hit = (q.wrapping_sub(ONES) & !q | bs.wrapping_sub(ONES) & !bs | x.wrapping_sub(ONES * 0x20) & !x) & HIGHS;
        if hit != 0 {
            return j + (hit.trailing_zeros() / 8) as usize;
        }
        j += 8;
    }
    while j < b.len() && !STOPS[b[j] as usize] {
        j += 1;
    }
    j
}

/// A string value: the text between the quotes as written, and whether it holds escapes.
#[derive(Debug, Clone, Copy)]
pub struct RawStr<'a> {
    pub inner: &'a str,
    pub escaped: bool,
}

impl<'a> RawStr<'a> {
    /// The string's value (borrowed unless it has escapes).
    pub fn decode(self) -> R<Cow<'a, str>> {
        if !self.escaped {
            return Ok(Cow::Borrowed(self.inner));
        }
        let mut out = String::with_capacity(self.inner.len());
        unescape_into(self.inner, &mut out)?;
        Ok(Cow::Owned(out))
    }
}

fn hex4(b: &[u8]) -> R<u32> {
    let mut v = 0u32;
    for &c in b.get(..4).ok_or(Bail)? {
        let d = (c as char).to_digit(16).ok_or(Bail)?;
        v = v * 16 + d;
    }
    Ok(v)
}

/// Append the value of already-validated string content (no quotes) to `out`.
pub fn unescape_into(s: &str, out: &mut String) -> R<()> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let Some(p) = memchr::memchr(b'\\', &b[i..]) else {
            out.push_str(&s[i..]);
            break;
        };
        out.push_str(&s[i..i + p]);
        i += p + 1;
        let c = *b.get(i).ok_or(Bail)?;
        i += 1;
        let ch = match c {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = hex4(&b[i..])?;
                i += 4;
                let code = if (0xD800..0xDC00).contains(&hi) {
                    if b.get(i..i + 2) != Some(b"\\u") {
                        return Err(Bail);
                    }
                    let lo = hex4(&b[i + 2..])?;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return Err(Bail);
                    }
                    i += 6;
                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                } else {
                    hi
                };
                char::from_u32(code).ok_or(Bail)?
            }
            _ => return Err(Bail),
        };
        out.push(ch);
    }
    Ok(())
}

pub struct Reader<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
    depth: u32,
}

impl<'a> Reader<'a> {
    pub fn new(s: &'a str) -> Self {
        Reader { s, b: s.as_bytes(), i: 0, depth: 0 }
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    #[inline]
    fn peek(&mut self) -> R<u8> {
        self.ws();
        self.b.get(self.i).copied().ok_or(Bail)
    }

    #[inline]
    fn expect(&mut self, c: u8) -> R<()> {
        if self.peek()? != c {
            return Err(Bail);
        }
        self.i += 1;
        Ok(())
    }

    /// Only whitespace remains.
    pub fn end(&mut self) -> R<()> {
        self.ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            Err(Bail)
        }
    }

    /// Consume `null` if it is next.
    pub fn null(&mut self) -> R<bool> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            return Ok(true);
        }
        Ok(false)
    }

    fn literal(&mut self, word: &[u8]) -> R<()> {
        if self.b.get(self.i..self.i + word.len()) != Some(word) {
            return Err(Bail);
        }
        self.i += word.len();
        Ok(())
    }

    /// The string at the cursor (validated: escapes well formed, no control characters).
    #[inline]
    pub fn string(&mut self) -> R<RawStr<'a>> {
        self.expect(b'"')?;
        let start = self.i;
        let j = find_stop(self.b, start);
        if self.b.get(j) == Some(&b'"') {
            self.i = j + 1;
            return Ok(RawStr { inner: &self.s[start..j], escaped: false });
        }
        self.escaped_string(start, j)
    }

    #[cold]
    fn escaped_string(&mut self, start: usize, mut j: usize) -> R<RawStr<'a>> {
        let mut escaped = false;
        let b = self.b;
        loop {
            match b.get(j) {
                Some(b'"') => break,
                Some(b'\\') => {
                    escaped = true;
                    match b.get(j + 1) {
                        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => j += 2,
                        Some(b'u') => {
                            hex4(b.get(j + 2..).ok_or(Bail)?)?;
                            j += 6;
                        }
                        _ => return Err(Bail),
                    }
                    j = find_stop(b, j);
                }
                _ => return Err(Bail),
            }
        }
        self.i = j + 1;
        // Quotes and backslashes are ASCII, so these are character boundaries.
        Ok(RawStr { inner: &self.s[start..j], escaped })
    }

    /// A string or null.
    pub fn opt_string(&mut self) -> R<Option<RawStr<'a>>> {
        if self.null()? {
            return Ok(None);
        }
        self.string().map(Some)
    }

    /// A nonnegative integer that fits `u64`, or null.
    pub fn opt_u64(&mut self) -> R<Option<u64>> {
        if self.null()? {
            return Ok(None);
        }
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(&c @ b'0'..=b'9') = self.b.get(self.i) {
            v = v.checked_mul(10).and_then(|v| v.checked_add(u64::from(c - b'0'))).ok_or(Bail)?;
            self.i += 1;
        }
        let n = self.i - start;
        if n == 0 || (n > 1 && self.b[start] == b'0') || matches!(self.b.get(self.i), Some(b'.' | b'e' | b'E')) {
            return Err(Bail);
        }
        Ok(Some(v))
    }

    fn number(&mut self) -> R<()> {
        let b = self.b;
        let mut j = self.i;
        if b.get(j) == Some(&b'-') {
            j += 1;
        }
        let digits = |j: &mut usize| {
            let s = *j;
            while let Some(b'0'..=b'9') = b.get(*j) {
                *j += 1;
            }
            *j - s
        };
        match b.get(j) {
            Some(b'0') => j += 1,
            Some(b'1'..=b'9') => {
                digits(&mut j);
            }
            _ => return Err(Bail),
        }
        if b.get(j) == Some(&b'.') {
            j += 1;
            if digits(&mut j) == 0 {
                return Err(Bail);
            }
        }
        if let Some(b'e' | b'E') = b.get(j) {
            j += 1;
            if let Some(b'+' | b'-') = b.get(j) {
                j += 1;
            }
            if digits(&mut j) == 0 {
                return Err(Bail);
            }
        }
        self.i = j;
        Ok(())
    }

    /// Skip (and validate) the value at the cursor; returns its span.
    pub fn skip(&mut self) -> R<(usize, usize)> {
        let c = self.peek()?;
        let start = self.i;
        match c {
            b'"' => {
                self.string()?;
            }
            b'{' => {
                self.walk_object(true, |r, _| r.skip().map(|_| ()))?;
            }
            b'[' => {
                self.array(|r| r.skip().map(|_| ()))?;
            }
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            _ => self.number()?,
        }
        Ok((start, self.i))
    }

    /// Skip a value and return its text as written.
    pub fn raw(&mut self) -> R<&'a str> {
        let (s, e) = self.skip()?;
        Ok(&self.s[s..e])
    }

    /// A raw value, with null read as absent (serde's `Option<&RawValue>`).
    pub fn opt_raw(&mut self) -> R<Option<&'a str>> {
        if self.null()? {
            return Ok(None);
        }
        self.raw().map(Some)
    }

    /// Walk an object, calling `member(reader, key)` with the cursor on each value; the
    /// callback must consume the value. Escaped keys bail (serde would unescape them).
    pub fn object(&mut self, member: impl FnMut(&mut Self, &'a [u8]) -> R<()>) -> R<()> {
        self.walk_object(false, member)
    }

    /// `escaped_keys`: accept keys with escapes (for objects only skipped, whose keys no
    /// one matches).
    fn walk_object(&mut self, escaped_keys: bool, mut member: impl FnMut(&mut Self, &'a [u8]) -> R<()>) -> R<()> {
        self.walk(b'{', b'}', |r| {
            let key = r.string()?;
            if key.escaped && !escaped_keys {
                return Err(Bail);
            }
            r.expect(b':')?;
            member(r, key.inner.as_bytes())
        })
    }

    /// Walk an array, calling `item(reader)` with the cursor on each element.
    pub fn array(&mut self, item: impl FnMut(&mut Self) -> R<()>) -> R<()> {
        self.walk(b'[', b']', item)
    }

    /// A container from `open` to `close`, `item` consuming each entry; separators,
    /// emptiness and the nesting limit are checked here once for objects and arrays.
    #[inline]
    fn walk(&mut self, open: u8, close: u8, mut item: impl FnMut(&mut Self) -> R<()>) -> R<()> {
        self.expect(open)?;
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Bail);
        }
        if self.peek()? != close {
            loop {
                item(self)?;
                match self.peek()? {
                    b',' => self.i += 1,
                    c if c == close => break,
                    _ => return Err(Bail),
                }
            }
        }
        self.i += 1;
        self.depth -= 1;
        Ok(())
    }

    /// Offset of the cursor in the input (for spans).
    pub fn pos(&self) -> usize {
        self.i
    }

    /// The input from `start` (after its leading whitespace) to the cursor.
    pub fn since(&self, start: usize) -> &'a str {
        self.s[start..self.i].trim_start()
    }
}

/// Set `bit` in `seen`, bailing if it was already set (serde rejects duplicate fields).
#[inline]
pub fn once(seen: &mut u32, bit: u32) -> R<()> {
    if *seen & bit != 0 {
        return Err(Bail);
    }
    *seen |= bit;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skips(s: &str) -> bool {
        let mut r = Reader::new(s);
        r.skip().is_ok() && r.end().is_ok()
    }

    #[test]
    fn accepts_exactly_what_serde_accepts() {
        for s in [
            r#"{"a":[1,-2.5e+3,0,true,false,null,"x\"\\\/\b\f\n\r\t\u00e9"],"b":{}}"#,
            " [ ] ",
            r#""\ud83d\ude00""#,
            "-0.0",
            "{\"k\" : \"v\" , \"l\":[ {} , [] ]}",
            r#"{"a":"é"}"#,
            "1",
            "[1,2",
            "{\"a\"}",
            "{\"a\":1,}",
            "[1,]",
            "01",
            "1.",
            ".5",
            "1e",
            "-",
            "tru",
            "nul",
            "\"a\u{1}\"",
            "\"\\x\"",
            "\"\\u12G4\"",
            "{1:2}",
            "[1] x",
            "\"abc",
            "+1",
            "{,}",
            "",
        ] {
            let serde_ok = serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok();
            assert_eq!(skips(s), serde_ok, "{s:?}");
        }
    }

    #[test]
    fn strings_decode_like_serde() {
        for s in [r#""plain""#, r#""a\nb\u00e9\"""#, r#""\ud83d\ude00!""#] {
            let mut r = Reader::new(s);
            let got = r.string().unwrap().decode().unwrap();
            assert_eq!(got, serde_json::from_str::<String>(s).unwrap());
        }
        let mut r = Reader::new(r#""\ud83d""#);
        assert!(r.string().unwrap().decode().is_err());
    }

    #[test]
    fn stop_search_finds_the_first_stop_at_any_offset() {
        for text in
            ["abcdefghij\"", "ab\\cdefghijklm", "é€😀é€😀é€😀\"", "aaaaaaaaaaaaaaaa\u{1f}", "zzzzzzzzzzzzzzzzzzzzz"]
        {
            let b = text.as_bytes();
            for start in 0..b.len() {
                let want = (start..b.len()).find(|&i| STOPS[b[i] as usize]).unwrap_or(b.len());
                assert_eq!(find_stop(b, start), want, "{text:?} from {start}");
            }
        }
    }

    #[test]
    fn integers() {
        let n = |s: &str| Reader::new(s).opt_u64();
        assert_eq!(n("12"), Ok(Some(12)));
        assert_eq!(n("null"), Ok(None));
        assert_eq!(n("18446744073709551616"), Err(Bail));
        assert_eq!(n("-1"), Err(Bail));
        assert_eq!(n("1.0"), Err(Bail));
        assert_eq!(n("007"), Err(Bail));
    }

    #[test]
    fn deep_nesting_bails() {
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(!skips(&deep));
    }
}
