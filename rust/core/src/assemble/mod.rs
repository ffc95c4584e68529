//! Non-streaming assembly: one final response built from an engine's stream frames,
//! following the spec's assembly table. Anything the table does not cover that carries a
//! value is refused by name, so a client never gets a response silently missing a part.
//!
//! `read` parses frames of the common shape in one pass and `fast` accumulates them; `value`
//! takes every other frame as a serde `Value`; this module holds the accumulated state
//! (choices, tool calls, logprobs, usage) and feeds each frame to one of the two; `finish`
//! settles the response and `write` writes it out.

mod fast;
mod finish;
mod read;
#[cfg(test)]
mod tests;
mod value;
mod write;

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::few::Few;
use crate::json_scan::{scan_id_list, IdListError};
use read::*;
use write::*;
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssembleError {
    /// JSON path of the offending field, e.g. `choices[0].delta.audio`.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for AssembleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for AssembleError {}

fn err(field: impl Into<String>, message: impl Into<String>) -> AssembleError {
    AssembleError { field: field.into(), message: message.into() }
}

/// Null, an empty array and an empty object carry no value.
fn has_value(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

#[derive(Default)]
struct ToolCall {
    id: Option<String>,
    name: Option<String>,
    arguments: String,
}

#[derive(Default)]
struct Choice {
    role: Option<String>,
    text: Option<String>,
    reasoning: Option<String>,
    reasoning_content: Option<String>,
    refusal: Option<String>,
    tool_calls: BTreeMap<u64, ToolCall>,
    function_call: Option<(String, String)>,
    /// Logprob entries kept as the engine wrote them: they are only ever passed through.
    /// Per array name, the entries' JSON text joined by commas (never parsed).
    logprobs: [Option<String>; 6],
    finish_reason: Option<Value>,
    stop_reason: Option<Value>,
    token_ids: Vec<u64>,
    prompt_token_ids: Option<Vec<u64>>,
    generation_events: u64,
}

pub struct Assembler {
    kind: Kind,
    keep_token_ids: bool,
    require_token_ids: bool,
    meta: Map<String, Value>,
    usage: Option<Value>,
    prompt_token_ids: Option<Vec<u64>>,
    choices: BTreeMap<u64, Choice>,
    saw_ids: bool,
    done: bool,
    /// Raw text of the last id/created/model/system_fingerprint seen, to skip re-parsing.
    meta_raw: [String; 4],
}

const META: [&str; 4] = ["id", "created", "model", "system_fingerprint"];

/// Every logprob array the table assembles, in the order of `Choice::logprobs`.
const LOGPROB_ARRAYS: [&str; 6] = ["content", "refusal", "tokens", "token_logprobs", "text_offset", "top_logprobs"];
const CHAT_LOGPROBS: &[&str] = &["content", "refusal"];
const TEXT_LOGPROBS: &[&str] = &["tokens", "token_logprobs", "text_offset", "top_logprobs"];

fn logprob_slot(name: &str) -> usize {
    LOGPROB_ARRAYS.iter().position(|n| *n == name).unwrap_or(0)
}

fn id_list(v: &Value, path: &str, sink: &mut Vec<u64>) -> Result<(), AssembleError> {
    let Value::Array(items) = v else {
        return Err(err(path, IdListError::NotAList.to_string()));
    };
    for (i, item) in items.iter().enumerate() {
        let e = match item {
            Value::Number(n) => match n.as_u64() {
                Some(id) => {
                    sink.push(id);
                    continue;
                }
                None if n.as_i64().is_some() => IdListError::Negative(i),
                None => IdListError::NotAnInteger(i),
            },
            Value::Bool(_) => IdListError::Boolean(i),
            _ => IdListError::NotAnInteger(i),
        };
        return Err(err(path, e.to_string()));
    }
    Ok(())
}

fn append_str(slot: &mut Option<String>, v: &Value, path: impl FnOnce() -> String) -> Result<bool, AssembleError> {
    match v {
        Value::Null => Ok(false),
        Value::String(s) => {
            slot.get_or_insert_with(String::new).push_str(s);
            Ok(!s.is_empty())
        }
        _ => Err(err(path(), "must be a string")),
    }
}

impl Assembler {
    pub fn new(kind: Kind, keep_token_ids: bool, require_token_ids: bool) -> Self {
        Assembler {
            kind,
            keep_token_ids,
            require_token_ids,
            meta: Map::new(),
            usage: None,
            prompt_token_ids: None,
            choices: BTreeMap::new(),
            saw_ids: false,
            done: false,
            meta_raw: Default::default(),
        }
    }

    /// Whether the `[DONE]` sentinel arrived.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The prompt length the engine itself reported (its prompt token IDs, which are
    /// exact, else usage), if any: what the router's sizing is checked against.
    pub fn reported_prompt_tokens(&self) -> Option<u64> {
        self.prompt_token_ids
            .as_ref()
            .map(|p| p.len() as u64)
            .or_else(|| self.choices.values().find_map(|c| c.prompt_token_ids.as_ref().map(|p| p.len() as u64)))
            .or_else(|| self.usage.as_ref().and_then(|u| u.get("prompt_tokens")).and_then(Value::as_u64))
    }

    /// Prompt tokens the engine said it served from its prefix cache.
    pub fn reported_cached_tokens(&self) -> Option<u64> {
        self.usage
            .as_ref()
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
    }

    /// Output length measured from the stream: validated token IDs when the engine sent
    /// them, else one token per generation event (what `stream_interval: 1` engines send).
    pub fn measured_output_tokens(&self) -> u64 {
        self.choices.values().map(|c| if self.saw_ids { c.token_ids.len() as u64 } else { c.generation_events }).sum()
    }

    /// Feed one event's data (a JSON frame or `[DONE]`).
    pub fn feed(&mut self, data: &str) -> Result<(), AssembleError> {
        self.feed_with(data, true)
    }

    /// [`Assembler::feed`] without the single-pass reader: the oracle its tests compare
    /// against.
    #[doc(hidden)]
    pub fn feed_without_reader(&mut self, data: &str) -> Result<(), AssembleError> {
        self.feed_with(data, false)
    }

    fn feed_with(&mut self, data: &str, reader: bool) -> Result<(), AssembleError> {
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        // The single-pass reader first; frames it declines get serde's typed parse, and
        // frames outside the common shape the general path.
        let mut frame = FastFrame::default();
        if reader && read_fast_frame(data, &mut frame).is_ok() {
            if let Some(done) = self.feed_fast(&frame) {
                return done;
            }
        } else if let Ok(fast) = serde_json::from_str::<FastFrame>(data) {
            if let Some(done) = self.feed_fast(&fast) {
                return done;
            }
        }
        let frame: Value = serde_json::from_str(data).map_err(|e| err("<frame>", format!("malformed JSON: {e}")))?;
        let Value::Object(frame) = frame else {
            return Err(err("<frame>", "frame is not a JSON object"));
        };
        for (key, value) in frame {
            match key.as_str() {
                "choices" => match value {
                    Value::Array(choices) => {
                        for (pos, c) in choices.into_iter().enumerate() {
                            self.choice(pos, c)?;
                        }
                    }
                    Value::Null => {}
                    _ => return Err(err("choices", "must be an array")),
                },
                "usage" => {
                    if has_value(&value) {
                        if !value.is_object() {
                            return Err(err("usage", "must be an object"));
                        }
                        self.usage = Some(value);
                    }
                }
                "prompt_token_ids" => {
                    // As the fast path reads it: anything but null is a list of IDs (an
                    // empty object is no list; an empty list is the prompt's, empty).
                    if !value.is_null() {
                        let mut ids = Vec::new();
                        id_list(&value, "prompt_token_ids", &mut ids)?;
                        self.prompt_token_ids = Some(ids);
                    }
                }
                "error" => {
                    if has_value(&value) {
                        let msg = value
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or("engine reported an error")
                            .to_owned();
                        return Err(err("error", msg));
                    }
                }
                "object" => {}
                _ => {
                    if !value.is_null() {
                        self.meta.insert(key, value);
                    }
                }
            }
        }
        Ok(())
    }
}
