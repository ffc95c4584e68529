//! Property tests over arbitrary bytes: no panics, bounded buffering, and results that do
//! not depend on how the stream was cut into chunks.

use narwhal_core::assemble::Kind;
use narwhal_core::relay::{Relay, StreamAssembler};
use narwhal_core::sse::SseDecoder;
use proptest::prelude::*;

fn cut(data: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for p in points {
        out.push(data[prev..p].to_vec());
        prev = p;
    }
    out.push(data[prev..].to_vec());
    out
}

fn stream_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"data: ".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(br#"{"choices":[{"index":0,"delta":{"content":"x"},"token_ids":[1]}]}"#.to_vec()),
        Just(b"[DONE]".to_vec()),
        Just(b": c".to_vec()),
        prop::collection::vec(any::<u8>(), 0..8),
    ];
    prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

proptest! {
    #[test]
    fn decoder_never_panics_and_is_split_invariant(data in stream_bytes(), cuts in prop::collection::vec(any::<usize>(), 0..6)) {
        let mut whole = SseDecoder::new(256);
        let mut a = Vec::new();
        let ra = whole.feed(&data, &mut a);
        let mut split = SseDecoder::new(256);
        let mut b = Vec::new();
        let mut rb = Ok(());
        for c in cut(&data, &cuts) {
            rb = split.feed(&c, &mut b);
            if rb.is_err() { break; }
        }
        prop_assert_eq!(ra.is_ok(), rb.is_ok());
        if ra.is_ok() { prop_assert_eq!(a, b); }
    }

    #[test]
    fn relay_and_assembler_never_panic(data in stream_bytes(), cuts in prop::collection::vec(any::<usize>(), 0..6)) {
        let mut relay = Relay::new(true, true, 256);
        let mut asm = StreamAssembler::new(Kind::Chat, true, true, 256);
        let mut forwarded = 0usize;
        for c in cut(&data, &cuts) {
            let rep = relay.feed(&c);
            forwarded += rep.forward.len();
            prop_assert!(rep.forward.len() <= c.len() * 2 + 1024);
            let _ = asm.feed(&c);
        }
        let _ = asm.finish(None);
        prop_assert!(forwarded <= data.len() * 2 + 1024);
    }
}
