"""A request on its way in. `RequestGate` (ASGI middleware) sees every HTTP request first: arrival
stamp, metrics by endpoint, API key, body size. `read_job` turns a validated generation body
(protocol.py) into what the backend takes: the model and token budget checked, the prompt tokenized,
the sampling settings built (`Job`)."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from starshard.server import protocol as P
from starshard.server.backend import Backend, QueueFull, SamplingConfig, ServiceUnavailable
from starshard.server.errors import ApiError, backend_error, error_response
from starshard.server.metrics import ServerMetrics
from starshard.server.settings import ServerSettings

log = logging.getLogger("starshard.server")

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class RequestGate:
    """Every HTTP request passes here first: stamps its arrival (for TTFT), counts it by endpoint
    and status, checks the API key, and refuses a body over the limit before reading it (by
    Content-Length, or by counting while reading a chunked one)."""

    def __init__(self, app, *, settings: ServerSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        path = scope["path"]
        # Fixed labels only: arbitrary paths would make unbounded metric series.
        endpoint = path if path in _ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

        async def counted_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, counted_send)
        await self.app(scope, self._counting(receive), counted_send)

    def _refusal(self, scope) -> Response | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # The key guards the API (/v1/...). /health and /metrics stay open for load balancers and
        # scrapers: they show no prompts or answers.
        if self.settings.api_key is not None and scope["path"].startswith("/v1/"):
            auth = headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if not auth:
                return error_response(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(),
                                                                        self.settings.api_key.encode()):
                return error_response(401, "invalid API key: check the key given with 'Authorization: Bearer'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return error_response(400, f"Content-Length {length!r} is not a byte count")
            if int(length) > self.settings.max_body_bytes:
                return error_response(413, self._too_large(int(length)), code="request_too_large")
        return None

    def _too_large(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "the body"
        limit = self.settings.max_body_bytes
        return (f"request body too large: {got} is over the limit of {limit} bytes (--max-body-mb "
                f"{limit / 2**20:g}); send a shorter document, or start the server with a larger --max-body-mb")

    def _counting(self, receive):
        seen = 0

        async def receive_counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.settings.max_body_bytes:
                    # FastAPI passes an HTTPException raised while it reads the body through as is.
                    raise HTTPException(413, self._too_large(None))
            return message

        return receive_counted


@dataclass(frozen=True)
class Job:
    """One generation request as the backend takes it."""

    rid: str  # the response id ("chatcmpl-..." / "cmpl-...")
    prompt: Any  # the backend's Prompt
    max_tokens: int
    sampling: SamplingConfig
    stops: list[str] | None


OPENAI_TEMPERATURE = 1.0  # what a request that leaves temperature out gets, as OpenAI's API and vLLM


def sampling_of(body: P.GenerationRequest) -> SamplingConfig:
    """What the request set; temperature left out is OpenAI's default 1.0 (temperature 0 is greedy), the
    rest keeps SamplingConfig's defaults (top_p 1, top_k off)."""
    temperature = OPENAI_TEMPERATURE if body.temperature is None else body.temperature
    given = {"temperature": temperature, "top_p": body.top_p, "seed": body.seed,
             "top_k": None if body.top_k is None else max(body.top_k, 0), "ignore_eos": body.ignore_eos or None}
    return SamplingConfig(**{k: v for k, v in given.items() if v is not None})


def _preview(x, limit: int = 2000) -> str:
    s = repr(x)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} chars)"


async def read_job(app: FastAPI, body: P.GenerationRequest, prefix: str, param: str) -> Job:
    """The body's checks against this server (model name, token limit, the window), its prompt
    tokenized by the backend; ApiError naming the field otherwise. prefix: the response id's
    ("chatcmpl", "cmpl"); param: the field that holds the prompt ("messages", "prompt")."""
    backend: Backend = app.state.backend
    settings: ServerSettings = app.state.settings
    served = app.state.served_model_name
    if body.model is not None and body.model != served:
        raise ApiError(404, f"the model '{body.model}' does not exist: this server serves '{served}'",
                       param="model", code="model_not_found")
    asked = body.token_budget()
    if asked is not None and asked > settings.max_tokens_limit:
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(400, f"{name}={asked} is over this server's limit of {settings.max_tokens_limit}: "
                            f"ask for at most {settings.max_tokens_limit}", param=name)

    rid = P.new_id(prefix)
    if isinstance(body, P.ChatCompletionRequest):
        source = [{"role": m.role, "content": m.content or ""} for m in body.messages]
        build = backend.chat_prompt
    else:
        source, build = body.prompt, backend.text_prompt
    if settings.log_prompts:
        log.info("%s prompt: %s", rid, _preview(source))
    try:  # tokenizing a long document takes a while: off the event loop
        prompt = await run_in_threadpool(build, source)
    except (QueueFull, ServiceUnavailable, ValueError) as e:
        raise backend_error(e, param) from e

    if asked is None:
        room = backend.max_model_len - len(prompt.ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(prompt.ids)} tokens, which fills the model window of "
                                f"{backend.max_model_len} tokens: shorten the document or the question",
                           param=param)
        asked = min(settings.max_tokens_limit, room)
    # protocol.py's ranges are SamplingConfig's: building it cannot fail here
    return Job(rid, prompt, asked, sampling_of(body), body.stop_list())
