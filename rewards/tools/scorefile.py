"""The files of `nemo-gym-grpc score`: NeMo Gym rows in, one result record per row out.

Input (ROWS.jsonl): one JSON object per line, a NeMo Gym dataset row plus `response`, the
OpenAI Responses object a rollout saved (NeMo Gym's rollout files have exactly this shape:
the row, `response`, and the verdict its resources server gave: `reward` and the server's own
fields). Blank lines are skipped. Each row goes to `/verify` as its server takes it: its fields
(None dropped) without its old verdict (`verdicts.py` says which fields those are) as the body,
its `response` as the response; routed by its `resources_server_ref.name` when it has one,
else by `--server`. Rollouts save every unset OpenAI parameter of `responses_create_params`
as null; the bridge drops those nulls (`bridge/nemo_gym/verify.py`), so the server applies
the defaults the rollout was made with.

Output (OUT.jsonl): one record per non-blank input line, in input order:

    {"line": 7, "row_sha256": "9f2c...", "resources_server": "mcqa", "reward": 1.0,
     "reward_components": {}, "error": null, "previous_reward": 0.0}

`line` is the 1-based input line number; `row_sha256` the first 16 hex digits of the SHA-256
of that line (without its line ending), which resume checks; `previous_reward` the row's own
numeric `reward` (a rollout's), else null. A row that could not be scored has `reward` null
and `error` {"code", "reason", "message"}: a verdict on the row (`is_verdict`) that the bridge
reports (e.g. INTERNAL / UPSTREAM_BAD_REPLY, INVALID_ARGUMENT / UPSTREAM_HTTP_ERROR), or one
decided here, INVALID_ARGUMENT with reason `INVALID_ROW` (the line is not a JSON object, or has
no `response` object), `NO_RESOURCES_SERVER` (no `resources_server_ref.name` and no
`--server`) or `INVALID_ITEM` (a server name that is not valid Unicode). A failure that says
nothing about the row (the bridge, head server or resources server unreachable, no route for
its server, ...) is no record: the run stops there, and a rerun scores the row.

Resume: records are only ever appended, in input order, so OUT is always the records of a
prefix of the input. `plan` checks that prefix line by line (number and hash), drops a last
line cut short by a crash, and says where to continue.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_grpc.rewards.client.convert import (
    InvalidText,
    json_object,
    proto_text,
    resources_server_name,
)
from nemo_gym_grpc.rewards.client.outcomes import (
    INVALID_ROW,
    NO_RESOURCES_SERVER,
    Failure,
    Outcome,
    finite_number,
)
from nemo_gym_grpc.shared.reasons import INVALID_ITEM, UPSTREAM_ADDRESS_REFUSED
from nemo_gym_grpc.v1 import verify_pb2

# Per-item failure codes that say nothing about the row itself but about where it went: the
# bridge, head server or resources server unreachable or failing for now (UNAVAILABLE, also a
# failed judge call, which NeMo Gym marks transient), no route for its server (NOT_FOUND), no
# `/verify` there (UNIMPLEMENTED), a rate limit, refused credentials, a cancelled item.
NOT_VERDICTS = frozenset(
    {
        "UNAVAILABLE",
        "NOT_FOUND",
        "UNIMPLEMENTED",
        "RESOURCE_EXHAUSTED",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "CANCELLED",
        "ABORTED",
    }
)
# Reasons that say the same under another code: a server the bridge will not dial
# (FAILED_PRECONDITION, its address refused).
NOT_VERDICT_REASONS = frozenset({UPSTREAM_ADDRESS_REFUSED})


def is_verdict(outcome: Outcome) -> bool:
    """True when `outcome` is final for its row, so it is written: a reward, or a failure of
    the row itself (not a whole-call failure, no code of `NOT_VERDICTS`, no reason of
    `NOT_VERDICT_REASONS`)."""
    if not isinstance(outcome, Failure):
        return True
    if outcome.whole_call or outcome.reason in NOT_VERDICT_REASONS:
        return False
    return outcome.code not in NOT_VERDICTS


class OutputMismatch(ValueError):
    """OUT is not the output of an earlier run on this input (a record does not match its
    input line, or is not a record at all), so it cannot be resumed."""


def digest(raw: bytes) -> str:
    """First 16 hex digits of the SHA-256 of one input line, without its line ending."""
    return hashlib.sha256(raw.rstrip(b"\r\n")).hexdigest()[:16]


def input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each non-blank line of `path`."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


@dataclass
class Row:
    """One input row, ready to send or already failed.

    Attributes:
        line: 1-based input line number (`request_id` is its text).
        digest: `digest` of the line.
        server: the routing key, or None when there is none.
        request: the `VerifyRequest` to send, or None when `failure` is set.
        failure: why the row cannot be sent (decided locally), or None.
        previous_reward: the row's own numeric `reward`, or None.
    """

    line: int
    digest: str
    server: str | None = None
    request: verify_pb2.VerifyRequest | None = None
    failure: Failure | None = None
    previous_reward: float | None = None

    @property
    def request_id(self) -> str:
        """The row's request_id: its line number, as text."""
        return str(self.line)


