"""A generation in flight, from the backend's thread to the client: `Generation` bridges the
backend's token events into asyncio (and applies stop strings, `StopFilter`); `Chat` and `Text` shape
the two generation APIs' chunks and responses; `stream` writes them as server-sent events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from starshard.server import protocol as P
from starshard.server.backend import TokenEvent
from starshard.server.errors import error_info, generation_error
from starshard.server.intake import Job

log = logging.getLogger("starshard.server")

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    pass


class GenerationFailed(Exception):
    """The engine ended the request with an error; `code` is its TokenEvent.error_code (errors.py maps it)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class StopFilter:
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


class Generation:
    """Bridges one backend request into asyncio: the backend thread's events land in a queue; stop
    strings are applied here; close() cancels the backend side unless it already finished."""

    def __init__(self, app: FastAPI, request: Request, job: Job, *, per_token: bool = False):
        self.request, self.metrics = request, app.state.metrics
        self.per_token = per_token  # return_token_ids: every token is a piece of its own, even with no text
        self.ids: list[int] = []  # the token ids behind the pieces not yet taken (take_ids)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.stop = StopFilter(job.stops)
        self.arrival = getattr(request.state, "arrival", time.perf_counter())
        self.first_token_at: float | None = None
        self.last: TokenEvent | None = None
        self.done = False
        self._getter: asyncio.Future | None = None
        self._next_check = time.monotonic() + DISCONNECT_POLL_S
        # submit() only enqueues (QueueFull is immediate), so it is called on the loop directly.
        self.ticket = app.state.backend.submit(job.prompt, max_tokens=job.max_tokens, sampling=job.sampling,
                                               stop=job.stops, on_event=self._on_event)
        self.running = app.state.generations  # the server ends those still running when it stops (end())
        self.running.add(self)

    def _on_event(self, ev: TokenEvent) -> None:  # the backend's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    async def next(self) -> tuple[str, str | None]:
        """The next text to show and the finish reason (None while running). Raises GenerationFailed,
        or ClientGone when the client disconnected."""
        while True:
            ev = self.last = await self._get()
            if ev.token_id is not None and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                self.metrics.ttft.observe(self.first_token_at - self.arrival)
            if ev.finish_reason in ("error", "cancelled"):  # "cancelled" that we did not ask for
                self.done = True
                raise GenerationFailed(ev.error or f"the engine ended the request ({ev.finish_reason})",
                                       ev.error_code)
            text = self.stop.feed(ev.text)
            if ev.token_id is not None:
                self.ids.append(ev.token_id)
            if self.stop.hit:
                if ev.finish_reason is None:
                    self.ticket.cancel()  # the rest is not wanted: free the batch slot now
                self.done = True
                return text, "stop"
            if ev.finish_reason is not None:
                self.done = True
                return text + self.stop.flush(), ev.finish_reason
            if text or (self.per_token and ev.token_id is not None):
                return text, None

    def take_ids(self) -> list[int]:
        """The token ids of the pieces returned since the last call."""
        ids, self.ids = self.ids, []
        return ids

    async def _get(self) -> TokenEvent:
        # Checks the client on a clock, not only when idle: a busy stream of tokens must not hide
        # a disconnect from a non-streaming request (a stream also learns of it from Starlette).
        while True:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    raise ClientGone
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=max(self._next_check - now, 0.0))
            if done:
                ev, self._getter = self._getter.result(), None
                return ev

    def usage(self) -> P.Usage:
        ev = self.last
        return P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)

    def end(self, message: str) -> None:
        """The server is stopping (on the loop): the request ends with an error (503, or an error event when
        streaming) after the pieces already queued, and the backend frees its slot."""
        self.queue.put_nowait(TokenEvent(None, "", "error", prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                                         error=message, error_code="unavailable"))
        self.ticket.cancel()

    def close(self) -> None:
        self.running.discard(self)
        if self._getter is not None:
            self._getter.cancel()
        if not self.done:
            self.done = True
            self.ticket.cancel()  # the client went away (or we failed): free the slot and KV


# ---- the two generation APIs ----


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


class Api:
    """How one generation API shapes its chunks and its response."""

    prefix = param = ""

    def __init__(self, rid: str, created: int, model: str, *, token_ids: bool = False,
                 continuous_usage: bool = False):
        self.rid, self.created, self.model = rid, created, model
        self.token_ids = token_ids  # return_token_ids: choices carry token_ids
        self.continuous_usage = continuous_usage  # stream_options.continuous_usage_stats: usage in every chunk


