"""The backend interface the HTTP server is written against.

The server imports these names from here only: the exceptions and event types are the scheduler's own
(starshard/serving/scheduler.py), the sampling settings the package's one type (config.SamplingConfig);
the protocols say what the server calls. `serving.scheduler.Scheduler` implements `Backend`; the tests
drive the server with a scripted fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from starshard.config import SamplingConfig  # noqa: F401
from starshard.serving.scheduler import QueueFull, ServiceUnavailable, TokenEvent  # noqa: F401


class Ticket(Protocol):
    def cancel(self) -> None:
        """The client went away: free the batch slot and the KV."""
        ...


class Backend(Protocol):
    model_name: str
    max_model_len: int  # the model window in tokens

    def chat_prompt(self, messages: list[dict]) -> Any:
        """messages [{"role", "content"}] -> Prompt; ValueError on bad roles or content."""
        ...

    def text_prompt(self, prompt: str | list[int]) -> Any:
        """Completions API: text or token ids -> Prompt."""
        ...

    def submit(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        sampling: SamplingConfig,
        stop: list[str] | None,
        on_event: Callable[[TokenEvent], None],
    ) -> Ticket:
        """Queue one request. Raises QueueFull, ServiceUnavailable, or ValueError (prompt + max_tokens
        over the window; the message names the limit)."""
        ...

    def health(self) -> str | None:
        """None when healthy, else why not."""
        ...

    def stats(self) -> dict:
        """Snapshot for /metrics: queue_depth, running, cache_bytes, cache_budget_bytes, cache_hits,
        cache_lookups, prefill_tokens_total, decode_tokens_total, cached_tokens_total."""
        ...
