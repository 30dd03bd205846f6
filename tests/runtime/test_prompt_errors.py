"""What a user reads when a prompt cannot run: the error names the prompt's length, the window and the fix,
not a budget that would not help or a chat template's detail."""
from types import SimpleNamespace

import pytest

from starshard.runtime.prompt import PromptTooLongError, build_chat_prompt, check_window

CFG = SimpleNamespace(max_position_embeddings=64, sliding_window=None)


def test_a_prompt_over_the_window_is_not_blamed_on_the_budget():
    with pytest.raises(PromptTooLongError) as e:
        check_window(CFG, 80, 1, budget="max_tokens")
    assert "the prompt is 80 tokens" in str(e.value) and "window of 64" in str(e.value)
    assert "max_tokens" not in str(e.value) and "at most 63 tokens" in str(e.value)
    with pytest.raises(PromptTooLongError, match="lower max_tokens"):  # here the budget is the fix
        check_window(CFG, 40, 30, budget="max_tokens")


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_user_message_is_named(content):
    tokenizer = SimpleNamespace(chat_template="{{ messages }}")  # refused before anything is rendered
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    with pytest.raises(ValueError, match=r"messages\[1\] \(the last user message\) has empty content"):
        build_chat_prompt(tokenizer, messages)


def test_a_checkpoint_without_tokenizer_files_has_no_tokenizer(tmp_path):
    """Text prompts then are refused, naming token ids, instead of running through the empty tokenizer (a
    vocabulary of 1) that transformers builds from a config alone."""
    from tests.helpers.hf_models import make_hf_model

    from starshard.runtime.prompt import build_prompt, load_tokenizer

    _, path = make_hf_model("qwen2", tmp_path)
    assert load_tokenizer(path) is None
    with pytest.raises(ValueError, match="pass token ids instead of text"):
        build_prompt(load_tokenizer(path), prompt="some text")
    assert build_prompt(None, prompt=[5, 6, 7]).ids == [5, 6, 7]
