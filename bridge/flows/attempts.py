"""An item's attempts on its upstream replicas, one rule for Verify and Run alike: how many and
when (`RetryPolicy`, `Attempts`), and how the RPC deadline bounds them (`time_left`,
`call_timeout`, `slot_wait`, `deadline_passed`).

- Margin: an upstream call and a wait for a slot end before the RPC deadline by
  max(DEADLINE_MARGIN, DEADLINE_MARGIN_SHARE x the time left), so that the item's own answer
  still reaches the client in time (on a busy machine, thousands of results cut at the
  deadline take more than 50 ms to send, and the whole call would otherwise end
  DEADLINE_EXCEEDED before they get their own UPSTREAM_TIMEOUT).
- One upstream call gets the item's own timeout, else its flow's default, cut to what the
  deadline leaves (`call_timeout`); a wait for a slot (`balancer.Slots.use`) lasts at most
  what the deadline leaves (`slot_wait`). When nothing is left, the item fails with
  DEADLINE_EXCEEDED / UPSTREAM_TIMEOUT before anything is sent (`deadline_passed`).
- The attempts (`Attempts`): each goes to the replica the balancer picks, one the item has
  not tried first. A failure its flow may retry gets another attempt: at once on a replica
  not yet tried, else after a backoff; never more than `RetryPolicy.attempts`, and none that
  would start after `RetryPolicy.budget` seconds or after the deadline. Every failure carries
  the number of attempts made in its `attempts` metadata.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.balancer import Balancer, Replica
from nemo_gym_grpc.shared import reasons

DEADLINE_MARGIN = 0.05
DEADLINE_MARGIN_SHARE = 0.02


def time_left(deadline: float, now: float | None = None) -> float:
    """Seconds an upstream call started at `now` (default: `time.monotonic()`) may take so
    that its answer still beats the RPC `deadline` (`time.monotonic()` seconds): the time left
    less max(DEADLINE_MARGIN, DEADLINE_MARGIN_SHARE x the time left). <= 0: no time."""
    left = deadline - (time.monotonic() if now is None else now)
    return left - max(DEADLINE_MARGIN, DEADLINE_MARGIN_SHARE * left)


def wait_within(bound: float, deadline: float | None) -> float:
    """Seconds to wait for something that may take `bound` seconds (a replica's capabilities),
    cut to what the RPC `deadline` leaves (`time_left`); never below 0."""
    return bound if deadline is None else max(0.0, min(bound, time_left(deadline)))


def slot_wait(deadline: float | None) -> float | None:
    """Seconds an item may wait for a slot (`balancer.Slots.use`): what the RPC `deadline`
    leaves (`time_left`), or None (as long as it takes) without a deadline."""
    return None if deadline is None else time_left(deadline)


def call_timeout(item_timeout: float, default: float, deadline: float | None) -> float:
    """Seconds one upstream call may take: `item_timeout` (the item's `timeout_seconds`; 0 =
    not set), else `default` (the flow's `--verify-timeout` / `--run-timeout`), cut to what
    the RPC `deadline` leaves (`time_left`). <= 0: no time (the caller raises
    `deadline_passed`)."""
    timeout = item_timeout or default
    if deadline is None:
        return timeout
    left = time_left(deadline)
    return left if left < timeout else timeout


class NotSent(errors.ItemError):
    """A failure before anything was sent upstream (the RPC deadline passed first)."""


def slot_timeout(url: str, queued: float) -> NotSent:
    """The RPC deadline (less its margin) passed after `queued` seconds waiting for a free
    upstream slot, before anything was sent to `url` (`deadline_passed`)."""
    return deadline_passed(
        f"while waiting {queued:.3f} s for a free slot to {url}",
        upstreamUrl=url,
        queuedSeconds=f"{queued:.3f}",
    )


def deadline_passed(situation: str, **metadata: object) -> NotSent:
    """DEADLINE_EXCEEDED / UPSTREAM_TIMEOUT, not retryable: the RPC deadline (less its margin)
    passed `situation` (e.g. "before the rollout could be sent to URL"), before anything was
    sent. `metadata` as for `errors.ItemError`."""
    return NotSent(
        code_pb2.DEADLINE_EXCEEDED,
        reasons.UPSTREAM_TIMEOUT,
        f"the RPC deadline passed {situation}",
        retryable=False,
        **metadata,
    )


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and full jitter (`--retry-attempts`,
    `--retry-budget`).

    Attributes:
        attempts: most attempts per item, first one included (1 = no retries).
        budget: most seconds from an item's first attempt to the start of its last one.
        initial_backoff: seconds before the second attempt (before jitter).
        max_backoff: cap on one backoff, seconds.
    """

    attempts: int
    budget: float
    initial_backoff: float = 0.1
    max_backoff: float = 2.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1 = the first) on a replica
        already tried: uniform in [0, min(max_backoff, initial_backoff * 2**(attempt-1))]."""
        return random.uniform(0.0, min(self.max_backoff, self.initial_backoff * 2 ** (attempt - 1)))


class Attempts:
    """One item's attempts on the replicas `urls` (base URLs, not empty) of its server (see
    the module docstring). Its flow drives them:

        tries = Attempts(policy, deadline, balancer, urls)
        while True:
            replica = tries.next()
            try:
                return await attempt(replica, tries.number)
            except errors.ItemError as exc:
                await tries.again(exc)  # raises exc when it is final

    Attributes:
        number: the attempt under way, 1 = the first.
        tried: the base URLs of the replicas tried so far, in order.
    """

    __slots__ = ("_policy", "_balancer", "_urls", "_bound", "number", "tried")

    def __init__(
        self, policy: RetryPolicy, deadline: float | None, balancer: Balancer, urls: list[str]
    ) -> None:
        self._policy = policy
        self._balancer = balancer
        self._urls = urls
        self._bound = time.monotonic() + policy.budget
        if deadline is not None and deadline < self._bound:
            self._bound = deadline
        self.number = 0
        self.tried: list[str] = []

    def reroute(self, urls: list[str]) -> None:
        """Make the next attempts go to `urls` (not empty): the server's URLs after a replica
        refused a connection (`Upstreams.moved`). Attempts made still count."""
        self._urls = urls

    @property
    def urls(self) -> list[str]:
        """The replicas' base URLs the attempts go to."""
        return self._urls

    def next(self) -> Replica:
        """The replica of the next attempt: one not tried yet first (`Balancer.pick`)."""
        self.number += 1
        replica = self._balancer.pick(self._urls, self.tried)
        self.tried.append(replica.url)
        return replica

    async def again(self, failure: errors.ItemError, may_retry: bool | None = None) -> None:
        """After a failed attempt: record the attempts made in `failure`'s `attempts`
        metadata; raise `failure` when it is final (`may_retry`, default its `retryable`,
        is false, no attempt is left, or the next would start past the budget or the
        deadline); else wait the backoff when every replica was tried.

        Raises:
            errors.ItemError: `failure`, when final.
        """
        failure.metadata["attempts"] = str(self.number)
        retry = failure.retryable if may_retry is None else may_retry
        final = not retry or self.number >= self._policy.attempts
        delay = 0.0
        if not final and len(set(self.tried)) >= len(self._urls):
            delay = self._policy.backoff(self.number)
        if final or time.monotonic() + delay >= self._bound:
            try:
                raise failure
            finally:
                del failure  # errors.py: no reference cycle through this frame
        if delay:
            await asyncio.sleep(delay)
