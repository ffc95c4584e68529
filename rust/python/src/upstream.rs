//! The receive side of an upstream (router -> engine) connection: HTTP/1.1 de-framing of
//! whole socket reads and, while a stream is relayed, the per-read relay itself.

use narwhal_core::http1::ResponseDecoder as CoreResponse;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyType};
use pyo3::{PyTraverseError, PyVisit};

use super::{RelayChunk, StreamRelay};

create_exception!(_native, HttpError, PyValueError, "The engine's HTTP/1.1 response is malformed.");

/// Incremental HTTP/1.1 response decoder for one upstream exchange: whole socket reads in
/// (straight from the receive buffer), de-framed body bytes out.
#[pyclass(module = "narwhal._native")]
pub(crate) struct ResponseDecoder {
    inner: CoreResponse,
    body: Vec<u8>,
}

impl ResponseDecoder {
    /// De-frame one read into `self.body`.
    fn decode(&mut self, data: &[u8]) -> Result<(), String> {
        self.body.clear();
        self.inner.feed(data, &mut self.body).map_err(|e| e.0)
    }
}

#[pymethods]
impl ResponseDecoder {
    #[new]
    fn new() -> Self {
        ResponseDecoder { inner: CoreResponse::new(), body: Vec::new() }
    }

    /// Decode one socket read, the first `n` bytes of a receive buffer the socket filled in
    /// place (`asyncio.BufferedProtocol`); returns the body bytes it carried (often empty
    /// before the head is complete). Raises `HttpError` on a malformed response.
    fn feed_buffer<'py>(
        &mut self,
        py: Python<'py>,
        buf: &Bound<'py, PyByteArray>,
        n: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        // SAFETY: no Python code runs while the slice is borrowed, so the bytearray
        // cannot be resized or freed under it.
        let data = unsafe { buf.as_bytes() };
        let data = data.get(..n).ok_or_else(|| PyValueError::new_err("n is past the buffer's end"))?;
        self.decode(data).map_err(HttpError::new_err)?;
        Ok(PyBytes::new(py, &self.body))
    }

    /// The connection closed: completes a close-delimited body, else raises `HttpError`.
    fn eof(&mut self) -> PyResult<()> {
        self.inner.eof().map_err(|e| HttpError::new_err(e.0))
    }

    /// The final response's status line and header fields have been read.
    #[getter]
    fn head_done(&self) -> bool {
        self.inner.head_done()
    }

    /// The final response's status code (0 until its head is read).
    #[getter]
    fn status(&self) -> u16 {
        self.inner.status
    }

    #[getter]
    fn content_type(&self) -> Option<&str> {
        self.inner.content_type.as_deref()
    }

    /// The final response's `Retry-After`, if it had one.
    #[getter]
    fn retry_after(&self) -> Option<&str> {
        self.inner.retry_after.as_deref()
    }

    /// The whole response, body and trailers included, has been read.
    #[getter]
    fn complete(&self) -> bool {
        self.inner.complete()
    }

    /// Whether the connection may carry another request once the response is complete.
    #[getter]
    fn keep_alive(&self) -> bool {
        self.inner.keep_alive
    }
}

/// Where a relayed stream's reads go.
struct Relaying {
    relay: Py<StreamRelay>,
    send: Py<PyAny>,
    on_report: Py<PyAny>,
    /// The type of what `send` returns when it sent at once (Granian's empty awaitable).
    sent_type: Py<PyType>,
}

