//! Thin PyO3 bindings: `narwhal._native`. Policy stays in Python; every call here takes a
//! whole network chunk (or a whole text delta) so the boundary is crossed once per chunk.

use narwhal_core::assemble::Kind;
use narwhal_core::relay::{ChunkReport, Relay, StreamAssembler};
use narwhal_core::sse::{SseDecoder as CoreDecoder, DEFAULT_MAX_EVENT_BYTES};
use narwhal_core::think::ThinkSplitter as CoreSplitter;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

mod prefix;
mod upstream;

create_exception!(_native, SseError, PyValueError, "The event stream is malformed.");
create_exception!(
    _native,
    AssemblyError,
    PyValueError,
    "The engine stream cannot be assembled; `.field` names the offending field."
);

/// One dispatched server-sent event.
#[pyclass(frozen, get_all, module = "narwhal._native")]
struct SseEvent {
    event: Option<String>,
    data: String,
    id: Option<String>,
    retry: Option<u64>,
}

#[pymethods]
impl SseEvent {
    /// Whether this is the `[DONE]` sentinel.
    #[getter]
    fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }

    fn __repr__(&self) -> String {
        format!("SseEvent(event={:?}, data={:?}, id={:?})", self.event, self.data, self.id)
    }
}

/// Incremental WHATWG event-stream decoder.
#[pyclass(module = "narwhal._native")]
struct SseDecoder {
    inner: CoreDecoder,
}

#[pymethods]
impl SseDecoder {
    #[new]
    #[pyo3(signature = (max_event_bytes = DEFAULT_MAX_EVENT_BYTES))]
    fn new(max_event_bytes: usize) -> Self {
        SseDecoder { inner: CoreDecoder::new(max_event_bytes) }
    }

    /// Decode one chunk; returns the events it completed.
    fn feed(&mut self, chunk: &[u8]) -> PyResult<Vec<SseEvent>> {
        let mut out = Vec::new();
        self.inner.feed(chunk, &mut out).map_err(|e| SseError::new_err(e.to_string()))?;
        Ok(out.into_iter().map(|e| SseEvent { event: e.event, data: e.data, id: e.id, retry: e.retry }).collect())
    }

    /// Whether an unfinished line or event is buffered.
    #[getter]
    fn has_pending(&self) -> bool {
        self.inner.has_pending()
    }
}

/// What one relayed chunk held.
#[pyclass(frozen, get_all, module = "narwhal._native")]
struct RelayChunk {
    forward: Py<PyBytes>,
    events: u32,
    generation_events: u32,
    output_tokens: u64,
    first_output: bool,
    finished: bool,
    done: bool,
    engine_error: bool,
    prompt_ids: Option<u64>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    fault_reason: Option<&'static str>,
    fault_message: Option<String>,
}

impl RelayChunk {
    fn from_report(py: Python<'_>, r: ChunkReport) -> Self {
        let (fault_reason, fault_message) = match r.fault {
            Some(f) => (Some(f.reason), Some(f.message)),
            None => (None, None),
        };
        RelayChunk {
            forward: PyBytes::new(py, &r.forward).unbind(),
            events: r.events,
            generation_events: r.generation_events,
            output_tokens: r.output_tokens,
            first_output: r.first_output,
            finished: r.finished,
            done: r.done,
            engine_error: r.engine_error,
            prompt_ids: r.prompt_ids,
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.completion_tokens,
            cached_tokens: r.cached_tokens,
            fault_reason,
            fault_message,
        }
    }
}

/// Streaming relay: decode, validate token IDs, strip them if asked, re-frame.
#[pyclass(module = "narwhal._native")]
struct StreamRelay {
    inner: Relay,
    counted: u64,
}

impl StreamRelay {
    /// Relay one body chunk, counting its tokens.
    fn relay(&mut self, chunk: &[u8]) -> ChunkReport {
        let report = self.inner.feed(chunk);
        self.counted += report.tokens();
        report
    }
}

#[pymethods]
impl StreamRelay {
    #[new]
    #[pyo3(signature = (strip_token_ids, require_token_ids, drop_usage = false, max_event_bytes = DEFAULT_MAX_EVENT_BYTES))]
    fn new(strip_token_ids: bool, require_token_ids: bool, drop_usage: bool, max_event_bytes: usize) -> Self {
        let inner = Relay::new(strip_token_ids, require_token_ids, max_event_bytes).drop_usage_frames(drop_usage);
        StreamRelay { inner, counted: 0 }
    }

    fn feed(&mut self, py: Python<'_>, chunk: &[u8]) -> RelayChunk {
        RelayChunk::from_report(py, self.relay(chunk))
    }

    /// `feed` for the per-read hot path: just the bytes to forward when the chunk held
    /// nothing but output (no first output, prompt IDs, usage, fault or end of stream),
    /// else the whole `RelayChunk`. Called once per token on an idle router, where every
    /// object and attribute touched is a cache miss, so the common case is one object.
    fn push(&mut self, py: Python<'_>, chunk: &[u8]) -> PyResult<Py<PyAny>> {
        let r = self.relay(chunk);
        if r.output_only() {
            Ok(PyBytes::new(py, &r.forward).into_any().unbind())
        } else {
            Ok(Py::new(py, RelayChunk::from_report(py, r))?.into_any())
        }
    }

