//! The frame reader: the common frame shape, borrowed, in one pass.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::few::Few;
use crate::json_read::{once, Bail, RawStr, Reader, R};
use crate::walk::{walk, Visit};

/// A JSON value's text as written, borrowed from the frame: serde reads it through
/// `RawValue`, the single-pass reader straight from its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Raw<'a>(pub(super) &'a str);

impl<'de: 'a, 'a> Deserialize<'de> for Raw<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        Ok(Raw(raw.get()))
    }
}

// The fast path: the common frame shape, borrowed, with every field known. A frame with any
// other field (or a value of a surprising type) fails this parse and takes the general path
// below, which accepts null-valued extras and names the offending field otherwise.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FastFrame<'a> {
    #[serde(borrow, default)]
    pub(super) id: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) object: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) created: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) model: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) system_fingerprint: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) choices: Few<FastChoice<'a>>,
    #[serde(borrow, default)]
    pub(super) usage: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) prompt_token_ids: Option<Raw<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FastChoice<'a> {
    #[serde(default)]
    pub(super) index: Option<u64>,
    #[serde(borrow, default)]
    pub(super) delta: Option<FastDelta<'a>>,
    #[serde(borrow, default)]
    pub(super) text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) logprobs: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) finish_reason: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) stop_reason: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) token_ids: Option<Raw<'a>>,
    /// Filled by the single-pass reader, which reads `logprobs` in the same pass.
    #[serde(skip)]
    pub(super) logprobs_read: Option<FastLogprobs<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FastDelta<'a> {
    #[serde(borrow, default)]
    pub(super) role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) reasoning: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) refusal: Option<Cow<'a, str>>,
    // Parsed in the same pass as the frame: tool-call streams are mostly argument fragments.
    #[serde(borrow, default)]
    pub(super) tool_calls: Option<Few<FastCall<'a>>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FastCall<'a> {
    #[serde(default)]
    pub(super) index: Option<u64>,
    #[serde(borrow, default)]
    pub(super) id: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "type")]
    pub(super) kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) function: Option<FastFunction<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FastFunction<'a> {
    #[serde(borrow, default)]
    pub(super) name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) arguments: Option<Cow<'a, str>>,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub(super) struct FastLogprobs<'a> {
    #[serde(borrow, default)]
    pub(super) content: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) refusal: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) tokens: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) token_logprobs: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) text_offset: Option<Raw<'a>>,
    #[serde(borrow, default)]
    pub(super) top_logprobs: Option<Raw<'a>>,
}

/// The fast-path frame read in one pass by [`walk`]: the shape serde's
/// `deny_unknown_fields` parse of [`FastFrame`] accepts, or [`Bail`]. (A null `choices` is
/// read as none here, where serde declines it and the general path reads it as none.)
pub(super) fn read_fast_frame<'a>(data: &'a str, f: &mut FastFrame<'a>) -> R<()> {
    walk(data, &mut FastRead { f, seen: 0, choice: 0, delta: 0 })
}

/// The assembler's reading of a frame ([`walk`]'s visitor): every member known, or [`Bail`].
struct FastRead<'f, 'a> {
    f: &'f mut FastFrame<'a>,
    seen: u32,
    choice: u32,
    delta: u32,
}

/// The choice the walk is in.
fn current<'c, 'a>(f: &'c mut FastFrame<'a>) -> &'c mut FastChoice<'a> {
    f.choices.last_mut().expect("a choice has begun")
}

impl<'a> Visit<'a> for FastRead<'_, 'a> {
    fn frame(&mut self, r: &mut Reader<'a>, key: &'a [u8]) -> R<()> {
        let f = &mut *self.f;
        let (bit, slot) = match key {
            b"id" => (1, &mut f.id),
            b"object" => (2, &mut f.object),
            b"created" => (4, &mut f.created),
            b"model" => (8, &mut f.model),
            b"system_fingerprint" => (16, &mut f.system_fingerprint),
            b"usage" => (32, &mut f.usage),
            b"prompt_token_ids" => (64, &mut f.prompt_token_ids),
            _ => return Err(Bail),
        };
        once(&mut self.seen, bit)?;
        *slot = r.opt_raw()?.map(Raw);
        Ok(())
    }

    fn choice_begins(&mut self) {
        self.f.choices.push_default();
        self.choice = 0;
        self.delta = 0;
    }

    fn choice(&mut self, r: &mut Reader<'a>, key: &'a [u8]) -> R<()> {
        let mut seen = self.choice;
        let c = current(self.f);
        match key {
            b"index" => {
                once(&mut seen, 1)?;
                c.index = r.opt_u64()?;
            }
            b"text" => {
                once(&mut seen, 2)?;
                c.text = opt_str(r)?;
            }
            b"finish_reason" => {
                once(&mut seen, 4)?;
                c.finish_reason = opt_str(r)?;
            }
            b"stop_reason" => {
                once(&mut seen, 8)?;
                c.stop_reason = r.opt_raw()?.map(Raw);
            }
            b"token_ids" => {
                once(&mut seen, 16)?;
                c.token_ids = r.opt_raw()?.map(Raw);
            }
            b"logprobs" => {
                once(&mut seen, 32)?;
                read_logprobs(r, c)?;
            }
            _ => return Err(Bail),
        }
        self.choice = seen;
        Ok(())
    }

