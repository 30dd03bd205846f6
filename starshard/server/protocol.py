"""Request and response bodies in the shapes of OpenAI's API.

Requests ignore fields they do not know (OpenAI clients send many) but refuse, with a message saying
what to send instead, the known ones this server cannot honour (n > 1, logprobs, echo, penalties,
tools, a JSON response_format, ...). Sampling follows OpenAI's defaults: temperature 1, top_p 1.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's extension: usage so far in every chunk (with include_usage)


class ChatMessage(_Request):
    role: str
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        """Joins text parts into one string; refuses other kinds (images, audio)."""
        if content is None or isinstance(content, str):
            return content or ""
        if not isinstance(content, list):
            # ValueError, not TypeError: pydantic turns only ValueError into a validation error.
            raise ValueError("content must be a string or a list of text parts")  # noqa: TRY004
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content parts of type {kind!r} are not supported: send text parts only")
            texts.append(part["text"])
        return "".join(texts)


class GenerationRequest(_Request):
    """Fields common to both generation endpoints."""

    model: str | None = None  # None = the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # left out: 1.0 (as OpenAI); 0 = greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 or 0 = off (vLLM users send -1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored
    # vLLM's extension: each choice carries the generated token ids, and a stream sends one chunk per token
    # event, also when its text is "" (random weights have no tokenizer: inter-token times stay measurable).
    return_token_ids: bool | None = False
    ignore_eos: bool | None = False  # vLLM's extension: generate max_tokens even past an end-of-sequence token
    # Known fields this server cannot honour: refused unless they ask for nothing (the validators below).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: list | None = None
    functions: list | None = None  # the older name of tools
    tool_choice: Any = None
    response_format: Any = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name}={value} is not supported: this server samples without penalties; "
                             f"leave {info.field_name} out or send 0")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} are not supported: this server has no tool calling; leave "
                             f"{info.field_name} out or send []")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value):
        if value not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported: this server has no tool calling; leave it out or "
                             "send \"none\"")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value):
        kind = value.get("type") if isinstance(value, dict) else value
        if value is not None and kind != "text":
            raise ValueError(f"response_format {kind!r} is not supported: this server answers plain text only; "
                             "leave response_format out or send {\"type\": \"text\"}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty: drop the empty one")
        return stops or None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n not in (None, 1):
            raise ValueError(f"n={n} is not supported: this server returns one choice; send n=1 or leave it out")
        return 1

    def stop_list(self) -> list[str] | None:
        return self.stop  # the validator made it a list (or None)

    def wants_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def wants_continuous_usage(self) -> bool:
        return self.wants_usage_chunk() and bool(self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs):
        if logprobs:
            raise ValueError("logprobs are not supported: leave logprobs out or set it to false")
        return logprobs

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: Any  # text or token ids; checked by _one_prompt
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, str):
            return prompt
        # A list holding one prompt (["text"] or [[ids]]) is one prompt; more are a batch.
        if not isinstance(prompt, list):
            raise ValueError("prompt must be a string or a list of token ids")  # noqa: TRY004 (as above)
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > 1:
                raise ValueError("batch prompts are not supported: send one request per prompt")
            return cls._one_prompt(prompt[0])
        if not prompt:
            raise ValueError("prompt is empty: send text or a list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ValueError("prompt must be a string or a list of non-negative integer token ids")
        return prompt

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported: leave it out")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, best_of):
        if best_of not in (None, 1):
            raise ValueError(f"best_of={best_of} is not supported: leave it out or send 1")
        return best_of

    def token_budget(self) -> int | None:
        return self.max_tokens


# ---- responses ----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": ...} / {"content": ...} / {} on the last chunk
    logprobs: None = None
    finish_reason: str | None = None


class TokenIdsChatChoice(ChatChoice):
    token_ids: list[int]  # return_token_ids


class TokenIdsChatCompletionResponse(ChatCompletionResponse):
    choices: list[TokenIdsChatChoice]


class TokenIdsChatChunkChoice(ChatChunkChoice):
    token_ids: list[int]  # return_token_ids: the ids behind this chunk's delta


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    # Also the shape of each streamed chunk (OpenAI reuses it), where finish_reason may be None.
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TokenIdsChatCompletionChunk(ChatCompletionChunk):
    choices: list[TokenIdsChatChunkChoice]


class TokenIdsCompletionChoice(CompletionChoice):
    token_ids: list[int]  # return_token_ids: the ids behind this choice's (or chunk's) text


class TokenIdsCompletionResponse(CompletionResponse):
    choices: list[TokenIdsCompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "starshard"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
