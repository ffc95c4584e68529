//! One OpenAI-shaped stream frame (chat or text completion): what it carries and whether
//! its token IDs hold up. Parsed with borrowed fields: nothing that is only looked at is
//! copied.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::json_read::{once, Bail, Reader, R};
use crate::json_scan::{scan_id_list, IdListError};
use crate::walk::{walk, Visit};

/// Bit flags for what a frame carries (across all its choices).
pub mod kind {
    pub const TEXT: u16 = 1;
    pub const REASONING: u16 = 1 << 1;
    pub const REASONING_CONTENT: u16 = 1 << 2;
    pub const TOOL_CALLS: u16 = 1 << 3;
    pub const REFUSAL: u16 = 1 << 4;
    pub const USAGE: u16 = 1 << 5;
    pub const ROLE: u16 = 1 << 6;
    pub const FINISH: u16 = 1 << 7;
    pub const ERROR: u16 = 1 << 8;
    /// Any kind that is generated output and so must carry token IDs.
    pub const GENERATED: u16 = TEXT | REASONING | REASONING_CONTENT | TOOL_CALLS | REFUSAL;
}

#[derive(Deserialize)]
struct RawFrame<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<RawChoice<'a>>>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<RawPromptDetails>,
}

#[derive(Deserialize)]
struct RawPromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct RawChoice<'a> {
    #[serde(default)]
    index: Option<u32>,
    #[serde(borrow, default)]
    delta: Option<RawDelta<'a>>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
    #[serde(borrow, default)]
    token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawDelta<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    reasoning: Option<&'a RawValue>,
    #[serde(borrow, default)]
    reasoning_content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    refusal: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    function_call: Option<&'a RawValue>,
}

/// A non-empty string, or a value of another non-null type (which the assembler rejects).
fn carries(v: Option<&RawValue>) -> bool {
    carries_raw(v.map(RawValue::get))
}

fn carries_raw(v: Option<&str>) -> bool {
    match v {
        None => false,
        Some(s) => s != "null" && s != "\"\"" && s != "[]",
    }
}

/// What one frame said.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FrameInfo {
    pub kinds: u16,
    /// Validated output token IDs in this frame, over all choices.
    pub output_ids: u64,
    /// Prompt token IDs count, top level (chat) or on a choice (completions).
    pub prompt_ids: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Prompt tokens the engine served from its prefix cache (`usage.prompt_tokens_details`).
    pub cached_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Not a JSON object of the expected shape.
    Json(String),
    /// A generation frame without `token_ids` on a choice.
    MissingTokenIds {
        choice: u32,
    },
    BadTokenIds {
        choice: u32,
        err: IdListError,
    },
    BadPromptTokenIds(IdListError),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Json(m) => write!(f, "malformed stream frame: {m}"),
            FrameError::MissingTokenIds { choice } => {
                write!(f, "choices[{choice}] carries output but no token_ids")
            }
            FrameError::BadTokenIds { choice, err } => write!(f, "choices[{choice}].{err}"),
            FrameError::BadPromptTokenIds(err) => write!(f, "prompt_{err}"),
        }
    }
}

impl std::error::Error for FrameError {}

impl FrameError {
    /// A short, stable label for counters.
    pub fn reason(&self) -> &'static str {
        match self {
            FrameError::Json(_) => "malformed_frame",
            FrameError::MissingTokenIds { .. } => "missing_token_ids",
            FrameError::BadTokenIds { err, .. } | FrameError::BadPromptTokenIds(err) => match err {
                IdListError::NotAList => "token_ids_not_a_list",
                IdListError::Boolean(_) => "boolean_token_id",
                IdListError::Negative(_) => "negative_token_id",
                IdListError::NotAnInteger(_) => "non_integer_token_id",
            },
        }
    }
}

/// Classify `data` and, when `require_ids`, check token IDs on every generation choice.
/// IDs present on any choice are validated and counted either way; `ids_sink` collects
/// them (all choices, in order) when given.
pub fn inspect(data: &str, require_ids: bool, ids_sink: Option<&mut Vec<u64>>) -> Result<FrameInfo, FrameError> {
    inspect_with_spans(data, require_ids, ids_sink, None)
}

