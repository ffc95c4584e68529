//! Non-streaming assembly: one final response built from an engine's stream frames,
//! following the spec's assembly table. Anything the table does not cover that carries a
//! value is refused by name, so a client never gets a response silently missing a part.
//!
//! `read` parses frames of the common shape in one pass, this module accumulates them
//! (choices, tool calls, logprobs, usage), and `write` writes the response out.

mod read;
#[cfg(test)]
mod tests;
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
                    if has_value(&value) {
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

    /// Returns `None` when the frame needs the general path (nothing was changed then).
    fn feed_fast(&mut self, f: &FastFrame<'_>) -> Option<Result<(), AssembleError>> {
        let needs_general = f.usage.is_some_and(|u| !u.0.starts_with('{') && u.0 != "null")
            || f.choices.iter().any(|c| {
                (self.kind == Kind::Chat && c.text.is_some())
                    || (self.kind == Kind::Completion && c.delta.is_some())
                    || c.delta.as_ref().and_then(|d| d.tool_calls.as_ref()).is_some_and(|calls| {
                        calls.iter().any(|call| call.kind.as_deref().is_some_and(|k| k != "function"))
                    })
            });
        if needs_general {
            return None;
        }
        let _ = f.object;
        for (i, raw) in [f.id, f.created, f.model, f.system_fingerprint].into_iter().enumerate() {
            let Some(raw) = raw else { continue };
            if raw.0 == "null" || self.meta_raw[i] == raw.0 {
                continue;
            }
            let v: Value = serde_json::from_str(raw.0).ok()?;
            self.meta.insert(META[i].to_owned(), v);
            self.meta_raw[i] = raw.0.to_owned();
        }
        if let Some(u) = non_null(f.usage) {
            self.usage = Some(serde_json::from_str(u.0).ok()?);
        }
        if let Some(p) = non_null(f.prompt_token_ids) {
            let mut ids = Vec::new();
            if let Err(e) = scan_id_list(p.0.as_bytes(), Some(&mut ids)) {
                return Some(Err(err("prompt_token_ids", e.to_string())));
            }
            self.prompt_token_ids = Some(ids);
        }
        for (pos, c) in f.choices.iter().enumerate() {
            if let Err(e) = self.choice_fast(pos, c) {
                return Some(Err(e));
            }
        }
        Some(Ok(()))
    }

    fn choice_fast(&mut self, pos: usize, c: &FastChoice<'_>) -> Result<(), AssembleError> {
        let index = c.index.unwrap_or(pos as u64);
        let acc = self.choices.entry(index).or_default();
        let mut generated = push(&mut acc.text, &c.text);
        if let Some(d) = &c.delta {
            if let Some(r) = &d.role {
                acc.role = Some(r.to_string());
            }
            generated |= push(&mut acc.text, &d.content);
            generated |= push(&mut acc.reasoning, &d.reasoning);
            generated |= push(&mut acc.reasoning_content, &d.reasoning_content);
            generated |= push(&mut acc.refusal, &d.refusal);
            for (k, call) in d.tool_calls.iter().flat_map(Few::iter).enumerate() {
                let slot = acc.tool_calls.entry(call.index.unwrap_or(k as u64)).or_default();
                push(&mut slot.id, &call.id);
                if let Some(f) = &call.function {
                    push(&mut slot.name, &f.name);
                    if let Some(a) = &f.arguments {
                        slot.arguments.push_str(a);
                    }
                }
                generated = true;
            }
        }
        self.finish_choice_fast(index, c, generated)
    }

    fn finish_choice_fast(&mut self, index: u64, c: &FastChoice<'_>, generated: bool) -> Result<(), AssembleError> {
        let FastChoice { logprobs, logprobs_read, finish_reason, stop_reason, token_ids, .. } = c;
        let kind = self.kind;
        let require = self.require_token_ids;
        let acc = self.choices.entry(index).or_default();
        let p = |f: &str| format!("choices[{index}].{f}");
        if let Some(lp) = non_null(*logprobs) {
            let read = logprobs_read.or_else(|| serde_json::from_str::<FastLogprobs>(lp.0).ok());
            let fast = read.filter(|f| {
                let all = [f.content, f.refusal, f.tokens, f.token_logprobs, f.text_offset, f.top_logprobs];
                all.iter().all(|v| non_null(*v).map_or(true, |r| r.0.starts_with('[')))
                    && match kind {
                        Kind::Chat => [f.tokens, f.token_logprobs, f.text_offset, f.top_logprobs]
                            .iter()
                            .all(|v| non_null(*v).is_none()),
                        Kind::Completion => non_null(f.content).is_none() && non_null(f.refusal).is_none(),
                    }
            });
            match fast {
                Some(f) => {
                    let arrays = [f.content, f.refusal, f.tokens, f.token_logprobs, f.text_offset, f.top_logprobs];
                    for (slot, items) in acc.logprobs.iter_mut().zip(arrays) {
                        if let Some(items) = non_null(items) {
                            join_array(slot.get_or_insert_with(String::new), items);
                        }
                    }
                }
                None => {
                    let lp: Value = serde_json::from_str(lp.0).map_err(|e| err(p("logprobs"), e.to_string()))?;
                    Self::logprobs(acc, kind, index, lp)?;
                }
            }
        }
        if let Some(f) = finish_reason {
            acc.finish_reason = Some(Value::from(f.as_ref()));
        }
        if let Some(s) = non_null(*stop_reason) {
            acc.stop_reason = serde_json::from_str(s.0).ok();
        }
        if generated {
            acc.generation_events += 1;
        }
        match token_ids {
            Some(raw) => {
                scan_id_list(raw.0.as_bytes(), Some(&mut acc.token_ids))
                    .map_err(|e| err(p("token_ids"), e.to_string()))?;
                self.saw_ids = true;
            }
            None if generated && require => return Err(err(p("token_ids"), "output frame carries no token_ids")),
            None => {}
        }
        Ok(())
    }

    fn logprobs(acc: &mut Choice, kind: Kind, index: u64, value: Value) -> Result<(), AssembleError> {
        let p = |f: &str| format!("choices[{index}].{f}");
        let Value::Object(lp) = value else {
            return Err(err(p("logprobs"), "must be an object"));
        };
        let names = if kind == Kind::Chat { CHAT_LOGPROBS } else { TEXT_LOGPROBS };
        for (k, v) in lp {
            let Some(name) = names.iter().find(|n| **n == k) else {
                if has_value(&v) {
                    return Err(err(p(&format!("logprobs.{k}")), "unsupported field"));
                }
                continue;
            };
            match v {
                Value::Null => {}
                Value::Array(items) => {
                    let buf = acc.logprobs[logprob_slot(name)].get_or_insert_with(String::new);
                    for item in items {
                        if !buf.is_empty() {
                            buf.push(',');
                        }
                        buf.push_str(&item.to_string());
                    }
                }
                _ => return Err(err(p(&format!("logprobs.{k}")), "must be an array")),
            }
        }
        Ok(())
    }

    fn choice(&mut self, pos: usize, c: Value) -> Result<(), AssembleError> {
        let Value::Object(c) = c else {
            return Err(err(format!("choices[{pos}]"), "must be an object"));
        };
        let index = match c.get("index") {
            None | Some(Value::Null) => pos as u64,
            Some(v) => {
                v.as_u64().ok_or_else(|| err(format!("choices[{pos}].index"), "must be a nonnegative integer"))?
            }
        };
        let kind = self.kind;
        let require = self.require_token_ids;
        let acc = self.choices.entry(index).or_default();
        let p = |f: &str| format!("choices[{index}].{f}");
        let mut generated = false;
        let mut ids_field: Option<Value> = None;
        for (key, value) in c {
            match (key.as_str(), kind) {
                ("index", _) => {}
                ("delta", Kind::Chat) => {
                    if has_value(&value) {
                        generated |= Self::delta(acc, index, value)?;
                    }
                }
                ("text", Kind::Completion) => {
                    generated |= append_str(&mut acc.text, &value, || p("text"))?;
                }
                ("logprobs", _) => {
                    if has_value(&value) {
                        Self::logprobs(acc, kind, index, value)?;
                    }
                }
                ("finish_reason", _) => {
                    if !value.is_null() {
                        if !value.is_string() {
                            return Err(err(p("finish_reason"), "must be a string"));
                        }
                        acc.finish_reason = Some(value);
                    }
                }
                // SGLang names vLLM's stop_reason `matched_stop`.
                ("stop_reason", _) | ("matched_stop", _) => {
                    if !value.is_null() {
                        acc.stop_reason = Some(value);
                    }
                }
                ("token_ids", _) => ids_field = Some(value),
                ("prompt_token_ids", _) => {
                    if has_value(&value) {
                        let mut ids = Vec::new();
                        id_list(&value, &p("prompt_token_ids"), &mut ids)?;
                        acc.prompt_token_ids = Some(ids);
                    }
                }
                _ => {
                    if has_value(&value) {
                        return Err(err(p(&key), "unsupported field"));
                    }
                }
            }
        }
        if generated {
            acc.generation_events += 1;
        }
        match ids_field {
            Some(v) if !v.is_null() || generated => {
                id_list(&v, &p("token_ids"), &mut acc.token_ids)?;
                self.saw_ids = true;
            }
            _ if generated && require => return Err(err(p("token_ids"), "output frame carries no token_ids")),
            _ => {}
        }
        Ok(())
    }

    fn delta(acc: &mut Choice, index: u64, delta: Value) -> Result<bool, AssembleError> {
        let Value::Object(delta) = delta else {
            return Err(err(format!("choices[{index}].delta"), "must be an object"));
        };
        let p = |f: &str| format!("choices[{index}].delta.{f}");
        let mut generated = false;
        for (key, value) in delta {
            match key.as_str() {
                "role" => match value {
                    Value::Null => {}
                    Value::String(s) => acc.role = Some(s),
                    _ => return Err(err(p("role"), "must be a string")),
                },
                "content" => generated |= append_str(&mut acc.text, &value, || p("content"))?,
                "reasoning" => generated |= append_str(&mut acc.reasoning, &value, || p("reasoning"))?,
                "reasoning_content" => {
                    generated |= append_str(&mut acc.reasoning_content, &value, || p("reasoning_content"))?
                }
                "refusal" => generated |= append_str(&mut acc.refusal, &value, || p("refusal"))?,
                "tool_calls" => match value {
                    Value::Null => {}
                    Value::Array(calls) => {
                        for (pos, call) in calls.into_iter().enumerate() {
                            Self::tool_call(acc, index, pos, call)?;
                            generated = true;
                        }
                    }
                    _ => return Err(err(p("tool_calls"), "must be an array")),
                },
                "function_call" => {
                    if has_value(&value) {
                        let Value::Object(fc) = value else {
                            return Err(err(p("function_call"), "must be an object"));
                        };
                        let slot = acc.function_call.get_or_insert_with(Default::default);
                        for (k, v) in fc {
                            let target = match k.as_str() {
                                "name" => &mut slot.0,
                                "arguments" => &mut slot.1,
                                _ if !has_value(&v) => continue,
                                _ => return Err(err(p(&format!("function_call.{k}")), "unsupported field")),
                            };
                            match v {
                                Value::Null => {}
                                Value::String(s) => target.push_str(&s),
                                _ => return Err(err(p(&format!("function_call.{k}")), "must be a string")),
                            }
                        }
                        generated = true;
                    }
                }
                _ => {
                    if has_value(&value) {
                        return Err(err(p(&key), "unsupported field"));
                    }
                }
            }
        }
        Ok(generated)
    }

    fn tool_call(acc: &mut Choice, index: u64, pos: usize, call: Value) -> Result<(), AssembleError> {
        let base = format!("choices[{index}].delta.tool_calls[{pos}]");
        let Value::Object(call) = call else {
            return Err(err(base, "must be an object"));
        };
        let slot_index = match call.get("index") {
            None | Some(Value::Null) => pos as u64,
            Some(v) => v.as_u64().ok_or_else(|| err(format!("{base}.index"), "must be a nonnegative integer"))?,
        };
        let slot = acc.tool_calls.entry(slot_index).or_default();
        for (k, v) in call {
            match k.as_str() {
                "index" => {}
                "id" => {
                    append_str(&mut slot.id, &v, || format!("{base}.id"))?;
                }
                "type" => match v.as_str() {
                    None if v.is_null() => {}
                    Some("function") => {}
                    _ => return Err(err(format!("{base}.type"), "only function tool calls are supported")),
                },
                "function" => {
                    if v.is_null() {
                        continue;
                    }
                    let Value::Object(f) = v else {
                        return Err(err(format!("{base}.function"), "must be an object"));
                    };
                    for (fk, fv) in f {
                        match fk.as_str() {
                            "name" => {
                                append_str(&mut slot.name, &fv, || format!("{base}.function.name"))?;
                            }
                            "arguments" => {
                                let mut args = None;
                                append_str(&mut args, &fv, || format!("{base}.function.arguments"))?;
                                if let Some(a) = args {
                                    slot.arguments.push_str(&a);
                                }
                            }
                            _ if !has_value(&fv) => {}
                            _ => return Err(err(format!("{base}.function.{fk}"), "unsupported field")),
                        }
                    }
                }
                _ => {
                    if has_value(&v) {
                        return Err(err(format!("{base}.{k}"), "unsupported field"));
                    }
                }
            }
        }
        Ok(())
    }

    /// The assembled response as JSON bytes. Without engine usage, usage is computed from
    /// `prompt_tokens` (the router's input length) and the measured output count.
    pub fn finish(&self, prompt_tokens: Option<u64>) -> Result<Vec<u8>, AssembleError> {
        if self.choices.is_empty() {
            return Err(err("choices", "engine stream carried no choices"));
        }
        let mut out = Map::new();
        for key in ["id", "created", "model", "system_fingerprint"] {
            if let Some(v) = self.meta.get(key) {
                out.insert(key.to_owned(), v.clone());
            }
        }
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        out.insert("object".to_owned(), Value::from(object));
        for (k, v) in &self.meta {
            if !out.contains_key(k) {
                out.insert(k.clone(), v.clone());
            }
        }
        let mut choices = Vec::with_capacity(self.choices.len());
        for (&index, c) in &self.choices {
            choices.push(self.render_choice(index, c)?);
        }
        out.insert("choices".to_owned(), Value::Null); // placeholder: keeps the key's place
        let usage = match &self.usage {
            Some(u) => u.clone(),
            None => {
                let completion = self.measured_output_tokens();
                // The engine's counted prompt IDs are exact; the router's estimate is the
                // last resort.
                let prompt = self.reported_prompt_tokens().or(prompt_tokens).unwrap_or(0);
                serde_json::json!({
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                })
            }
        };
        out.insert("usage".to_owned(), usage);
        if self.keep_token_ids && self.kind == Kind::Chat {
            if let Some(p) = &self.prompt_token_ids {
                out.insert("prompt_token_ids".to_owned(), Value::from(p.clone()));
            }
        }
        let mut body = Vec::with_capacity(256);
        Response { base: out, choices }.write(&mut body).map_err(|e| err("<response>", e.to_string()))?;
        Ok(body)
    }

    fn render_choice<'s>(&'s self, index: u64, c: &'s Choice) -> Result<ChoiceOut<'s>, AssembleError> {
        let mut ch = Map::new();
        ch.insert("index".to_owned(), Value::from(index));
        match self.kind {
            Kind::Chat => {
                let mut msg = Map::new();
                msg.insert("role".to_owned(), Value::from(c.role.clone().unwrap_or_else(|| "assistant".to_owned())));
                let has_calls = !c.tool_calls.is_empty() || c.function_call.is_some();
                let content = match &c.text {
                    Some(t) if !(t.is_empty() && has_calls) => Value::from(t.clone()),
                    None if !has_calls => Value::from(""),
                    _ => Value::Null,
                };
                msg.insert("content".to_owned(), content);
                for (name, v) in
                    [("reasoning", &c.reasoning), ("reasoning_content", &c.reasoning_content), ("refusal", &c.refusal)]
                {
                    if let Some(v) = v {
                        msg.insert(name.to_owned(), Value::from(v.clone()));
                    }
                }
                if !c.tool_calls.is_empty() {
                    let mut calls = Vec::with_capacity(c.tool_calls.len());
                    for (pos, call) in c.tool_calls.values().enumerate() {
                        let path = |f: &str| format!("choices[{index}].message.tool_calls[{pos}].{f}");
                        let id = call
                            .id
                            .as_deref()
                            .filter(|s| !s.is_empty())
                            .ok_or_else(|| err(path("id"), "tool call has no id"))?;
                        let name = call
                            .name
                            .as_deref()
                            .filter(|s| !s.is_empty())
                            .ok_or_else(|| err(path("function.name"), "tool call has no function name"))?;
                        calls.push(serde_json::json!({
                            "id": id,
                            "type": "function",
                            "function": {"name": name, "arguments": call.arguments},
                        }));
                    }
                    msg.insert("tool_calls".to_owned(), Value::Array(calls));
                }
                if let Some((name, args)) = &c.function_call {
                    msg.insert("function_call".to_owned(), serde_json::json!({"name": name, "arguments": args}));
                }
                ch.insert("message".to_owned(), Value::Object(msg));
            }
            Kind::Completion => {
                ch.insert("text".to_owned(), Value::from(c.text.clone().unwrap_or_default()));
            }
        }
        ch.insert("logprobs".to_owned(), Value::Null); // placeholder: keeps the key's place
        ch.insert("finish_reason".to_owned(), c.finish_reason.clone().unwrap_or(Value::Null));
        if let Some(s) = &c.stop_reason {
            ch.insert("stop_reason".to_owned(), s.clone());
        }
        if self.keep_token_ids {
            ch.insert("token_ids".to_owned(), Value::from(c.token_ids.clone()));
            if self.kind == Kind::Completion {
                if let Some(p) = &c.prompt_token_ids {
                    ch.insert("prompt_token_ids".to_owned(), Value::from(p.clone()));
                }
            }
        }
        let logprobs =
            c.logprobs.iter().any(Option::is_some).then_some(LogprobsOut { kind: self.kind, items: &c.logprobs });
        Ok(ChoiceOut { base: ch, logprobs })
    }
}