/// One upstream connection's receive side, installed as its asyncio protocol's
/// `get_buffer` and `buffer_updated`: the event loop reads the socket into `buffer` and
/// calls straight into Rust.
///
/// Every read is de-framed by the connection's `decoder`; its body goes to `on_body`
/// (Python) — except while a stream is relayed (`start_relay`), when a read that holds
/// nothing but output is relayed and handed to the ASGI `send` here, with no Python frame
/// at all. That is the path of nearly every token, and on an idle router each Python
/// frame it used to run was a string of cache misses. Anything else a relayed read holds
/// (first output, usage, the end, a fault) goes to `on_report` as a `RelayChunk`, and an
/// exception `send` raised goes there too. So does a send that did not go at once (its
/// result is not of `sent_type`: Granian's channel to the client was full): the relay
/// stops at once, and the awaitable goes to `on_report`, which must see it through before
/// anything else is sent, or a later send would overtake it. `on_fault` gets the message of a malformed
/// response, or None for bytes on a connection with no exchange.
#[pyclass(module = "narwhal._native")]
pub(crate) struct UpstreamReader {
    buffer: Py<PyByteArray>,
    #[pyo3(get, set)]
    decoder: Option<Py<ResponseDecoder>>,
    /// None once the garbage collector cleared the reader (its connection is gone).
    callbacks: Option<Callbacks>,
    relaying: Option<Relaying>,
    /// Reads so far: a watchdog that sees it unchanged knows the engine went quiet, without
    /// a Python call per read.
    #[pyo3(get)]
    reads: u64,
}

/// The connection's own read and fault handlers: bound methods of the connection, which in
/// turn holds this reader. The cycle is collectable because the reader tells the garbage
/// collector about them (`__traverse__`); without that, every closed connection stayed
/// alive with its read buffer.
struct Callbacks {
    on_body: Py<PyAny>,
    on_fault: Py<PyAny>,
}

/// What one read came to, with the callbacks it leads to. Decided with the reader's
/// borrows held; the callbacks run after they are released (one may set a new decoder or
/// stop the relay).
enum Read {
    /// Nothing to call.
    Nothing,
    /// `on_fault(message)`.
    Fault(Py<PyAny>, Option<String>),
    /// `on_body(body)`.
    Body(Py<PyAny>, Py<PyBytes>),
    /// `send` the bytes, or `on_report` the chunk; then `on_body(b"")` (`end`) if the
    /// response is complete.
    Relayed {
        send: Option<(Py<PyAny>, Py<PyBytes>, Py<PyType>)>,
        report: Option<RelayChunk>,
        on_report: Py<PyAny>,
        end: Option<Py<PyAny>>,
    },
}

#[pymethods]
impl UpstreamReader {
    #[new]
    fn new(py: Python<'_>, size: usize, on_body: Py<PyAny>, on_fault: Py<PyAny>) -> Self {
        UpstreamReader {
            buffer: PyByteArray::new_with(py, size, |_| Ok(())).expect("a zeroed bytearray").unbind(),
            decoder: None,
            callbacks: Some(Callbacks { on_body, on_fault }),
            relaying: None,
            reads: 0,
        }
    }

    /// The buffer the next read fills (`asyncio.BufferedProtocol.get_buffer`); the buffer
    /// is one fixed size, whatever the loop hints.
    #[pyo3(signature = (sizehint))]
    #[allow(unused_variables)]
    fn get_buffer(&self, py: Python<'_>, sizehint: isize) -> Py<PyByteArray> {
        self.buffer.clone_ref(py)
    }

    /// Relay reads through `relay` to the ASGI `send` from now on; reports that need the
    /// router's attention go to `on_report`.
    fn start_relay(&mut self, relay: Py<StreamRelay>, send: Py<PyAny>, on_report: Py<PyAny>, sent_type: Py<PyType>) {
        self.relaying = Some(Relaying { relay, send, on_report, sent_type });
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.buffer)?;
        if let Some(d) = &self.decoder {
            visit.call(d)?;
        }
        if let Some(c) = &self.callbacks {
            visit.call(&c.on_body)?;
            visit.call(&c.on_fault)?;
        }
        if let Some(r) = &self.relaying {
            visit.call(&r.relay)?;
            visit.call(&r.send)?;
            visit.call(&r.on_report)?;
            visit.call(&r.sent_type)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.decoder = None;
        self.callbacks = None;
        self.relaying = None;
    }

