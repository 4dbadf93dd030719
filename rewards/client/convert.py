"""TRL/axolotl reward-function arguments -> `nemo_gym_grpc.v1.VerifyRequest`s.

Input shapes are those TRL passes to a reward function: `completions` and `prompts` (one per
item, conversational or plain text) plus every dataset column as a keyword argument holding one
value per item. axolotl's NeMo Gym dataset loader produces the columns `prompt` (a list with
one user message), `resources_server_ref` (`{"name": <resources server>}`) and `verify_extra`
(the whole NeMo Gym dataset row, including its own `responses_create_params`; Arrow fills keys
that other rows have and this one lacks with None).

Rules that belong to the bridge are left to it: a row that is not a JSON object or holds NaN
or a lone surrogate escape comes back as INVALID_ARGUMENT, an unknown name as NOT_FOUND. This
module decides two per-item rules itself: an item without a `resources_server_ref` name
(missing, None from Arrow, or not `{"name": ...}`: the message names the expected shape), and
text that is not valid Unicode (a lone surrogate such as "\\ud800" in the completion, a prompt
message or the server name; proto3 `string` fields must be UTF-8), which cannot even be put in
a message. Such an item gets a local INVALID_ARGUMENT failure (`Batch.rejected`, reason
INVALID_ITEM, like the bridge's own invalid items), is not sent, and the rest of the batch is
scored. Otherwise only argument shapes no item could be built from are rejected, by raising.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.shared.reasons import INVALID_ITEM
from nemo_gym_grpc.v1 import verify_pb2

_R = TypeVar("_R")  # the request message (VerifyRequest, RunRequest)
_O = TypeVar("_O")  # its successful result (VerifyResponse, RunResponse)


class InvalidItem(ValueError):
    """An item that cannot be sent: its caller fails it alone, here (`Batch.reject`), and sends
    the rest."""


class InvalidText(InvalidItem):
    """Text that a proto3 `string` field cannot carry (it has a lone surrogate)."""


def proto_text(text: str, what: str) -> str:
    """`text` as a proto3 `string` field can carry it.

    A surrogate pair written as two code points ("\\ud83d\\ude00", as UTF-16 decoders may
    leave it) is joined into its character; that is a change of representation, not of text.

    Args:
        text: any Python string.
        what: what the text is, for the error message (e.g. "completion").

    Raises:
        InvalidText: the text holds a lone surrogate (U+D800..U+DFFF without its partner,
            e.g. from a JSON "\\ud800" escape or bytes decoded with "surrogateescape");
            the message names `what`, the code point and its index.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    try:
        joined.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidText(
            f"{what} is not valid Unicode: lone surrogate U+{ord(joined[exc.start]):04X} at "
            f"character {exc.start} (gRPC strings must be UTF-8); the item was not sent"
        ) from None
    return joined


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


def proto_messages(messages: Sequence[tuple[str, str]]) -> list[verify_pb2.Message]:
    """(role, content) pairs (`prompt_messages`) as the contract's `Message`s.

    Raises:
        InvalidText: a role or content is not valid Unicode.
    """
    return [
        verify_pb2.Message(
            role=proto_text(role, f"prompt message {i} role"),
            content=proto_text(content, f"prompt message {i} content"),
        )
        for i, (role, content) in enumerate(messages)
    ]


def resources_server_name(ref: Any) -> str:
    """The routing key from one `resources_server_ref` value (`{"name": "mcqa"}` -> "mcqa").

    A missing, empty or malformed ref (not a dict, no string `name`) gives "" (`build_batch`
    fails that item with INVALID_ARGUMENT naming the expected shape).
    """
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else ""


def json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """The JSON object `text` holds (a dataset line, a label, a row stored as text).

    Raises:
        ValueError: `text` is not JSON, or JSON of something else than an object; the one
            message form for such text, "{what}: not JSON: ..." / "{what}: a JSON list, not
            an object" (`what` names where it was, e.g. "line 7", "sample.metadata").
    """
    try:
        value = json.loads(text)
    except ValueError as exc:  # also invalid UTF-8
        raise ValueError(f"{what}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: a JSON {type(value).__name__}, not an object")
    return value


def row_json(extra: Any, index: int) -> str:
    """`verify_extra[index]` (the dataset row) as JSON text for `VerifyRequest.row_json`.

    None gives "" (no row). Text is taken as the row's JSON text (as the `rollout_func` takes
    it: a column of JSON text keeps Arrow from filling other rows' keys in with None) and
    decoded first. Anything else is dumped as is, ASCII-escaped, so any Python text can travel;
    the bridge drops None values and fails that item alone (INVALID_ARGUMENT / INVALID_ITEM)
    when the value is not a JSON object (text that is not JSON included), holds NaN/Infinity,
    or holds a lone surrogate escape ("\\ud800": dataset text that is not Unicode).

    Raises:
        TypeError: the row holds a value JSON cannot represent (e.g. bytes, datetime).
    """
    if extra is None:
        return ""
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            pass  # sent as a JSON string, which the bridge refuses for this item alone
    try:
        return json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"verify_extra[{index}] is not JSON serializable: {exc}") from None


