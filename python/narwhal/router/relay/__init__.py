"""Relay: one placed request's upstream call, streamed through or assembled, one mode a
module.

- `relayer`: the upstream call, the engine's refusals, the dispatch by mode;
- `reading`: what the modes use of the relayer (the bounded read, the timed-out event);
- `accounting`: a streamed answer's accounting, read by read (`StreamRelay` in Rust);
- `stream`: streamed answers, pulled read by read;
- `push`: the native relay from the connection's read callback once the first bytes are
  out, where the server's `send` allows (Granian): no Python frame per token;
- `assemble`: a non-streaming client's answer, assembled in Rust;
- `passthrough`: relayed as the engine sends it (the Responses API);
- `errors`: how an answer fails, and the error event that ends a stream.
"""
