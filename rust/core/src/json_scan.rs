//! Byte-level JSON walking for frames that are passed through, not rebuilt.
//!
//! Removing `token_ids` from a frame must not re-serialize the values that stay: members are
//! copied as the engine wrote them and only the removed ones are skipped. Input here has
//! already been parsed by serde, so the scanner may assume well-formed JSON and reports a
//! bare `Malformed` otherwise.

#[derive(Debug, PartialEq, Eq)]
pub struct Malformed;

fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

fn skip_string(b: &[u8], i: usize) -> Result<usize, Malformed> {
    let mut j = i + 1;
    loop {
        let p = memchr::memchr2(b'"', b'\\', b.get(j..).ok_or(Malformed)?).ok_or(Malformed)?;
        j += p;
        if b[j] == b'\\' {
            j += 2;
        } else {
            return Ok(j + 1);
        }
    }
}

/// Index just past the value starting at `i` (after whitespace).
pub fn skip_value(b: &[u8], i: usize) -> Result<usize, Malformed> {
    let i = ws(b, i);
    match b.get(i).ok_or(Malformed)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Err(Malformed)
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                j += 1;
            }
            if j == i {
                Err(Malformed)
            } else {
                Ok(j)
            }
        }
    }
}

/// Copy the object at `b[i..]` into `out`, leaving out members whose key is in `drop`;
/// members named `recurse` that hold an array of objects get the same treatment one level
/// down with `inner_drop`. Returns the index past the object.
fn filter_object(
    b: &[u8],
    i: usize,
    out: &mut Vec<u8>,
    drop: &[&[u8]],
    recurse: Option<(&[u8], &[&[u8]])>,
) -> Result<usize, Malformed> {
    let mut j = ws(b, i);
    if b.get(j) != Some(&b'{') {
        return Err(Malformed);
    }
    out.push(b'{');
    j += 1;
    let mut first = true;
    loop {
        j = ws(b, j);
        match b.get(j).ok_or(Malformed)? {
            b'}' => {
                out.push(b'}');
                return Ok(j + 1);
            }
            b',' => {
                j += 1;
                continue;
            }
            b'"' => {}
            _ => return Err(Malformed),
        }
        let key_start = j;
        let key_end = skip_string(b, j)?;
        let key = &b[key_start + 1..key_end - 1];
        let colon = ws(b, key_end);
        if b.get(colon) != Some(&b':') {
            return Err(Malformed);
        }
        let value_start = ws(b, colon + 1);
        let value_end = skip_value(b, value_start)?;
        j = value_end;
        if drop.contains(&key) {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        match recurse {
            Some((name, inner)) if key == name && b[value_start] == b'[' => {
                out.extend_from_slice(&b[key_start..value_start]);
                filter_array_of_objects(b, value_start, out, inner)?;
            }
            _ => out.extend_from_slice(&b[key_start..value_end]),
        }
    }
}

fn filter_array_of_objects(b: &[u8], i: usize, out: &mut Vec<u8>, drop: &[&[u8]]) -> Result<usize, Malformed> {
    out.push(b'[');
    let mut j = i + 1;
    let mut first = true;
    loop {
        j = ws(b, j);
        match b.get(j).ok_or(Malformed)? {
            b']' => {
                out.push(b']');
                return Ok(j + 1);
            }
            b',' => {
                j += 1;
                continue;
            }
            _ => {}
        }
        if !first {
            out.push(b',');
        }
        first = false;
        if b[j] == b'{' {
            j = filter_object(b, j, out, drop, None)?;
        } else {
            let end = skip_value(b, j)?;
            out.extend_from_slice(&b[j..end]);
            j = end;
        }
    }
}

/// Whether the frame might name a token-ID field; a cheap pre-check before filtering.
pub fn mentions_token_ids(b: &[u8]) -> bool {
    memchr::memmem::find(b, b"token_ids\"").is_some()
}

/// Append `frame` to `out` without top-level `prompt_token_ids` and without `token_ids` /
/// `prompt_token_ids` on each choice. Frames that name neither are copied untouched.
pub fn strip_token_ids(frame: &[u8], out: &mut Vec<u8>) -> Result<(), Malformed> {
    if !mentions_token_ids(frame) {
        out.extend_from_slice(frame);
        return Ok(());
    }
    const TOP: &[&[u8]] = &[b"prompt_token_ids"];
    const CHOICE: &[&[u8]] = &[b"token_ids", b"prompt_token_ids"];
    filter_object(frame, 0, out, TOP, Some((b"choices", CHOICE)))?;
    Ok(())
}

fn ws_back(b: &[u8], mut i: usize) -> usize {
    while i > 0 && matches!(b[i - 1], b' ' | b'\t' | b'\n' | b'\r') {
        i -= 1;
    }
    i
}

/// Copy `frame` into `out` without the members whose *values* occupy `value_spans` (as
/// found by the parser). Only the separators around each member are looked at, so the cost
/// is a copy. Returns `Err` when the layout is not the simple one (escaped keys, adjacent
/// removals); the caller then falls back to [`strip_token_ids`].
pub fn strip_value_spans(frame: &[u8], value_spans: &mut [(usize, usize)], out: &mut Vec<u8>) -> Result<(), Malformed> {
    value_spans.sort_unstable();
    let mark = out.len();
    let mut cut: Vec<(usize, usize)> = Vec::with_capacity(value_spans.len());
    for &(vs, ve) in value_spans.iter() {
        let colon = ws_back(frame, vs);
        if colon == 0 || frame[colon - 1] != b':' {
            return Err(Malformed);
        }
        let key_end = ws_back(frame, colon - 1);
        let key_start = if frame[..key_end].ends_with(b"\"prompt_token_ids\"") {
            key_end - 18
        } else if frame[..key_end].ends_with(b"\"token_ids\"") {
            key_end - 11
        } else {
            return Err(Malformed);
        };
        let before = ws_back(frame, key_start);
        let member = if before > 0 && frame[before - 1] == b',' {
            (before - 1, ve)
        } else {
            let after = ws(frame, ve);
            if frame.get(after) == Some(&b',') {
                (key_start, after + 1)
            } else {
                (key_start, ve)
            }
        };
        if cut.last().is_some_and(|&(_, e)| e > member.0) {
            out.truncate(mark);
            return Err(Malformed);
        }
        cut.push(member);
    }
    let mut prev = 0;
    for (s, e) in cut {
        out.extend_from_slice(&frame[prev..s]);
        prev = e;
    }
    out.extend_from_slice(&frame[prev..]);
    Ok(())
}

/// What a `token_ids` value failed on.
#[derive(Debug, PartialEq, Eq, Clone)]
pub enum IdListError {
    NotAList,
    Boolean(usize),
    Negative(usize),
    NotAnInteger(usize),
}

impl std::fmt::Display for IdListError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdListError::NotAList => write!(f, "token_ids is not a list"),
            IdListError::Boolean(i) => write!(f, "token_ids[{i}] is a Boolean"),
            IdListError::Negative(i) => write!(f, "token_ids[{i}] is negative"),
            IdListError::NotAnInteger(i) => write!(f, "token_ids[{i}] is not an integer"),
        }
    }
}

