"""Straightforward pure-Python references for the Rust hot paths: the oracles of the
differential tests and the baselines of the benchmarks. Clarity over speed, on purpose."""

from __future__ import annotations

from typing import Any

import orjson


class SseError(ValueError):
    pass


class RefSseDecoder:
    def __init__(self, max_event_bytes: int = 4 * 1024 * 1024) -> None:
        self.buf = b""
        self.offset = 0  # stream offset of buf[0]
        self.first = True
        self.skip_lf = False
        self.data: list[str] = []
        self.data_len = 0
        self.event = ""
        self.last_id: str | None = None
        self.max = max_event_bytes

    def feed(self, chunk: bytes) -> list[tuple[str | None, str, str | None]]:
        out: list[tuple[str | None, str, str | None]] = []
        if self.skip_lf and chunk:
            self.skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                self.offset += 1
        self.buf += chunk
        while True:
            cut = [i for i in (self.buf.find(b"\r"), self.buf.find(b"\n")) if i >= 0]
            if not cut:
                if len(self.buf) + self.data_len > self.max:
                    raise SseError("too large")
                return out
            i = min(cut)
            line, sep = self.buf[:i], self.buf[i : i + 1]
            start = self.offset
            rest = i + 1
            if sep == b"\r":
                if len(self.buf) > i + 1:
                    if self.buf[i + 1 : i + 2] == b"\n":
                        rest += 1
                else:
                    self.skip_lf = True
            self.buf = self.buf[rest:]
            self.offset += rest
            if self.first:
                self.first = False
                if line.startswith(b"\xef\xbb\xbf"):
                    line, start = line[3:], start + 3
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SseError(f"invalid UTF-8 at {start + e.start}") from None
            self._line(text, out)

    def _line(self, line: str, out: list[tuple[str | None, str, str | None]]) -> None:
        if line == "":
            if self.data:
                out.append((self.event or None, "\n".join(self.data), self.last_id))
            self.data, self.data_len, self.event = [], 0, ""
            return
        if line.startswith(":"):
            return
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self.data_len += len(value.encode()) + 1
            if self.data_len > self.max:
                raise SseError("too large")
            self.data.append(value)
        elif field == "event":
            self.event = value
        elif field == "id" and "\0" not in value:
            self.last_id = value


GENERATED = ("content", "reasoning", "reasoning_content", "refusal", "tool_calls", "function_call")


def _carries(v: Any) -> bool:
    return v is not None and v != "" and v != []


def check_ids(v: Any) -> int:
    if not isinstance(v, list):
        raise ValueError("token_ids is not a list")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError("bad token id")
    return len(v)


def ref_relay_event(data: str, strip: bool, require_ids: bool) -> tuple[bytes, int, bool]:
    """(forwarded payload, validated output IDs, generated?) for one event; raises on a fault."""
    if data == "[DONE]":
        return b"[DONE]", 0, False
    frame = orjson.loads(data)
    if not isinstance(frame, dict):
        raise ValueError("not an object")
    n = 0
    generated_any = False
    for c in frame.get("choices") or []:
        d = c.get("delta") or {}
        gen = any(_carries(d.get(k)) for k in GENERATED) or _carries(c.get("text"))
        generated_any |= gen
        ids = c.get("token_ids")
        if ids is not None or (gen and "token_ids" in c):
            n += check_ids(ids)
        elif gen and require_ids:
            raise ValueError("missing token_ids")
    if frame.get("prompt_token_ids") is not None:
        check_ids(frame["prompt_token_ids"])
    if not strip or b"token_ids" not in data.encode():
        return data.encode(), n, generated_any
    frame.pop("prompt_token_ids", None)
    for c in frame.get("choices") or []:
        c.pop("token_ids", None)
        c.pop("prompt_token_ids", None)
    return orjson.dumps(frame), n, generated_any


def ref_assemble(frames: list[str], kind: str) -> dict[str, Any]:
    """Concatenate a stream's frames into one response (the spec's assembly table)."""
    meta: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for data in frames:
        if data == "[DONE]":
            continue
        f = orjson.loads(data)
        for k in ("id", "created", "model", "system_fingerprint"):
            if f.get(k) is not None:
                meta[k] = f[k]
        if f.get("usage"):
            usage = f["usage"]
        for pos, c in enumerate(f.get("choices") or []):
            idx = c.get("index", pos)
            acc = choices.setdefault(
                idx, {"text": None, "calls": {}, "extra": {}, "lp": {}, "finish": None, "n": 0}
            )
            if c.get("finish_reason") is not None:
                acc["finish"] = c["finish_reason"]
            for k, v in (c.get("logprobs") or {}).items():
                if v is not None:
                    acc["lp"].setdefault(k, []).extend(v)
            parts = c.get("delta") or {} if kind == "chat" else {"content": c.get("text")}
            gen = False
            for k in ("content", "reasoning", "reasoning_content", "refusal"):
                v = parts.get(k)
                if isinstance(v, str):
                    if k == "content":
                        acc["text"] = (acc["text"] or "") + v
                    else:
                        acc["extra"][k] = acc["extra"].get(k, "") + v
                    gen |= v != ""
            for p2, tc in enumerate(parts.get("tool_calls") or []):
                slot = acc["calls"].setdefault(
                    tc.get("index", p2), {"id": "", "name": "", "arguments": ""}
                )
                slot["id"] += tc.get("id") or ""
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
                gen = True
            acc["n"] += gen
    out_choices = []
    for idx in sorted(choices):
        acc = choices[idx]
        ch: dict[str, Any] = {"index": idx}
        if kind == "chat":
            msg: dict[str, Any] = {"role": "assistant"}
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for _, c in sorted(acc["calls"].items())
            ]
            msg["content"] = acc["text"] if acc["text"] or not calls else None
            if acc["text"] is None and not calls:
                msg["content"] = ""
            msg.update(acc["extra"])
            if calls:
                msg["tool_calls"] = calls
            ch["message"] = msg
            ch["logprobs"] = acc["lp"] or None
        else:
            ch["text"] = acc["text"] or ""
            ch["logprobs"] = acc["lp"] or None
        ch["finish_reason"] = acc["finish"]
        out_choices.append(ch)
    n = sum(a["n"] for a in choices.values())
    return {
        **meta,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "choices": out_choices,
        "usage": usage or {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n},
    }


class RefThinkSplitter:
    def __init__(
        self, open_: str = "<think>", close: str = "</think>", start_in_reasoning: bool = False
    ) -> None:
        self.open, self.close = open_, close
        self.text = ""
        self.start_in = start_in_reasoning

    def split_all(self) -> tuple[str, str]:
        """Reference answer on the whole text at once."""
        t = self.text
        if self.start_in:
            body = t
        else:
            s = t.lstrip()
            if not s.startswith(self.open):
                return "", t
            body = s[len(self.open) :]
        if self.close in body:
            r, _, c = body.partition(self.close)
            return r, c.lstrip()
        return body, ""