    fn delta_begins(&mut self) {
        current(self.f).delta = Some(FastDelta::default());
    }

    fn delta(&mut self, r: &mut Reader<'a>, key: &'a [u8]) -> R<()> {
        let mut seen = self.delta;
        let d = current(self.f).delta.as_mut().expect("the delta has begun");
        let (bit, slot) = match key {
            b"role" => (1, &mut d.role),
            b"content" => (2, &mut d.content),
            b"reasoning" => (4, &mut d.reasoning),
            b"reasoning_content" => (8, &mut d.reasoning_content),
            b"refusal" => (16, &mut d.refusal),
            b"tool_calls" => {
                once(&mut seen, 32)?;
                self.delta = seen;
                if r.null()? {
                    return Ok(());
                }
                let calls = d.tool_calls.insert(Few::default());
                return r.array(|r| read_call(r, calls.push_default()));
            }
            _ => return Err(Bail),
        };
        once(&mut seen, bit)?;
        self.delta = seen;
        *slot = opt_str(r)?;
        Ok(())
    }
}

pub(super) fn opt_str<'a>(r: &mut Reader<'a>) -> R<Option<Cow<'a, str>>> {
    r.opt_string()?.map(RawStr::decode).transpose()
}

/// A choice's `logprobs`, kept as written and read in the same pass.
fn read_logprobs<'a>(r: &mut Reader<'a>, c: &mut FastChoice<'a>) -> R<()> {
    if r.null()? {
        return Ok(());
    }
    let start = r.pos();
    let mut lp = FastLogprobs::default();
    let mut lseen = 0u32;
    r.object(|r, key| {
        let (bit, slot) = match key {
            b"content" => (1, &mut lp.content),
            b"refusal" => (2, &mut lp.refusal),
            b"tokens" => (4, &mut lp.tokens),
            b"token_logprobs" => (8, &mut lp.token_logprobs),
            b"text_offset" => (16, &mut lp.text_offset),
            b"top_logprobs" => (32, &mut lp.top_logprobs),
            _ => return Err(Bail),
        };
        once(&mut lseen, bit)?;
        *slot = r.opt_raw()?.map(Raw);
        Ok(())
    })?;
    c.logprobs = Some(Raw(r.since(start)));
    c.logprobs_read = Some(lp);
    Ok(())
}

pub(super) fn read_call<'a>(r: &mut Reader<'a>, call: &mut FastCall<'a>) -> R<()> {
    let mut seen = 0u32;
    r.object(|r, key| {
        match key {
            b"index" => {
                once(&mut seen, 1)?;
                call.index = r.opt_u64()?;
            }
            b"id" => {
                once(&mut seen, 2)?;
                call.id = opt_str(r)?;
            }
            b"type" => {
                once(&mut seen, 4)?;
                call.kind = opt_str(r)?;
            }
            b"function" => {
                once(&mut seen, 8)?;
                if r.null()? {
                    return Ok(());
                }
                let mut f = FastFunction::default();
                let mut fseen = 0u32;
                r.object(|r, key| {
                    let (bit, slot) = match key {
                        b"name" => (1, &mut f.name),
                        b"arguments" => (2, &mut f.arguments),
                        _ => return Err(Bail),
                    };
                    once(&mut fseen, bit)?;
                    *slot = opt_str(r)?;
                    Ok(())
                })?;
                call.function = Some(f);
            }
            _ => return Err(Bail),
        }
        Ok(())
    })
}

pub(super) fn non_null(v: Option<Raw<'_>>) -> Option<Raw<'_>> {
    v.filter(|r| r.0 != "null")
}

/// Append the items of a raw JSON array to a comma-joined buffer, without parsing them.
pub(super) fn join_array(buf: &mut String, array: Raw<'_>) -> bool {
    let s = array.0;
    let Some(inner) = s.strip_prefix('[').and_then(|r| r.strip_suffix(']')) else {
        return false;
    };
    let inner = inner.trim();
    if !inner.is_empty() {
        if !buf.is_empty() {
            buf.push(',');
        }
        buf.push_str(inner);
    }
    true
}

pub(super) fn push(slot: &mut Option<String>, s: &Option<Cow<'_, str>>) -> bool {
    match s {
        Some(s) => {
            slot.get_or_insert_with(String::new).push_str(s);
            !s.is_empty()
        }
        None => false,
    }
}
