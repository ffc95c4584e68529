//! The single-pass reader against serde on generated frames, valid and broken: wherever the
//! reader answers, it answers what serde does; whatever serde refuses, the reader declines.

use narwhal_core::assemble::{Assembler, Kind};
use narwhal_core::frame::{inspect_fast, inspect_serde};
use narwhal_core::json_scan::{strip_token_ids, strip_value_spans};
use proptest::prelude::*;

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("null".to_string()),
        Just("\"\"".to_string()),
        Just("\"x\"".to_string()),
        Just(r#""a\n\"b\" \u00e9 \ud83d\ude00""#.to_string()),
        Just("[]".to_string()),
        Just("[1,2]".to_string()),
        Just("[ 3 ]".to_string()),
        Just("[true]".to_string()),
        Just("[-1]".to_string()),
        Just("[1.5]".to_string()),
        Just("7".to_string()),
        Just("-2.5e3".to_string()),
        Just("{}".to_string()),
        Just("{\"k\":[1,{\"z\":null}]}".to_string()),
        Just("false".to_string()),
    ]
}

fn members(keys: &'static [&'static str], inner: BoxedStrategy<String>) -> impl Strategy<Value = String> {
    let member =
        (prop::sample::select(keys), prop_oneof![3 => value(), 2 => inner]).prop_map(|(k, v)| format!("\"{k}\":{v}"));
    (prop::collection::vec(member, 0..6), prop::sample::select(&[",", " , ", ",\n"][..]))
        .prop_map(|(m, sep)| format!("{{{}}}", m.join(sep)))
}

fn frame() -> impl Strategy<Value = String> {
    let function = members(&["name", "arguments", "extra"], value().boxed()).boxed();
    let call = members(&["index", "id", "type", "function"], function).boxed();
    let calls = prop::collection::vec(call, 0..3).prop_map(|c| format!("[{}]", c.join(","))).boxed();
    let delta = members(
        &["role", "content", "reasoning", "reasoning_content", "refusal", "tool_calls", "function_call", "audio"],
        calls,
    )
    .boxed();
    let logprobs =
        members(&["content", "refusal", "tokens", "token_logprobs", "text_offset", "top_logprobs"], value().boxed())
            .boxed();
    let choice_inner = prop_oneof![delta, logprobs].boxed();
    let choice = members(
        &[
            "index",
            "delta",
            "text",
            "finish_reason",
            "stop_reason",
            "token_ids",
            "prompt_token_ids",
            "logprobs",
            "matched_stop",
        ],
        choice_inner,
    )
    .boxed();
    let choices = prop::collection::vec(choice, 0..3).prop_map(|c| format!("[{}]", c.join(","))).boxed();
    let usage =
        members(&["prompt_tokens", "completion_tokens", "prompt_tokens_details", "cached_tokens"], value().boxed())
            .boxed();
    let inner = prop_oneof![choices, usage].boxed();
    members(
        &[
            "id",
            "object",
            "created",
            "model",
            "system_fingerprint",
            "choices",
            "usage",
            "prompt_token_ids",
            "error",
            "extra",
        ],
        inner,
    )
}

fn text() -> impl Strategy<Value = String> {
    prop::sample::select(&["\"\"", "\"hi\"", "\" w\\u00f6rld\\n\"", "\"\\\"q\\\"\"", "null"][..])
        .prop_map(str::to_string)
}

