"""A request's token ids: the chat template applied, the context / query split found, the window checked.

Context-parallel strategies treat the two sides differently (Star and APB run the query after the
context; the context cache keys on the ids), so the split is exact: the two sides are tokenized
separately and every strategy sees the same ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from starshard.checkpoints.convert import gguf_tokenizer
from starshard.config import ModelConfig


class PromptTooLongError(ValueError):
    pass


@dataclass
class Prompt:
    """Token ids of one request; ids[:context_len] is the context, the rest is the query.
    ids[:head_len] is the chat template's head (system / user header) at the context's front."""

    ids: list[int]
    context_len: int
    head_len: int = 0
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    def device_ids(self, device) -> torch.Tensor:
        """All ids as a [L] tensor on `device`, uploaded once (CUDA: from pinned memory, non-blocking): a
        chunked prefill's steps take slices of it, so none waits on a host copy (a copy from a Python list
        drains the GPU's queue, which then idles while the host launches the step)."""
        device = torch.device(device)
        if device not in self._on_device:
            host = torch.tensor(self.ids, dtype=torch.long)
            if device.type == "cuda":
                host = host.pin_memory()
            self._on_device[device] = host.to(device, non_blocking=True)
        return self._on_device[device]


# What a checkpoint directory holds its tokenizer in (HF's fast and slow formats, sentencepiece models)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path: Path):
    """The model's tokenizer, or None if the checkpoint has none (then prompts must be token ids)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        if path.is_file():  # .gguf
            return gguf_tokenizer(path)
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            return None  # transformers would build an empty tokenizer (a vocabulary of 1) from the config alone
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def build_prompt(tokenizer, *, prompt=None, context=None, question=None, raw=False) -> Prompt:
    """Token ids for a plain prompt or a context + question pair, chat template applied unless raw.

    The context/query split is found in the rendered text and the two sides are tokenized
    separately, so the split is exact and every strategy sees the same ids.
    """
    if prompt is not None and (context is not None or question is not None):
        raise ValueError("give either prompt or context + question, not both")
    if prompt is None and context is None:
        raise ValueError("give a prompt, or a context and a question")
    if isinstance(prompt, (list, tuple)):  # token ids pass through untouched
        return Prompt(list(prompt), len(prompt))
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer files: pass token ids instead of text")
    context_text = prompt if prompt is not None else context
    query_text = "" if prompt is not None else ("\n\n" + question if question else "")
    content = context_text + query_text
    use_template = not raw and getattr(tokenizer, "chat_template", None)
    text = (
        tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        if use_template
        else content
    )
    start = text.find(content)
    split = start + len(context_text)
    head = tokenizer.encode(text[:split], add_special_tokens=not use_template)
    tail = tokenizer.encode(text[split:], add_special_tokens=False) if split < len(text) else []
    return Prompt(head + tail, len(head), _head_len(tokenizer, text[:start], head, use_template) if use_template else 0)


def _head_len(tokenizer, head_text: str, ids: list[int], use_template) -> int:
    """Tokens of the template head: those of the head text alone that the prompt's ids start with
    (a token merging across the head / context boundary counts as context)."""
    alone = tokenizer.encode(head_text, add_special_tokens=not use_template) if head_text else []
    n = 0
    while n < min(len(alone), len(ids)) and alone[n] == ids[n]:
        n += 1
    return n


def check_window(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, budget: str = "max_new_tokens",
                 unwindowed: str | None = None) -> None:
    """Refuse a request the model cannot hold: prompt + new tokens over the window. The message names the
    limit and what to change; `budget` is what the caller calls the new-token budget (a flag, an API
    field). A sliding window is no limit where the local layers attend it (engine/model.py); `unwindowed`
    names what runs this model without its windows (--fp8 attention's 8-bit scores), which then holds
    only sequences within the sliding window, where the window hides nothing."""
    window = cfg.max_position_embeddings
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if prompt_len >= window:  # the prompt alone: no new-token budget would make it fit
        raise PromptTooLongError(f"the prompt is {prompt_len} tokens, which fills the model window of {window} "
                                 f"tokens (room is needed for at least one new token): shorten the prompt to at most "
                                 f"{window - max(max_new_tokens, 1)} tokens")
    if max_new_tokens >= window:
        raise PromptTooLongError(f"{max_new_tokens} new tokens leave no room for a prompt: the budget exceeds the model "
                                 f"window of {window} tokens; lower {budget} below {window}")
    if prompt_len + max_new_tokens > window:
        raise PromptTooLongError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the model window of "
            f"{window} tokens; shorten the prompt to at most {window - max_new_tokens} tokens or lower {budget}"
        )
    sw = cfg.sliding_window
    if unwindowed is not None and sw is not None and prompt_len + max_new_tokens > sw:
        raise PromptTooLongError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the model's sliding window "
            f"(sliding_window={sw}), and {unwindowed} does not run sliding windows yet: keep prompt + new tokens "
            f"within {sw}, or run with --cp 1 --cp-strategy dense, no --sparse, no --fp8 attention (LLM.generate)"
        )


ROLES = ("system", "user", "assistant")


def build_chat_prompt(tokenizer, messages: list[dict]) -> Prompt:
    """Token ids of a chat conversation, the template applied, split into context and query.

    The query is the last paragraph (after the last blank line) of the last user message, or that
    whole message when it has none; everything before it is the context. So a document sent in
    earlier messages, or before a blank line in the same message, is context: Star / APB treat it as
    such, and the context cache finds it again when the next question or turn repeats it."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer files: use the completions API with token ids")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        clean.append({"role": m["role"], "content": content})
    last_user = max((i for i, m in enumerate(clean) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("messages need at least one user message")
    if not clean[last_user]["content"].strip():
        raise ValueError(f"messages[{last_user}] (the last user message) has empty content: send the question as "
                         "its content")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use the completions API")
    text = tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
    content = clean[last_user]["content"]
    start = text.rfind(content) if content else -1
    if start < 0:
        raise ValueError("could not find the last user message in the rendered chat template")
    cut = content.rfind("\n\n")
    split = start + (cut + 2 if cut >= 0 else 0)
    head = tokenizer.encode(text[:split], add_special_tokens=False)
    tail = tokenizer.encode(text[split:], add_special_tokens=False)
    first = text.find(clean[0]["content"]) if clean[0]["content"] else -1
    head_len = _head_len(tokenizer, text[:first], head, True) if first > 0 else 0
    return Prompt(head + tail, len(head), head_len)