/// Byte range of a borrowed raw value inside the frame it was parsed from.
fn span(data: &str, raw: &RawValue) -> (usize, usize) {
    let start = raw.get().as_ptr() as usize - data.as_ptr() as usize;
    (start, start + raw.get().len())
}

/// [`inspect`], also recording into `spans` where each token-ID value sits in `data`
/// (top-level `prompt_token_ids`, per-choice `token_ids` and `prompt_token_ids`).
pub fn inspect_with_spans(
    data: &str,
    require_ids: bool,
    mut ids_sink: Option<&mut Vec<u64>>,
    mut spans: Option<&mut Vec<(usize, usize)>>,
) -> Result<FrameInfo, FrameError> {
    if let Ok(info) = inspect_fast(data, require_ids, ids_sink.as_deref_mut(), spans.as_deref_mut()) {
        return Ok(info);
    }
    inspect_serde(data, require_ids, ids_sink, spans)
}

/// The single-pass reader's version of [`inspect_with_spans`] for well-formed, valid frames.
/// Any problem (including a validation failure) is [`Bail`], with `ids_sink` and `spans`
/// left as they were: the serde path then reports it precisely. Unlike the serde path it
/// also records the spans of null token-ID values, so stripping them needs no second look.
pub fn inspect_fast(
    data: &str,
    require_ids: bool,
    mut ids_sink: Option<&mut Vec<u64>>,
    mut spans: Option<&mut Vec<(usize, usize)>>,
) -> R<FrameInfo> {
    let marks = (ids_sink.as_ref().map_or(0, |s| s.len()), spans.as_ref().map_or(0, |s| s.len()));
    let result = read_frame(data, require_ids, ids_sink.as_deref_mut(), spans.as_deref_mut());
    if result.is_err() {
        if let Some(s) = ids_sink {
            s.truncate(marks.0);
        }
        if let Some(s) = spans {
            s.truncate(marks.1);
        }
    }
    result
}

type Spans<'s> = Option<&'s mut Vec<(usize, usize)>>;

fn read_frame(data: &str, require_ids: bool, ids_sink: Option<&mut Vec<u64>>, spans: Spans<'_>) -> R<FrameInfo> {
    let mut c = Classify {
        data,
        require_ids,
        info: FrameInfo::default(),
        ids_sink,
        spans,
        seen: 0,
        choice: ChoiceSeen::default(),
    };
    walk(data, &mut c)?;
    Ok(c.info)
}

/// The classification's reading of a frame ([`walk`]'s visitor).
struct Classify<'d, 'x, 's> {
    data: &'d str,
    require_ids: bool,
    info: FrameInfo,
    ids_sink: Option<&'x mut Vec<u64>>,
    spans: Spans<'s>,
    seen: u32,
    choice: ChoiceSeen<'d>,
}

/// What the current choice carried so far.
#[derive(Default)]
struct ChoiceSeen<'d> {
    kinds: u16,
    ids: Option<&'d str>,
    seen: u32,
    delta_seen: u32,
}