    /// Back to handing every body to `on_body`.
    fn stop_relay(&mut self) {
        self.relaying = None;
    }

    /// `nbytes` were read into the buffer (`asyncio.BufferedProtocol.buffer_updated`).
    fn buffer_updated(slf: &Bound<'_, Self>, nbytes: usize) -> PyResult<()> {
        let py = slf.py();
        slf.borrow_mut().reads += 1;
        let read = slf.borrow().read(py, nbytes)?;
        match read {
            Read::Nothing => {}
            Read::Fault(on_fault, message) => {
                on_fault.call1(py, (message,))?;
            }
            Read::Body(on_body, body) => {
                on_body.call1(py, (body,))?;
            }
            Read::Relayed { send, report, on_report, end } => {
                if let Some((send, forward, sent_type)) = send {
                    let message = PyDict::new(py);
                    message.set_item(intern!(py, "type"), intern!(py, "http.response.body"))?;
                    message.set_item(intern!(py, "body"), forward)?;
                    message.set_item(intern!(py, "more_body"), true)?;
                    // Granian's `send` does its work in the call and returns an empty
                    // awaitable, unless its channel to the client is full. A client that
                    // went away raises here: the router decides.
                    match send.call1(py, (message,)) {
                        Err(e) => {
                            on_report.call1(py, (e.into_value(py),))?;
                            return Ok(());
                        }
                        Ok(sent) if !sent.bind(py).get_type().is(sent_type.bind(py)) => {
                            // Not sent yet: nothing may pass it, so the rest goes by Python.
                            slf.borrow_mut().relaying = None;
                            on_report.call1(py, (sent,))?;
                        }
                        Ok(_) => {}
                    }
                }
                if let Some(chunk) = report {
                    on_report.call1(py, (Py::new(py, chunk)?,))?;
                }
                if let Some(on_body) = end {
                    on_body.call1(py, (PyBytes::new(py, b""),))?;
                }
            }
        }
        Ok(())
    }
}

impl UpstreamReader {
    fn read(&self, py: Python<'_>, n: usize) -> PyResult<Read> {
        let Some(cb) = &self.callbacks else {
            return Ok(Read::Nothing); // cleared: the connection is being collected
        };
        let Some(decoder) = &self.decoder else {
            return Ok(Read::Fault(cb.on_fault.clone_ref(py), None));
        };
        let mut d = decoder.borrow_mut(py);
        {
            let buffer = self.buffer.bind(py);
            // SAFETY: no Python code runs while the slice is borrowed, so the bytearray
            // cannot be resized or freed under it.
            let data = unsafe { buffer.as_bytes() };
            let data = data.get(..n).ok_or_else(|| PyValueError::new_err("n is past the buffer's end"))?;
            if let Err(message) = d.decode(data) {
                return Ok(Read::Fault(cb.on_fault.clone_ref(py), Some(message)));
            }
        }
        let Some(r) = &self.relaying else {
            return Ok(Read::Body(cb.on_body.clone_ref(py), PyBytes::new(py, &d.body).unbind()));
        };
        // An empty body is framing only (a chunk-size line, the last chunk): nothing to relay.
        let (send, report) = if d.body.is_empty() {
            (None, None)
        } else {
            let report = r.relay.borrow_mut(py).relay(&d.body);
            if !report.output_only() {
                (None, Some(RelayChunk::from_report(py, report)))
            } else if report.forward.is_empty() {
                (None, None)
            } else {
                (
                    Some((r.send.clone_ref(py), PyBytes::new(py, &report.forward).unbind(), r.sent_type.clone_ref(py))),
                    None,
                )
            }
        };
        let end = d.inner.complete().then(|| cb.on_body.clone_ref(py));
        Ok(Read::Relayed { send, report, on_report: r.on_report.clone_ref(py), end })
    }
}
