"""Per-item extras for TRL's `log_metric` / `log_extra` reward-function callbacks.

TRL's GRPOTrainer (1.8 and newer) passes two callables to every reward function:
`log_metric(name, value)` (a scalar for this batch; averaged over the logging step and logged
next to `reward`, `kl`, ...) and `log_extra(column, values)` (one value per item, a column of
the completions table). When both or either is given, the reward functions ask the bridge for
the upstream reply (`include_reply`) and report, for a function named NAME
(`reward_nemo_gym_verify`, or `nemo_gym` for `create_nemo_gym_reward_fn`):

metrics (`log_metric`), one value per call:
- `rewards/NAME/failed_fraction`: failed items / items (also when the policy gave them 0.0);
- `rewards/NAME/degraded_fraction`: items scored with a `failure_kind` or `failure_reason`
  (NeMo Gym >= 0.7: a degraded but valid measurement, its reward kept) / items;
- `rewards/NAME/latency_seconds`: mean upstream `/verify` wall time of the scored items;
- `rewards/NAME/components/C`: mean of `reward_components[C]` over items that have it;
- `rewards/NAME/reply/F`: mean of the upstream reply's numeric field F over items that have
  it (e.g. `equivalence_score`, reasoning_gym's `score`, math_with_judge's `library_reward`).

columns (`log_extra`), one value per item (None where an item has no such value):
- `NAME/error`: the failure's cause ("UNAVAILABLE (UPSTREAM_UNAVAILABLE)"), None on success;
- `NAME/failure_kind`, `NAME/failure_reason`: what NeMo Gym (>= 0.7) said went wrong: a
  scored item's `VerifyResponse.failure_kind` / `failure_reason` (a degraded but valid
  measurement), a failed item's error metadata `failureKind` / `failureReason` (e.g. a judge
  failure: "judge_failed" and the judge's error); `NAME/failure_report`: a failed item's
  `failureReport` (docs/failures.md; no NeMo Gym release sends one yet); each at most
  MAX_LOGGED_TEXT characters (a longer one cut, ending with "..."), None where there is none;
- `NAME/components/C` and `NAME/reply/F`: the item's values.

Reply fields count when they are numbers (`outcomes.finite_number`), their name does not
start with "_" (NeMo Gym bookkeeping) and is not a key of the item's dataset row (a resources
server echoes row fields; those are inputs, not results). Columns seen once keep being logged
(None-filled), so the completions table's columns stay aligned from batch to batch.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_gym_grpc.rewards.client.outcomes import Failure, Outcome, finite_number

MAX_LOGGED_TEXT = 500  # characters of a failure_reason in TRL's completions table
# A column -> the VerifyResponse field of a scored item (if it has one) and the error metadata
# key of a failed one.
DIAGNOSTICS = {
    "failure_kind": "failureKind",
    "failure_reason": "failureReason",
    "failure_report": "failureReport",
}


def wanted(kwargs: Mapping[str, Any]) -> bool:
    """True when the caller (TRL) passed a `log_metric` or `log_extra` callable."""
    return callable(kwargs.get("log_metric")) or callable(kwargs.get("log_extra"))


def diagnostic(outcome: Outcome, column: str) -> str | None:
    """An item's value of a DIAGNOSTICS `column` for its table cell (see the module
    docstring): None when empty, else at most MAX_LOGGED_TEXT characters."""
    if isinstance(outcome, Failure):
        text = outcome.metadata.get(DIAGNOSTICS[column], "")
    else:
        text = getattr(outcome, column, "")
    return bounded(text) or None


def bounded(text: str) -> str:
    """`text` cut to MAX_LOGGED_TEXT characters (a longer one ends with "...")."""
    if len(text) > MAX_LOGGED_TEXT:
        return text[: MAX_LOGGED_TEXT - 3] + "..."
    return text


def failure_text(failure: Failure) -> str:
    """A failure in one line for TRL's tables: its cause, then what NeMo Gym said went wrong
    when the bridge passed it on (DIAGNOSTICS' metadata keys), e.g. "UNAVAILABLE
    (UPSTREAM_JUDGE_FAILED) failureKind=judge_failed failureReason=...";
    at most MAX_LOGGED_TEXT characters."""
    metadata = failure.metadata
    told = (f"{key}={metadata[key]}" for key in DIAGNOSTICS.values() if key in metadata)
    return bounded(" ".join((failure.cause, *told)))


def item_values(outcome: Outcome, row: Any) -> dict[str, float]:
    """The extras of one successful item: {"components/C": v, "reply/F": v}; {} for a failure.

    `row` is the item's dataset row (`verify_extra` value) or None; its keys are left out of
    the reply fields.
    """
    if isinstance(outcome, Failure):
        return {}
    values = {f"components/{name}": value for name, value in outcome.reward_components.items()}
    if outcome.reply_json:
        try:
            reply = json.loads(outcome.reply_json)
        except ValueError:
            reply = None
        row_keys = row.keys() if isinstance(row, Mapping) else ()
        if isinstance(reply, dict):
            for key, value in reply.items():
                number = finite_number(value)
                if number is not None and not key.startswith("_") and key not in row_keys:
                    values[f"reply/{key}"] = number
    return values


class ExtrasLog:
    """Reports one reward function's extras to TRL's callbacks (see the module docstring).

    Thread-safe; remembers the columns it has logged so they are logged on every later call.

    Args:
        name: the reward function's name (NAME above).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._columns: list[str] = []
        self._lock = threading.Lock()

    def emit(self, outcomes: Sequence[Outcome], kwargs: Mapping[str, Any]) -> None:
        """Call `kwargs["log_metric"]` / `kwargs["log_extra"]` (those that are callable) for
        one call's `outcomes` (one per item, in input order). Rows come from
        `kwargs["verify_extra"]` when it has one entry per item."""
        log_metric, log_extra = kwargs.get("log_metric"), kwargs.get("log_extra")
        if not outcomes or not (callable(log_metric) or callable(log_extra)):
            return
        rows = kwargs.get("verify_extra")
        if not isinstance(rows, Sequence) or len(rows) != len(outcomes):
            rows = [None] * len(outcomes)
        per_item = [item_values(o, row) for o, row in zip(outcomes, rows, strict=True)]
        scored = [o for o in outcomes if not isinstance(o, Failure)]

        if callable(log_metric):
            failed = len(outcomes) - len(scored)
            log_metric(f"rewards/{self.name}/failed_fraction", failed / len(outcomes))
            degraded = sum(1 for o in scored if o.failure_kind or o.failure_reason)
            log_metric(f"rewards/{self.name}/degraded_fraction", degraded / len(outcomes))
            if scored:
                latency = sum(o.latency_seconds for o in scored) / len(scored)
                log_metric(f"rewards/{self.name}/latency_seconds", latency)
            sums: dict[str, list[float]] = {}
            for values in per_item:
                for key, value in values.items():
                    sums.setdefault(key, []).append(value)
            for key in sorted(sums):
                log_metric(f"rewards/{self.name}/{key}", sum(sums[key]) / len(sums[key]))

        if callable(log_extra):
            causes = [o.cause if isinstance(o, Failure) else None for o in outcomes]
            log_extra(f"{self.name}/error", causes)
            for key in DIAGNOSTICS:
                log_extra(f"{self.name}/{key}", [diagnostic(o, key) for o in outcomes])
            with self._lock:
                for values in per_item:
                    for key in values:
                        if key not in self._columns:
                            self._columns.append(key)
                columns = list(self._columns)
            for key in columns:
                log_extra(f"{self.name}/{key}", [values.get(key) for values in per_item])
