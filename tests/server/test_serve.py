"""The real server end to end: `launch/serve.py` started as a separate process on a free 127.0.0.1
port (--port 0, the bound port read from its "serving NAME on URL" line) with the embedded
SmolLM2-135M-Instruct on CPU, driven by the official `openai` client: answers and usage, the context
cache across questions and turns, batching that does not change answers, a bounded load run, bad
inputs, and a context-parallel group (torchrun --cp 2 ring) that answers alike and ends as a whole
when one of its ranks is killed.

The API layer's details (every error shape, stop strings, disconnects) are covered with a fake
backend in test_server_api.py; this module checks what only the real scheduler can show. The greedy
references come from starshard.LLM in this process, on the very token ids the server runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.server_process import MODEL, SERVE, ServerProcess, children, environ_of, running, server_env

KEY = "sk-serve-test"
WINDOW = 8192  # SmolLM2's max_position_embeddings
TOKENS_LIMIT = 4096  # serve.py's default --max-tokens-limit
CACHE_GIB = 0.08  # small on purpose: ~1800 tokens of entries, so the load run has to evict
CLIENT_TIMEOUT = 120

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


def _cp_cmd() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0", SERVE, "--cp", "2", "--cp-strategy", "ring", "--port", "0",
            "--dist-timeout", "30", "--log-level", "warning"]


@pytest.fixture(scope="module")
def cp_launch(logdir):
    """The torchrun cp=2 ring server, started at once so its model load overlaps the single-process
    tests; cp_server waits for it. None (and those tests skip) without torchrun."""
    if shutil.which("torchrun") is None:
        yield None
        return
    server = ServerProcess("cp2", _cp_cmd(), server_env(), logdir)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def single(logdir, cp_launch):
    """One single-process server: an API key, a 1 MiB body limit and a small context cache."""
    cmd = [sys.executable, SERVE, "--port", "0", "--api-key", KEY, "--max-body-mb", "1",
           "--cache-gib", str(CACHE_GIB), "--log-level", "warning"]
    server = ServerProcess("single", cmd, server_env(), logdir)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def base(single):
    return single.base


@pytest.fixture(scope="module")
def client(base):
    with openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    """The in-process greedy reference (and tokenizer) on the same embedded checkpoint."""
    from starshard import LLM

    return LLM(progress=False)


# ---- helpers ----


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def stream_text(chunks) -> tuple[str, str | None, object]:
    """(text, last finish_reason, usage) of a streamed chat or completion."""
    text, finish, usage = [], None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            text.append(piece or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage


def chat_ids(llm, messages, head=False) -> tuple:
    """(token ids, context length[, template head length]) of a chat prompt, as the server builds it."""
    from starshard.runtime.prompt import build_chat_prompt

    p = build_chat_prompt(llm.tokenizer, messages)
    return (p.ids, p.context_len, p.head_len) if head else (p.ids, p.context_len)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens two prompts share, at most all but b's last (the cache always leaves one to run)."""
    n = 0
    while n < min(len(a), len(b) - 1) and a[n] == b[n]:
        n += 1
    return n


def reference(llm, messages, max_tokens: int) -> str:
    ids, _ = chat_ids(llm, messages)
    return llm.generate(ids, max_new_tokens=max_tokens).text


def check_usage(usage, prompt_tokens: int, max_tokens: int, finish: str) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    if finish == "length":
        assert usage.completion_tokens == max_tokens
    else:
        assert finish == "stop" and 1 <= usage.completion_tokens <= max_tokens


ANIMALS = ["fox", "dog", "cat", "owl", "bee", "ant", "elk", "yak", "cow", "pig", "hen", "rat", "bat", "eel",
           "ram", "emu", "gnu", "ape", "doe", "jay"]
COLORS = ["red", "blue", "green", "grey", "brown", "white", "black", "pink"]


def document(seed: int, facts: int) -> str:
    """A list of facts ("The red fox is number 3."), ~7 tokens each; different per seed."""
    out = []
    for i in range(facts):
        a, c = ANIMALS[(i + seed) % len(ANIMALS)], COLORS[(i * 3 + seed) % len(COLORS)]
        out.append(f"The {c} {a} is number {(i * 7 + seed * 13) % 97}.")
    return " ".join(out)


