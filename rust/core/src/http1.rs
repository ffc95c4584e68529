//! Incremental HTTP/1.1 response decoding for the router's upstream connections.
//!
//! Engines answer a streaming request with one chunked response whose chunks are usually
//! one SSE frame each. Decoding that framing in Python costs a few calls per chunk, i.e.
//! per token; here a whole network read is de-framed in one pass and the body bytes come
//! out contiguous, ready for the SSE relay.
//!
//! Scope is what a client of an inference engine meets: a status line, header fields
//! (only the framing ones and `content-type` are kept), `1xx` interim responses skipped,
//! then a body framed by `transfer-encoding: chunked`, `content-length`, or the connection
//! closing. Limits bound memory: the head, a chunk-size line and each trailer line.

use std::fmt;

/// Largest response head (status line and header fields) accepted.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest chunk-size line (with extensions) or trailer line accepted.
const MAX_LINE_BYTES: usize = 8 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpError(pub String);

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HttpError {}

fn err<T>(msg: impl Into<String>) -> Result<T, HttpError> {
    Err(HttpError(msg.into()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Reading hex digits of a chunk size (`value` so far, `digits` seen).
    Size {
        value: u64,
        digits: u8,
    },
    /// After the size: extensions or whitespace up to the line end.
    SizeRest {
        value: u64,
        cr: bool,
    },
    Data(u64),
    /// The CRLF that ends a chunk's data (`cr`: the CR was seen).
    DataEnd {
        cr: bool,
    },
    /// Trailer lines after the last chunk; an empty line ends the message.
    Trailer {
        line: usize,
        cr: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Chunked(Chunk),
    Length(u64),
    UntilClose,
    Done,
    Failed,
}

/// One response's decoder. Feed it what the socket delivers, in any splits.
#[derive(Debug)]
pub struct ResponseDecoder {
    state: State,
    head: Vec<u8>,
    /// Status of the final (non-1xx) response; 0 until its head is complete.
    pub status: u16,
    pub content_type: Option<String>,
    /// The final response's `Retry-After`, passed on with an engine's refusal.
    pub retry_after: Option<String>,
    /// Whether the connection may carry another request once this response is complete.
    pub keep_alive: bool,
    line: usize,
}

impl Default for ResponseDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl ResponseDecoder {
    pub fn new() -> Self {
        Self {
            state: State::Head,
            head: Vec::new(),
            status: 0,
            content_type: None,
            retry_after: None,
            keep_alive: false,
            line: 0,
        }
    }

    /// The final response's head was read and is well formed (a malformed head leaves the
    /// decoder failed with no status: there is nothing to hand on).
    pub fn head_done(&self) -> bool {
        self.status != 0
    }

    /// The whole response (head, body, trailers) has been read.
    pub fn complete(&self) -> bool {
        self.state == State::Done
    }

    /// Decode `input`, appending body bytes to `body`. Bytes after a complete response are
    /// dropped and make the connection not reusable: the router never pipelines requests.
    pub fn feed(&mut self, mut input: &[u8], body: &mut Vec<u8>) -> Result<(), HttpError> {
        let r = (|| {
            while !input.is_empty() {
                input = match self.state {
                    State::Head => self.head_bytes(input)?,
                    State::Chunked(c) => self.chunked(c, input, body)?,
                    State::Length(n) => {
                        let take = n.min(input.len() as u64) as usize;
                        body.extend_from_slice(&input[..take]);
                        self.state = if n == take as u64 { State::Done } else { State::Length(n - take as u64) };
                        &input[take..]
                    }
                    State::UntilClose => {
                        body.extend_from_slice(input);
                        &[]
                    }
                    State::Done => {
                        // Bytes after a complete response (the router never pipelines): the
                        // response stands, but the connection cannot be trusted again.
                        self.keep_alive = false;
                        &[]
                    }
                    State::Failed => return err("the response was already malformed"),
                };
            }
            Ok(())
        })();
        if r.is_err() {
            self.state = State::Failed;
        }
        r
    }

    /// The connection closed. Completes a close-delimited body; anything else unfinished
    /// is an error.
    pub fn eof(&mut self) -> Result<(), HttpError> {
        match self.state {
            State::Done => Ok(()),
            State::UntilClose => {
                self.state = State::Done;
                Ok(())
            }
            State::Head => err("the connection closed before the response head"),
            _ => {
                self.state = State::Failed;
                err("the connection closed in the middle of the response body")
            }
        }
    }

    fn head_bytes<'a>(&mut self, input: &'a [u8]) -> Result<&'a [u8], HttpError> {
        // The blank line may straddle reads: search from just before the new bytes.
        let from = self.head.len().saturating_sub(3);
        let had = self.head.len();
        let room = MAX_HEAD_BYTES + 4 - had.min(MAX_HEAD_BYTES + 4);
        self.head.extend_from_slice(&input[..input.len().min(room)]);
        let Some(end) = find_head_end(&self.head[from..]).map(|e| e + from) else {
            if self.head.len() > MAX_HEAD_BYTES {
                return err(format!("the response head is over {MAX_HEAD_BYTES} bytes"));
            }
            return Ok(&[]);
        };
        let head = std::mem::take(&mut self.head);
        self.parse_head(&head[..end])?;
        Ok(&input[end - had..])
    }

    fn parse_head(&mut self, head: &[u8]) -> Result<(), HttpError> {
        let text = std::str::from_utf8(head).map_err(|_| HttpError("the response head is not UTF-8".into()))?;
        let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
        let status_line = lines.next().unwrap_or("");
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or("");
        let http10 = match version {
            "HTTP/1.1" => false,
            "HTTP/1.0" => true,
            _ => return err(format!("not an HTTP/1.x status line: {:?}", truncate(status_line))),
        };
        let code = parts.next().unwrap_or("");
        let status: u16 = match code.parse() {
            Ok(s) if code.len() == 3 && (100..600).contains(&s) => s,
            _ => return err(format!("bad status code {:?}", truncate(code))),
        };
        let mut chunked = false;
        let mut length: Option<u64> = None;
        let mut close = http10;
        let mut content_type = None;
        let mut retry_after = None;
        for line in lines.filter(|l| !l.is_empty()) {
            let Some((name, value)) = line.split_once(':') else {
                return err(format!("bad header line {:?}", truncate(line)));
            };
            if name.is_empty() || name.ends_with([' ', '\t']) {
                return err(format!("bad header name {:?}", truncate(name)));
            }
            let value = value.trim_matches([' ', '\t']);
            if name.eq_ignore_ascii_case("transfer-encoding") {
                // Only the last coding frames the body; anything but chunked there is
                // read until close (RFC 9112 §6.3).
                let last = value.rsplit(',').next().unwrap_or("").trim();
                chunked = last.eq_ignore_ascii_case("chunked");
                close |= !chunked;
            } else if name.eq_ignore_ascii_case("content-length") {
                let n: u64 = match value.parse() {
                    Ok(n) if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => n,
                    _ => return err(format!("bad content-length {:?}", truncate(value))),
                };
                if length.is_some_and(|m| m != n) {
                    return err("conflicting content-length fields");
                }
                length = Some(n);
            } else if name.eq_ignore_ascii_case("connection") {
                for token in value.split(',').map(str::trim) {
                    if token.eq_ignore_ascii_case("close") {
                        close = true;
                    } else if http10 && token.eq_ignore_ascii_case("keep-alive") {
                        close = false;
                    }
                }
            } else if name.eq_ignore_ascii_case("content-type") {
                content_type = Some(value.to_owned());
            } else if name.eq_ignore_ascii_case("retry-after") {
                retry_after = Some(value.to_owned());
            }
        }
        if (100..200).contains(&status) {
            if status == 101 {
                return err("the engine switched protocols");
            }
            return Ok(()); // interim response: the real head follows
        }
        self.status = status;
        self.content_type = content_type;
        self.retry_after = retry_after;
        self.state = if status == 204 || status == 304 {
            State::Done
        } else if chunked {
            // A length beside chunked framing may be a smuggling attempt: never reuse.
            close |= length.is_some();
            State::Chunked(Chunk::Size { value: 0, digits: 0 })
        } else if let Some(n) = length {
            if n == 0 {
                State::Done
            } else {
                State::Length(n)
            }
        } else {
            close = true;
            State::UntilClose
        };
        self.keep_alive = !close;
        Ok(())
    }

    fn chunked<'a>(&mut self, mut c: Chunk, mut input: &'a [u8], body: &mut Vec<u8>) -> Result<&'a [u8], HttpError> {
        while let Some((&b, rest)) = input.split_first() {
            if let Chunk::Data(n) = c {
                let take = n.min(input.len() as u64) as usize;
                body.extend_from_slice(&input[..take]);
                input = &input[take..];
                c = if n == take as u64 { Chunk::DataEnd { cr: false } } else { Chunk::Data(n - take as u64) };
                continue;
            }
            input = rest;
            self.line += 1;
            if self.line > MAX_LINE_BYTES {
                return err(format!("a chunk-size or trailer line is over {MAX_LINE_BYTES} bytes"));
            }
            c = match c {
                Chunk::Size { value, digits } => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        if digits == 16 {
                            return err("chunk size too large");
                        }
                        let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                        Chunk::Size { value: value << 4 | d, digits: digits + 1 }
                    }
                    _ if digits == 0 => return err(format!("bad chunk size byte {b:#04x}")),
                    b'\r' => Chunk::SizeRest { value, cr: true },
                    b'\n' => self.size_line_end(value),
                    b';' | b' ' | b'\t' => Chunk::SizeRest { value, cr: false },
                    _ => return err(format!("bad chunk size byte {b:#04x}")),
                },
                Chunk::SizeRest { value, cr } => match b {
                    b'\n' => self.size_line_end(value),
                    _ if cr => return err("CR without LF after a chunk size"),
                    b'\r' => Chunk::SizeRest { value, cr: true },
                    // Chunk extensions are allowed and ignored.
                    _ => Chunk::SizeRest { value, cr: false },
                },
                Chunk::DataEnd { cr } => match b {
                    b'\n' => {
                        self.line = 0;
                        Chunk::Size { value: 0, digits: 0 }
                    }
                    b'\r' if !cr => Chunk::DataEnd { cr: true },
                    _ => return err("chunk data longer than its size"),
                },
                Chunk::Trailer { line, cr } => match b {
                    b'\n' if line == 0 => {
                        self.state = State::Done;
                        return Ok(input);
                    }
                    b'\n' => {
                        self.line = 0;
                        Chunk::Trailer { line: 0, cr: false }
                    }
                    _ if cr => return err("CR without LF in the trailer"),
                    b'\r' => Chunk::Trailer { line, cr: true },
                    _ => Chunk::Trailer { line: line + 1, cr: false },
                },
                Chunk::Data(_) => unreachable!("handled above"),
            };
        }
        self.state = State::Chunked(c);
        Ok(input)
    }

    fn size_line_end(&mut self, value: u64) -> Chunk {
        self.line = 0;
        if value == 0 {
            Chunk::Trailer { line: 0, cr: false }
        } else {
            Chunk::Data(value)
        }
    }
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    // CRLF CRLF, or bare LF LF from lenient servers; returns the index after it.
    let mut i = 0;
    while let Some(p) = buf[i..].iter().position(|&b| b == b'\n') {
        let at = i + p;
        let next = &buf[at + 1..];
        if next.first() == Some(&b'\n') {
            return Some(at + 2);
        }
        if next.starts_with(b"\r\n") {
            return Some(at + 3);
        }
        i = at + 1;
    }
    None
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(60) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(parts: &[&[u8]]) -> (ResponseDecoder, Vec<u8>, Result<(), HttpError>) {
        let mut d = ResponseDecoder::new();
        let mut body = Vec::new();
        for p in parts {
            if let Err(e) = d.feed(p, &mut body) {
                return (d, body, Err(e));
            }
        }
        (d, body, Ok(()))
    }

    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";

    #[test]
    fn chunked_in_one_read_and_byte_by_byte() {
        let (d, body, r) = decode(&[CHUNKED]);
        r.unwrap();
        assert_eq!(body, b"hello, world");
        assert!(d.complete() && d.keep_alive);
        assert_eq!(d.status, 200);
        assert_eq!(d.content_type.as_deref(), Some("text/event-stream"));
        let bytes: Vec<&[u8]> = CHUNKED.chunks(1).collect();
        let (d, body, r) = decode(&bytes);
        r.unwrap();
        assert_eq!(body, b"hello, world");
        assert!(d.complete());
    }

    #[test]
    fn content_length_and_close_delimited() {
        let (d, body, r) =
            decode(&[b"HTTP/1.1 400 Bad\r\ncontent-length: 4\r\ncontent-type: application/json\r\n\r\n{}", b"{}"]);
        r.unwrap();
        assert_eq!((d.status, body.as_slice(), d.complete(), d.keep_alive), (400, &b"{}{}"[..], true, true));
        assert_eq!(d.retry_after, None);
        let (d, _, _) = decode(&[b"HTTP/1.1 429 Busy\r\nRetry-After: 1\r\ncontent-length: 0\r\n\r\n"]);
        assert_eq!(d.retry_after.as_deref(), Some("1"));
        let (mut d, body, r) = decode(&[b"HTTP/1.0 200 OK\r\n\r\nab", b"cd"]);
        r.unwrap();
        assert!(!d.complete() && !d.keep_alive);
        d.eof().unwrap();
        assert!(d.complete());
        assert_eq!(body, b"abcd");
    }

    #[test]
    fn interim_responses_are_skipped() {
        let (d, body, r) = decode(&[b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]);
        r.unwrap();
        assert_eq!((d.status, body.as_slice()), (200, &b"ok"[..]));
    }

    #[test]
    fn connection_close_and_smuggling_shapes_are_not_reused() {
        let (d, ..) = decode(&[b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 0\r\n\r\n"]);
        assert!(d.complete() && !d.keep_alive);
        let (d, ..) = decode(&[b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"]);
        assert!(d.complete() && !d.keep_alive);
    }

    #[test]
    fn malformed_responses_are_errors() {
        for bad in [
            &b"HTTP/2 200 OK\r\n\r\n"[..],
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n11111111111111111\r\n",
        ] {
            let (_, _, r) = decode(&[bad]);
            assert!(r.is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let mut d = ResponseDecoder::new();
        let mut body = Vec::new();
        d.feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", &mut body).unwrap();
        assert!(d.eof().is_err());
        let huge = vec![b'a'; MAX_HEAD_BYTES + 10];
        let (_, _, r) = decode(&[b"HTTP/1.1 200 OK\r\nx: ", &huge]);
        assert!(r.is_err());
    }

    #[test]
    fn bytes_after_a_complete_response_keep_it_but_not_the_connection() {
        let (d, body, r) = decode(&[b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nab", b"junk"]);
        r.unwrap();
        assert_eq!(body, b"a");
        assert!(d.complete() && !d.keep_alive);
    }

    #[test]
    fn a_malformed_head_is_never_a_head() {
        // The caller hands the status on once the head is done: a failed head must not
        // look done (status 0 reached the ASGI server, which panicked on it).
        for bad in [
            &b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n\r\n"[..],
            b"HTTP/1.1 20 OK\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nx-bad: \xff\xfe\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        ] {
            let (d, _, r) = decode(&[bad]);
            assert!(r.is_err() && !d.head_done() && d.status == 0, "{:?}", String::from_utf8_lossy(bad));
        }
        let (d, _, r) = decode(&[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"]);
        assert!(r.is_err() && d.head_done() && d.status == 200); // the body failed, not the head
    }
}
