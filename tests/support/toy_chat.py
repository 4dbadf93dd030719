"""The scripted policy's toy tokenizer and chat template: deterministic token ids for rollouts.

    tokenize("what's it like in sf?")             -> [ids in [FIRST_WORD_ID, VOCAB_SIZE)]
    prompt_token_ids(messages, tools)              -> the prompt a turn is generated from
    generation_token_ids(assistant_message)        -> the tokens of that generated turn
    log_probs(ids)                                 -> deterministic negative floats, one per id

`messages` are Chat Completions messages (what NeMo Gym's `vllm_model` sends upstream: role
system / developer / user / assistant (content, tool_calls) / tool), `tools` the request's
`tools` ([{"type": "function", "function": {"name": ...}}]). Every id is below VOCAB_SIZE (64),
so a tiny TRL model with `vocab_size >= VOCAB_SIZE` can train on them; ids 0-7 are SPECIAL, and
VOCAB names every id.

Prefix-stable across turns, as a real chat template is: a prompt is the rendered messages
followed by the generation header ASSISTANT, and a generation is an assistant message rendered
without that header, so turn k's prompt starts with turn k-1's prompt + generation ids and the
extra ids are the rendered tool output (ending in the next ASSISTANT header).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 64
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL, TOOL_CALL = range(8)
SPECIAL = {
    "<pad>": PAD,
    "<s>": BOS,
    "</s>": EOS,  # ends every rendered message (the end-of-turn token)
    "<|system|>": SYSTEM,
    "<|user|>": USER,
    "<|assistant|>": ASSISTANT,
    "<|tool|>": TOOL,
    "<|tool_call|>": TOOL_CALL,
}
FIRST_WORD_ID = len(SPECIAL)
# A name per id (position = id): the SPECIAL names, then "w8" ... "w63". A WordLevel tokenizer
# over VOCAB (e.g. tests/support/tiny_trl.py's) has exactly these ids, so a tiny TRL model built
# on it can train on rollout token ids and decode them.
VOCAB = [*SPECIAL, *(f"w{i}" for i in range(FIRST_WORD_ID, VOCAB_SIZE))]
_WORD = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str) -> list[int]:
    """Words and punctuation of `text`, each mapped by CRC-32 into [FIRST_WORD_ID, VOCAB_SIZE).
    Deterministic across processes and runs (no Python hash seed); concatenation-stable on word
    boundaries: tokenize(a + " " + b) == tokenize(a) + tokenize(b)."""
    span = VOCAB_SIZE - FIRST_WORD_ID
    return [FIRST_WORD_ID + zlib.crc32(w.encode()) % span for w in _WORD.findall(text)]


def content_text(content: Any) -> str:
    """A message's text: a string as is, a list of content parts joined by a space (their
    `text`), None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
    return " ".join(str(p) for p in parts)


def tool_names(tools: Iterable[Mapping[str, Any]] | None) -> list[str]:
    """The function names of a Chat Completions (or Responses) `tools` list."""
    names = []
    for tool in tools or ():
        function = tool.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
        names.append(str(name))
    return names


def render_message(message: Mapping[str, Any]) -> list[int]:
    """One message with its role header and EOS. An assistant's tool calls follow its content,
    each as TOOL_CALL + name + arguments (the JSON text as sent)."""
    role = message.get("role")
    text = tokenize(content_text(message.get("content")))
    if role in ("system", "developer"):
        return [SYSTEM, *text, EOS]
    if role == "user":
        return [USER, *text, EOS]
    if role == "tool":
        return [TOOL, *text, EOS]
    if role == "assistant":
        return [ASSISTANT, *generation_token_ids(message)]
    raise ValueError(f"unknown chat role {role!r}")


def generation_token_ids(message: Mapping[str, Any]) -> list[int]:
    """The generated tokens of an assistant message: its content, its tool calls, EOS (the
    ASSISTANT header belongs to the prompt)."""
    ids = tokenize(content_text(message.get("content")))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        ids += [TOOL_CALL, *tokenize(str(function.get("name", "")))]
        ids += tokenize(str(function.get("arguments", "")))
    return [*ids, EOS]


def prompt_token_ids(
    messages: Sequence[Mapping[str, Any]], tools: Iterable[Mapping[str, Any]] | None = None
) -> list[int]:
    """BOS, the tool names (if any) as a system block, every message, then the ASSISTANT
    generation header."""
    ids = [BOS]
    names = tool_names(tools)
    if names:
        ids += [SYSTEM, *tokenize(" ".join(names)), EOS]
    for message in messages:
        ids += render_message(message)
    return [*ids, ASSISTANT]


def log_probs(ids: Sequence[int]) -> list[float]:
    """A deterministic log-probability per generated id: -(1 + (7 * id + position) % 10) / 10,
    in [-1.0, -0.1]."""
    return [-(1 + (7 * t + i) % 10) / 10 for i, t in enumerate(ids)]
