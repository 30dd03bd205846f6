"""Settings of the HTTP server, checked when built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

API_KEY_ENV = "STARSHARD_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SHUTDOWN_GRACE_S = 5.0  # SIGTERM / SIGINT: seconds the requests in flight get to finish


def _api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


@dataclass
class ServerSettings:
    # Loopback by default: the API has no key unless one is set, so exposing it is a choice.
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the bound one is printed)
    api_key: str | None = field(default_factory=_api_key_from_env)
    max_body_bytes: int = 64 * 1024 * 1024  # documents are long
    max_tokens_limit: int = 4096  # the most completion tokens one request may ask for
    served_model_name: str | None = None  # None = the backend's model_name
    log_prompts: bool = False  # prompts are private documents: off unless asked
    log_level: str = "info"
    # SIGTERM / SIGINT: requests in flight get this long to finish, then they are cut off, so that the
    # caller's shutdown (the cache's write-down) is not held up by a long stream
    shutdown_grace_s: float = SHUTDOWN_GRACE_S

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host is empty: give an address to bind, e.g. 127.0.0.1 or 0.0.0.0")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r} is not a TCP port: use 0..65535 (0 = any free port)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(f"api_key is blank: give a real key, or None (and unset {API_KEY_ENV}) for no key")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes!r} is too small: use at least 1024 bytes")
        if not isinstance(self.max_tokens_limit, int) or self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit={self.max_tokens_limit!r} must be a positive integer")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name is blank: give a name, or None to use the engine's")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s={self.shutdown_grace_s!r} must be >= 0 seconds")
        self.log_level = str(self.log_level).lower()
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
