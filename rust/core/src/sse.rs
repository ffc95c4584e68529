//! Incremental decoder for `text/event-stream` (WHATWG HTML, "Server-sent events").
//!
//! Bytes arrive in arbitrary network chunks; lines may end in LF, CR or CRLF and a CRLF may
//! be split across two chunks. Lines are validated as UTF-8 only once complete, so a chunk
//! boundary inside a multi-byte character is harmless. Memory is bounded by `max_event_bytes`:
//! a line or an event's data growing past it is an error, never an unbounded buffer.

use std::fmt;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The `event:` field, `None` for the default type ("message").
    pub event: Option<String>,
    /// The joined `data:` lines, without the final newline.
    pub data: String,
    /// The last event ID seen on the stream so far (it persists across events).
    pub id: Option<String>,
    /// A `retry:` value given inside this event's block.
    pub retry: Option<u64>,
}

impl Event {
    /// The OpenAI end-of-stream sentinel.
    pub fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseError {
    /// A line or an event's data exceeded the configured maximum.
    EventTooLarge { limit: usize },
    /// A line was not valid UTF-8; `offset` counts bytes from the stream's start.
    InvalidUtf8 { offset: u64 },
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SseError::EventTooLarge { limit } => {
                write!(f, "event-stream event exceeds {limit} bytes")
            }
            SseError::InvalidUtf8 { offset } => {
                write!(f, "event stream is not valid UTF-8 at byte offset {offset}")
            }
        }
    }
}

impl std::error::Error for SseError {}

pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

#[derive(Debug)]
pub struct SseDecoder {
    /// Bytes of a line that has not ended yet.
    partial: Vec<u8>,
    /// Stream offset of `partial[0]`.
    partial_start: u64,
    /// Stream offset of the next byte to be fed.
    fed: u64,
    data: String,
    event: String,
    last_id: Option<String>,
    retry: Option<u64>,
    max_event_bytes: usize,
    /// The previous chunk ended in CR: a LF opening the next one belongs to it.
    skip_lf: bool,
    first_line: bool,
    failed: Option<SseError>,
    /// Spent data buffers handed back by the caller, reused for the next events.
    spare: Vec<String>,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseDecoder {
    pub fn new(max_event_bytes: usize) -> Self {
        SseDecoder {
            partial: Vec::new(),
            partial_start: 0,
            fed: 0,
            data: String::new(),
            event: String::new(),
            last_id: None,
            retry: None,
            max_event_bytes,
            skip_lf: false,
            first_line: true,
            failed: None,
            spare: Vec::new(),
        }
    }

    /// Feed one chunk; complete events are appended to `out`.
    ///
    /// After an error the decoder stays failed: later calls return the same error.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let result = self.feed_inner(chunk, out);
        if let Err(err) = &result {
            self.failed = Some(err.clone());
        }
        result
    }

    fn feed_inner(&mut self, chunk: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        let base = self.fed;
        self.fed += chunk.len() as u64;
        let mut i = 0;
        if self.skip_lf && !chunk.is_empty() {
            self.skip_lf = false;
            if chunk[0] == b'\n' {
                i = 1;
            }
        }
        while i < chunk.len() {
            let Some(p) = memchr::memchr2(b'\r', b'\n', &chunk[i..]) else {
                if self.partial.is_empty() {
                    self.partial_start = base + i as u64;
                }
                self.partial.extend_from_slice(&chunk[i..]);
                if self.partial.len() + self.data.len() > self.max_event_bytes {
                    return Err(SseError::EventTooLarge { limit: self.max_event_bytes });
                }
                break;
            };
            let end = i + p;
            if self.partial.is_empty() {
                self.line(&chunk[i..end], base + i as u64, out)?;
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(&chunk[i..end]);
                let start = self.partial_start;
                self.line(&line, start, out)?;
                line.clear();
                self.partial = line;
            }
            i = end + 1;
            if chunk[end] == b'\r' {
                if i < chunk.len() {
                    if chunk[i] == b'\n' {
                        i += 1;
                    }
                } else {
                    self.skip_lf = true;
                }
            }
        }
        Ok(())
    }

    /// Hand back events the caller is done with: their buffers serve the next events, so a
    /// steady stream decodes without allocating.
    pub fn recycle(&mut self, events: &mut Vec<Event>) {
        for ev in events.drain(..) {
            if self.spare.len() < 64 {
                let mut s = ev.data;
                s.clear();
                self.spare.push(s);
            }
        }
    }

    /// Whether bytes of an unfinished line or event are buffered.
    pub fn has_pending(&self) -> bool {
        !self.partial.is_empty() || !self.data.is_empty()
    }

