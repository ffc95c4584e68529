//! The assembled response: usage settled, each choice rendered for `write`.

use super::*;

impl Assembler {
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
