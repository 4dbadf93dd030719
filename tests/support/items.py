"""Builders and readers shared by the test modules: mcqa items, ErrorInfo, whole streams.

mcqa_item("r1")                       # mcqa's first example row, the right letter boxed
mcqa_item("w1", row, False)           # a wrong letter; mcqa_item("x", row, "C") boxes C
results = scored(stub, items)         # {request_id: VerifyResponse}, the stream ended OK
error_info(results["w1"]).reason
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2

from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

MCQA_ROW = Path(__file__).resolve().parents[1] / "data" / "mcqa_row.json"


def mcqa_row() -> dict[str, Any]:
    """The first row of NeMo Gym's mcqa data/example.jsonl (the same in 0.4.0 and 0.7.0), from
    its checked-in copy tests/data/mcqa_row.json (no venv needed), a fresh dict on every call."""
    row: dict[str, Any] = json.loads(MCQA_ROW.read_text())
    return row


def wrong_letter(letter: str) -> str:
    """An mcqa option letter other than `letter`."""
    return "A" if letter != "A" else "C"


def mcqa_item(
    request_id: str,
    row: Mapping[str, Any] | None = None,
    answer: str | bool = True,
    **fields: Any,
) -> verify_pb2.VerifyRequest:
    """An mcqa item whose completion is "Let me think. \\boxed{X}".

    `row` defaults to mcqa_row(). X is `answer` if it is a letter; True boxes the row's
    expected letter, False a wrong one. `fields` set or override any VerifyRequest field
    (completion, resources_server, row_json, timeout_seconds, ...).
    """
    row = mcqa_row() if row is None else row
    expected = str(row["expected_answer"])
    if isinstance(answer, bool):
        answer = expected if answer else wrong_letter(expected)
    fields.setdefault("completion", f"Let me think. \\boxed{{{answer}}}")
    fields.setdefault("resources_server", "mcqa")
    fields.setdefault("row_json", json.dumps(row))
    return verify_pb2.VerifyRequest(request_id=request_id, **fields)


def scoring_reply(size: int) -> bytes:
    """A `/verify` reply body of `size` bytes that scores (reward 1.0, padded), for scripted
    upstreams that must answer large."""
    head = b'{"reward": 1.0, "pad": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def error_info(result: verify_pb2.VerifyResponse) -> error_details_pb2.ErrorInfo:
    """The single ErrorInfo of a failed result; asserts that the result is a failure with
    exactly one detail, in the bridge's error domain."""
    assert result.HasField("error"), f"{result.request_id} has no error"
    assert len(result.error.details) == 1
    detail = error_details_pb2.ErrorInfo()
    assert result.error.details[0].Unpack(detail)
    assert detail.domain == reasons.ERROR_DOMAIN
    return detail


def reason(result: verify_pb2.VerifyResponse) -> str:
    """The ErrorInfo reason of a failed result (UPSTREAM_TIMEOUT, ...), checked as error_info
    checks it."""
    return str(error_info(result).reason)


@dataclass
class Outcome:
    """What one VerifyStream call gave: results by request_id, the call's error (None = it
    ended OK) and how long it took, in seconds."""

    results: dict[str, verify_pb2.VerifyResponse] = field(default_factory=dict)
    error: grpc.RpcError | None = None
    seconds: float = 0.0


def stream(
    stub: verify_pb2_grpc.VerifyServiceStub,
    items: Sequence[verify_pb2.VerifyRequest],
    timeout: float = 60.0,
) -> Outcome:
    """Send `items` on one VerifyStream (64 per message, RPC deadline `timeout` s); asserts
    that no result has an unknown request_id or answers an item twice."""
    batches = [
        verify_pb2.VerifyStreamRequest(items=items[k : k + 64]) for k in range(0, len(items), 64)
    ]
    sent = {i.request_id for i in items}
    outcome = Outcome()
    started = time.monotonic()
    try:
        for message in stub.VerifyStream(iter(batches), timeout=timeout):
            for result in message.results:
                assert result.request_id in sent, result.request_id
                assert result.request_id not in outcome.results, result.request_id
                outcome.results[result.request_id] = result
    except grpc.RpcError as exc:
        outcome.error = exc
    outcome.seconds = time.monotonic() - started
    return outcome


def scored(
    stub: verify_pb2_grpc.VerifyServiceStub,
    items: Sequence[verify_pb2.VerifyRequest],
    timeout: float = 60.0,
) -> dict[str, verify_pb2.VerifyResponse]:
    """Results of a stream (see stream) that must end OK with one result per item."""
    outcome = stream(stub, items, timeout)
    assert outcome.error is None, outcome.error
    assert sorted(outcome.results) == sorted(i.request_id for i in items)
    return outcome.results
