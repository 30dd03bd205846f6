"""OpenAI-compatible HTTP server over an Engine (see engine_api.py).

create_app(engine, settings) builds the FastAPI app; run_server(app, settings) serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from starshard.server import protocol as P
from starshard.server.engine_api import Engine, EngineUnavailable, QueueFull, SamplingParams, TokenEvent
from starshard.server.metrics import ServerMetrics
from starshard.server.settings import ServerSettings

log = logging.getLogger("starshard.server")

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics"
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


# ---- errors ----


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    info = P.ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "internal_error"), param=param, code=code)
    return JSONResponse(P.ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def _engine_error(e: Exception, param: str | None = None) -> ApiError:
    """QueueFull, EngineUnavailable or ValueError from the engine as an HTTP error."""
    if isinstance(e, QueueFull):
        detail = f" ({e})" if str(e) else ""
        return ApiError(429, f"the server is busy: its queue is full{detail}; retry later",
                        code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailable):
        return ApiError(503, f"the engine is unavailable: {e or 'no reason given'}", code="engine_unavailable")
    return ApiError(400, str(e), param=param)  # ValueError: the engine's message names the limit


def _describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message naming the field, and the field, from FastAPI's (pydantic's) errors."""
    first = errors[0]
    if first["type"] == "json_invalid":
        where = first["loc"][1] if len(first["loc"]) > 1 else "?"
        why = first.get("ctx", {}).get("error", "not JSON")
        return f"malformed JSON in the request body ({why} at character {where}): send one JSON object", None
    if not [x for x in first["loc"] if x != "body"]:  # the body as a whole
        if first["type"] == "missing":
            return "the request body is empty: send a JSON object (Content-Type: application/json)", None
        return "the request body must be a JSON object sent with Content-Type: application/json", None

    def one(error: dict) -> str:
        field = ".".join(str(x) for x in error["loc"] if x != "body")
        why = "this field is required" if error["type"] == "missing" else error["msg"].removeprefix("Value error, ")
        return f"invalid field '{field}': {why}"

    shown = "; ".join(one(e) for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return shown + more, str(next(x for x in first["loc"] if x != "body"))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(RequestValidationError)  # FastAPI would answer 422; OpenAI clients expect 400
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = _describe_validation(list(e.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}: this server has {ROUTES}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}: this server has {ROUTES}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(e).__name__}): see the server log")


# ---- the request gate ----


class _Intake:
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
        return (f"request body too large: {got} is over the limit of {self.settings.max_body_bytes} bytes; "
                "send a shorter document, or start the server with a larger max_body_bytes")

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


# ---- one request in flight ----


class _ClientGone(Exception):
    pass


class _EngineFailed(Exception):
    pass


class _StopFilter:
    """Applies stop strings to text as it streams: holds back a tail that could be the start of a
    stop string, so no part of one is ever shown."""

    def __init__(self, stops: list[str] | None):
        self.stops = stops or []
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return buf[:cut]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:k])),
                   default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class _Generation:
    """Bridges one engine request into asyncio: the engine thread's events land in a queue; stop
    strings are applied here; close() cancels the engine side unless it already finished."""

    def __init__(self, app: FastAPI, request: Request, prompt, max_tokens: int, sampling: SamplingParams,
                 stops: list[str] | None):
        self.request, self.metrics = request, app.state.metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.stop = _StopFilter(stops)
        self.arrival = getattr(request.state, "arrival", time.perf_counter())
        self.first_token_at: float | None = None
        self.last: TokenEvent | None = None
        self.done = False
        self._getter: asyncio.Future | None = None
        self._next_check = time.monotonic() + DISCONNECT_POLL_S
        # submit() only enqueues (QueueFull is immediate), so it is called on the loop directly.
        self.ticket = app.state.engine.submit(prompt, max_tokens=max_tokens, sampling=sampling, stop=stops,
                                              on_event=self._on_event)

    def _on_event(self, ev: TokenEvent) -> None:  # the engine's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    async def next(self) -> tuple[str, str | None]:
        """The next text to show and the finish reason (None while running). Raises _EngineFailed,
        or _ClientGone when the client disconnected."""
        while True:
            ev = self.last = await self._get()
            if ev.token_id is not None and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                self.metrics.ttft.observe(self.first_token_at - self.arrival)
            if ev.finish_reason in ("error", "cancelled"):  # "cancelled" that we did not ask for
                self.done = True
                raise _EngineFailed(ev.error or f"the engine ended the request ({ev.finish_reason})")
            text = self.stop.feed(ev.text)
            if self.stop.hit:
                if ev.finish_reason is None:
                    self.ticket.cancel()  # the rest is not wanted: free the batch slot now
                self.done = True
                return text, "stop"
            if ev.finish_reason is not None:
                self.done = True
                return text + self.stop.flush(), ev.finish_reason
            if text:
                return text, None

    async def _get(self) -> TokenEvent:
        # Checks the client on a clock, not only when idle: a busy stream of tokens must not hide
        # a disconnect from a non-streaming request (a stream also learns of it from Starlette).
        while True:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    raise _ClientGone
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=max(self._next_check - now, 0.0))
            if done:
                ev, self._getter = self._getter.result(), None
                return ev

    def usage(self) -> P.Usage:
        ev = self.last
        return P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
        if not self.done:
            self.done = True
            self.ticket.cancel()  # the client went away (or we failed): free the slot and KV


