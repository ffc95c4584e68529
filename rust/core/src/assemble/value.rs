//! The general path: a frame as a serde `Value`, accumulated field by field, anything the
//! assembly table does not cover refused by name.

use super::*;

impl Assembler {
    pub(super) fn logprobs(acc: &mut Choice, kind: Kind, index: u64, value: Value) -> Result<(), AssembleError> {
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

    pub(super) fn choice(&mut self, pos: usize, c: Value) -> Result<(), AssembleError> {
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
}
