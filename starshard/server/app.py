"""OpenAI-compatible HTTP server over a Backend (see backend.py): the routes and the app's assembly.

create_app(backend, settings) builds the FastAPI app; run_server(app, settings) serves it with uvicorn;
port_error(host, port) says before anything loads whether the address can be bound.
A generation request goes: RequestGate (intake.py) -> the route -> read_job (intake.py: checks,
tokenizing) -> Generation (streaming.py: submit to the backend, its events into asyncio) -> one JSON
response, or server-sent events (streaming.py); errors.py shapes every failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from starshard.server import protocol as P
from starshard.server.backend import Backend, QueueFull, ServiceUnavailable
from starshard.server.errors import ApiError, backend_error, generation_error, install_error_handlers
from starshard.server.intake import RequestGate, read_job
from starshard.server.metrics import ServerMetrics
from starshard.server.settings import ServerSettings
from starshard.server.streaming import (Api, Chat, ClientGone, EventStream, Generation, GenerationFailed, Text,
                                        log_done, stream)

log = logging.getLogger("starshard.server")


async def _generate(request: Request, body: P.GenerationRequest, api: type[Api]) -> Response:
    app: FastAPI = request.app
    job = await read_job(app, body, api.prefix, api.param)
    try:
        gen = Generation(app, request, job, per_token=bool(body.return_token_ids))
    except (QueueFull, ServiceUnavailable, ValueError) as e:
        raise backend_error(e, "max_tokens") from e

    out = api(job.rid, P.now(), app.state.served_model_name, token_ids=bool(body.return_token_ids),
              continuous_usage=body.wants_continuous_usage())
    try:
        # Wait for the first piece before answering, so that a failure before any token is still an
        # HTTP status (503) the client can act on, also when streaming.
        first = await gen.next()
        if body.stream:
            response = EventStream(stream(gen, out, first, body.wants_usage_chunk(), job.rid), gen)
            gen = None  # the response owns it now
            return response
        texts, (text, reason) = [], first
        while True:
            texts.append(text)
            if reason is not None:
                break
            text, reason = await gen.next()
        log_done(job.rid, gen, reason)
        return JSONResponse(out.response("".join(texts), reason, gen.usage(), gen.take_ids()).model_dump())
    except GenerationFailed as e:
        raise generation_error(str(e), e.code) from e
    except ClientGone:
        log.info("%s: client disconnected before the answer; cancelled", job.rid)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    finally:
        if gen is not None:
            gen.close()


# ---- the app ----


def create_app(backend: Backend, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="starshard", summary="OpenAI-compatible API for long documents")
    app.state.backend = backend
    app.state.settings = settings
    app.state.served_model_name = settings.served_model_name or backend.model_name
    app.state.metrics = ServerMetrics(backend.stats)
    app.state.created = P.now()
    app.state.generations = set()  # the Generations running now (streaming.py)
    install_error_handlers(app)
    app.add_middleware(RequestGate, settings=settings, metrics=app.state.metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await _generate(request, body, Chat)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await _generate(request, body, Text)

    def card() -> P.ModelCard:
        return P.ModelCard(id=app.state.served_model_name, created=app.state.created,
                           max_model_len=backend.max_model_len)

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
            why = backend.health()
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn.Server that says where it listens once the socket is bound, and whose SIGINT / SIGTERM
    only stop it: run() returns, so that the caller's graceful shutdown (the cache's write-down) runs.
    Requests in flight get `grace` seconds to finish, then end with 503 (an error event when streaming)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float):
        super().__init__(config)
        self.app, self.model, self.grace = app, app.state.served_model_name, grace
        self.bound_port: int | None = None
        self.stopped = False  # run() has returned: a further signal finds the caller's shutdown under way

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.bound_port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"serving {self.model} on http://{self.config.host}:{self.bound_port}", flush=True)

    async def shutdown(self, sockets=None) -> None:
        later = asyncio.get_running_loop().call_later(self.grace, self._end_in_flight)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            later.cancel()

    def _end_in_flight(self) -> None:
        running = list(self.app.state.generations)
        if running:
            log.info("shutdown: %d requests still running after %g s end with 503", len(running), self.grace)
        for gen in running:
            gen.end("the server is shutting down")

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own restores the handlers it replaced and raises the caught signal again once the server
        # has stopped, which kills the process (or raises KeyboardInterrupt) before the caller can shut down.
        # Ours stay installed until the process ends.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self.handle_exit)
        try:
            yield
        finally:
            self.stopped = True

    def handle_exit(self, sig, frame) -> None:
        if self.stopped:
            log.info("%s: already shutting down", signal.Signals(sig).name)
            return
        super().handle_exit(sig, frame)


def port_error(host: str, port: int) -> str | None:
    """Why (host, port) cannot be bound now, naming the flag to change; None when it can (or port 0). Checked
    before the model loads, so that a busy port fails in a second, not after the load; it binds as uvicorn
    (asyncio) will, every address host resolves to with SO_REUSEADDR, and lets go at once."""
    if port == 0:
        return None
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host}: not an address of this machine ({e.strerror})"
    for family, kind, proto, _, addr in addrs:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's create_server: IPv6 only, the IPv4 address is its own
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"--port {port}: {host}:{port} is already in use (another server?); stop it, or pick "
                            "another --port (0: any free port)")
                return f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"
    return None


def make_server(app: FastAPI, settings: ServerSettings) -> _Server:
    """A uvicorn server for app, not yet running (run() blocks; tests run it in a thread)."""
    # uvicorn cancels what is still running a few seconds after the requests were ended (a stuck handler)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s + 5)
    return _Server(config, app, settings.shutdown_grace_s)


def run_server(app: FastAPI, settings: ServerSettings) -> None:
    """Serve app on (settings.host, settings.port) until interrupted."""
    make_server(app, settings).run()