# ---- the two generation APIs ----


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


class _Api:
    """How one generation API shapes its chunks and its response."""

    prefix = param = ""

    def __init__(self, rid: str, created: int, model: str):
        self.rid, self.created, self.model = rid, created, model


class _Chat(_Api):
    prefix, param = "chatcmpl", "messages"

    def _chunk(self, delta: dict, finish: str | None = None, usage=None, choices=True) -> str:
        c = [P.ChatChunkChoice(delta=delta, finish_reason=finish)] if choices else []
        return _sse(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=c,
                                          usage=usage))

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, text: str) -> str:
        return self._chunk({"content": text})

    def finish(self, reason: str) -> str:
        return self._chunk({}, reason)

    def usage(self, usage: P.Usage) -> str:
        return self._chunk({}, usage=usage, choices=False)

    def response(self, text: str, reason: str, usage: P.Usage) -> P.ChatCompletionResponse:
        choice = P.ChatChoice(message=P.AssistantMessage(content=text), finish_reason=reason)
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[choice],
                                        usage=usage)


class _Text(_Api):
    prefix, param = "cmpl", "prompt"

    def _chunk(self, text: str, finish: str | None = None, usage=None, choices=True) -> str:
        c = [P.CompletionChoice(text=text, finish_reason=finish)] if choices else []
        return _sse(P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=c,
                                         usage=usage))

    def start(self) -> list[str]:
        return []

    def text(self, text: str) -> str:
        return self._chunk(text)

    def finish(self, reason: str) -> str:
        return self._chunk("", reason)

    def usage(self, usage: P.Usage) -> str:
        return self._chunk("", usage=usage, choices=False)

    def response(self, text: str, reason: str, usage: P.Usage) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                    choices=[P.CompletionChoice(text=text, finish_reason=reason)], usage=usage)


def _sampling(body: P.GenerationRequest) -> SamplingParams:
    """Only what the request set; the rest keeps SamplingParams' defaults (greedy)."""
    given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
             "top_k": None if body.top_k is None else max(body.top_k, 0)}
    return SamplingParams(**{k: v for k, v in given.items() if v is not None})


def _preview(x, limit: int = 2000) -> str:
    s = repr(x)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} chars)"


async def _generate(request: Request, body: P.GenerationRequest, api: type[_Api]) -> Response:
    app: FastAPI = request.app
    engine: Engine = app.state.engine
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

    rid = P.new_id(api.prefix)
    if api is _Chat:
        source = [{"role": m.role, "content": m.content or ""} for m in body.messages]
        build = engine.chat_prompt
    else:
        source, build = body.prompt, engine.text_prompt
    if settings.log_prompts:
        log.info("%s prompt: %s", rid, _preview(source))
    try:  # tokenizing a long document takes a while: off the event loop
        prompt = await run_in_threadpool(build, source)
    except (QueueFull, EngineUnavailable, ValueError) as e:
        raise _engine_error(e, api.param) from e

    if asked is None:
        room = engine.max_model_len - len(prompt.ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(prompt.ids)} tokens, which fills the model window of "
                                f"{engine.max_model_len} tokens: shorten the document or the question",
                           param=api.param)
        asked = min(settings.max_tokens_limit, room)
    try:
        gen = _Generation(app, request, prompt, asked, _sampling(body), body.stop_list())
    except (QueueFull, EngineUnavailable, ValueError) as e:
        raise _engine_error(e, "max_tokens") from e

    out = api(rid, P.now(), served)
    try:
        # Wait for the first piece before answering, so that a failure before any token is still an
        # HTTP status (503) the client can act on, also when streaming.
        first = await gen.next()
        if body.stream:
            response = _EventStream(_stream(gen, out, first, body.wants_usage_chunk(), rid), gen)
            gen = None  # the response owns it now
            return response
        texts, (text, reason) = [], first
        while True:
            texts.append(text)
            if reason is not None:
                break
            text, reason = await gen.next()
        _log_done(rid, gen, reason)
        return JSONResponse(out.response("".join(texts), reason, gen.usage()).model_dump())
    except _EngineFailed as e:
        raise ApiError(503, f"generation failed: {e}", code="engine_error") from e
    except _ClientGone:
        log.info("%s: client disconnected before the answer; cancelled", rid)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    finally:
        if gen is not None:
            gen.close()


