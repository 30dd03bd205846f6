"""The load benchmark's HTTP backend (`bench serve --scenario load --url URL`): async streaming POSTs to
/v1/completions with token-id prompts, one chunk per token (`return_token_ids`, vLLM's extension) and
the usage in every chunk (`stream_options.continuous_usage_stats`), so that a cancelled stream's
counts are known too; /metrics scraped before and after for the cross-check. Needs httpx (the
`bench` extra); no torch, no model."""
from __future__ import annotations

import asyncio
import json
import time

from starshard.benchmarks.serve_load import RequestRecord, RequestSpec, parse_prometheus

try:
    import httpx
except ImportError:  # only the client mode needs it
    httpx = None

SETTLE_S = 30.0  # after the load: how long the running / queue gauges may take to reach 0 (cancels land)


def require_httpx() -> None:
    if httpx is None:
        raise ValueError("--url needs the httpx package: pip install 'httpx>=0.27' (starshard's [bench] extra)")


class HttpBackend:
    """One server at base_url; send() is serve_load.run_load's sender."""

    def __init__(self, base_url: str, *, api_key: str | None = None, request_timeout: float = 600.0,
                 max_connections: int | None = None, ignore_eos: bool = False):
        require_httpx()
        self.timeout, self.ignore_eos = request_timeout, ignore_eos
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                        timeout=httpx.Timeout(request_timeout, connect=30.0),
                                        limits=httpx.Limits(max_connections=max_connections,
                                                            max_keepalive_connections=max_connections))
        self.model: str | None = None

    async def model_info(self) -> tuple[str, int]:
        """(served model id, its window in tokens) from /v1/models."""
        r = await self.client.get("/v1/models")
        if r.status_code != 200:
            raise ValueError(f"GET /v1/models answered {r.status_code}: {r.text[:300]} (check --url and --api-key)")
        card = r.json()["data"][0]
        self.model = card["id"]
        return card["id"], int(card["max_model_len"])

    async def scrape(self) -> dict[str, float]:
        r = await self.client.get("/metrics")
        r.raise_for_status()
        return parse_prometheus(r.text)

    async def settle(self) -> dict[str, float]:
        """/metrics once the running and queue gauges are 0 (or after SETTLE_S): client cancels reach the
        scheduler a poll and a step after the connection closed."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            m = await self.scrape()
            if (m.get("starshard_running_requests") == 0 and m.get("starshard_queue_depth") == 0) \
                    or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.2)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        rec.start = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(spec, rec), self.timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            rec.error = f"no terminal event within --request-timeout {self.timeout:g} s"
        except httpx.HTTPError as e:  # the connection failed or dropped: no terminal event
            rec.error = f"{type(e).__name__}: {e}"

    async def _stream(self, spec: RequestSpec, rec: RequestRecord) -> None:
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
                "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            rec.http_status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:500]
                rec.failure, rec.error, rec.end = str(r.status_code), message, time.perf_counter()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:  # a failure after the 200 went out
                    rec.failure, rec.error, rec.end = "stream", chunk["error"].get("message"), now
                    return
                usage = chunk.get("usage")
                if usage:
                    rec.completion_tokens, rec.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(choice.get("text")))  # a server without token ids
                    if n:
                        rec.token_times.append(now)
                        rec.output_tokens += n
                    if choice.get("finish_reason"):
                        rec.finish_reason, rec.end = choice["finish_reason"], now
                if rec.finish_reason is None and spec.cancel_after and rec.output_tokens >= spec.cancel_after:
                    rec.client_cancelled, rec.end = True, now
                    return  # leaving the stream closes the connection: the server cancels the request
