"""What the verl, slime and OpenRLHF adapters share: score `StackItem`s, turn outcomes into floats.

Those stacks hand a reward function text and a label, not a NeMo Gym row. Each adapter
(`verl.py`, `slime.py`, `openrlhf.py`) reads the NeMo Gym row and the resources server name
from where `tools/export.py` put them and builds `StackItem`s; this module sends them over one
`VerifyStream` (the same `convert.build_batch` / `Route.send` path as
`reward_nemo_gym_verify`, the same settings and embedded bridge) and applies the stacks'
failure policy.

Failure policy (`stack_rewards`). None of these stacks has a "missing reward": verl and
OpenRLHF put every score into a float tensor (a NaN spreads through the group mean/std of
GRPO-style advantages into the whole group and the loss), slime sums them into advantages. So:

- `NEMO_GYM_GRPC_ON_ERROR` unset (the default here, unlike TRL's `none`): a failed item makes
  the call raise `ScoringError`; the stack's own error handling stops the step.
- `NEMO_GYM_GRPC_ON_ERROR=zero`: 0.0, flagged (each adapter reports `scoring_failed`).
- `NEMO_GYM_GRPC_ON_ERROR=none`: NaN, flagged (only if the user filters NaN rewards).
- `NEMO_GYM_GRPC_ON_ERROR=raise`: as unset.

A call of several items also has the `max_failure_fraction` guard (`client/policy.py`); a call of
one item (verl's `compute_score`, slime's one-sample function) does not: there the guard would
turn every failure into `ScoringError` and `on_error` would never apply. One-item calls made
together still travel together (`score_one`, `Coalescer`), each judged on its own outcome.
"""

from __future__ import annotations

import asyncio
import math
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_grpc.rewards.client import convert, policy, settings, stream
from nemo_gym_grpc.rewards.client.outcomes import Failure, Outcome
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.v1 import verify_pb2

# `model` written into the Responses object the bridge builds from each completion.
MODEL = "nemo-gym-grpc"
# Where `tools/export.py` puts the NeMo Gym row and the resources server name (verl `extra_info`,
# slime `metadata`, OpenRLHF's JSON label): keys of one dict.
SERVER_KEY = "resources_server"
ROW_KEY = "nemo_gym_row"


@dataclass(frozen=True)
class StackItem:
    """One completion to score.

    Attributes:
        server: resources server name ("" fails the item with INVALID_ARGUMENT).
        completion: the model's answer text.
        row: the NeMo Gym dataset row (its own `responses_create_params`, `expected_answer`,
            ...). None or empty fails the item (INVALID_ARGUMENT / INVALID_ITEM, not sent):
            without its row a resources server scores against nothing, e.g. mcqa gives 0.0.
        prompt: plain text or a list of `{"role", "content"}` messages, or None; used by the
            bridge only for a row without `responses_create_params`.
    """

    server: str
    completion: str
    row: Mapping[str, Any] | None = None
    prompt: Any = None


def nemo_gym_fields(carrier: Any, where: str) -> tuple[str, dict[str, Any] | None]:
    """(resources server name, NeMo Gym row) from the dict `tools/export.py` wrote (`SERVER_KEY`,
    `ROW_KEY`), or from its JSON text. The row may itself be a dict or JSON text (verl's
    parquet holds it as text). A missing name gives "" (the item then fails, not the batch).

    Raises:
        ValueError: `carrier` is text that is not a JSON object, or the row in it is neither
            a dict nor the JSON text of one (e.g. a list); the message names the field
            (`where`, e.g. "sample.metadata", and `ROW_KEY`).
    """
    fields = convert.json_object(carrier, where) if isinstance(carrier, str) else carrier
    if not isinstance(fields, Mapping):
        return "", None
    server = fields.get(SERVER_KEY)
    row = fields.get(ROW_KEY)
    field = f"{where}[{ROW_KEY!r}]"
    if isinstance(row, str):
        row = convert.json_object(row, field)
    elif row is not None and not isinstance(row, Mapping):
        raise ValueError(
            f"{field}: must be the NeMo Gym row as a dict (or its JSON text), "
            f"got {type(row).__name__}: {row!r:.100}"
        )
    return (server if isinstance(server, str) else ""), (dict(row) if row else None)


def _batch(
    items: Sequence[StackItem],
) -> convert.Batch[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse]:
    batch = convert.build_batch(
        [item.completion for item in items],
        [item.prompt for item in items],
        [{"name": item.server} for item in items],
        [None if item.row is None else dict(item.row) for item in items],
        model=MODEL,
        timeout_seconds=0.0,  # the bridge's --verify-timeout
        batch_id=uuid.uuid4().hex[:16],
    )
    rowless = [index for index, item in enumerate(items) if not item.row]
    if rowless:
        unsent = {batch.request_id(index) for index in rowless}
        batch.requests[:] = [r for r in batch.requests if r.request_id not in unsent]
        for index in rowless:
            batch.reject(
                index,
                f"item {index} has no NeMo Gym row (`{ROW_KEY}`, where `nemo-gym-grpc export` "
                "puts it): its resources server would score it against nothing",
            )
    return batch