impl<'d> Visit<'d> for Classify<'d, '_, '_> {
    fn frame(&mut self, r: &mut Reader<'d>, key: &'d [u8]) -> R<()> {
        match key {
            b"usage" => {
                once(&mut self.seen, 2)?;
                read_usage(r, &mut self.info)
            }
            b"prompt_token_ids" => {
                once(&mut self.seen, 4)?;
                read_prompt_ids(r, self.data, &mut self.info, self.spans.as_deref_mut())
            }
            b"error" => {
                once(&mut self.seen, 8)?;
                if !r.null()? {
                    r.skip()?;
                    self.info.kinds |= kind::ERROR;
                }
                Ok(())
            }
            _ => r.skip().map(drop),
        }
    }

    fn choice_begins(&mut self) {
        self.choice = ChoiceSeen::default();
    }

    fn choice(&mut self, r: &mut Reader<'d>, key: &'d [u8]) -> R<()> {
        let c = &mut self.choice;
        let (bit, flag) = match key {
            b"index" => {
                once(&mut c.seen, 1)?;
                return match r.opt_u64()? {
                    Some(i) if i > u64::from(u32::MAX) => Err(Bail),
                    _ => Ok(()),
                };
            }
            b"token_ids" => {
                once(&mut c.seen, 4)?;
                c.ids = id_value(r, self.data, self.spans.as_deref_mut())?;
                return Ok(());
            }
            b"prompt_token_ids" => {
                once(&mut c.seen, 8)?;
                return read_prompt_ids(r, self.data, &mut self.info, self.spans.as_deref_mut());
            }
            b"text" => (16, kind::TEXT),
            b"finish_reason" => (32, kind::FINISH),
            _ => return r.skip().map(drop),
        };
        once(&mut c.seen, bit)?;
        if carries_raw(r.opt_raw()?) {
            c.kinds |= flag;
        }
        Ok(())
    }

    fn delta(&mut self, r: &mut Reader<'d>, key: &'d [u8]) -> R<()> {
        let c = &mut self.choice;
        let (bit, flag) = match key {
            b"role" => (1, kind::ROLE),
            b"content" => (2, kind::TEXT),
            b"reasoning" => (4, kind::REASONING),
            b"reasoning_content" => (8, kind::REASONING_CONTENT),
            b"refusal" => (16, kind::REFUSAL),
            b"tool_calls" => (32, kind::TOOL_CALLS),
            b"function_call" => (64, kind::TOOL_CALLS),
            _ => return r.skip().map(drop),
        };
        once(&mut c.delta_seen, bit)?;
        if carries_raw(r.opt_raw()?) {
            c.kinds |= flag;
        }
        Ok(())
    }

    fn choice_ends(&mut self) -> R<()> {
        let c = &self.choice;
        match c.ids {
            Some(raw) => {
                let sink = self.ids_sink.as_deref_mut();
                self.info.output_ids += scan_id_list(raw.as_bytes(), sink).map_err(|_| Bail)? as u64;
            }
            None if self.require_ids && c.kinds & kind::GENERATED != 0 => return Err(Bail),
            None => {}
        }
        self.info.kinds |= c.kinds;
        Ok(())
    }
}

/// A token-ID member's value, its span recorded (null ones too: stripping removes the
/// member whatever it holds); `None` when null.
fn id_value<'d>(r: &mut Reader<'_>, data: &'d str, spans: Spans<'_>) -> R<Option<&'d str>> {
    let (s, e) = r.skip()?;
    if let Some(v) = spans {
        v.push((s, e));
    }
    Ok(Some(&data[s..e]).filter(|raw| *raw != "null"))
}

fn read_prompt_ids(r: &mut Reader<'_>, data: &str, info: &mut FrameInfo, spans: Spans<'_>) -> R<()> {
    if let Some(raw) = id_value(r, data, spans)? {
        info.prompt_ids = Some(scan_id_list(raw.as_bytes(), None).map_err(|_| Bail)? as u64);
    }
    Ok(())
}

fn read_usage(r: &mut Reader<'_>, info: &mut FrameInfo) -> R<()> {
    if r.null()? {
        return Ok(());
    }
    info.kinds |= kind::USAGE;
    let mut seen = 0u32;
    r.object(|r, key| {
        let (bit, slot) = match key {
            b"prompt_tokens" => (1, &mut info.prompt_tokens),
            b"completion_tokens" => (2, &mut info.completion_tokens),
            b"prompt_tokens_details" => {
                once(&mut seen, 4)?;
                if r.null()? {
                    return Ok(());
                }
                let mut dseen = 0u32;
                return r.object(|r, key| {
                    if key != b"cached_tokens" {
                        return r.skip().map(drop);
                    }
                    once(&mut dseen, 1)?;
                    info.cached_tokens = r.opt_u64()?;
                    Ok(())
                });
            }
            _ => return r.skip().map(drop),
        };
        once(&mut seen, bit)?;
        *slot = r.opt_u64()?;
        Ok(())
    })
}

