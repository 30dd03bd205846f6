"""The engine interface the HTTP server is written against.

The server imports these names from here only: the exceptions and event types are the engine's own
(starshard/runtime/service.py); the protocols say what the server calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from starshard.runtime.service import EngineUnavailable, QueueFull, SamplingParams, TokenEvent  # noqa: F401


class Ticket(Protocol):
    def cancel(self) -> None:
        """The client went away: free the batch slot and the KV."""
        ...


class Engine(Protocol):
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
        sampling: SamplingParams,
        stop: list[str] | None,
        on_event: Callable[[TokenEvent], None],
    ) -> Ticket:
        """Queue one request. Raises QueueFull, EngineUnavailable, or ValueError (prompt + max_tokens
        over the window; the message names the limit)."""
        ...

    def health(self) -> str | None:
        """None when healthy, else why not."""
        ...

    def stats(self) -> dict:
        """Snapshot for /metrics: queue_depth, running, cache_bytes, cache_budget_bytes, cache_hits,
        cache_lookups, prefill_tokens_total, decode_tokens_total, cached_tokens_total."""
        ...
