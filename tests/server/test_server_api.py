"""The OpenAI-compatible server against a scripted fake backend: the official `openai` client and
raw httpx against a real uvicorn on a free 127.0.0.1 port, plus TestClient for settings variants."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from starshard.server import ServerSettings, create_app, make_server
from starshard.server.backend import QueueFull, SamplingConfig, ServiceUnavailable, TokenEvent

MODEL = "fake/doc-model"  # a slash, as in Hugging Face names: /v1/models/{id} must cope
KEY = "sk-test-key"
WINDOW = 64
LIMIT = 32
BODY_LIMIT = 2048
SCRIPT = ["Hello", " world", ",", " the", " answer", " is", " 42", "."]
FULL = "".join(SCRIPT)
DOC = "alpha beta gamma delta epsilon zeta eta theta"  # 8 tokens for the fake tokenizer


# ---- the fake backend ----


@dataclass
class FakePrompt:  # the server only reads .ids; the real Prompt lives in the engine package
    ids: list[int]
    context_len: int
    head_len: int = 0


@dataclass
class FakeTicket:
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancelled_at: float | None = None
    emitted: int = 0

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled_at = time.monotonic()
            self.cancelled.set()


class FakeBackend:
    """Emits SCRIPT one word per token from its own thread; a word-level tokenizer; a context
    cache keyed by the prompt's context ids (so a follow-up on the same document reports it)."""

    model_name = MODEL
    max_model_len = WINDOW

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.script, self.delay = list(SCRIPT), 0.002
        self.fail_next: Exception | None = None  # raised by the next submit()
        self.error_after: int | None = None  # emit this many tokens, then an "error" event
        self.error = ("rank 1 died", None)  # that event's message and error_code
        self.unhealthy: str | None = None
        self.calls: list[dict] = []
        self.tickets: list[FakeTicket] = []
        self.cache: dict[tuple, int] = {}
        self.counts = {"hits": 0, "lookups": 0, "prefill": 0, "decode": 0, "cached": 0}

    def _ids(self, text: str) -> list[int]:
        with self.lock:
            return [self.vocab.setdefault(w, len(self.vocab) + 1) for w in text.split()]

    def chat_prompt(self, messages):
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}: use system, user or assistant")
        doc = self._ids(messages[0]["content"])  # the first message holds the document
        rest = [i for m in messages[1:] for i in self._ids(m["content"])]
        return FakePrompt(doc + rest, context_len=len(doc))

    def text_prompt(self, prompt):
        ids = self._ids(prompt) if isinstance(prompt, str) else list(prompt)
        return FakePrompt(ids, context_len=len(ids))

    def submit(self, prompt, *, max_tokens, sampling, stop, on_event):
        self.calls.append({"prompt": prompt, "max_tokens": max_tokens, "sampling": sampling, "stop": stop})
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        if len(prompt.ids) + max_tokens > WINDOW:
            raise ValueError(f"prompt ({len(prompt.ids)} tokens) + max_tokens ({max_tokens}) is over the model "
                             f"window of {WINDOW} tokens: lower max_tokens or shorten the prompt")
        key = tuple(prompt.ids[: prompt.context_len])
        self.counts["lookups"] += 1
        cached = self.cache.get(key, 0)
        self.counts["hits"] += bool(cached)
        self.counts["cached"] += cached
        self.counts["prefill"] += len(prompt.ids) - cached
        self.cache[key] = len(key)
        ticket = FakeTicket()
        self.tickets.append(ticket)
        args = (ticket, len(prompt.ids), cached, max_tokens, on_event, list(self.script), self.delay,
                self.error_after, self.error)
        threading.Thread(target=self._run, args=args, daemon=True).start()
        return ticket

    def _run(self, ticket, n_prompt, cached, max_tokens, on_event, script, delay, error_after, error):
        def event(tid, text, finish, done, error=None, code=None):
            on_event(TokenEvent(tid, text, finish, n_prompt, cached, done, error, code))

        for i, word in enumerate(script):
            if ticket.cancelled.wait(delay):
                return event(None, "", "cancelled", i)
            if error_after == i:
                return event(None, "", "error", i, *error)
            ticket.emitted += 1
            self.counts["decode"] += 1
            last = i + 1 == max_tokens
            event(self.vocab.get(word, 99), word, "length" if last else None, i + 1)
            if last:
                return
        event(None, "", "stop", len(script))  # EOS

    def health(self):
        return self.unhealthy

    def stats(self):
        c = self.counts
        return {"queue_depth": 0, "running": sum(not t.cancelled.is_set() for t in self.tickets[-4:]),
                "cache_bytes": 1000 * len(self.cache), "cache_budget_bytes": 1 << 20, "cache_hits": c["hits"],
                "cache_lookups": c["lookups"], "prefill_tokens_total": c["prefill"],
                "decode_tokens_total": c["decode"], "cached_tokens_total": c["cached"], "prefill_chunks_total": 3,
                "prefilling_tokens_left": 0, "cancelled_total": 1, "timeouts_total": 2,
                "errors_by_code": {"insufficient_memory": 4, "timeout": 2}}