/// Optional members with values of the right type: frames the assembler accepts.
fn obj(members: Vec<Option<(&'static str, String)>>) -> String {
    let m: Vec<String> = members.into_iter().flatten().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", m.join(","))
}

fn good_frame() -> impl Strategy<Value = String> {
    let call = (prop::option::of(0u8..2), prop::option::of(text()), prop::option::of(text()), prop::option::of(text()))
        .prop_map(|(i, id, name, args)| {
            let function = obj(vec![name.map(|n| ("name", n)), args.map(|a| ("arguments", a))]);
            obj(vec![
                i.map(|i| ("index", i.to_string())),
                id.map(|v| ("id", v)),
                Some(("type", "\"function\"".into())),
                Some(("function", function)),
            ])
        });
    let delta = (
        prop::option::of(text()),
        prop::option::of(text()),
        prop::option::of(text()),
        prop::option::of(prop::collection::vec(call, 0..2)),
    )
        .prop_map(|(role, content, reasoning, calls)| {
            obj(vec![
                role.map(|r| ("role", r)),
                content.map(|c| ("content", c)),
                reasoning.map(|r| ("reasoning_content", r)),
                calls.map(|c| ("tool_calls", format!("[{}]", c.join(",")))),
            ])
        });
    let logprobs = prop::sample::select(
        &[
            "null",
            "{\"content\":[{\"token\":\"a\",\"logprob\":-0.5}]}",
            "{\"content\":null,\"refusal\":[]}",
            "{\"tokens\":[\"a\"],\"token_logprobs\":[-1.0],\"text_offset\":[0],\"top_logprobs\":[{\"a\":-1.0}]}",
        ][..],
    );
    let choice = (
        prop::option::of(0u8..2),
        prop::option::of(delta),
        prop::option::of(text()),
        prop::option::of(prop::sample::select(&["null", "\"stop\"", "\"length\""][..])),
        prop::option::of(prop::sample::select(&["[]", "[5]", "[1, 2]", "null"][..])),
        prop::option::of(logprobs),
        prop::option::of(prop::sample::select(&["null", "\"</s>\"", "7"][..])),
    )
        .prop_map(|(i, d, t, f, ids, lp, stop)| {
            obj(vec![
                i.map(|i| ("index", i.to_string())),
                d.map(|d| ("delta", d)),
                t.map(|t| ("text", t)),
                f.map(|f| ("finish_reason", f.to_string())),
                ids.map(|v| ("token_ids", v.to_string())),
                lp.map(|v| ("logprobs", v.to_string())),
                stop.map(|v| ("stop_reason", v.to_string())),
            ])
        });
    (
        prop::collection::vec(choice, 0..3),
        prop::option::of(prop::sample::select(&["null", "{\"prompt_tokens\":3,\"completion_tokens\":2}"][..])),
        prop::option::of(prop::sample::select(&["[1,2,3]", "null"][..])),
        prop::option::of(prop::sample::select(&["\"main\"", "null"][..])),
    )
        .prop_map(|(choices, usage, prompt, model)| {
            obj(vec![
                Some(("id", "\"c-1\"".into())),
                Some(("created", "1700000000".into())),
                model.map(|m| ("model", m.to_string())),
                Some(("choices", format!("[{}]", choices.join(",")))),
                usage.map(|u| ("usage", u.to_string())),
                prompt.map(|p| ("prompt_token_ids", p.to_string())),
            ])
        })
}

/// A frame (of either generator), sometimes with one byte changed or cut short.
fn maybe_broken() -> impl Strategy<Value = String> {
    (prop_oneof![frame(), good_frame()], any::<u8>(), any::<usize>(), 0u8..4).prop_map(|(f, byte, at, how)| {
        let mut b = f.into_bytes();
        let at = at % (b.len() + 1);
        match how {
            0 if at < b.len() => b[at] = byte & 0x7f,
            1 => b.truncate(at),
            _ => {}
        }
        String::from_utf8(b).unwrap_or_default()
    })
}

fn assembled(frames: &[String], kind: Kind, reader: bool) -> Result<Vec<u8>, String> {
    let mut a = Assembler::new(kind, true, false);
    for f in frames {
        let r = if reader { a.feed(f) } else { a.feed_without_reader(f) };
        r.map_err(|e| e.to_string())?;
    }
    a.finish(None).map_err(|e| e.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn inspection_agrees_with_serde(data in maybe_broken(), require in any::<bool>()) {
        let mut fast_ids = Vec::new();
        let mut spans = Vec::new();
        let fast = inspect_fast(&data, require, Some(&mut fast_ids), Some(&mut spans));
        let mut slow_ids = Vec::new();
        let slow = inspect_serde(&data, require, Some(&mut slow_ids), None);
        match fast {
            Ok(info) => {
                prop_assert_eq!(Ok(info), slow);
                prop_assert_eq!(fast_ids, slow_ids);
                // The reader's spans are a complete edit: same result as the byte scanner.
                let mut a = Vec::new();
                let mut b = Vec::new();
                if strip_value_spans(data.as_bytes(), &mut spans, &mut a).is_ok() {
                    strip_token_ids(data.as_bytes(), &mut b).unwrap();
                    // (Values skipped as raw may hold lone surrogates that `Value` refuses.)
                    // Both refused is agreement: the two edits may lay out the rest
                    // differently, so an error's column need not match.
                    let av = serde_json::from_slice::<serde_json::Value>(&a).ok();
                    let bv = serde_json::from_slice::<serde_json::Value>(&b).ok();
                    prop_assert_eq!(av, bv);
                }
            }
            Err(_) => prop_assert!(fast_ids.is_empty() && spans.is_empty()),
        }
    }

    #[test]
    fn assembly_agrees_with_serde(frames in prop::collection::vec(maybe_broken(), 1..4), chat in any::<bool>()) {
        let kind = if chat { Kind::Chat } else { Kind::Completion };
        prop_assert_eq!(assembled(&frames, kind, true), assembled(&frames, kind, false));
    }
}

/// Frames whose typed parse fails (`choices: null`) take the general path without the
/// reader and the fast path with it: empty values must read alike on both (proptest found
/// `prompt_token_ids: {}` an error on one and nothing on the other).
#[test]
fn empty_values_read_alike_on_both_paths() {
    let first =
        r#"{"choices":[{"text":"a","index":0,"token_ids":[1]}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
    for second in [
        r#"{"choices":null,"usage":{}}"#,
        r#"{"choices":[],"usage":{}}"#,
        r#"{"choices":null,"usage":[]}"#,
        r#"{"choices":null,"prompt_token_ids":[]}"#,
        r#"{"choices":null,"prompt_token_ids":{}}"#,
        r#"{"choices":null,"model":{}}"#,
    ] {
        let frames = [first.to_owned(), second.to_owned()];
        for kind in [Kind::Chat, Kind::Completion] {
            assert_eq!(assembled(&frames, kind, true), assembled(&frames, kind, false), "{second}");
        }
    }
    // An empty usage keeps the one before it.
    let frames = [first.to_owned(), r#"{"choices":[],"usage":{}}"#.to_owned()];
    let out = assembled(&frames, Kind::Completion, true).unwrap();
    assert!(String::from_utf8(out).unwrap().contains(r#""prompt_tokens":3"#));
}

#[test]
fn generator_reaches_the_fast_paths() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut read, mut assembled_fast) = (0, 0);
    for _ in 0..2000 {
        let data = maybe_broken().new_tree(&mut runner).unwrap().current();
        read += usize::from(inspect_fast(&data, false, None, None).is_ok());
        let frames = [data];
        assembled_fast += usize::from(assembled(&frames, Kind::Chat, true).is_ok());
    }
    eprintln!("inspect fast ok: {read}/2000, assembled ok: {assembled_fast}/2000");
    // Both outcomes must be well represented, or the properties above test little.
    assert!((200..1800).contains(&read), "{read}");
    assert!((100..1900).contains(&assembled_fast), "{assembled_fast}");
}