def parse_row(
    raw: bytes,
    line: int,
    default_server: str | None,
    timeout_seconds: float,
    verdict_fields: Callable[[str], frozenset[str]] = lambda server: frozenset(),
) -> Row:
    """Turn one input line into a `Row` (never raises: a bad line becomes a failed row).

    Args:
        raw: the line's bytes (UTF-8 JSON).
        line: its 1-based number.
        default_server: `--server`, the route of rows without `resources_server_ref.name`.
        timeout_seconds: per-item `/verify` timeout sent with the request; 0 = the bridge's.
        verdict_fields: server name -> the fields its `/verify` answer adds, left out of the
            row sent (`verdicts.Verdicts.of`).
    """
    row = Row(line=line, digest=digest(raw))
    data = _json_object(raw, row)
    if data is None:
        return row
    row.server = resources_server_name(data.get("resources_server_ref")) or default_server
    row.previous_reward = finite_number(data.get("reward"))
    response = data.get("response")
    if not isinstance(response, dict):
        row.failure = _invalid(
            INVALID_ROW, f"line {line}: no `response` object (the Responses object a rollout saves)"
        )
    elif row.server is None:
        row.failure = _invalid(
            NO_RESOURCES_SERVER,
            f"line {line}: no resources_server_ref.name and no --server was given",
        )
    else:
        try:
            server = proto_text(row.server, "resources_server_ref name")
        except InvalidText as exc:
            row.failure = _invalid(INVALID_ITEM, str(exc))
            return row
        leave_out = {"response", *verdict_fields(server)}
        body = {key: value for key, value in data.items() if key not in leave_out}
        row.request = verify_pb2.VerifyRequest(
            request_id=row.request_id,
            resources_server=server,
            row_json=json.dumps(body),
            response_json=json.dumps(response),
            timeout_seconds=timeout_seconds,
        )
    return row


def _invalid(reason: str, message: str) -> Failure:
    return Failure("INVALID_ARGUMENT", reason, message)


def _json_object(raw: bytes, row: Row) -> dict[str, Any] | None:
    """The line's JSON object, or None with `row.failure` set (INVALID_ROW)."""
    try:
        return json_object(raw, f"line {row.line}")
    except ValueError as exc:
        row.failure = _invalid(INVALID_ROW, str(exc))
        return None


def record(row: Row, outcome: Outcome) -> dict[str, Any]:
    """The output record of `row` (see the module docstring) given its outcome."""
    result: dict[str, Any] = {
        "line": row.line,
        "row_sha256": row.digest,
        "resources_server": row.server,
        "reward": None,
        "reward_components": {},
        "error": None,
        "previous_reward": row.previous_reward,
    }
    if isinstance(outcome, Failure):
        result["error"] = {
            "code": outcome.code,
            "reason": outcome.reason,
            "message": outcome.message,
        }
    else:
        result["reward"] = outcome.reward
        result["reward_components"] = dict(outcome.reward_components)
    return result


def dumps(rec: dict[str, Any]) -> bytes:
    """One output line: the record as ASCII JSON and a newline."""
    return json.dumps(rec).encode() + b"\n"


@dataclass
class _ServerStats:
    rows: int = 0
    rewards: list[float] = field(default_factory=list)
    causes: Counter[str] = field(default_factory=Counter)


