"""GRPO advantages computed over the scored completions only, in plain Python: the reference the
axolotl tests compare what trains with (tests/test_axolotl_advantages.py, tests/test_axolotl.py).

A completion is unscorable when every reward function gave None (a row of None). Each group's
unscorable completions are dropped, ordinary GRPO advantages (TRL's formulas: mean, unbiased
std, + EPSILON) are computed over the rest, and the dropped ones get 0.0, as does the one
scored completion of a group (its std is undefined).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

EPSILON = 1e-4
Matrix = Sequence[Sequence[float | None]]


def _stdev(values: Sequence[float]) -> float | None:
    """The unbiased std, None when undefined (fewer than 2 values)."""
    return statistics.stdev(values) if len(values) > 1 else None


def _scaled(value: float | None, mean: float, std: float | None, scale: bool = True) -> float:
    """(value - mean) / (std + EPSILON), or value - mean without `scale`; 0.0 for an
    unscorable value (None) or, when scaling, an undefined std."""
    if value is None or (scale and std is None):
        return 0.0
    return (value - mean) / (std + EPSILON) if scale and std is not None else value - mean


def summed(matrix: Matrix, weights: Sequence[float]) -> list[float | None]:
    """Each completion's weighted sum over the functions that scored it; None if none did."""
    return [
        None
        if all(v is None for v in row)
        else sum(w * v for w, v in zip(weights, row, strict=True) if v is not None)
        for row in matrix
    ]


def _groups(values: Sequence[float | None], group: int) -> list[Sequence[float | None]]:
    return [values[start : start + group] for start in range(0, len(values), group)]


def advantages(
    matrix: Matrix, weights: Sequence[float], group: int, scale_rewards: str = "group"
) -> list[float]:
    """TRL's "sum_then_normalize" (`scale_rewards` "group", "batch" or "none") over the
    scored completions only (see the module)."""
    sums = summed(matrix, weights)
    batch_std = _stdev([v for v in sums if v is not None])
    out: list[float] = []
    for chunk in _groups(sums, group):
        kept = [v for v in chunk if v is not None]
        mean = statistics.mean(kept) if kept else 0.0
        std = batch_std if scale_rewards == "batch" else _stdev(kept)
        out += [_scaled(v, mean, std, scale_rewards != "none") for v in chunk]
    return out


def normalized_then_summed(matrix: Matrix, weights: Sequence[float], group: int) -> list[float]:
    """TRL's "normalize_then_sum" over the scored completions only: each function's values
    normalized in their group (a value whose group std is undefined adds nothing), weighted
    and summed per completion, then normalized over the batch."""
    normalized: list[list[float | None]] = [[None] * len(weights) for _ in matrix]
    for k in range(len(weights)):
        for start in range(0, len(matrix), group):
            rows = range(start, min(start + group, len(matrix)))
            kept = [v for i in rows if (v := matrix[i][k]) is not None]
            mean, std = (statistics.mean(kept) if kept else 0.0), _stdev(kept)
            for i in rows:
                value = matrix[i][k]
                if value is not None and std is not None:
                    normalized[i][k] = _scaled(value, mean, std)
    sums = [
        None if all(v is None for v in row) else (total or 0.0)  # NaN-skipping sum: 0.0 if empty
        for row, total in zip(matrix, summed(normalized, weights), strict=True)
    ]
    kept = [v for v in sums if v is not None]
    mean = statistics.mean(kept) if kept else 0.0
    return [_scaled(v, mean, _stdev(kept)) for v in sums]
