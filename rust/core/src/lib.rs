//! Narwhal's byte-level hot paths, free of any Python types.
//!
//! - [`sse`]: incremental `text/event-stream` decoding;
//! - [`frame`]: classification and token-ID validation of one OpenAI stream frame;
//! - [`json_read`]: a strict single-pass reader for frames of the common shape;
//! - [`json_scan`]: pass-through edits of frames (token-ID stripping) without re-serializing;
//! - [`assemble`]: one non-streaming response from a stream's frames;
//! - [`http1`]: incremental HTTP/1.1 response de-framing for upstream connections;
//! - [`prefix`]: chained block hashes of prompts, and per engine the blocks placed there;
//! - [`think`]: streaming reasoning/content separation with delimiter holdback;
//! - [`relay`]: per-chunk pipelines combining the above for the router;
//! - [`walk`]: the one walk over a frame's members, choices and deltas, which [`frame`]
//!   and [`assemble`] each read in their own terms.

pub mod assemble;
pub mod few;
pub mod frame;
pub mod http1;
pub mod json_read;
pub mod json_scan;
pub mod prefix;
pub mod relay;
pub mod sse;
pub mod think;
pub mod walk;