class Summary:
    """Per resources server: rows, scored rows, mean reward, failures by cause."""

    def __init__(self) -> None:
        self.servers: dict[str, _ServerStats] = {}

    def add(self, rec: dict[str, Any]) -> None:
        """Count one output record."""
        stats = self.servers.setdefault(rec.get("resources_server") or "(none)", _ServerStats())
        stats.rows += 1
        error = rec.get("error")
        if error:
            reason = error.get("reason")
            stats.causes[f"{error.get('code')} ({reason})" if reason else error.get("code")] += 1
        else:
            stats.rewards.append(float(rec["reward"]))

    @property
    def rows(self) -> int:
        """Records counted."""
        return sum(s.rows for s in self.servers.values())

    @property
    def failed(self) -> int:
        """Records with an error."""
        return sum(sum(s.causes.values()) for s in self.servers.values())

    def table(self) -> str:
        """A plain-text table, one line per server and a total line."""
        total = _ServerStats()
        for stats in self.servers.values():
            total.rows += stats.rows
            total.rewards += stats.rewards
            total.causes.update(stats.causes)
        header = ("resources server", "rows", "scored", "mean reward", "failed", "failures")
        lines = [header]
        for name, stats in [*sorted(self.servers.items()), ("all", total)]:
            mean = f"{sum(stats.rewards) / len(stats.rewards):.4f}" if stats.rewards else "-"
            causes = ", ".join(f"{c} x{n}" for c, n in stats.causes.most_common())
            failed = str(sum(stats.causes.values()))
            lines.append(
                (name, str(stats.rows), str(len(stats.rewards)), mean, failed, causes or "-")
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        out = []
        for line in lines:
            cells = [
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=False))
            ]
            out.append("  ".join([*cells, line[-1]]).rstrip())
        return "\n".join(out)


@dataclass
class Plan:
    """Where a run starts.

    Attributes:
        total: non-blank input lines.
        done: records already in OUT (the first `done` of them).
        resume_after: input line number of the last record in OUT (0 = none).
        summary: the `Summary` of the records already in OUT.
        dropped_bytes: bytes of a cut-short last line removed from OUT (0 = none).
    """

    total: int = 0
    done: int = 0
    resume_after: int = 0
    summary: Summary = field(default_factory=Summary)
    dropped_bytes: int = 0


def _drop_partial_tail(path: Path) -> int:
    """Truncate `path` after its last newline; returns the bytes removed."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
        return size - keep


def plan(rows_path: Path, out_path: Path) -> Plan:
    """Check OUT against the input and find where to resume.

    A missing OUT means a fresh start. An OUT whose last line was cut short (a crash while
    writing) loses that line. Every record must match, in order, the next non-blank input
    line (number and hash). Reads both files once, keeping nothing per row.

    Raises:
        OutputMismatch: a record does not match (another input, or an edited file), a line
            of OUT is not a record, or OUT has more records than the input has rows.
        OSError: a file cannot be read (or OUT cannot be truncated).
    """
    result = Plan()
    if not out_path.exists():
        for _ in input_lines(rows_path):
            result.total += 1
        return result
    result.dropped_bytes = _drop_partial_tail(out_path)
    with open(out_path, "rb") as out:
        held = out.readline()
        for number, raw in input_lines(rows_path):
            result.total += 1
            if not held:
                continue
            try:
                rec = json.loads(held)
                matches = rec["line"] == number and rec["row_sha256"] == digest(raw)
            except (ValueError, KeyError, TypeError):
                raise OutputMismatch(
                    f"{out_path}: record {result.done + 1} is not a score record: {held[:80]!r}"
                ) from None
            if not matches:
                raise OutputMismatch(
                    f"{out_path}: record {result.done + 1} (line {rec['line']}) does not match "
                    f"line {number} of {rows_path}; it was written for other input. "
                    "Use another -o, or delete it to start over"
                )
            result.summary.add(rec)
            result.done += 1
            result.resume_after = number
            held = out.readline()
        if held:
            raise OutputMismatch(
                f"{out_path} has more records than {rows_path} has rows; it was written "
                "for other input"
            )
    return result


def pending_rows(
    rows_path: Path,
    after: int,
    default_server: str | None,
    timeout_seconds: float,
    verdict_fields: Callable[[str], frozenset[str]] = lambda server: frozenset(),
) -> Iterator[Row]:
    """The `Row`s of the non-blank input lines numbered above `after`, parsed lazily
    (`parse_row`'s arguments)."""
    for number, raw in input_lines(rows_path):
        if number > after:
            yield parse_row(raw, number, default_server, timeout_seconds, verdict_fields)
