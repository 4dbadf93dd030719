"""The fault matrix (test_faults.py): bad input (big messages, lone surrogates, invalid UTF-8,
unknown servers, malformed and oversized items).
"""

from __future__ import annotations

import json
import threading

import grpc
import requests
from google.rpc import code_pb2

from nemo_gym_grpc.bridge.nemo_gym.verify import completion_response
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.v1 import verify_pb2
from tests.support import fault_matrix
from tests.support.fault_matrix import assert_failed, assert_rewarded, assert_still_serves
from tests.support.items import mcqa_item as item
from tests.support.items import scored

MiB = 1024 * 1024
MAX_ITEM_BYTES = BridgeConfig().max_item_bytes

# The fault matrix's fixtures (tests/support/fault_matrix.py), this module's own.
row = fault_matrix.row
proxy = fault_matrix.proxy
scripted = fault_matrix.scripted
bridge = fault_matrix.bridge
no_faults = fault_matrix.no_faults


def test_64_items_of_100_kb_in_one_message_are_all_scored(stub, proxy, row):
    filler = "Let me think about every option in turn. " * 2500  # ~100 KB
    items = [item(f"big{i}", row, answer=i % 4 != 0) for i in range(64)]
    for request in items:
        request.completion = filler + request.completion
    message = verify_pb2.VerifyStreamRequest(items=items)
    assert message.ByteSize() > 6 * MiB  # over gRPC's default 4 MiB receive limit
    results = scored(stub, items)
    for i, request in enumerate(items):
        assert_rewarded(results[request.request_id], 0.0 if i % 4 == 0 else 1.0)


def test_lone_surrogate_escapes_fail_their_item_and_the_rest_is_scored(stub, proxy, row, nemo_gym):
    """A JSON text escape like "\\ud800" decodes to a lone surrogate, which is not Unicode
    text: the bridge refuses the item (a real NeMo Gym server answers such a body with 500).
    A valid surrogate pair ("\\ud83d\\ude00", an emoji) is fine."""
    lone = dict(row, note="\ud800")
    text = f"\\boxed{{{row['expected_answer']}}} \udfff"
    response = completion_response(text, "policy")
    items = [
        verify_pb2.VerifyRequest(
            request_id="lone-row", resources_server="mcqa", row_json=json.dumps(lone)
        ),
        item("lone-response", row, response_json=json.dumps(response)),
        item("lone-params", row, responses_create_params_json='{"input": "\\udbff x"}'),
        item("pair", row, completion=f"\U0001f600 \\boxed{{{row['expected_answer']}}}"),
        item("plain", row),
    ]
    assert "\\ud800" in items[0].row_json and "\\ud83d\\ude00" in json.dumps("\U0001f600")
    results = scored(stub, items)
    for request_id, field_name in [
        ("lone-row", "row_json"),
        ("lone-response", "response_json"),
        ("lone-params", "responses_create_params_json"),
    ]:
        assert_failed(
            results[request_id], code_pb2.INVALID_ARGUMENT, "INVALID_ITEM", field=field_name
        )
        assert proxy.attempts[request_id] == 0  # never sent upstream
    assert_rewarded(results["pair"])
    assert_rewarded(results["plain"])
    direct = requests.post(
        f"{nemo_gym.server_urls['mcqa']}/verify",
        data=json.dumps({**row, "response": response}),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert direct.status_code == 500  # why the bridge refuses these items itself


def test_invalid_utf8_on_the_wire_ends_the_stream_with_invalid_argument(bridge, stub, row):
    """Proto3 strings must be valid UTF-8; a message that is not cannot be parsed, so its
    items have no request_id to answer. The stream answers what it read before, then ends
    INVALID_ARGUMENT. (A unary Verify with such bytes: see test_message_limits.py.)"""
    good = verify_pb2.VerifyStreamRequest(items=[item("before", row)]).SerializeToString()
    marker = "REPLACEDBYINVALIDUTF8"
    broken = verify_pb2.VerifyStreamRequest(items=[item("broken", row, completion=marker)])
    bad = broken.SerializeToString().replace(marker.encode(), b"\xff\xfe" + b"x" * 19)
    after = verify_pb2.VerifyStreamRequest(items=[item("after", row)]).SerializeToString()
    sent = threading.Event()

    def messages():
        yield good
        sent.wait(30)  # "before" is answered first
        yield bad
        yield after

    with grpc.insecure_channel(bridge.target) as channel:
        method = channel.stream_stream(
            "/nemo_gym_grpc.v1.VerifyService/VerifyStream",
            request_serializer=lambda raw: raw,
            response_deserializer=verify_pb2.VerifyStreamResponse.FromString,
        )
        results, error = {}, None
        try:
            for message in method(messages(), timeout=30):
                results.update({r.request_id: r for r in message.results})
                sent.set()
        except grpc.RpcError as exc:
            error = exc
    assert list(results) == ["before"] and results["before"].reward == 1.0
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be parsed" in error.details() and "UTF-8" in error.details()
    assert_still_serves(stub, row)


def test_unknown_servers_and_malformed_items_fail_alone(stub, proxy, row):
    bad = {
        "unknown": (dict(resources_server="no_such_server"), code_pb2.NOT_FOUND),
        "no-server": (dict(resources_server=""), code_pb2.INVALID_ARGUMENT),
        "row-not-json": (dict(row_json="{"), code_pb2.INVALID_ARGUMENT),
        "row-a-list": (dict(row_json="[]"), code_pb2.INVALID_ARGUMENT),
        "row-nan": (dict(row_json='{"x": NaN}'), code_pb2.INVALID_ARGUMENT),
        "response-a-string": (dict(response_json='"text"'), code_pb2.INVALID_ARGUMENT),
        "deep": (dict(row_json="[" * 100_000 + "]" * 100_000), code_pb2.INVALID_ARGUMENT),
        "negative-timeout": (dict(timeout_seconds=-1.0), code_pb2.INVALID_ARGUMENT),
        "nan-timeout": (dict(timeout_seconds=float("nan")), code_pb2.INVALID_ARGUMENT),
        "inf-timeout": (dict(timeout_seconds=float("inf")), code_pb2.INVALID_ARGUMENT),
    }
    items = [item(request_id, row, **fields) for request_id, (fields, _) in bad.items()]
    items.append(item("good", row))
    results = scored(stub, items)
    for request_id, (_, code) in bad.items():
        assert results[request_id].error.code == code, results[request_id].error.message
        assert results[request_id].reward == 0.0
    assert_rewarded(results["good"])
    assert sum(proxy.attempts.values()) == 1


def test_an_item_over_the_size_limit_fails_alone(stub, proxy, row):
    huge = item("huge", row, completion="x" * (MAX_ITEM_BYTES + 1))
    results = scored(stub, [huge, item("small", row)])
    assert_failed(
        results["huge"],
        code_pb2.INVALID_ARGUMENT,
        "ITEM_TOO_LARGE",
        maxItemBytes=str(MAX_ITEM_BYTES),
        itemBytes=str(huge.ByteSize()),
    )
    assert_rewarded(results["small"])
    assert proxy.attempts["huge"] == 0
