"""Failure reports: an upstream's own account of why an item or rollout failed, passed on as
opaque text.

No released NeMo Gym sends one: 0.7.0 (the newest on PyPI) has neither the `X-NG-Failure-Report`
reply header nor a `failure_report` field in an episode's `failure`; what it does send,
`failure_kind` and `failure_reason`, the bridge passes on as `failureKind` / `failureReason`
(`verify.py`, `episodes.py`). For a NeMo Gym that adds either, a failed item's or rollout's
`ErrorInfo.metadata` carries the report under `failureReport` (REPORT_KEY): the header's value
(any reply the bridge reads, `/verify` or `/run`), or, for an episode, its `failure_report`
field (JSON text unless it is a string), which wins over the header. At most MAX_REPORT_BYTES
bytes of UTF-8 (2 KiB), a cut one ending with TRUNCATED. A reply that scores keeps no report
(its result has no field for one).
"""

from __future__ import annotations

import json
from typing import Any

from nemo_gym_grpc.bridge import errors

HEADER = "X-NG-Failure-Report"
EPISODE_FIELD = "failure_report"
REPORT_KEY = "failureReport"
MAX_REPORT_BYTES = 2048
TRUNCATED = " [truncated]"


def bounded(value: Any) -> str:
    """A header's or field's `value` as report text ("" for None or ""): the string itself, or
    the JSON text of anything else, valid UTF-8 (`errors.utf8_text`), cut to MAX_REPORT_BYTES
    bytes with TRUNCATED at its end when it is longer."""
    if value is None or value == "":
        return ""
    text = errors.utf8_text(value if isinstance(value, str) else json.dumps(value))
    data = text.encode()
    if len(data) <= MAX_REPORT_BYTES:
        return text
    kept = data[: MAX_REPORT_BYTES - len(TRUNCATED.encode())]
    return kept.decode(errors="ignore") + TRUNCATED  # a character cut in two is dropped


def attach(error: errors.ItemError, report: str) -> None:
    """Put `report` (`bounded` text) into `error`'s metadata under REPORT_KEY, unless it is ""
    or the error has one already (an episode's own field wins over the reply's header)."""
    if report and REPORT_KEY not in error.metadata:
        error.metadata[REPORT_KEY] = report