class Chat(Api):
    prefix, param = "chatcmpl", "messages"

    def _chunk(self, delta: dict, finish: str | None = None, usage=None, choices=True, ids=()) -> str:
        if self.token_ids:
            c = [P.TokenIdsChatChunkChoice(delta=delta, finish_reason=finish, token_ids=ids)] if choices else []
            chunk = P.TokenIdsChatCompletionChunk
        else:
            c = [P.ChatChunkChoice(delta=delta, finish_reason=finish)] if choices else []
            chunk = P.ChatCompletionChunk
        return sse(chunk(id=self.rid, created=self.created, model=self.model, choices=c, usage=usage))

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, text: str, ids=(), usage=None) -> str:
        return self._chunk({"content": text}, usage=usage, ids=ids)

    def finish(self, reason: str, usage=None) -> str:
        return self._chunk({}, reason, usage=usage)

    def usage(self, usage: P.Usage) -> str:
        return self._chunk({}, usage=usage, choices=False)

    def response(self, text: str, reason: str, usage: P.Usage, ids=()) -> P.ChatCompletionResponse:
        message = P.AssistantMessage(content=text)
        if self.token_ids:
            choices = [P.TokenIdsChatChoice(message=message, finish_reason=reason, token_ids=ids)]
            return P.TokenIdsChatCompletionResponse(id=self.rid, created=self.created, model=self.model,
                                                    choices=choices, usage=usage)
        choice = P.ChatChoice(message=message, finish_reason=reason)
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[choice],
                                        usage=usage)


class Text(Api):
    prefix, param = "cmpl", "prompt"

    def _chunk(self, text: str, finish: str | None = None, usage=None, choices=True, ids=()) -> str:
        return sse(self._response(text, finish, usage, ids) if choices else
                   P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage))

    def _response(self, text: str, finish: str | None, usage, ids) -> P.CompletionResponse:
        if self.token_ids:
            choice = P.TokenIdsCompletionChoice(text=text, finish_reason=finish, token_ids=ids)
            return P.TokenIdsCompletionResponse(id=self.rid, created=self.created, model=self.model,
                                                choices=[choice], usage=usage)
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                    choices=[P.CompletionChoice(text=text, finish_reason=finish)], usage=usage)

    def start(self) -> list[str]:
        return []

    def text(self, text: str, ids=(), usage=None) -> str:
        return self._chunk(text, usage=usage, ids=ids)

    def finish(self, reason: str, usage=None) -> str:
        return self._chunk("", reason, usage=usage)

    def usage(self, usage: P.Usage) -> str:
        return self._chunk("", usage=usage, choices=False)

    def response(self, text: str, reason: str, usage: P.Usage, ids=()) -> P.CompletionResponse:
        return self._response(text, reason, usage, ids)


# ---- server-sent events ----


class EventStream(StreamingResponse):
    """SSE response that closes its generation however the response ends, even when the client
    left before the first chunk (then the chunk generator never ran and its finally cannot)."""

    def __init__(self, chunks: AsyncIterator[str], gen: Generation):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


async def stream(gen: Generation, out: Api, first, include_usage: bool, rid: str) -> AsyncIterator[str]:
    # On a disconnect Starlette cancels this generator (or _get notices): finally cancels the ticket.
    try:
        for chunk in out.start():
            yield chunk
        text, reason = first
        while True:
            ids = gen.take_ids() if out.token_ids else ()
            if text or ids:
                yield out.text(text, ids, gen.usage() if out.continuous_usage else None)
            if reason is not None:
                break
            text, reason = await gen.next()
        yield out.finish(reason, gen.usage() if out.continuous_usage else None)
        if include_usage:
            yield out.usage(gen.usage())
        log_done(rid, gen, reason)
    except GenerationFailed as e:  # after the 200 went out: tell the client in the stream
        yield sse(P.ErrorResponse(error=error_info(generation_error(str(e), e.code))))
    except ClientGone:
        log.info("%s: client disconnected mid-stream; cancelled", rid)
        return
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


def log_done(rid: str, gen: Generation, reason: str) -> None:
    u = gen.usage()
    ttft = f"{gen.first_token_at - gen.arrival:.3f}s" if gen.first_token_at else "-"
    log.info("%s done: prompt=%d cached=%d completion=%d finish=%s ttft=%s", rid, u.prompt_tokens,
             u.prompt_tokens_details.cached_tokens, u.completion_tokens, reason, ttft)
