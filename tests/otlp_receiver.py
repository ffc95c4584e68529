"""An OTLP/HTTP trace receiver for tests: `POST /v1/traces` bodies decoded with
`opentelemetry-proto` (what a collector does first), kept as plain spans to assert on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    service: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (2 server, 3 client)
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    error: str | None = None  # the status message of a span whose status is error


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        str(res.get("service.name", "")),
                        s.name,
                        s.kind,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {kv.key: _value(kv.value) for kv in s.attributes},
                        [
                            (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                            for e in s.events
                        ],
                        s.status.message if s.status.code == 2 else None,
                    )
                )
    return out


class Receiver:
    """Listens on 127.0.0.1 (a free port) until `close`; `url` is the collector's base URL."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    spans = decode(body)
                    with receiver._changed:
                        receiver._spans.extend(spans)
                        receiver._changed.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[Span]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, found: Callable[[list[Span]], bool], within: float = 60) -> list[Span]:
        """The spans received, once `found` holds of them (an AssertionError after
        `within` seconds: the exporter sends in batches, every few seconds)."""
        with self._changed:
            if not self._changed.wait_for(lambda: found(list(self._spans)), within):
                names = [(s.service, s.name) for s in self._spans]
                raise AssertionError(f"the spans expected did not come; received: {names}")
            return list(self._spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
