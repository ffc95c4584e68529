//! The fast path: a frame of the common shape, read borrowed in one pass (`read`),
//! accumulated without building a `Value`; `None` hands the frame to the general path.

use super::*;

impl Assembler {
    /// Returns `None` when the frame needs the general path (nothing was changed then).
    pub(super) fn feed_fast(&mut self, f: &FastFrame<'_>) -> Option<Result<(), AssembleError>> {
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
            // An empty usage says nothing: the last one that said something stands, as on
            // the general path.
            let v: Value = serde_json::from_str(u.0).ok()?;
            if has_value(&v) {
                self.usage = Some(v);
            }
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
}
