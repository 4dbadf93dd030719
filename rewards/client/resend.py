"""What the client sends again, in one place: a call's streams (what goes on the wire in each,
messages of at most 64 items, and what a broken stream leaves to send again), and which failed
calls are worth another call (`RETRYABLE`, `send_again`) or never are (`PERMANENT`).

When a call's stream breaks (it ends UNAVAILABLE: the bridge was killed, its connection reset,
or it drained), its unanswered items are sent again on a new stream of the same call, to
whichever bridge of the target the channel reaches then (another one of a multi-address target,
or the same one once it is back), within the call's deadline and at most MAX_STREAMS streams in
all. Which items: every unanswered one of a `VerifyStream` (a `/verify` may so reach the
upstream twice), but of a `RunStream` only those never handed to gRPC, whose `/run` cannot have
started (the bridge's own rule for retrying a rollout). docs/failures.md says what this means.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from google.rpc import code_pb2

from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.shared.contract import MiB
from nemo_gym_grpc.shared.reasons import RETRYABLE_CODES, STREAM_IDLE

ITEMS_PER_MESSAGE = 64
# A message is closed early once its items reach this size (a big message only adds latency).
BYTES_PER_MESSAGE = 16 * MiB
MAX_STREAMS = 3  # a call's first stream and at most two more after breaks
log = logging.getLogger(__name__)
BROKEN = "UNAVAILABLE"  # the status of a stream that broke (its bridge gone, reset, draining)
# Codes whose cause is usually gone a moment later: the bridge's own rule for an item's attempts
# (`nemo_gym_grpc.shared.reasons.RETRYABLE_CODES`), by name as a `Failure` holds them.
RETRYABLE = frozenset(code_pb2.Code.Name(code) for code in RETRYABLE_CODES)
# Call-level codes that sending again cannot fix (token refused, no such service, a message
# refused).
PERMANENT = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "INVALID_ARGUMENT"})


def rotated(failure: Failure) -> bool:
    """True for a stream the bridge ended because it sat idle (`STREAM_IDLE`: nothing in
    flight, nothing sent for its `--stream-idle-timeout`): no failure, a new stream takes the
    next items."""
    return failure.reason == STREAM_IDLE


def send_again(failure: Failure) -> bool:
    """True when the items `failure` left without an outcome are worth another call: its code
    is RETRYABLE, or it is a whole call cut by its own deadline (a busy bridge)."""
    return failure.code in RETRYABLE or (failure.whole_call and failure.code == "DEADLINE_EXCEEDED")


class Item(Protocol):
    """A VerifyRequest or RunRequest: what the call reads of an item."""

    @property
    def request_id(self) -> str: ...

    def ByteSize(self) -> int: ...  # noqa: N802 (protobuf's name)


Req = TypeVar("Req", bound=Item)
Msg = TypeVar("Msg")


def chunks(items: Sequence[Req]) -> Iterator[list[Req]]:
    """`items` in chunks (one stream message each) of at most ITEMS_PER_MESSAGE items and,
    unless a single item is bigger, at most BYTES_PER_MESSAGE bytes."""
    chunk: list[Req] = []
    size = 0
    for item in items:
        item_size = item.ByteSize()
        if chunk and (len(chunk) == ITEMS_PER_MESSAGE or size + item_size > BYTES_PER_MESSAGE):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield chunk


class Streams(Generic[Req]):
    """The items of a call's current stream (`pending`) and which of them gRPC has taken.

    Args:
        items: the call's sendable items, all sent on its first stream.
        resend_taken: whether an unanswered item gRPC had taken may be sent again
            (`VerifyStream`: yes; `RunStream`: no, its `/run` may have started).
    """

    def __init__(self, items: Sequence[Req], resend_taken: bool) -> None:
        self.pending = list(items)
        self.resend_taken = resend_taken
        self.taken: set[str] = set()
        self.count = 1

    def messages(self, message: Callable[[list[Req]], Msg]) -> Iterator[Msg]:
        """The current stream's messages; an item counts as taken once gRPC pulled its
        message from this iterator."""
        for chunk in chunks(self.pending):
            self.taken.update(item.request_id for item in chunk)
            yield message(chunk)

    def after_break(
        self, failure: Failure | None, unanswered: list[Req], time_left: float, where: str = ""
    ) -> tuple[list[Req], list[Req]]:
        """After the current stream (`where`, for the log) ended with `failure` (None: OK) and
        left `unanswered`: (the items to send on a next stream, the items that keep the
        stream's failure). Nothing is sent again unless the stream broke (BROKEN), fewer than
        MAX_STREAMS streams ran and time is left; the next stream's items then become
        `pending`, and a WARNING says so."""
        if failure is None or failure.code != BROKEN:
            return [], []
        again = [i for i in unanswered if self.resend_taken or i.request_id not in self.taken]
        kept = [i for i in unanswered if not self.resend_taken and i.request_id in self.taken]
        if not again or self.count >= MAX_STREAMS or time_left <= 0:
            return [], kept
        self.pending, self.taken, self.count = again, set(), self.count + 1
        log.warning(
            "%s broke (%s: %s): its %d unanswered items go out again (stream %d of %d)",
            where, failure.code, failure.message, len(again), self.count, MAX_STREAMS,
        )  # fmt: skip
        return again, kept
