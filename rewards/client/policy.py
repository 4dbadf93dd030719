"""What a reward function returns for items that failed: the `on_error` policy and the guard.

- `on_error="none"` (default): a failed item's reward is None (what TRL does with it:
  docs/rewards.md, "What TRL does with None").
- `on_error="zero"`: 0.0, as axolotl's own NeMo Gym functions did (seed-compatible; a failure
  then trains the policy like a wrong answer, so use it only to reproduce old runs).
- `on_error="raise"`: any failed item makes the call raise `ScoringError`.

Whatever the policy, the guard raises `ScoringError` when more than `max_failure_fraction`
(default 0.5) of one call's items failed: a batch of mostly missing (or zeroed) rewards is an
outage, not a training signal. `max_failure_fraction=1` turns the guard off; 0 makes every
failure raise. A batch that is not fully failed but partly is gets one warning on the
`nemo_gym_grpc.rewards` logger, counting failures by cause.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

from nemo_gym_grpc.rewards.client.outcomes import Failure, Outcome

log = logging.getLogger("nemo_gym_grpc.rewards")


class ScoringError(RuntimeError):
    """A reward-function call failed as a whole under its failure policy.

    Raised when `on_error="raise"` and any item failed, or when more than
    `max_failure_fraction` of the items failed. The message counts failures by cause
    (e.g. "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x6") and quotes the first message of each.

    Attributes:
        failures: input index -> `Failure`, for every failed item.
        size: number of items in the call.
        causes: cause ("CODE (REASON)") -> number of items.
    """

    def __init__(self, message: str, failures: Mapping[int, Failure], size: int) -> None:
        super().__init__(message)
        self.failures = dict(failures)
        self.size = size
        self.causes = Counter(f.cause for f in self.failures.values())


def summary(failures: Mapping[int, Failure]) -> str:
    """Failures counted by cause, most common first, then the first message of each cause,
    e.g. "NOT_FOUND (UNKNOWN_RESOURCES_SERVER) x2. First of each: NOT_FOUND (...): ..."."""
    causes = Counter(f.cause for f in failures.values())
    examples: dict[str, str] = {}
    for failure in failures.values():
        examples.setdefault(failure.cause, failure.message)
    counts = ", ".join(f"{cause} x{n}" for cause, n in causes.most_common())
    detail = "; ".join(f"{cause}: {message[:300]}" for cause, message in examples.items())
    return f"{counts}. First of each: {detail}"


def guard(
    failures: Mapping[int, Failure],
    total: int,
    *,
    max_failure_fraction: float,
    where: str,
    what: str = "items",
    gives: str,
) -> None:
    """The guard: raise when more than `max_failure_fraction` of a call's `total` items
    failed; else, when any failed, one warning on the `nemo_gym_grpc.rewards` logger.

    Args:
        failures: input index -> `Failure` of each failed item.
        what: what the items are, for messages ("items", "rollouts").
        gives: what a failed item gave, for the warning (e.g. "reward None, on_error=none").

    Raises:
        ScoringError: the failed fraction is above `max_failure_fraction`.
    """
    if not failures:
        return
    head = f"{len(failures)} of {total} {what} failed"
    if len(failures) / total > max_failure_fraction:
        raise ScoringError(
            f"{head}, more than max_failure_fraction={max_failure_fraction:g} allows ({where}); "
            f"not returning a batch of mostly missing rewards: {summary(failures)}",
            failures,
            total,
        )
    log.warning("%s (%s; %s): %s", head, gives, where, summary(failures))


def apply(
    outcomes: Sequence[Outcome],
    *,
    on_error: str,
    max_failure_fraction: float,
    where: str,
) -> list[float | None]:
    """Rewards for `outcomes` (one per item, in input order) under the policy.

    Args:
        outcomes: a `VerifyResponse` (success) or a `Failure` per item.
        on_error: "none", "zero" or "raise" (validated by the caller, see `settings`).
        max_failure_fraction: raise when failed / total is above this (0..1).
        where: context for messages, e.g. "bridge 127.0.0.1:50051, batch 3f2a...".

    Returns:
        list[float | None]: the reward of each success; None ("none") or 0.0 ("zero") for
        each failure. Same length and order as `outcomes`.

    Raises:
        ScoringError: `on_error == "raise"` and an item failed, or more than
            `max_failure_fraction` of the items failed.
    """
    failures = {i: o for i, o in enumerate(outcomes) if isinstance(o, Failure)}
    if failures and on_error == "raise":
        raise ScoringError(
            f"{len(failures)} of {len(outcomes)} items failed (on_error=raise; {where}): "
            f"{summary(failures)}",
            failures,
            len(outcomes),
        )
    missing = None if on_error == "none" else 0.0
    guard(
        failures,
        len(outcomes),
        max_failure_fraction=max_failure_fraction,
        where=where,
        gives=f"reward {missing}, on_error={on_error}",
    )
    return [missing if i in failures else o.reward for i, o in enumerate(outcomes)]  # type: ignore[union-attr]
