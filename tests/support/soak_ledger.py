"""The soak's bookkeeping: every logical item, what it should score, what it got.

Kinds: RIGHT (mcqa's right letter: reward 1.0), WRONG (a wrong letter: 0.0), BAD (an item the
bridge must reject). An item is resolved once, by a reward or a per-item failure. A call that
fails as a whole (bridge gone, deadline, the soak's own cancel) leaves its unanswered items to
be sent again by the same worker; an item never resolved by the end is lost. Thread-safe.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from google.rpc import error_details_pb2

from nemo_gym_grpc.v1 import verify_pb2

RIGHT, WRONG, BAD = "right", "wrong", "bad"
RIGHT_SHARE = 0.75  # of the good items; any 0.0 for one of them is a silent 0.0
RESEND_GRACE = 60.0  # seconds after the run's end in which resends are still sent


def _reason(status: Any) -> str:
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


class Ledger:
    """Counts (`counts`), failure causes (`causes`), one sample row per second (`series`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kinds: dict[str, str] = {}
        self.resolved: set[str] = set()
        self._resend: dict[str, deque[str]] = {}
        self._next: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.causes: Counter[str] = Counter()
        self.notes: list[str] = []
        self.series: list[dict[str, Any]] = []
        self._stopped_at: float | None = None

    # sending ---------------------------------------------------------------------------------
    def keep_going(self, prefix: str, stop: threading.Event) -> bool:
        """True while the run lasts; after it, while this worker has items to send again
        (for at most RESEND_GRACE s)."""
        if not stop.is_set():
            return True
        with self._lock:
            if self._stopped_at is None:
                self._stopped_at = time.monotonic()
            pending = bool(self._resend.get(prefix))
            return pending and time.monotonic() - self._stopped_at < RESEND_GRACE

    def take(
        self, prefix: str, size: int, rng: random.Random, bad_fraction: float, stop: threading.Event
    ) -> list[str]:
        """The next batch of a worker: its items to send again first, then new ones (none once
        the run is over)."""
        with self._lock:
            queue = self._resend.setdefault(prefix, deque())
            ids = [queue.popleft() for _ in range(min(size, len(queue)))]
            while len(ids) < size and not stop.is_set():
                item_id = f"{prefix}{self._next[prefix]}"
                self._next[prefix] += 1
                if rng.random() < bad_fraction:
                    kind = BAD
                else:
                    kind = RIGHT if rng.random() < RIGHT_SHARE else WRONG
                self.kinds[item_id] = kind
                self.counts[f"items_{kind}"] += 1
                ids.append(item_id)
            self.counts["sends"] += len(ids)
            return ids

    def kind(self, item_id: str) -> str:
        return self.kinds[item_id]

    # results ---------------------------------------------------------------------------------
    def check_new_result(
        self, item_id: str, sent: set[str], got: dict[str, verify_pb2.VerifyResponse]
    ) -> bool:
        """False (and counted) for a result of an item not in this call, or a second result
        of one item in this call."""
        if item_id not in sent:
            self.count("results_unknown_id")
            return False
        if item_id in got:
            self.count("results_duplicated")
            return False
        return True

    def resolve_result(self, item_id: str, result: verify_pb2.VerifyResponse) -> None:
        """A raw stream's result: a reward, or a per-item error (typed if it has a code and an
        ErrorInfo reason)."""
        if result.WhichOneof("outcome") == "reward":
            self._judge(item_id, result.reward, None, True)
            return
        reason = _reason(result.error)
        cause = f"{result.error.code}/{reason}" if reason else str(result.error.code)
        self._judge(item_id, None, cause, bool(result.error.code and reason))

    def resolve_rewards(
        self,
        prefix: str,
        ids: Sequence[str],
        rewards: Sequence[float | None],
        causes: Sequence[Any],
    ) -> None:
        """A reward function's list: a float, or None with its cause ("CODE (REASON)") in the
        `log_extra` error column. A cause without a reason is a failure of the whole call
        (the bridge gives every per-item error a reason): sent again."""
        if len(rewards) != len(ids) or len(causes) != len(ids):
            self.count("reward_fn_wrong_length")
            self.unanswered(prefix, ids, whole_call=True)
            return
        again = []
        for item_id, reward, cause in zip(ids, rewards, causes, strict=True):
            if reward is not None:
                self._judge(item_id, float(reward), None, True)
            elif isinstance(cause, str) and "(" in cause:
                self._judge(item_id, None, cause, True)
            else:
                again.append(item_id)
        if again:
            self.unanswered(prefix, again, whole_call=True)

    def unanswered(self, prefix: str, ids: Sequence[str], whole_call: bool) -> None:
        """Items of a call that got no result: sent again when the call failed as a whole;
        counted as a broken contract when it ended OK."""
        if not ids:
            return
        with self._lock:
            if whole_call:
                self._resend.setdefault(prefix, deque()).extend(ids)
                self.counts["resent"] += len(ids)
            else:
                self.counts["unanswered_in_ok_call"] += len(ids)

    def _judge(self, item_id: str, reward: float | None, cause: str | None, typed: bool) -> None:
        with self._lock:
            if item_id in self.resolved:
                self.counts["results_duplicated"] += 1
                return
            self.resolved.add(item_id)
            kind = self.kinds[item_id]
            if reward is None:
                self.counts["failures"] += 1
                self.causes[str(cause)] += 1
                if not typed:
                    self.counts["failures_untyped"] += 1
                if kind == BAD:
                    self.counts["bad_rejected"] += 1
                return
            self.counts["rewards"] += 1
            if kind == RIGHT and reward == 0.0:
                self.counts["silent_zero"] += 1
            elif (kind, reward) not in ((RIGHT, 1.0), (WRONG, 0.0)):
                self.counts["misassigned"] += 1

    # bookkeeping -----------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def note(self, text: str) -> None:
        with self._lock:
            if len(self.notes) < 20:
                self.notes.append(text)

    def lost(self) -> int:
        with self._lock:
            return len(self.kinds) - len(self.resolved)

    def sample(self, elapsed: float, pid: int, sample: tuple[int, int] | None) -> None:
        """One row of the time series: the bridge's pid, RSS bytes and fds (None if it is
        between lives), and the running totals."""
        with self._lock:
            self.series.append(
                {
                    "t": round(elapsed, 2),
                    "pid": pid,
                    "rss": sample[0] if sample else None,
                    "fds": sample[1] if sample else None,
                    "resolved": len(self.resolved),
                    "failures": self.counts["failures"],
                    "resent": self.counts["resent"],
                }
            )

    def progress(self, elapsed: float) -> str:
        with self._lock:
            rate = len(self.resolved) / elapsed if elapsed else 0.0
            return (
                f"{elapsed:.0f} s: {len(self.resolved)} resolved ({rate:.0f}/s), "
                f"{self.counts['failures']} failed, {self.counts['resent']} resent"
            )
