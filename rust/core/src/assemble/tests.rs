use super::*;

fn assemble(kind: Kind, frames: &[&str]) -> Result<Value, AssembleError> {
    let mut a = Assembler::new(kind, false, false);
    for f in frames {
        a.feed(f)?;
    }
    Ok(serde_json::from_slice(&a.finish(Some(5))?).unwrap())
}

#[test]
fn chat_fields_concatenate_and_finish_survives_usage_frame() {
    let v = assemble(
        Kind::Chat,
        &[
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"th"}}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"reasoning_content":"ink","content":"he"}}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop","stop_reason":7}]}"#,
            r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#,
            "[DONE]",
        ],
    )
    .unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "hello");
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "think");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], 7);
    assert_eq!(v["usage"]["total_tokens"], 8);
}

#[test]
fn tool_calls_grouped_by_index_in_order() {
    let v = assemble(
        Kind::Chat,
        &[
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"id":"b","type":"function","function":{"name":"g","arguments":""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"{\"x\""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}},{"index":1,"function":{"arguments":"{}"}}]}}]}"#,
        ],
    )
    .unwrap();
    let calls = &v["choices"][0]["message"]["tool_calls"];
    assert_eq!(calls[0]["id"], "a");
    assert_eq!(calls[0]["function"]["arguments"], "{\"x\":1}");
    assert_eq!(calls[1]["function"]["name"], "g");
    assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
}

#[test]
fn tool_call_without_id_is_an_error() {
    let e = assemble(Kind::Chat, &[r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]}}]}"#])
        .unwrap_err();
    assert_eq!(e.field, "choices[0].message.tool_calls[0].id");
}

#[test]
fn unsupported_fields_with_values_are_named() {
    let e = assemble(Kind::Chat, &[r#"{"choices":[{"delta":{"audio":{"data":"x"}}}]}"#]).unwrap_err();
    assert_eq!(e.field, "choices[0].delta.audio");
    let ok = assemble(Kind::Chat, &[r#"{"choices":[{"delta":{"content":"x","audio":null,"annotations":[]}}]}"#]);
    assert!(ok.is_ok());
    let e = assemble(Kind::Chat, &[r#"{"choices":[{"delta":{"content":5}}]}"#]).unwrap_err();
    assert_eq!(e.field, "choices[0].delta.content");
    let e = assemble(
        Kind::Chat,
        &[r#"{"choices":[{"delta":{"tool_calls":[{"id":"a","type":"custom","custom":{"input":"x"}}]}}]}"#],
    )
    .unwrap_err();
    assert_eq!(e.field, "choices[0].delta.tool_calls[0].type");
}

#[test]
fn completion_logprobs_concatenate_and_usage_is_computed() {
    let v = assemble(
        Kind::Completion,
        &[
            r#"{"id":"t","choices":[{"index":0,"text":"a","logprobs":{"tokens":["a"],"token_logprobs":[-0.1],"text_offset":[0],"top_logprobs":[{"a":-0.1}]}}]}"#,
            r#"{"id":"t","choices":[{"index":0,"text":"b","logprobs":{"tokens":["b"],"token_logprobs":[-0.2],"text_offset":[1],"top_logprobs":[{"b":-0.2}]},"finish_reason":"length"}]}"#,
        ],
    )
    .unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "ab");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], serde_json::json!(["a", "b"]));
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"], serde_json::json!([0, 1]));
    assert_eq!(v["usage"], serde_json::json!({"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}));
}

#[test]
fn token_ids_kept_when_asked_and_required_when_configured() {
    let mut a = Assembler::new(Kind::Chat, true, true);
    a.feed(r#"{"prompt_token_ids":[1,2],"choices":[{"delta":{"role":"assistant"}}]}"#).unwrap();
    a.feed(r#"{"choices":[{"delta":{"content":"x"},"token_ids":[9,10]}]}"#).unwrap();
    let v: Value = serde_json::from_slice(&a.finish(None).unwrap()).unwrap();
    assert_eq!(v["choices"][0]["token_ids"], serde_json::json!([9, 10]));
    assert_eq!(v["prompt_token_ids"], serde_json::json!([1, 2]));
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(a.reported_prompt_tokens(), Some(2));
    // No usage from the engine: the counted prompt IDs win over the router's estimate.
    let v: Value = serde_json::from_slice(&a.finish(Some(5)).unwrap()).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    let e = a.feed(r#"{"choices":[{"delta":{"content":"y"}}]}"#).unwrap_err();
    assert_eq!(e.field, "choices[0].token_ids");
    let e = a.feed(r#"{"choices":[{"delta":{"content":"y"},"token_ids":[true]}]}"#).unwrap_err();
    assert_eq!(e.message, "token_ids[0] is a Boolean");
}