def _route() -> Route:
    return Route.resolve(target=None, timeout=settings.batch_timeout())


def score_items(items: Sequence[StackItem]) -> list[Outcome]:
    """One outcome per item, in order, over one `VerifyStream` (grpcio, the shared channel).

    Target, TLS, token, timeouts: `client/settings.py` (`NEMO_GYM_GRPC_TARGET`, or an embedded
    bridge discovering servers from `NEMO_GYM_HEAD_URL`). Raises what `Route.send` and
    `convert.build_batch` raise (ValueError, TypeError, RuntimeError, ProtocolError)."""
    batch = _batch(items)
    return batch.outcomes(_route().send(stream.VERIFY, batch.requests))


async def score_items_async(items: Sequence[StackItem]) -> list[Outcome]:
    """`score_items` as a coroutine (grpc.aio, a channel per call; an embedded bridge is
    started in a worker thread)."""
    batch = _batch(items)
    return batch.outcomes(await _route().asend(stream.VERIFY, batch.requests))


class Coalescer:
    """Sends the one-item calls made on one event loop within `window_seconds` of each other
    as one `VerifyStream` call (`score_items_async`); each caller gets its own item's outcome.

    verl's reward loop and slime await a one-item reward function for every sample at once
    (512 calls for a 512-sample batch); one stream each would be slow and exceed the bridge's
    concurrent stream limit (`--max-streams`: the excess waits, then RESOURCE_EXHAUSTED). A
    batch is also sent as soon as it holds `max_batch` items. If the call raises, or `batch_check`
    (given the call's outcomes) does, every caller in it gets the error.
    """

    def __init__(
        self,
        window_seconds: float = 0.02,
        max_batch: int = 1024,
        batch_check: Callable[[list[Outcome]], object] | None = None,
    ) -> None:
        self.window_seconds = window_seconds
        self.max_batch = max_batch
        self.batch_check = batch_check
        self._pending: list[tuple[StackItem, asyncio.Future[Outcome]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()  # referenced until done

    async def outcome(self, item: StackItem) -> Outcome:
        """The outcome of `item`, scored with the items queued alongside it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) >= self.max_batch:
            self._send(loop)
        elif self._timer is None:
            self._timer = loop.call_later(self.window_seconds, self._send, loop)
        return await future

    def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiters, self._pending = self._pending, []
        if waiters:
            task = loop.create_task(self._score(waiters))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _score(self, waiters: list[tuple[StackItem, asyncio.Future[Outcome]]]) -> None:
        try:
            outcomes = await score_items_async([item for item, _ in waiters])
            if self.batch_check is not None:
                self.batch_check(outcomes)
        except Exception as exc:  # every item of the call gets the call's error
            for _, future in waiters:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), outcome in zip(waiters, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)


_coalescers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Coalescer] = (
    weakref.WeakKeyDictionary()
)


async def score_one(item: StackItem) -> Outcome:
    """The outcome of one item, sent with the other one-item calls on this event loop
    (`Coalescer`). Raises what `score_items_async` raises."""
    loop = asyncio.get_running_loop()
    coalescer = _coalescers.get(loop)
    if coalescer is None:
        coalescer = _coalescers[loop] = Coalescer()
    return await coalescer.outcome(item)


def stack_on_error() -> str:
    """The stacks' `on_error`: `NEMO_GYM_GRPC_ON_ERROR` when set, else "raise"."""
    if settings.env_text(settings.ON_ERROR_ENV) is None:
        return "raise"
    return settings.on_error()


def stack_rewards(outcomes: Sequence[Outcome], *, where: str) -> list[float]:
    """Floats for `outcomes` under the stacks' failure policy (module docstring): the reward,
    or for a failed item 0.0 (`zero`) or NaN (`none`).

    Raises:
        ScoringError: `on_error` is raise (the default) and an item failed, or a call of
            several items had more than `max_failure_fraction` of them fail.
    """
    guard = 1.0 if len(outcomes) == 1 else settings.max_failure_fraction()
    rewards = policy.apply(
        outcomes, on_error=stack_on_error(), max_failure_fraction=guard, where=where
    )
    return [math.nan if reward is None else reward for reward in rewards]


def failure_cause(outcome: Outcome) -> str:
    """ "" for a success, else the failure's cause ("NOT_FOUND (UNKNOWN_RESOURCES_SERVER)")."""
    return outcome.cause if isinstance(outcome, Failure) else ""