    /// Output tokens relayed so far (`ChunkReport::tokens` summed over the chunks).
    #[getter]
    fn counted(&self) -> u64 {
        self.counted
    }

    /// Whether the stream ended mid-event.
    #[getter]
    fn has_pending(&self) -> bool {
        self.inner.has_pending()
    }
}

fn parse_kind(kind: &str) -> PyResult<Kind> {
    match kind {
        "chat" => Ok(Kind::Chat),
        "completion" => Ok(Kind::Completion),
        _ => Err(PyValueError::new_err("kind must be 'chat' or 'completion'")),
    }
}

fn assembly_err(py: Python<'_>, e: narwhal_core::assemble::AssembleError) -> PyErr {
    let err = AssemblyError::new_err(e.to_string());
    // Attaching the field cannot fail on a fresh exception instance.
    let _ = err.value(py).setattr("field", e.field);
    err
}

/// Non-streaming assembler over an engine's SSE stream.
#[pyclass(module = "narwhal._native")]
struct Assembler {
    inner: StreamAssembler,
}

#[pymethods]
impl Assembler {
    #[new]
    #[pyo3(signature = (kind, keep_token_ids = false, require_token_ids = false, max_event_bytes = DEFAULT_MAX_EVENT_BYTES))]
    fn new(kind: &str, keep_token_ids: bool, require_token_ids: bool, max_event_bytes: usize) -> PyResult<Self> {
        Ok(Assembler {
            inner: StreamAssembler::new(parse_kind(kind)?, keep_token_ids, require_token_ids, max_event_bytes),
        })
    }

    /// Feed one network chunk; returns whether it carried the first generated output.
    fn feed(&mut self, py: Python<'_>, chunk: &[u8]) -> PyResult<bool> {
        self.inner.feed(chunk).map_err(|e| assembly_err(py, e))
    }

    #[getter]
    fn done(&self) -> bool {
        self.inner.is_done()
    }

    #[getter]
    fn reported_prompt_tokens(&self) -> Option<u64> {
        self.inner.reported_prompt_tokens()
    }

    #[getter]
    fn measured_output_tokens(&self) -> u64 {
        self.inner.measured_output_tokens()
    }

    #[getter]
    fn reported_cached_tokens(&self) -> Option<u64> {
        self.inner.reported_cached_tokens()
    }

    /// The response as JSON bytes; `prompt_tokens` sizes usage when the engine sent none.
    #[pyo3(signature = (prompt_tokens = None))]
    fn finish<'py>(&self, py: Python<'py>, prompt_tokens: Option<u64>) -> PyResult<Bound<'py, PyBytes>> {
        let body = self.inner.finish(prompt_tokens).map_err(|e| assembly_err(py, e))?;
        Ok(PyBytes::new(py, &body))
    }
}

/// Streaming reasoning/content splitter with delimiter holdback.
#[pyclass(module = "narwhal._native")]
struct ThinkSplitter {
    inner: CoreSplitter,
}

#[pymethods]
impl ThinkSplitter {
    #[new]
    #[pyo3(signature = (pairs = None, start_in_reasoning = false, answer_headers = None))]
    fn new(
        pairs: Option<Vec<(String, String)>>,
        start_in_reasoning: bool,
        answer_headers: Option<Vec<String>>,
    ) -> Self {
        let inner = CoreSplitter::new(pairs.unwrap_or_default(), start_in_reasoning);
        ThinkSplitter { inner: inner.with_answer_headers(answer_headers.unwrap_or_default()) }
    }

    /// Split one text delta into `(reasoning, content)`. A delta that goes wholly to one
    /// side comes back as the same string object, uncopied.
    fn feed<'py>(&mut self, text: Bound<'py, PyString>) -> PyResult<(Bound<'py, PyString>, Bound<'py, PyString>)> {
        let py = text.py();
        let s = text.to_str()?;
        Ok(match self.inner.passes_whole(s) {
            Some(true) => (text, PyString::new(py, "")),
            Some(false) => (PyString::new(py, ""), text),
            None => {
                let (r, c) = self.inner.feed(s);
                (PyString::new(py, &r), PyString::new(py, &c))
            }
        })
    }

    /// Flush held-back text at the end of generation.
    fn finish(&mut self) -> (String, String) {
        self.inner.finish()
    }

    #[getter]
    fn opened(&self) -> bool {
        self.inner.opened()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed()
    }

    #[getter]
    fn in_reasoning(&self) -> bool {
        self.inner.in_reasoning()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SseError", py.get_type::<SseError>())?;
    m.add("AssemblyError", py.get_type::<AssemblyError>())?;
    m.add("HttpError", py.get_type::<upstream::HttpError>())?;
    m.add_class::<SseEvent>()?;
    m.add_class::<SseDecoder>()?;
    m.add_class::<RelayChunk>()?;
    m.add_class::<StreamRelay>()?;
    m.add_class::<Assembler>()?;
    m.add_class::<ThinkSplitter>()?;
    m.add_class::<prefix::PromptBlocks>()?;
    m.add_class::<prefix::PrefixMap>()?;
    m.add_class::<upstream::ResponseDecoder>()?;
    m.add_class::<upstream::UpstreamReader>()?;
    Ok(())
}
