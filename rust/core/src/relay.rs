//! Whole-chunk pipelines the router drives: one call per network chunk.
//!
//! [`Relay`] decodes, checks and re-frames a stream for a streaming client;
//! [`StreamAssembler`] decodes and assembles it for a non-streaming one.

use crate::assemble::{AssembleError, Assembler, Kind};
use crate::frame::{inspect_fast, inspect_serde, kind};
use crate::json_scan::{mentions_token_ids, strip_token_ids, strip_value_spans};
use crate::sse::{Event, SseDecoder, SseError};

/// Why a stream stopped being relayable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamFault {
    /// Stable label for counters (`missing_token_ids`, `sse_invalid_utf8`, ...).
    pub reason: &'static str,
    pub message: String,
}

fn sse_fault(e: &SseError) -> StreamFault {
    let reason = match e {
        SseError::EventTooLarge { .. } => "sse_event_too_large",
        SseError::InvalidUtf8 { .. } => "sse_invalid_utf8",
    };
    StreamFault { reason, message: e.to_string() }
}

/// What one chunk held.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChunkReport {
    /// SSE bytes to write to the client (whole events only).
    pub forward: Vec<u8>,
    pub events: u32,
    /// Events carrying generated output.
    pub generation_events: u32,
    /// Validated output token IDs in this chunk.
    pub output_tokens: u64,
    /// This chunk carried the stream's first generated output.
    pub first_output: bool,
    pub finished: bool,
    pub done: bool,
    pub engine_error: bool,
    pub prompt_ids: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Set when the stream failed in this chunk (or before); nothing after it is forwarded.
    pub fault: Option<StreamFault>,
}

impl ChunkReport {
    /// Output tokens in this chunk: validated token IDs, else one per generation event
    /// (engines that send no IDs).
    pub fn tokens(&self) -> u64 {
        if self.output_tokens > 0 {
            self.output_tokens
        } else {
            u64::from(self.generation_events)
        }
    }

    /// The chunk held nothing a caller must act on besides its bytes and tokens: no first
    /// output, prompt IDs, usage, fault or end of stream (most chunks of a stream).
    pub fn output_only(&self) -> bool {
        // An engine's error event needs the router's attention: its stream will end without
        // `[DONE]`, and that end is then the request's outcome, not a broken engine.
        !self.first_output
            && !self.done
            && !self.engine_error
            && self.fault.is_none()
            && self.prompt_ids.is_none()
            && self.prompt_tokens.is_none()
            && self.cached_tokens.is_none()
    }
}

pub struct Relay {
    decoder: SseDecoder,
    strip: bool,
    require_ids: bool,
    drop_usage: bool,
    events: Vec<Event>,
    spans: Vec<(usize, usize)>,
    scratch: Vec<u8>,
    seen_output: bool,
    fault: Option<StreamFault>,
}

fn frame_event(out: &mut Vec<u8>, ev: &Event, payload: &[u8]) {
    if let Some(name) = &ev.event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    if memchr::memchr(b'\n', payload).is_none() {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(payload);
        out.push(b'\n');
    } else {
        for line in payload.split(|&b| b == b'\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line);
            out.push(b'\n');
        }
    }
    out.push(b'\n');
}

impl Relay {
    /// `strip`: remove token-ID fields (the client did not ask for them).
    /// `require_ids`: the engine's dialect promises token IDs on every output event.
    pub fn new(strip: bool, require_ids: bool, max_event_bytes: usize) -> Self {
        Relay {
            decoder: SseDecoder::new(max_event_bytes),
            strip,
            require_ids,
            drop_usage: false,
            events: Vec::new(),
            spans: Vec::new(),
            scratch: Vec::new(),
            seen_output: false,
            fault: None,
        }
    }

    /// Read usage-only frames (for the prompt and cached-token counts) but do not forward
    /// them: the router asked the engine for usage that its client did not ask for.
    pub fn drop_usage_frames(mut self, drop: bool) -> Self {
        self.drop_usage = drop;
        self
    }