# ---- a real server ----


def start(app, settings):
    server = make_server(app, settings)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return server, thread


def stop(server, thread):
    server.should_exit = True
    thread.join(5)


@pytest.fixture(scope="module")
def served():
    engine = FakeBackend()
    settings = ServerSettings(port=0, api_key=KEY, max_body_bytes=BODY_LIMIT, max_tokens_limit=LIMIT,
                              log_level="warning")
    server, thread = start(create_app(engine, settings), settings)
    yield engine, f"http://127.0.0.1:{server.bound_port}"
    stop(server, thread)


@pytest.fixture
def engine(served):
    served[0].reset()
    return served[0]


@pytest.fixture(scope="module")
def base(served):
    return served[1]


# Clients are made once: building one (its TLS context) costs ~0.1 s.
@pytest.fixture(scope="module")
def client(base):
    with openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def anon(base):  # no key
    with httpx.Client(base_url=base, timeout=10) as c:
        yield c


def chat(client, content=DOC, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def stream_chat(client, **kw):
    return list(chat(client, stream=True, **kw))


def text_of(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def assert_alive(client):
    assert chat(client).choices[0].message.content == FULL


# ---- generation ----


def test_chat_answer_usage_and_cached_follow_up(client, engine):
    first = chat(client, content=DOC + " one")
    assert first.choices[0].message.content == FULL
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "stop"
    assert first.id.startswith("chatcmpl-") and len(first.id) > 20 and first.model == MODEL
    assert first.object == "chat.completion" and first.created > 0
    u = first.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (9, len(SCRIPT), 9 + len(SCRIPT))
    assert u.prompt_tokens_details.cached_tokens == 0
    # A follow-up on the same document: the fake cache serves the 9-token context.
    again = chat(client, content=DOC + " one")
    assert again.usage.prompt_tokens_details.cached_tokens == 9


def test_chat_stream_role_then_content_then_usage(client, engine):
    chunks = stream_chat(client, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text_of(chunks) == FULL
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(SCRIPT)
    assert chunks[-1].usage.prompt_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    without = stream_chat(client)
    assert without[-1].choices and without[-1].usage is None


def test_completions_text_and_token_ids(client, engine):
    r = client.completions.create(model=MODEL, prompt=DOC)
    assert r.choices[0].text == FULL and r.choices[0].finish_reason == "stop"
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage.prompt_tokens == 8
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert r.choices[0].text == "Hello world" and r.choices[0].finish_reason == "length"
    assert engine.calls[-1]["prompt"].ids == [5, 6, 7]
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7]])  # one prompt in a list is fine
    assert r.choices[0].text == FULL
    chunks = list(client.completions.create(model=MODEL, prompt=DOC, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 8  # same text as the first request


def test_max_tokens_and_default_budget(client, engine):
    r = chat(client, max_tokens=3)
    assert r.choices[0].message.content == "Hello world," and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    chat(client, max_completion_tokens=4, max_tokens=2)  # the newer name wins
    assert engine.calls[-1]["max_tokens"] == 4
    chat(client)  # absent: the server limit, as the window has room
    assert engine.calls[-1]["max_tokens"] == LIMIT
    chat(client, content=" ".join(["w"] * 40))  # absent: what is left of the window
    assert engine.calls[-1]["max_tokens"] == WINDOW - 40


def test_sampling_fields_reach_the_engine(client, engine):
    chat(client, temperature=0.7, top_p=0.9, seed=3, extra_body={"top_k": 5}, user="u1", presence_penalty=0)
    assert engine.calls[-1]["sampling"] == SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, seed=3)
    chat(client, extra_body={"top_k": -1})
    assert engine.calls[-1]["sampling"] == SamplingConfig(temperature=1.0)  # absent = 1.0, as OpenAI; -1 = no top-k
    chat(client, temperature=0, top_p=0.9)
    assert engine.calls[-1]["sampling"] == SamplingConfig(temperature=0.0, top_p=0.9)  # 0 = greedy
    # fields asking for nothing are accepted: zero penalties, no tools, plain text
    chat(client, frequency_penalty=0.0, presence_penalty=0, tools=[], tool_choice="none",
         response_format={"type": "text"})
    assert engine.calls[-1]["sampling"] == SamplingConfig(temperature=1.0)


def test_stop_strings_truncate_and_cancel(client, engine):
    r = chat(client, stop=" answer")
    assert r.choices[0].message.content == "Hello world, the" and r.choices[0].finish_reason == "stop"
    assert engine.calls[-1]["stop"] == [" answer"]
    deadline = time.monotonic() + 1
    while not engine.tickets[-1].cancelled.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.tickets[-1].cancelled.is_set(), "the engine was not told to stop after the stop string"
    r = client.completions.create(model=MODEL, prompt=DOC, stop=["zzz", "42"])
    assert r.choices[0].text == "Hello world, the answer is " and r.choices[0].finish_reason == "stop"


def test_stop_strings_streamed_never_leak(client, engine):
    # "the ans" spans two tokens: " the" must be held back, not shown, once it matched.
    chunks = stream_chat(client, stop="the ans")
    assert text_of(chunks) == "Hello world, "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # A held tail that never becomes a stop string is shown at the end.
    chunks = stream_chat(client, stop=[".!"])
    assert text_of(chunks) == FULL
    chunks = list(client.completions.create(model=MODEL, prompt=DOC, stream=True, stop=", the"))
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"


# ---- errors: every one is OpenAI-shaped, never 422, and the server keeps serving ----


def sse_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_return_token_ids_streams_every_token_event(http, engine):
    # A tokenizer-less engine (random weights) gives tokens whose text is "": with return_token_ids each
    # still gets its own chunk (vLLM's extension), so a client can time every token.
    engine.script = ["", "", "Hi", ""]
    body = {"model": MODEL, "prompt": [5, 6, 7], "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(http, "/v1/completions", body)
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["token_ids"]]
    assert [c["choices"][0]["token_ids"] for c in tokens] == [[99]] * 4
    assert [c["choices"][0]["text"] for c in tokens] == ["", "", "Hi", ""]
    assert [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3, 4]  # continuous usage
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["token_ids"] == []
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    # Without it: text chunks only, no token_ids, usage only at the end.
    plain = sse_chunks(http, "/v1/completions", {**body, "return_token_ids": False,
                                                 "stream_options": {"include_usage": True}})
    assert [c["choices"][0]["text"] for c in plain if c["choices"]] == ["Hi", ""]
    assert all("token_ids" not in c["choices"][0] for c in plain if c["choices"])
    assert [c["usage"] is not None for c in plain] == [False, False, True]
    # Not streamed, and chat: every id in the choice.
    r = http.post("/v1/completions", json={**body, "stream": False})
    assert r.json()["choices"][0]["token_ids"] == [99] * 4 and r.json()["choices"][0]["text"] == "Hi"
    chat_chunks = sse_chunks(http, "/v1/chat/completions", {**body, "prompt": None,
                                                            "messages": [{"role": "user", "content": DOC}]})
    assert [c["choices"][0]["token_ids"] for c in chat_chunks if c["choices"]] == [[]] + [[99]] * 4 + [[]]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": DOC}],
                                                "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == [99] * 4 and r.json()["choices"][0]["message"]["content"] == "Hi"


def error_of(response: httpx.Response, status: int, *needles: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["type"], str)
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def post_chat(http, **body):
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": DOC}])
    return http.post("/v1/chat/completions", json=body)


BAD_REQUESTS = {
    "malformed json": (lambda h: h.post("/v1/chat/completions", content=b'{"model": "x", "messages": [}',
                                        headers={"Content-Type": "application/json"}), 400, "malformed JSON"),
    "empty body": (lambda h: h.post("/v1/chat/completions"), 400, "body is empty"),
    "body not an object": (lambda h: h.post("/v1/chat/completions", json=[1, 2]), 400, "JSON object"),
    "missing messages": (lambda h: h.post("/v1/chat/completions", json={"model": MODEL}), 400,
                         "'messages'", "required"),
    "messages not a list": (lambda h: post_chat(h, messages="hi"), 400, "'messages'"),
    "empty messages": (lambda h: post_chat(h, messages=[]), 400, "'messages'"),
    "image content": (lambda h: post_chat(h, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
                      400, "'messages.0.content'", "text"),
    "bad role": (lambda h: post_chat(h, messages=[{"role": "robot", "content": "x"}]), 400, "unknown role"),
    "temperature": (lambda h: post_chat(h, temperature=5), 400, "'temperature'"),
    "max_tokens type": (lambda h: post_chat(h, max_tokens="many"), 400, "'max_tokens'"),
    "two bad fields": (lambda h: post_chat(h, top_p=0, seed="x"), 400, "'top_p'", "'seed'"),
    "n": (lambda h: post_chat(h, n=2), 400, "n=2 is not supported"),
    "presence_penalty": (lambda h: post_chat(h, presence_penalty=0.5), 400, "'presence_penalty'",
                         "presence_penalty=0.5 is not supported"),
    "frequency_penalty": (lambda h: h.post("/v1/completions", json={"prompt": "x", "frequency_penalty": -1}), 400,
                          "'frequency_penalty'", "send 0"),
    "tools": (lambda h: post_chat(h, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "'tools'",
              "no tool calling"),
    "tool_choice": (lambda h: post_chat(h, tool_choice="required"), 400, "'tool_choice'"),
    "response_format": (lambda h: post_chat(h, response_format={"type": "json_object"}), 400, "'response_format'",
                        "'json_object' is not supported"),
    "logprobs": (lambda h: post_chat(h, logprobs=True), 400, "logprobs"),
    "empty stop": (lambda h: post_chat(h, stop=[""]), 400, "stop strings must not be empty"),
    "max_tokens over limit": (lambda h: post_chat(h, max_tokens=LIMIT + 1), 400, f"limit of {LIMIT}"),
    "over the window": (lambda h: post_chat(h, messages=[{"role": "user", "content": " ".join(["w"] * 40)}],
                                            max_tokens=30), 400, f"window of {WINDOW}"),
    "prompt fills window": (lambda h: post_chat(h, messages=[{"role": "user", "content": "w " * 70}]), 400,
                            f"window of {WINDOW}"),
    "batch prompt": (lambda h: h.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400,
                     "batch prompts are not supported"),
    "bad token ids": (lambda h: h.post("/v1/completions", json={"model": MODEL, "prompt": [1, -2]}), 400,
                      "token ids"),
    "missing prompt": (lambda h: h.post("/v1/completions", json={"model": MODEL}), 400, "'prompt'"),
    "echo": (lambda h: h.post("/v1/completions", json={"prompt": "x", "echo": True}), 400, "echo"),
    "unknown model": (lambda h: post_chat(h, model="gpt-4"), 404, "'gpt-4'", MODEL),
    "unknown model card": (lambda h: h.get("/v1/models/gpt-4"), 404, MODEL),
    "unknown route": (lambda h: h.get("/v1/nothing"), 404, "/v1/nothing", "/v1/chat/completions"),
    "wrong method": (lambda h: h.get("/v1/chat/completions"), 405, "GET"),
    "no key": (lambda h: h.post("/v1/chat/completions", json={}, headers={"Authorization": ""}), 401,
               "missing API key"),
    "wrong key": (lambda h: h.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401,
                  "invalid API key"),
    "body over limit": (lambda h: post_chat(h, messages=[{"role": "user", "content": "x" * BODY_LIMIT}]), 413,
                        f"limit of {BODY_LIMIT} bytes", "larger --max-body-mb"),
    "chunked body over limit": (lambda h: h.post("/v1/completions", content=iter([b" " * 1000] * 4),
                                                 headers={"Content-Type": "application/json"}), 413,
                                f"limit of {BODY_LIMIT} bytes"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_answered_and_server_keeps_serving(case, http, client, engine):
    call, status, *needles = BAD_REQUESTS[case]
    error = error_of(call(http), status, *needles)
    if case == "unknown model":
        assert error["code"] == "model_not_found" and error["param"] == "model"
    if case in ("missing messages", "temperature", "presence_penalty", "frequency_penalty", "tools",
                "response_format"):
        assert error["param"] == case.split()[-1]
    assert_alive(client)


def test_engine_refusals_map_to_429_and_503(client, engine):
    engine.fail_next = QueueFull("64 waiting")
    with pytest.raises(openai.RateLimitError, match="queue is full"):
        chat(client)
    engine.fail_next = ServiceUnavailable("rank 2 died")
    with pytest.raises(openai.InternalServerError, match="rank 2 died") as e:
        chat(client)
    assert e.value.status_code == 503
    assert_alive(client)


def test_openai_client_sees_typed_errors(client, engine):
    with pytest.raises(openai.NotFoundError, match=MODEL):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="window of 64"):
        chat(client, max_tokens=LIMIT, content="w " * 40)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_alive(client)


def test_failure_before_first_token_is_503_also_streaming(client, engine):
    engine.error_after = 0
    with pytest.raises(openai.InternalServerError, match="rank 1 died") as e:
        chat(client)
    assert e.value.status_code == 503
    with pytest.raises(openai.InternalServerError, match="rank 1 died"):
        stream_chat(client)
    engine.error_after = None
    assert_alive(client)


MEMORY = ("out of memory: this request's prefill needs 5.20 GiB on rank 3 (its new KV and the step's working set) but "
          "3.10 GiB are free there; other requests are unaffected; retry later, or start the server with a lower "
          "--cache-gib or --prefill-chunk")


def test_out_of_memory_is_503_with_retry_after_and_the_sizes(http, engine):
    engine.error_after, engine.error = 0, (MEMORY, "insufficient_memory")
    try:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "stream": stream,
                                                        "messages": [{"role": "user", "content": DOC}]})
            err = r.json()["error"]
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert err["code"] == "insufficient_memory" and "5.20 GiB on rank 3" in err["message"]
            assert "3.10 GiB are free" in err["message"] and "--cache-gib" in err["message"]
    finally:
        engine.error_after, engine.error = None, ("rank 1 died", None)


def test_timeout_is_503_request_timeout_and_mid_stream_an_error_event(http, client, engine):
    engine.error_after, engine.error = 0, ("the request ran past --request-timeout 2s (2.01 s)", "timeout")
    try:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": DOC})
        assert r.status_code == 503 and r.json()["error"]["code"] == "request_timeout", r.text
        assert "retry-after" not in r.headers and "--request-timeout" in r.json()["error"]["message"]
        engine.error_after = 2
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": DOC, "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert '"request_timeout"' in events[-2] and events[-1] == "[DONE]"
    finally:
        engine.error_after, engine.error = None, ("rank 1 died", None)
    assert_alive(client)


def test_failure_mid_stream_is_an_error_event(client, engine):
    engine.error_after = 3
    seen = []
    with pytest.raises(openai.APIError, match="rank 1 died"):
        for chunk in chat(client, stream=True):
            seen.append(chunk)  # noqa: PERF402 (keeps what came before the error)
    assert text_of(seen) == "Hello world,"
    engine.error_after = None
    assert_alive(client)


# ---- disconnects ----


def wait_cancelled(ticket, within=1.0) -> float:
    start = time.monotonic()
    assert ticket.cancelled.wait(within), "the engine ticket was not cancelled"
    return ticket.cancelled_at - start


def test_disconnect_mid_stream_cancels(http, client, engine):
    engine.script, engine.delay = [" tok"] * 200, 0.02
    body = {"model": MODEL, "messages": [{"role": "user", "content": DOC}], "stream": True, "max_tokens": LIMIT}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if '"content":" tok"' in line:
                break
    ticket = engine.tickets[-1]
    wait_cancelled(ticket)
    assert ticket.emitted < LIMIT
    engine.reset()
    assert_alive(client)


def test_disconnect_before_answer_cancels(http, client, engine):
    engine.script, engine.delay = [" tok"] * 200, 0.05
    with pytest.raises(httpx.ReadTimeout):  # the client gives up; httpx then drops the connection
        http.post("/v1/chat/completions", timeout=0.3,
                  json={"messages": [{"role": "user", "content": DOC}], "max_tokens": LIMIT})
    ticket = engine.tickets[-1]
    wait_cancelled(ticket)
    assert ticket.emitted < LIMIT
    engine.reset()
    assert_alive(client)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_prefill_cancels(stream, http, client, engine):
    engine.delay = 2.0  # a long prefill: nothing comes for 2 s
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", timeout=0.3,
                  json={"messages": [{"role": "user", "content": DOC}], "stream": stream})
    ticket = engine.tickets[-1]
    wait_cancelled(ticket)
    assert ticket.emitted == 0
    engine.reset()
    assert_alive(client)


# ---- models, health, metrics ----


def test_models(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "starshard"
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] == WINDOW
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_is_open_and_reports_the_reason(anon, engine):
    r = anon.get("/health")  # no key: probes stay open
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    engine.unhealthy = "rank 3 stopped answering"
    r = anon.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "rank 3 stopped answering"


def test_metrics_are_open_and_named(anon, client, engine):
    chat(client)
    chat(client)  # a cache hit
    assert post_chat(anon).status_code == 401  # to be counted
    text = anon.get("/metrics").text  # no key: scrapers stay open
    for name in ["starshard_queue_depth", "starshard_running_requests", "starshard_context_cache_bytes",
                 "starshard_context_cache_budget_bytes", "starshard_context_cache_hit_rate",
                 "starshard_context_cache_hits_total", "starshard_prefill_tokens_total",
                 "starshard_decode_tokens_total", "starshard_cached_prompt_tokens_total",
                 "starshard_time_to_first_token_seconds_bucket", "starshard_engine_up 1.0",
                 "starshard_prefill_chunks_total 3.0", "starshard_prefilling_tokens_left 0.0",
                 "starshard_cancelled_requests_total 1.0", "starshard_request_timeouts_total 2.0",
                 'starshard_request_errors_total{code="insufficient_memory"} 4.0',
                 'starshard_request_errors_total{code="timeout"} 2.0']:
        assert name in text, name
    assert 'starshard_context_cache_hit_rate 0.5' in text
    requests = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("starshard_requests_total{")}
    assert requests['starshard_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert requests['starshard_requests_total{endpoint="/v1/chat/completions",status="401"}'] >= 1
    ttft_count = [line for line in text.splitlines() if line.startswith("starshard_time_to_first_token_seconds_count")]
    assert float(ttft_count[0].split()[-1]) >= 2


# ---- settings and app variants (TestClient: no server needed) ----


def test_settings_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="port"):
        ServerSettings(port=70000)
    with pytest.raises(ValueError, match="max_tokens_limit"):
        ServerSettings(max_tokens_limit=0)
    with pytest.raises(ValueError, match="log_level"):
        ServerSettings(log_level="loud")
    monkeypatch.setenv("STARSHARD_API_KEY", "from-env")
    assert ServerSettings().api_key == "from-env"
    monkeypatch.delenv("STARSHARD_API_KEY")
    s = ServerSettings()
    assert s.api_key is None and s.host == "127.0.0.1" and s.max_body_bytes == 64 << 20 and not s.log_prompts


def test_no_key_apps_side_by_side_and_prompts_unlogged(caplog):
    engine = FakeBackend()
    with caplog.at_level(logging.INFO, logger="starshard.server"):
        quiet = TestClient(create_app(engine, ServerSettings(api_key=None, served_model_name="doc")))
        loud = TestClient(create_app(engine, ServerSettings(api_key=None, log_prompts=True)))  # a second registry
        body = {"model": "doc", "messages": [{"role": "user", "content": "secret-document words"}]}
        r = quiet.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == FULL
        assert "secret-document" not in caplog.text and "done" in caplog.text
        r = loud.post("/v1/chat/completions", json={**body, "model": MODEL})
        assert r.status_code == 200 and "secret-document" in caplog.text
    assert quiet.get("/v1/models").json()["data"][0]["id"] == "doc"


def test_run_server_announces_its_address(capsys):
    settings = ServerSettings(port=0, log_level="warning")
    server, thread = start(create_app(FakeBackend(), settings), settings)
    try:
        out = capsys.readouterr().out
        assert f"serving {MODEL} on http://127.0.0.1:{server.bound_port}" in out
        assert httpx.get(f"http://127.0.0.1:{server.bound_port}/health").json() == {"status": "ok"}
    finally:
        stop(server, thread)
