//! Any body, framed in any chunk sizes and delivered in any splits, comes out whole; bytes
//! cut short never come out as a complete response.

use narwhal_core::http1::ResponseDecoder;
use proptest::prelude::*;

fn encode(body: &[u8], sizes: &[usize], ext: bool) -> Vec<u8> {
    let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    let mut rest = body;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes[i % sizes.len()].clamp(1, rest.len());
        i += 1;
        out.extend_from_slice(format!("{n:x}").as_bytes());
        if ext && i % 2 == 0 {
            out.extend_from_slice(b";name=value");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&rest[..n]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[n..];
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

fn run(wire: &[u8], cuts: &[usize]) -> (ResponseDecoder, Vec<u8>) {
    let mut d = ResponseDecoder::new();
    let mut body = Vec::new();
    let mut at = 0;
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    points.sort_unstable();
    points.push(wire.len());
    for p in points {
        d.feed(&wire[at..p], &mut body).unwrap();
        at = p;
    }
    (d, body)
}

proptest! {
    #[test]
    fn any_framing_and_split_gives_the_body(
        body in prop::collection::vec(any::<u8>(), 0..600),
        sizes in prop::collection::vec(1usize..300, 1..6),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        ext in any::<bool>(),
    ) {
        let wire = encode(&body, &sizes, ext);
        let (d, got) = run(&wire, &cuts);
        prop_assert!(d.complete());
        prop_assert!(d.keep_alive);
        prop_assert_eq!(d.status, 200);
        prop_assert_eq!(got, body);
    }

    #[test]
    fn a_cut_short_response_is_never_complete(
        body in prop::collection::vec(any::<u8>(), 1..300),
        sizes in prop::collection::vec(1usize..100, 1..4),
        cut in any::<usize>(),
    ) {
        let wire = encode(&body, &sizes, false);
        let end = cut % wire.len();
        let (mut d, got) = run(&wire[..end], &[]);
        prop_assert!(!d.complete());
        prop_assert!(body.starts_with(&got));
        prop_assert!(d.eof().is_err());
    }
}