class _EventStream(StreamingResponse):
    """SSE response that closes its generation however the response ends, even when the client
    left before the first chunk (then the chunk generator never ran and its finally cannot)."""

    def __init__(self, chunks: AsyncIterator[str], gen: _Generation):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


async def _stream(gen: _Generation, out: _Api, first, include_usage: bool, rid: str) -> AsyncIterator[str]:
    # On a disconnect Starlette cancels this generator (or _get notices): finally cancels the ticket.
    try:
        for chunk in out.start():
            yield chunk
        text, reason = first
        while True:
            if text:
                yield out.text(text)
            if reason is not None:
                break
            text, reason = await gen.next()
        yield out.finish(reason)
        if include_usage:
            yield out.usage(gen.usage())
        _log_done(rid, gen, reason)
    except _EngineFailed as e:  # after the 200 went out: tell the client in the stream
        info = P.ErrorInfo(message=f"generation failed: {e}", type="service_unavailable", code="engine_error")
        yield _sse(P.ErrorResponse(error=info))
    except _ClientGone:
        log.info("%s: client disconnected mid-stream; cancelled", rid)
        return
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


def _log_done(rid: str, gen: _Generation, reason: str) -> None:
    u = gen.usage()
    ttft = f"{gen.first_token_at - gen.arrival:.3f}s" if gen.first_token_at else "-"
    log.info("%s done: prompt=%d cached=%d completion=%d finish=%s ttft=%s", rid, u.prompt_tokens,
             u.prompt_tokens_details.cached_tokens, u.completion_tokens, reason, ttft)


# ---- the app ----


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="starshard", summary="OpenAI-compatible API for long documents")
    app.state.engine = engine
    app.state.settings = settings
    app.state.served_model_name = settings.served_model_name or engine.model_name
    app.state.metrics = ServerMetrics(engine.stats)
    app.state.created = P.now()
    _install_error_handlers(app)
    app.add_middleware(_Intake, settings=settings, metrics=app.state.metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await _generate(request, body, _Chat)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await _generate(request, body, _Text)

    def card() -> P.ModelCard:
        return P.ModelCard(id=app.state.served_model_name, created=app.state.created,
                           max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # names like "org/model" hold a slash
    async def model(model_id: str):
        if model_id != app.state.served_model_name:
            raise ApiError(404, f"the model '{model_id}' does not exist: this server serves "
                                f"'{app.state.served_model_name}'", param="model", code="model_not_found")
        return card().model_dump()

    @app.get("/health")
    async def health():
        try:
            why = engine.health()
        except Exception as e:  # noqa: BLE001 (a health check that throws is unhealthy, not a 500)
            why = f"health check failed: {type(e).__name__}: {e}"
        if why is None:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        data, content_type = app.state.metrics.render()
        return Response(data, media_type=content_type)

    return app


# ---- serving ----


class _Server(uvicorn.Server):
    """uvicorn.Server that says where it listens once the socket is bound."""

    def __init__(self, config: uvicorn.Config, model: str):
        super().__init__(config)
        self.model = model
        self.bound_port: int | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.bound_port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"serving {self.model} on http://{self.config.host}:{self.bound_port}", flush=True)


def make_server(app: FastAPI, settings: ServerSettings) -> _Server:
    """A uvicorn server for app, not yet running (run() blocks; tests run it in a thread)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    return _Server(config, app.state.served_model_name)


def run_server(app: FastAPI, settings: ServerSettings) -> None:
    """Serve app on (settings.host, settings.port) until interrupted."""
    make_server(app, settings).run()