    fn line(&mut self, mut raw: &[u8], mut offset: u64, out: &mut Vec<Event>) -> Result<(), SseError> {
        // The same bound as for a buffered partial line, so the outcome never depends on
        // where the chunks were cut.
        if raw.len() + self.data.len() > self.max_event_bytes {
            return Err(SseError::EventTooLarge { limit: self.max_event_bytes });
        }
        if self.first_line {
            self.first_line = false;
            if raw.starts_with(&[0xEF, 0xBB, 0xBF]) {
                raw = &raw[3..];
                offset += 3;
            }
        }
        let line =
            std::str::from_utf8(raw).map_err(|e| SseError::InvalidUtf8 { offset: offset + e.valid_up_to() as u64 })?;
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        if line.starts_with(':') {
            return Ok(());
        }
        let (field, value) = match line.find(':') {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.data.len() + value.len() + 1 > self.max_event_bytes {
                    return Err(SseError::EventTooLarge { limit: self.max_event_bytes });
                }
                self.data.push_str(value);
                self.data.push('\n');
            }
            "event" => {
                self.event.clear();
                self.event.push_str(value);
            }
            "id" if !value.contains('\0') => self.last_id = Some(value.to_owned()),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                self.retry = value.parse().ok();
            }
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self, out: &mut Vec<Event>) {
        let retry = self.retry.take();
        if self.data.is_empty() {
            self.event.clear();
            return;
        }
        self.data.pop();
        let event = if self.event.is_empty() { None } else { Some(std::mem::take(&mut self.event)) };
        out.push(Event {
            event,
            data: std::mem::replace(&mut self.data, self.spare.pop().unwrap_or_default()),
            id: self.last_id.clone(),
            retry,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(chunks: &[&[u8]]) -> Result<Vec<Event>, SseError> {
        let mut d = SseDecoder::new(1024);
        let mut out = Vec::new();
        for c in chunks {
            d.feed(c, &mut out)?;
        }
        Ok(out)
    }

    fn datas(events: &[Event]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn line_endings_all_work() {
        let ev = decode(&[b"data: a\n\ndata: b\r\rdata: c\r\n\r\n"]).unwrap();
        assert_eq!(datas(&ev), ["a", "b", "c"]);
    }

    #[test]
    fn crlf_split_across_chunks_is_one_line_end() {
        let ev = decode(&[b"data: a\r", b"\ndata: b\r", b"\n\r\n"]).unwrap();
        assert_eq!(datas(&ev), ["a\nb"]);
    }

    #[test]
    fn multi_line_data_and_fields() {
        let ev = decode(&[b"event: delta\nid: 7\nretry: 300\ndata: x\ndata:y\n: comment\n\n"]).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].data, "x\ny");
        assert_eq!(ev[0].event.as_deref(), Some("delta"));
        assert_eq!(ev[0].id.as_deref(), Some("7"));
        assert_eq!(ev[0].retry, Some(300));
    }

    #[test]
    fn bom_is_stripped_even_when_split() {
        let ev = decode(&[b"\xEF", b"\xBB\xBFdata: ok\n\n"]).unwrap();
        assert_eq!(datas(&ev), ["ok"]);
    }

    #[test]
    fn utf8_split_inside_character() {
        let s = "data: h\u{e9}llo \u{1F600}\n\n".as_bytes();
        for cut in 0..s.len() {
            let ev = decode(&[&s[..cut], &s[cut..]]).unwrap();
            assert_eq!(datas(&ev), ["h\u{e9}llo \u{1F600}"]);
        }
    }

    #[test]
    fn invalid_utf8_names_offset() {
        let err = decode(&[b"data: ok\n\ndata: b", b"ad\xFF\n\n"]).unwrap_err();
        assert_eq!(err, SseError::InvalidUtf8 { offset: 19 });
    }

    #[test]
    fn done_sentinel() {
        let ev = decode(&[b"data: [DONE]\n\n"]).unwrap();
        assert!(ev[0].is_done());
    }

    #[test]
    fn oversized_event_is_an_error_and_sticks() {
        let big = vec![b'x'; 2000];
        let mut d = SseDecoder::new(1024);
        let mut out = Vec::new();
        assert!(d.feed(b"data: ", &mut out).is_ok());
        assert_eq!(d.feed(&big, &mut out), Err(SseError::EventTooLarge { limit: 1024 }));
        assert!(d.feed(b"\n\n", &mut out).is_err());
    }

    #[test]
    fn oversized_multi_line_data_is_an_error() {
        let line = format!("data: {}\n", "y".repeat(600));
        let err = decode(&[line.as_bytes(), line.as_bytes()]).unwrap_err();
        assert_eq!(err, SseError::EventTooLarge { limit: 1024 });
    }

    #[test]
    fn empty_data_block_dispatches_nothing() {
        let ev = decode(&[b"event: x\n\ndata\n\n"]).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].data, "");
        assert_eq!(ev[0].event, None);
    }
}