def metrics(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def assert_alive(client):
    r = chat(client, user("Say hi."), max_tokens=1)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens == 1


# ---- 1. chat and completions, streamed and not ----

SHORT = user("Write one sentence about the sea.")


def test_chat_answer_stream_and_usage(client, llm):
    ids, _ = chat_ids(llm, SHORT)
    r = chat(client, SHORT, max_tokens=8)
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.strip() and r.choices[0].message.role == "assistant" and r.model == MODEL
    check_usage(r.usage, len(ids), 8, finish)
    assert text == llm.generate(ids, max_new_tokens=8).text  # greedy: the engine's tokens, no other

    chunks = list(chat(client, SHORT, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    s_text, s_finish, s_usage = stream_text(chunks)
    assert (s_text, s_finish) == (text, finish)
    check_usage(s_usage, len(ids), 8, finish)
    assert s_usage.completion_tokens == r.usage.completion_tokens
    assert s_usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_completions_answer_stream_and_usage(client, llm):
    from starshard.runtime.prompt import build_prompt

    prompt = "The three largest cities of France are"
    n_prompt = len(build_prompt(llm.tokenizer, prompt=prompt, raw=True).ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text.strip() and r.object == "text_completion"
    check_usage(r.usage, n_prompt, 6, finish)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    s_text, s_finish, s_usage = stream_text(chunks)
    assert (s_text, s_finish) == (text, finish)
    check_usage(s_usage, n_prompt, 6, finish)
    assert s_usage.completion_tokens == r.usage.completion_tokens


# ---- 2. / 3. the context cache: another question, another turn ----

DOC = document(1, 55)  # ~530 tokens
Q_A, Q_B, Q_C = "What number is the red fox?", "What number is the grey owl?", "And the blue cat?"
DOC_MAX = 12


@pytest.fixture(scope="module")
def doc_answers(client, llm):
    """Question A then question B on a document the server has not seen (another prompt is cached
    before, so the result does not depend on which test ran first)."""
    chat(client, user(document(99, 10) + "\n\nWhat number is the pink dog?"), max_tokens=1)
    a = chat(client, user(DOC + "\n\n" + Q_A), max_tokens=DOC_MAX)
    b = chat(client, user(DOC + "\n\n" + Q_B), max_tokens=DOC_MAX)
    return a, b


def test_cached_answer_equals_the_uncached_reference(doc_answers, llm):
    a, b = doc_answers
    for r in (a, b):
        assert r.choices[0].message.content.strip()
    ref = reference(llm, user(DOC + "\n\n" + Q_B), DOC_MAX)
    assert b.choices[0].message.content == ref


def test_second_question_on_a_document_skips_its_prefill(doc_answers, llm):
    a, b = doc_answers
    ids_a, _, head_a = chat_ids(llm, user(DOC + "\n\n" + Q_A), head=True)
    ids_b, context_b = chat_ids(llm, user(DOC + "\n\n" + Q_B))
    assert context_b > 400  # the document (and the template's head) is the context
    assert a.usage.prompt_tokens == len(ids_a) and b.usage.prompt_tokens == len(ids_b)
    # A: only the chat template's head (the system prompt every request starts with) may be reused.
    assert a.usage.prompt_tokens_details.cached_tokens <= head_a, "a document never sent before came from the cache"
    # B: everything it shares with A (the document, and the question's first words) comes from A's KV.
    cached, shared = b.usage.prompt_tokens_details.cached_tokens, common_prefix(ids_a, ids_b)
    assert context_b <= shared < len(ids_b)
    assert cached == shared, (
        f"question B reused {cached} cached tokens; it shares {shared} of its {len(ids_b)} with question A")


def test_follow_up_turn_reuses_the_document(doc_answers, client, llm):
    a, _ = doc_answers
    messages = user(DOC + "\n\n" + Q_A) + [{"role": "assistant", "content": a.choices[0].message.content},
                                          {"role": "user", "content": Q_C}]
    r = chat(client, messages, max_tokens=6)
    ids, _ = chat_ids(llm, messages)
    ids_a, doc_context = chat_ids(llm, user(DOC + "\n\n" + Q_A))
    assert r.choices[0].message.content.strip() and r.usage.prompt_tokens == len(ids)
    # What the turn shares with question A's prompt (the document at least) comes from A's KV.
    cached, shared = r.usage.prompt_tokens_details.cached_tokens, common_prefix(ids_a, ids)
    # (- 1: the context's closing "\n\n" is one token when it ends the prompt's context, two "\n" once
    # the question is an earlier turn's text; the cache cannot match across that.)
    assert doc_context - 1 <= shared < len(ids)
    assert cached == shared, f"the follow-up reused {cached} tokens; it shares {shared} with the first turn"


# ---- 4. concurrent streams decode together, and answer as alone ----


def test_concurrent_streams_answer_as_alone(client):
    doc = document(7, 20)  # ~140 tokens
    questions = ["What number is the green dog?", "What number is the black elk?", "Which animal is number 20?",
                 "How many animals are listed?"]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(questions))

    def one(i):
        try:
            barrier.wait(30)
            first = None
            chunks = []
            for c in chat(client, user(doc + "\n\n" + questions[i]), max_tokens=8, stream=True,
                          stream_options={"include_usage": True}):
                chunks.append(c)
                if first is None and c.choices and c.choices[0].delta.content:
                    first = time.monotonic()
            results[i] = (*stream_text(chunks), first, time.monotonic())
        except BaseException as e:  # noqa: BLE001 (re-raised below in the test thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CLIENT_TIMEOUT + 30)
    assert not errors, errors
    assert sorted(results) == list(range(len(questions))), "a stream did not finish"
    # They were in flight together: every stream had its first token before any stream ended.
    assert max(r[3] for r in results.values()) < min(r[4] for r in results.values())
    for i, q in enumerate(questions):
        text, finish, usage, *_ = results[i]
        assert text.strip() and finish in ("length", "stop") and usage.completion_tokens >= 1
        alone = chat(client, user(doc + "\n\n" + q), max_tokens=8)
        assert (text, finish) == (alone.choices[0].message.content, alone.choices[0].finish_reason), q


# ---- 5. a bounded load run ----


def test_load_run_stays_within_the_cache_budget(client, http):
    docs = [document(20 + d, 4) for d in range(3)]  # ~30 tokens each, repeated
    jobs = [(docs[i % 3], f"What number is the {COLORS[i % 8]} {ANIMALS[i % 20]}?") for i in range(64)]
    before = metrics(http)
    lock = threading.Lock()
    done: list = []
    errors: list = []
    deadline = time.monotonic() + 240

    def worker():
        while time.monotonic() < deadline:
            with lock:
                if not jobs:
                    return
                doc, q = jobs.pop()
            try:
                r = chat(client, user(doc + "\n\n" + q), max_tokens=4, timeout=60)
                done.append(r)
            except Exception as e:  # noqa: BLE001 (counted; the run goes on)
                errors.append(e)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()) + 65)
    assert not any(t.is_alive() for t in threads), "the load run did not end"
    assert not errors, errors[:3]
    assert len(done) == 64, f"{len(done)} of 64 answered before the deadline"
    for r in done:
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 0
        assert 1 <= r.usage.completion_tokens <= 4
    after = metrics(http)
    assert after["starshard_context_cache_bytes"] <= after["starshard_context_cache_budget_bytes"]
    assert after["starshard_context_cache_budget_bytes"] == int(CACHE_GIB * 2**30)
    hits = after["starshard_context_cache_hits_total"] - before.get("starshard_context_cache_hits_total", 0)
    assert hits > 0
    ok = 'starshard_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[ok] - before.get(ok, 0) == 64
    assert after["starshard_queue_depth"] == 0 and after["starshard_running_requests"] == 0


# ---- 6. bad inputs against the real server ----


def _error(r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for needle in needles:
        assert needle in message, message


def test_bad_inputs_are_refused_and_the_server_keeps_serving(http, client, llm, base):
    good = {"model": MODEL, "messages": user("hi"), "max_tokens": 1}
    _error(http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [}',
                     headers={"Content-Type": "application/json"}), 400, "malformed JSON")
    assert_alive(client)
    _error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "'messages'")
    assert_alive(client)
    _error(http.post("/v1/chat/completions", json={**good, "model": "gpt-4"}), 404, "'gpt-4'", MODEL)
    assert_alive(client)
    _error(http.post("/v1/chat/completions", json={**good, "max_tokens": TOKENS_LIMIT + 1}), 400,
           f"limit of {TOKENS_LIMIT}")
    assert_alive(client)
    # A prompt that, with the tokens asked for, does not fit the window; then one that fills it.
    long_text = "hello " * (WINDOW - 50)
    n_long = len(chat_ids(llm, user(long_text))[0])
    assert WINDOW - 40 < n_long <= WINDOW
    _error(http.post("/v1/chat/completions", json={**good, "messages": user(long_text), "max_tokens": 100}), 400,
           f"window of {WINDOW}")
    assert_alive(client)
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hello " * (WINDOW + 100))}),
           400, f"window of {WINDOW}")
    assert_alive(client)
    # with max_tokens given, a prompt over the window is still the prompt's fault, not max_tokens'
    r = http.post("/v1/chat/completions", json={**good, "messages": user("hello " * (WINDOW + 100))})
    _error(r, 400, "the prompt is", f"window of {WINDOW}")
    assert "max_tokens" not in r.json()["error"]["message"]
    _error(http.post("/v1/chat/completions", json={**good, "messages": user("")}), 400, "has empty content")
    assert_alive(client)
    _error(http.post("/v1/chat/completions", json={**good, "messages": user("x" * (1 << 20))}), 413,
           f"limit of {1 << 20} bytes", "--max-body-mb")
    assert_alive(client)
    with httpx.Client(base_url=base, timeout=30) as anon:
        _error(anon.post("/v1/chat/completions", json=good), 401, "missing API key")
        _error(anon.post("/v1/chat/completions", json=good, headers={"Authorization": "Bearer wrong"}), 401,
               "invalid API key")
        assert anon.get("/health").status_code == 200  # probes stay open
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=30) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert_alive(client)


