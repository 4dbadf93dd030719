"""TRL/axolotl reward-function arguments -> `nemo_gym_grpc.v1.VerifyRequest`s.

Input shapes are those TRL passes to a reward function: `completions` and `prompts` (one per
item, conversational or plain text) plus every dataset column as a keyword argument holding one
value per item. axolotl's NeMo Gym dataset loader produces the columns `prompt` (a list with
one user message), `resources_server_ref` (`{"name": <resources server>}`) and `verify_extra`
(the whole NeMo Gym dataset row, including its own `responses_create_params`; Arrow fills keys
that other rows have and this one lacks with None).

Rules that belong to the bridge are left to it: an empty `resources_server` comes back as
INVALID_ARGUMENT, a row that is not a JSON object or holds NaN as INVALID_ARGUMENT, an unknown
name as NOT_FOUND. This module only rejects argument shapes no item could be built from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_grpc.v1 import verify_pb2


def _utf8(text: str) -> tuple[str, bool]:
    """`text` made encodable as UTF-8 (proto3 `string` requires it), and whether it changed.

    Lone surrogates (e.g. from a JSON `"\\ud800"` escape) become U+FFFD; a surrogate pair
    written as two code points is joined into its character.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fixed = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return fixed, True
    return text, False


def content_text(content: Any) -> str:
    """The text of a chat message's `content`.

    A string is returned as is; None is ""; a list of content parts (OpenAI style,
    `{"type": "text", "text": ...}`, or plain strings) gives its text parts concatenated in
    order (image and other non-text parts are skipped).

    Raises:
        TypeError: `content` is of another type.
    """
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise TypeError(f"message content must be a string or a list of parts, got {content!r:.100}")


def completion_text(completion: Any) -> str:
    """The model's answer text from one TRL completion.

    - Plain text (a `str`): returned as is.
    - Conversational (a list of `{"role", "content"}` dicts, TRL's format for chat datasets):
      the contents of its assistant messages (a message without `role` counts as one), joined
      with "\\n" in order. The usual single assistant message gives exactly its `content`,
      which is what axolotl's seed took (`completion[0]["content"]`). An empty list gives "".

    Raises:
        TypeError: `completion` is neither a string nor a list of message dicts.
    """
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, (list, tuple)):
        raise TypeError(
            f"a completion must be a string or a list of message dicts, got {completion!r:.100}"
        )
    texts = []
    for message in completion:
        if not isinstance(message, Mapping):
            raise TypeError(f"a completion message must be a dict, got {message!r:.100}")
        if message.get("role", "assistant") in (None, "assistant"):
            text = content_text(message.get("content"))
            if text:
                texts.append(text)
    return "\n".join(texts)


def prompt_messages(prompt: Any) -> list[tuple[str, str]]:
    """(role, content) pairs for one TRL prompt.

    A plain string is one user message; a conversational prompt (list of `{"role",
    "content"}` dicts) gives each message in order (missing role -> "user"); None gives [].

    Raises:
        TypeError: `prompt` has another shape.
    """
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [("user", prompt)]
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(
            f"a prompt must be a string or a list of message dicts, got {prompt!r:.100}"
        )
    messages = []
    for message in prompt:
        if not isinstance(message, Mapping):
            raise TypeError(f"a prompt message must be a dict, got {message!r:.100}")
        messages.append((str(message.get("role") or "user"), content_text(message.get("content"))))
    return messages


def resources_server_name(ref: Any) -> str:
    """The routing key from one `resources_server_ref` value (`{"name": "mcqa"}` -> "mcqa").

    A missing, empty or malformed ref (not a dict, no string `name`) gives "": the item is
    still sent and the bridge answers it with INVALID_ARGUMENT, so the failure is counted
    like any other instead of being decided here.
    """
    if isinstance(ref, Mapping) and isinstance(ref.get("name"), str):
        return ref["name"]
    return ""


def row_json(extra: Any, index: int) -> str:
    """`verify_extra[index]` (the dataset row) as JSON text for `VerifyRequest.row_json`.

    None gives "" (no row). Anything else is dumped as is (ASCII-escaped, so lone surrogates
    survive as `\\udXXX` escapes); the bridge drops None values and rejects a value that is
    not a JSON object, or holds NaN/Infinity, for that item alone.

    Raises:
        TypeError: the row holds a value JSON cannot represent (e.g. bytes, datetime).
    """
    if extra is None:
        return ""
    try:
        return json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"verify_extra[{index}] is not JSON serializable: {exc}") from None


@dataclass
class Batch:
    """The VerifyRequests of one reward-function call.

    Attributes:
        requests: one per completion, in input order; `request_id` is f"{batch_id}-{index}".
        repaired: indices of items whose text was not valid Unicode (lone surrogates,
            replaced with U+FFFD so proto3 can carry it).
    """

    requests: list[verify_pb2.VerifyRequest]
    repaired: list[int] = field(default_factory=list)


def _check_length(name: str, values: Sequence[Any], count: int) -> None:
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for {count} completions")


def build_batch(
    completions: Sequence[Any],
    prompts: Sequence[Any] | None,
    resources_server_refs: Sequence[Any] | None,
    verify_extras: Sequence[Any] | None,
    *,
    model: str,
    timeout_seconds: float,
    batch_id: str,
) -> Batch:
    """Build one `VerifyRequest` per completion.

    Args:
        completions: TRL completions (plain strings or lists of message dicts).
        prompts: TRL prompts (same count), or None.
        resources_server_refs: `resources_server_ref` column, one `{"name": ...}` per item.
        verify_extras: `verify_extra` column, one dataset row dict (or None) per item, or
            None when the dataset has no such column (every item then has no row).
        model: written into the Responses object the bridge builds from the completion.
        timeout_seconds: per-item upstream `/verify` budget; 0 = the bridge's default.
        batch_id: prefix of the request ids; unique per call.

    Returns:
        The requests in input order and the indices whose text had to be repaired.

    Raises:
        ValueError: `resources_server_ref` is missing, or a column's length differs from the
            number of completions (never zipped, truncated or broadcast).
        TypeError: a completion, prompt or row has a shape no request can be built from.
    """
    count = len(completions)
    if resources_server_refs is None:
        raise ValueError(
            "reward function needs the `resources_server_ref` column (one {'name': "
            "<resources server>} per completion), as axolotl's NeMo Gym dataset loader makes"
        )
    _check_length("resources_server_ref", resources_server_refs, count)
    if prompts is not None:
        _check_length("prompts", prompts, count)
    if verify_extras is not None:
        _check_length("verify_extra", verify_extras, count)

    batch = Batch(requests=[])
    for index, completion in enumerate(completions):
        repaired = False
        text, changed = _utf8(completion_text(completion))
        repaired |= changed
        messages = []
        for role, content in prompt_messages(prompts[index] if prompts is not None else None):
            role, role_changed = _utf8(role)
            content, content_changed = _utf8(content)
            repaired |= role_changed or content_changed
            messages.append(verify_pb2.Message(role=role, content=content))
        server, changed = _utf8(resources_server_name(resources_server_refs[index]))
        repaired |= changed
        extra = verify_extras[index] if verify_extras is not None else None
        batch.requests.append(
            verify_pb2.VerifyRequest(
                request_id=f"{batch_id}-{index}",
                resources_server=server,
                prompt=messages,
                completion=text,
                model=model,
                row_json=row_json(extra, index),
                timeout_seconds=timeout_seconds,
            )
        )
        if repaired:
            batch.repaired.append(index)
    return batch
