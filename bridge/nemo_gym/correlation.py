"""NeMo Gym 0.7's rollout correlation (`rollout_correlation.py`, `episode_types.py`): rollout
ids, the `/ng-rollout/<id>` route prefix and the `EpisodeId`.

A rollout id matches ROLLOUT_ID and does not end with the attempt suffix `-a<N>` (N >= 1) that
`EpisodeId` reserves; NeMo Gym counts an episode's attempts from 0 and captures attempt A >= 1
of rollout R under `R-a<A>`. The bridge uses an item's `request_id` as its rollout id where it
is a valid one.
"""

from __future__ import annotations

import re
from typing import Any

ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ATTEMPT_SUFFIX = re.compile(r"-a[1-9][0-9]*$")
ROLLOUT_PREFIX = "/ng-rollout/"
# Longest request_id put into a URL path, characters: NeMo Gym 0.7's uvicorn (httptools) took
# a 65,000-character `/ng-rollout/<id>/verify` and refused 100,000 with HTTP 400 (measured);
# far below both, the bridge's parsed-URL cache stays small (a few hundred KB).
MAX_ROUTED_ID = 256


def rollout_id_problem(rollout_id: str) -> str | None:
    """Why `rollout_id` cannot be a NeMo Gym rollout id, or None when it can."""
    if not ROLLOUT_ID.match(rollout_id):
        return f"must match {ROLLOUT_ID.pattern}"
    if ATTEMPT_SUFFIX.search(rollout_id):
        return "must not end with the reserved attempt suffix -a<N>"
    return None


def rollout_prefix(request_id: str, attempt: int) -> str:
    """The `/ng-rollout/<id>` prefix for attempt `attempt` (1 = the first) of the item
    `request_id`, or "" when the id cannot be a NeMo Gym rollout id or is longer than
    MAX_ROUTED_ID. The id is the capture key
    of `EpisodeId(request_id, attempt - 1)`: `request_id` itself for the first attempt,
    `request_id-a<N-1>` for attempt N >= 2."""
    if len(request_id) > MAX_ROUTED_ID or rollout_id_problem(request_id) is not None:
        return ""
    key = request_id if attempt <= 1 else f"{request_id}-a{attempt - 1}"
    return ROLLOUT_PREFIX + key


def episode_id(rollout_id: str, attempt: int) -> dict[str, Any]:
    """NeMo Gym's `EpisodeId` `{"rollout_id", "attempt"}`: `attempt` is NeMo Gym's count (0 =
    the first dispatch); `rollout_id` must be a valid rollout id (`rollout_id_problem`)."""
    return {"rollout_id": rollout_id, "attempt": attempt}