    pub fn feed(&mut self, chunk: &[u8]) -> ChunkReport {
        let mut rep = ChunkReport::default();
        if let Some(f) = &self.fault {
            rep.fault = Some(f.clone());
            return rep;
        }
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        if let Err(e) = self.decoder.feed(chunk, &mut events) {
            self.fault = Some(sse_fault(&e));
        }
        rep.forward.reserve(chunk.len() + 16);
        for ev in &events {
            rep.events += 1;
            if ev.is_done() {
                rep.done = true;
                frame_event(&mut rep.forward, ev, b"[DONE]");
                continue;
            }
            // The single-pass reader records every token-ID span, so its spans are the whole
            // edit; frames it declines go through serde, which may miss null-valued or oddly
            // written ones, so they get the scan-based check as well.
            self.spans.clear();
            let spans = self.strip.then_some(&mut self.spans);
            let (info, exact) = match inspect_fast(&ev.data, self.require_ids, None, spans) {
                Ok(i) => (i, true),
                Err(_) => {
                    let spans = self.strip.then_some(&mut self.spans);
                    match inspect_serde(&ev.data, self.require_ids, None, spans) {
                        Ok(i) => (i, false),
                        Err(e) => {
                            self.fault = Some(StreamFault { reason: e.reason(), message: e.to_string() });
                            break;
                        }
                    }
                }
            };
            let strip =
                self.strip && if exact { !self.spans.is_empty() } else { mentions_token_ids(ev.data.as_bytes()) };
            if info.kinds & kind::GENERATED != 0 {
                rep.generation_events += 1;
                if !self.seen_output {
                    self.seen_output = true;
                    rep.first_output = true;
                }
            }
            rep.output_tokens += info.output_ids;
            rep.finished |= info.kinds & kind::FINISH != 0;
            rep.engine_error |= info.kinds & kind::ERROR != 0;
            rep.prompt_ids = info.prompt_ids.or(rep.prompt_ids);
            rep.prompt_tokens = info.prompt_tokens.or(rep.prompt_tokens);
            rep.completion_tokens = info.completion_tokens.or(rep.completion_tokens);
            rep.cached_tokens = info.cached_tokens.or(rep.cached_tokens);
            if self.drop_usage && info.kinds == kind::USAGE {
                continue;
            }
            if strip {
                let body = &mut self.scratch;
                body.clear();
                let data = ev.data.as_bytes();
                let clean =
                    strip_value_spans(data, &mut self.spans, body).is_ok() && (exact || !mentions_token_ids(body));
                if !clean {
                    body.clear();
                    if strip_token_ids(data, body).is_err() {
                        self.fault =
                            Some(StreamFault { reason: "malformed_frame", message: "malformed stream frame".into() });
                        break;
                    }
                }
                frame_event(&mut rep.forward, ev, body);
            } else {
                frame_event(&mut rep.forward, ev, ev.data.as_bytes());
            }
        }
        self.decoder.recycle(&mut events);
        self.events = events;
        rep.fault = self.fault.clone();
        rep
    }

    /// Whether the engine stream ended mid-event (bytes buffered without a blank line).
    pub fn has_pending(&self) -> bool {
        self.decoder.has_pending()
    }
}

/// Decoder plus assembler: chunks in, one response out.
pub struct StreamAssembler {
    decoder: SseDecoder,
    assembler: Assembler,
    events: Vec<Event>,
    seen_output: bool,
}

impl StreamAssembler {
    pub fn new(kind: Kind, keep_token_ids: bool, require_ids: bool, max_event_bytes: usize) -> Self {
        StreamAssembler {
            decoder: SseDecoder::new(max_event_bytes),
            assembler: Assembler::new(kind, keep_token_ids, require_ids),
            events: Vec::new(),
            seen_output: false,
        }
    }

    /// Feed a chunk; returns whether it held the stream's first generated output.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<bool, AssembleError> {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let decoded = self.decoder.feed(chunk, &mut events);
        let before = self.assembler.measured_output_tokens();
        for ev in &events {
            self.assembler.feed(&ev.data)?;
        }
        self.decoder.recycle(&mut events);
        self.events = events;
        decoded.map_err(|e| AssembleError { field: "<stream>".into(), message: e.to_string() })?;
        let first = !self.seen_output && self.assembler.measured_output_tokens() > before;
        self.seen_output |= first;
        Ok(first)
    }

    pub fn is_done(&self) -> bool {
        self.assembler.is_done()
    }

    pub fn reported_prompt_tokens(&self) -> Option<u64> {
        self.assembler.reported_prompt_tokens()
    }

    pub fn measured_output_tokens(&self) -> u64 {
        self.assembler.measured_output_tokens()
    }

    pub fn reported_cached_tokens(&self) -> Option<u64> {
        self.assembler.reported_cached_tokens()
    }

    pub fn finish(&self, prompt_tokens: Option<u64>) -> Result<Vec<u8>, AssembleError> {
        self.assembler.finish(prompt_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_strips_validates_and_reports() {
        let mut r = Relay::new(true, true, 1 << 16);
        let a = r.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}],\"prompt_token_ids\":[1,2]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"h");
        assert_eq!(a.forward, b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n");
        assert_eq!(a.prompt_ids, Some(2));
        assert!(!a.first_output);
        let b = r.feed(b"i\"},\"token_ids\":[5,6]}]}\n\ndata: [DONE]\n\n");
        assert!(b.first_output && b.done);
        assert_eq!(b.output_tokens, 2);
        assert_eq!(b.forward, b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n");
    }

    #[test]
    fn usage_frames_are_read_and_dropped_when_asked() {
        let frames = b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n";
        let kept = Relay::new(false, false, 1 << 16).feed(frames);
        let mut r = Relay::new(false, false, 1 << 16).drop_usage_frames(true);
        let dropped = r.feed(frames);
        assert_eq!((dropped.cached_tokens, dropped.prompt_tokens), (Some(7), Some(9)));
        assert_eq!(kept.cached_tokens, Some(7));
        assert!(kept.forward.windows(7).any(|w| w == b"\"usage\""));
        assert_eq!(
            dropped.forward,
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"
        );
        assert!(dropped.done && dropped.events == 3);
    }

    #[test]
    fn relay_fault_stops_forwarding() {
        let mut r = Relay::new(false, true, 1 << 16);
        let rep = r.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"token_ids\":[1]}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n");
        assert_eq!(rep.events, 2);
        assert_eq!(rep.fault.as_ref().unwrap().reason, "missing_token_ids");
        assert!(!rep.done);
        assert_eq!(rep.forward, b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"token_ids\":[1]}]}\n\n");
        assert!(r.feed(b"data: {}\n\n").fault.is_some());
    }
}
