"""LexiEngine's routes, one a module, each with its job builder (the request checked and
tokenized into a `Job`) and its writer (pieces into that route's chunks): `chat`,
`completions`, `responses`. What they share lives in `protocol` (intake) and `render`
(output state)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from narwhal.engine.config import EngineConfig
from narwhal.engine.model import Model
from narwhal.engine.protocol import Job
from narwhal.engine.routes.chat import ChatWriter, chat_job
from narwhal.engine.routes.completions import CompletionWriter, completion_job
from narwhal.engine.routes.responses import ResponsesWriter, responses_job

JobBuilder = Callable[[dict[str, Any], EngineConfig, Model], Job]

JOBS: dict[str, JobBuilder] = {
    "/v1/chat/completions": chat_job,
    "/v1/completions": completion_job,
    "/v1/responses": responses_job,
}

Writer = ChatWriter | CompletionWriter | ResponsesWriter


def writer_for(job: Job, model_id: str) -> Writer:
    if job.route == "chat":
        return ChatWriter(job, model_id)
    if job.route == "completion":
        return CompletionWriter(job, model_id)
    return ResponsesWriter(job, model_id)