/// Check a raw JSON value as a list of nonnegative integers, pushing each ID into `sink`
/// when one is given; returns the count.
pub fn scan_id_list(raw: &[u8], mut sink: Option<&mut Vec<u64>>) -> Result<usize, IdListError> {
    let mut j = ws(raw, 0);
    if raw.get(j) != Some(&b'[') {
        return Err(IdListError::NotAList);
    }
    j += 1;
    let mut n = 0usize;
    loop {
        j = ws(raw, j);
        let Some(&c) = raw.get(j) else {
            return Err(IdListError::NotAList);
        };
        match c {
            b']' => return Ok(n),
            b',' => {
                j += 1;
                continue;
            }
            b'0'..=b'9' => {
                let mut v: u64 = 0;
                let start = j;
                while j < raw.len() && raw[j].is_ascii_digit() {
                    v = v.saturating_mul(10).saturating_add(u64::from(raw[j] - b'0'));
                    j += 1;
                }
                if j - start > 19 || matches!(raw.get(j), Some(b'.' | b'e' | b'E')) {
                    return Err(IdListError::NotAnInteger(n));
                }
                if let Some(s) = sink.as_deref_mut() {
                    s.push(v);
                }
                n += 1;
            }
            b'-' => return Err(IdListError::Negative(n)),
            b't' | b'f' => return Err(IdListError::Boolean(n)),
            _ => return Err(IdListError::NotAnInteger(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(s: &str) -> String {
        let mut out = Vec::new();
        strip_token_ids(s.as_bytes(), &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn strips_choice_and_prompt_ids_keeping_the_rest_verbatim() {
        let s = r#"{"id":"x","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":"a\"token_ids\""},"token_ids":[5]}],"usage":null}"#;
        assert_eq!(strip(s), r#"{"id":"x","choices":[{"index":0,"delta":{"content":"a\"token_ids\""}}],"usage":null}"#);
    }

    #[test]
    fn first_member_removed_and_whitespace() {
        let s = r#"{ "prompt_token_ids" : [ 1 ] , "choices" : [ { "token_ids": [], "text": "hi" } ] }"#;
        assert_eq!(strip(s), r#"{"choices" : [{"text": "hi"}]}"#);
    }

    #[test]
    fn untouched_without_ids() {
        let s = r#"{"choices":[{"delta":{"content":"x"}}]}"#;
        assert_eq!(strip(s), s);
    }

    #[test]
    fn id_list_rules() {
        assert_eq!(scan_id_list(b"[1, 2 ,3]", None), Ok(3));
        assert_eq!(scan_id_list(b"[]", None), Ok(0));
        assert_eq!(scan_id_list(b"[1,true]", None), Err(IdListError::Boolean(1)));
        assert_eq!(scan_id_list(b"[-1]", None), Err(IdListError::Negative(0)));
        assert_eq!(scan_id_list(b"[1.5]", None), Err(IdListError::NotAnInteger(0)));
        assert_eq!(scan_id_list(b"[\"1\"]", None), Err(IdListError::NotAnInteger(0)));
        assert_eq!(scan_id_list(b"{}", None), Err(IdListError::NotAList));
        assert_eq!(scan_id_list(b"null", None), Err(IdListError::NotAList));
        let mut ids = Vec::new();
        scan_id_list(b"[7,8]", Some(&mut ids)).unwrap();
        assert_eq!(ids, [7, 8]);
    }
}

#[cfg(test)]
mod span_tests {
    use super::*;
    use crate::frame::inspect_with_spans;

    fn both(s: &str) -> (Result<String, Malformed>, String) {
        let mut spans = Vec::new();
        inspect_with_spans(s, false, None, Some(&mut spans)).unwrap();
        let mut a = Vec::new();
        let fast = strip_value_spans(s.as_bytes(), &mut spans, &mut a).map(|_| String::from_utf8(a).unwrap());
        let mut b = Vec::new();
        strip_token_ids(s.as_bytes(), &mut b).unwrap();
        (fast, String::from_utf8(b).unwrap())
    }

    #[test]
    fn span_strip_agrees_with_the_scanner_or_declines() {
        for s in [
            r#"{"id":"x","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5]}]}"#,
            r#"{"prompt_token_ids":[1],"choices":[{"token_ids":[5],"delta":{}}]}"#,
            r#"{"choices":[{"token_ids":[5],"prompt_token_ids":[1],"text":"x"}]}"#,
            r#"{"choices":[{"text":"x","token_ids":[5],"prompt_token_ids":[1]}]}"#,
            r#"{ "choices" : [ { "text" : "x" , "token_ids" : [ 5 ] } ] }"#,
        ] {
            let (fast, slow) = both(s);
            let slow_v: serde_json::Value = serde_json::from_str(&slow).unwrap();
            if let Ok(f) = fast {
                let fast_v: serde_json::Value = serde_json::from_str(&f).unwrap();
                assert_eq!(fast_v, slow_v, "{s}");
                assert!(!f.contains("token_ids"));
            }
        }
    }
}
