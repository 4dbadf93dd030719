"""The scripted policy's toy tokenizer and chat template (tests/support/toy_chat.py): the
properties rollout tests rely on. Pure; no servers."""

from __future__ import annotations

from tests.support import toy_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = {"function": {"name": "get_weather", "arguments": '{"city": "sf"}'}}


def test_ids_are_deterministic_word_ids_below_the_vocabulary_size() -> None:
    ids = toy_chat.tokenize("what's it like in sf? \\boxed{-1}")
    assert len(ids) == 14  # what ' s it like in sf ? \ boxed { - 1 }
    assert all(toy_chat.FIRST_WORD_ID <= i < toy_chat.VOCAB_SIZE for i in ids)
    assert toy_chat.tokenize("a b") == toy_chat.tokenize("a") + toy_chat.tokenize("b")
    assert len(toy_chat.VOCAB) == toy_chat.VOCAB_SIZE
    assert toy_chat.VOCAB[toy_chat.EOS] == "</s>"


def test_each_turn_s_prompt_extends_the_last_prompt_and_generation() -> None:
    messages: list[dict] = [
        {"role": "developer", "content": "be helpful"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather in sf?"}]},
    ]
    first = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    prompt = toy_chat.prompt_token_ids(messages, TOOLS)
    generated = toy_chat.generation_token_ids(first)
    messages += [first, {"role": "tool", "content": '{"weather_description": "cold"}'}]
    second = toy_chat.prompt_token_ids(messages, TOOLS)
    assert second[: len(prompt) + len(generated)] == prompt + generated
    observation = second[len(prompt) + len(generated) :]
    assert observation[0] == toy_chat.TOOL and observation[-2:] == [
        toy_chat.EOS,
        toy_chat.ASSISTANT,
    ]
    assert generated[0] == toy_chat.TOOL_CALL and generated[-1] == toy_chat.EOS


def test_log_probs_are_negative_and_one_per_id() -> None:
    ids = toy_chat.tokenize("Here is the forecast: cold")
    lps = toy_chat.log_probs(ids)
    assert len(lps) == len(ids) and all(-1.0 <= lp < 0 for lp in lps)
    assert lps == toy_chat.log_probs(ids)