/// The serde path: the oracle, and the fallback for every frame the reader declines, with
/// the precise error for the malformed ones.
pub fn inspect_serde(
    data: &str,
    require_ids: bool,
    mut ids_sink: Option<&mut Vec<u64>>,
    mut spans: Option<&mut Vec<(usize, usize)>>,
) -> Result<FrameInfo, FrameError> {
    let frame: RawFrame = serde_json::from_str(data).map_err(|e| FrameError::Json(e.to_string()))?;
    let mut info = FrameInfo::default();
    if frame.error.is_some() {
        info.kinds |= kind::ERROR;
    }
    if let Some(u) = &frame.usage {
        info.kinds |= kind::USAGE;
        info.prompt_tokens = u.prompt_tokens;
        info.completion_tokens = u.completion_tokens;
        info.cached_tokens = u.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens);
    }
    if let Some(p) = frame.prompt_token_ids {
        if let Some(s) = spans.as_deref_mut() {
            s.push(span(data, p));
        }
        if p.get() != "null" {
            let n = scan_id_list(p.get().as_bytes(), None).map_err(FrameError::BadPromptTokenIds)?;
            info.prompt_ids = Some(n as u64);
        }
    }
    for (pos, c) in frame.choices.iter().flatten().enumerate() {
        let idx = c.index.unwrap_or(pos as u32);
        let mut k = 0u16;
        if let Some(d) = &c.delta {
            if carries(d.content) {
                k |= kind::TEXT;
            }
            if carries(d.reasoning) {
                k |= kind::REASONING;
            }
            if carries(d.reasoning_content) {
                k |= kind::REASONING_CONTENT;
            }
            if carries(d.refusal) {
                k |= kind::REFUSAL;
            }
            if carries(d.tool_calls) || carries(d.function_call) {
                k |= kind::TOOL_CALLS;
            }
            if carries(d.role) {
                k |= kind::ROLE;
            }
        }
        if carries(c.text) {
            k |= kind::TEXT;
        }
        if carries(c.finish_reason) {
            k |= kind::FINISH;
        }
        if let Some(p) = c.prompt_token_ids {
            if let Some(s) = spans.as_deref_mut() {
                s.push(span(data, p));
            }
            if p.get() != "null" {
                let n = scan_id_list(p.get().as_bytes(), None).map_err(FrameError::BadPromptTokenIds)?;
                info.prompt_ids = Some(n as u64);
            }
        }
        if let (Some(raw), Some(s)) = (c.token_ids, spans.as_deref_mut()) {
            s.push(span(data, raw));
        }
        match c.token_ids {
            Some(raw) if raw.get() != "null" || k & kind::GENERATED != 0 => {
                let n = scan_id_list(raw.get().as_bytes(), ids_sink.as_deref_mut())
                    .map_err(|err| FrameError::BadTokenIds { choice: idx, err })?;
                info.output_ids += n as u64;
            }
            _ if require_ids && k & kind::GENERATED != 0 => {
                return Err(FrameError::MissingTokenIds { choice: idx });
            }
            _ => {}
        }
        info.kinds |= k;
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_frame_with_ids() {
        let i = inspect(r#"{"choices":[{"index":0,"delta":{"content":"hi"},"token_ids":[1,2]}]}"#, true, None).unwrap();
        assert_eq!(i.kinds, kind::TEXT);
        assert_eq!(i.output_ids, 2);
    }

    #[test]
    fn role_only_frame_needs_no_ids() {
        let i = inspect(
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[1,2,3]}"#,
            true,
            None,
        )
        .unwrap();
        assert_eq!(i.kinds, kind::ROLE);
        assert_eq!(i.prompt_ids, Some(3));
    }

    #[test]
    fn missing_boolean_and_null_ids_fail() {
        let f = |s: &str| inspect(s, true, None).unwrap_err().reason();
        assert_eq!(f(r#"{"choices":[{"delta":{"content":"x"}}]}"#), "missing_token_ids");
        assert_eq!(f(r#"{"choices":[{"delta":{"content":"x"},"token_ids":[false]}]}"#), "boolean_token_id");
        assert_eq!(f(r#"{"choices":[{"delta":{"content":"x"},"token_ids":null}]}"#), "missing_token_ids");
        assert_eq!(f(r#"{"choices":[{"delta":{"reasoning_content":"x"},"token_ids":7}]}"#), "token_ids_not_a_list");
        assert_eq!(f(r#"[1]"#), "malformed_frame");
    }

    #[test]
    fn ids_not_required_for_other_dialects() {
        let i = inspect(r#"{"choices":[{"text":"x","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#, false, None).unwrap();
        assert_eq!(i.kinds, kind::TEXT | kind::FINISH | kind::USAGE);
        assert_eq!(i.prompt_tokens, Some(3));
        assert_eq!(i.completion_tokens, Some(1));
    }
}