@dataclass
class Batch(Generic[_R, _O]):
    """The items of one reward-function call (or of one batch of rollouts, `rollouts.py`).

    Attributes:
        size: the number of input items (completions).
        batch_id: unique per call; item `index` (its input position) has the request_id
            `request_id(index)`, f"{batch_id}-{index}".
        requests: the items to send, in input order.
        rejected: input position -> local failure (INVALID_ARGUMENT / INVALID_ITEM) of each
            item that was not sent (no server name, or text that is not valid Unicode).
    """

    size: int
    batch_id: str
    requests: list[_R] = field(default_factory=list)
    rejected: dict[int, Failure] = field(default_factory=dict)

    def request_id(self, index: int) -> str:
        """The request_id of the item at input position `index`."""
        return f"{self.batch_id}-{index}"

    def reject(self, index: int, message: str) -> None:
        """Fail the item at input position `index` here, unsent (INVALID_ARGUMENT /
        INVALID_ITEM), unless it already failed."""
        self.rejected.setdefault(index, Failure("INVALID_ARGUMENT", INVALID_ITEM, message))

    def outcomes(self, sent: Mapping[str, _O | Failure]) -> list[_O | Failure]:
        """One outcome per input item, in input order: the rejected items' failures, and for
        the others `sent[request_id]` (from `Route.send`, `stream.send`).

        Raises:
            ValueError: `sent` has no outcome for a request of this batch.
        """
        outcomes: list[_O | Failure] = []
        for index in range(self.size):
            rejected = self.rejected.get(index)
            outcome = rejected if rejected is not None else sent.get(self.request_id(index))
            if outcome is None:
                raise ValueError(f"no outcome for request_id {self.request_id(index)!r}")
            outcomes.append(outcome)
        return outcomes


def _checked_count(
    completions: Sequence[Any],
    prompts: Sequence[Any] | None,
    resources_server_refs: Sequence[Any] | None,
    verify_extras: Sequence[Any] | None,
) -> int:
    """The number of items, once every column has one value per completion (`build_batch`'s
    ValueError and TypeError for the columns' shapes)."""
    for name, column in (("completions", completions), ("prompts", prompts)):
        if isinstance(column, (str, bytes)):
            raise TypeError(f"{name} must be a list (one per item), got a {type(column).__name__}")
    if resources_server_refs is None:
        raise ValueError(
            "reward function needs the `resources_server_ref` column (one {'name': "
            "<resources server>} per completion), as axolotl's NeMo Gym dataset loader makes"
        )
    count = len(completions)
    for name, values in (
        ("resources_server_ref", resources_server_refs),
        ("prompts", prompts),
        ("verify_extra", verify_extras),
    ):
        if values is not None and len(values) != count:
            raise ValueError(f"{name} has {len(values)} entries for {count} completions")
    return count


def build_batch(
    completions: Sequence[Any],
    prompts: Sequence[Any] | None,
    resources_server_refs: Sequence[Any] | None,
    verify_extras: Sequence[Any] | None,
    *,
    model: str,
    timeout_seconds: float,
    batch_id: str,
    include_reply: bool = False,
) -> Batch[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse]:
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
        include_reply: ask the bridge for the upstream reply's other fields (`reply_json`).

    Returns:
        The requests to send, in input order, and the items rejected locally (no server
        name, or text that is not valid Unicode: INVALID_ARGUMENT, not sent).

    Raises:
        ValueError: `resources_server_ref` is missing, or a column's length differs from the
            number of completions (never zipped, truncated or broadcast).
        TypeError: `completions` or `prompts` is a string, not a list; or a completion,
            prompt or row has a shape no request can be built from.
    """
    count = _checked_count(completions, prompts, resources_server_refs, verify_extras)
    assert resources_server_refs is not None  # _checked_count raised otherwise
    batch: Batch[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse]
    batch = Batch(size=count, batch_id=batch_id)
    for index, completion in enumerate(completions):
        request = verify_pb2.VerifyRequest(
            request_id=batch.request_id(index),
            model=model,
            row_json=row_json(verify_extras[index] if verify_extras is not None else None, index),
            timeout_seconds=timeout_seconds,
            include_reply=include_reply,
        )
        text = completion_text(completion)
        prompt = prompt_messages(prompts[index] if prompts is not None else None)
        try:
            _fill(request, index, text, prompt, resources_server_refs[index])
        except InvalidItem as exc:
            batch.reject(index, str(exc))
            continue
        batch.requests.append(request)
    return batch


def _fill(
    request: verify_pb2.VerifyRequest,
    index: int,
    text: str,
    prompt: list[tuple[str, str]],
    ref: Any,
) -> None:
    """Set the resources server, completion and prompt of `request` (item `index`).

    Raises:
        InvalidItem: `ref` names no server, or a text is not valid Unicode.
    """
    server = resources_server_name(ref)
    if not server:
        raise InvalidItem(
            f"resources_server_ref[{index}] is {ref!r:.100}; each item needs "
            "{'name': <resources server>}"
        )
    request.completion = proto_text(text, "completion")
    request.prompt.extend(proto_messages(prompt))
    request.resources_server = proto_text(server, "resources_server_ref name")