# ---- 7. the context-parallel group: same answers, cache, and a killed rank ----


@pytest.fixture(scope="module")
def cp_server(cp_launch):
    if cp_launch is None:
        pytest.skip("torchrun is not on PATH: the cp=2 server tests need it")
    cp_launch.wait_ready()
    return cp_launch


@pytest.fixture(scope="module")
def cp_client(cp_server):
    with openai.OpenAI(base_url=f"{cp_server.base}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT) as c:
        yield c


CP_DOC = document(3, 20)  # ~140 tokens


def test_cp2_answers_like_one_process_and_reuses_the_cache(cp_client, client, llm):
    first = user(CP_DOC + "\n\nWhat number is the blue fox?")
    one = chat(client, first, max_tokens=8)
    cp = chat(cp_client, first, max_tokens=8)
    assert cp.choices[0].message.content == one.choices[0].message.content
    assert cp.choices[0].finish_reason == one.choices[0].finish_reason
    assert cp.usage.prompt_tokens == one.usage.prompt_tokens == len(chat_ids(llm, first)[0])
    follow = first + [{"role": "assistant", "content": cp.choices[0].message.content},
                      {"role": "user", "content": "And the red owl?"}]
    r = chat(cp_client, follow, max_tokens=6)
    ids_first, doc_context = chat_ids(llm, first)
    shared = common_prefix(ids_first, chat_ids(llm, follow)[0])
    assert r.choices[0].message.content.strip() and doc_context - 1 <= shared < r.usage.prompt_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == shared
    one_follow = chat(client, follow, max_tokens=6)
    assert r.choices[0].message.content == one_follow.choices[0].message.content


def test_cp2_killed_rank_ends_the_server(cp_server):
    """Runs last: it destroys the cp=2 server. Rank 1 is SIGKILLed while a stream is in flight: the
    stream fails, later requests fail at once, and torchrun exits non-zero naming the failure."""
    workers = children(cp_server.proc.pid)
    rank1 = [pid for pid in workers if environ_of(pid).get("RANK") == "1"]
    assert len(workers) == 2 and len(rank1) == 1, (workers, [environ_of(p).get("RANK") for p in workers])
    c = openai.OpenAI(base_url=f"{cp_server.base}/v1", api_key="none", max_retries=0, timeout=30)
    outcome: dict = {}
    streaming = threading.Event()

    def in_flight():
        text = []
        try:
            for chunk in chat(c, user("Tell me a very long story about a fox."), max_tokens=400, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    streaming.set()
            outcome["finished"] = "".join(text)
        except Exception as e:  # noqa: BLE001 (what the client saw is the result)
            outcome["error"] = e
        finally:
            streaming.set()

    t = threading.Thread(target=in_flight, daemon=True)
    t.start()
    assert streaming.wait(60), "the stream did not start"
    assert "error" not in outcome, outcome
    t0 = time.monotonic()
    os.kill(rank1[0], signal.SIGKILL)
    try:
        rc = cp_server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs 60 s after rank 1 was killed:\n{cp_server.stderr()[-2000:]}")
    ended = time.monotonic() - t0
    t.join(40)
    assert not t.is_alive(), "the in-flight stream hangs"
    assert "error" in outcome, f"the in-flight stream finished normally: {outcome}"
    assert isinstance(outcome["error"], (openai.APIError, httpx.HTTPError)), repr(outcome["error"])
    assert rc != 0 and ended < 60
    err = cp_server.stderr()
    named = "error: rank" in err or re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*-9", err)
    assert named, err[-3000:]
    t1 = time.monotonic()
    with pytest.raises((openai.APIConnectionError, openai.InternalServerError)) as e:
        chat(c, user("hi"), max_tokens=1)
    assert time.monotonic() - t1 < 35
    if isinstance(e.value, openai.InternalServerError):
        assert e.value.status_code == 503
    gone = time.monotonic() + 15
    while any(running(pid) for pid in workers) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not any(running(pid) for pid in workers), "a rank outlived the server"
