"""Item checks and encoding (`bridge.flows.verify_checks.check_item`): pure, no network,
no NeMo Gym."""

from __future__ import annotations

import json

import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.verify_checks import check_item
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2

ROW = {"question": "2+2?", "options": [{"A": "4"}], "expected_answer": "A", "unused": None}


def item(**fields) -> verify_pb2.VerifyRequest:
    fields.setdefault("request_id", "r1")
    fields.setdefault("resources_server", "mcqa")
    fields.setdefault("row_json", json.dumps(ROW))
    fields.setdefault("completion", "\\boxed{A}")
    return verify_pb2.VerifyRequest(**fields)


def check(request: verify_pb2.VerifyRequest, **settings) -> tuple[bytes, bytes | None]:
    settings.setdefault("max_item_bytes", 1 << 20)
    settings.setdefault("session_servers", ())
    return check_item(request, **settings)


def refused(request: verify_pb2.VerifyRequest, **settings) -> errors.ItemError:
    with pytest.raises(errors.ItemError) as caught:
        check(request, **settings)
    assert caught.value.code == code_pb2.INVALID_ARGUMENT
    return caught.value


def test_a_good_item_becomes_its_verify_body_without_nulls_and_no_seed_body():
    verify, seed = check(item())
    body = json.loads(verify)
    assert seed is None
    assert "unused" not in body and body["expected_answer"] == "A"
    assert body["responses_create_params"] == {"input": []}
    assert body["response"]["id"] == "resp_r1"
    assert body["response"]["output"][0]["content"][0]["text"] == "\\boxed{A}"


def test_a_session_item_gets_the_seed_body_without_the_response():
    for request, servers in [(item(seed_session=True), ()), (item(), ("mcqa",))]:
        verify, seed = check(request, session_servers=servers)
        assert seed is not None
        assert json.loads(seed) == {k: v for k, v in json.loads(verify).items() if k != "response"}


def test_non_ascii_text_is_sent_as_utf8_not_escaped():
    verify, _ = check(item(completion="Ünïcode \U0001f600"))
    assert "Ünïcode \U0001f600".encode() in verify


def test_an_item_over_the_size_limit_is_too_large():
    request = item(completion="x" * 1000)
    error = refused(request, max_item_bytes=1000)
    assert error.reason == reasons.ITEM_TOO_LARGE
    assert error.metadata == {"itemBytes": str(request.ByteSize()), "maxItemBytes": "1000"}
    assert error.message == (
        f"item is {request.ByteSize()} bytes; the bridge accepts items of at most 1000 bytes"
    )
    check(request, max_item_bytes=request.ByteSize())  # the limit itself is accepted


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (dict(resources_server=""), "resources_server", "resources_server is empty"),
        (
            dict(timeout_seconds=-1.0),
            "timeout_seconds",
            "timeout_seconds must be finite and >= 0, got -1.0",
        ),
        (
            dict(timeout_seconds=float("nan")),
            "timeout_seconds",
            "timeout_seconds must be finite and >= 0, got nan",
        ),
        (
            dict(timeout_seconds=float("inf")),
            "timeout_seconds",
            "timeout_seconds must be finite and >= 0, got inf",
        ),
        (dict(request_id=""), "request_id", "request_id is empty"),
        (dict(request_id="", seed_session=True), "request_id", "request_id is empty"),
        (dict(row_json="[]"), "row_json", "row_json must be a JSON object, got list"),
        (
            dict(response_json='"text"'),
            "response_json",
            "response_json must be a JSON object, got str",
        ),
    ],
)
def test_bad_fields_are_invalid_items_naming_the_field(fields, field, message):
    error = refused(item(**fields))
    assert error.reason == reasons.INVALID_ITEM
    assert error.metadata == {"field": field}
    assert error.message == message


@pytest.mark.parametrize("field", ["row_json", "responses_create_params_json", "response_json"])
def test_invalid_json_is_an_invalid_item(field):
    error = refused(item(**{field: "{"}))
    assert error.reason == reasons.INVALID_ITEM and error.metadata == {"field": field}
    assert error.message.startswith(f"{field} is not valid JSON: ")


def test_nan_and_deep_nesting_are_invalid_items():
    nan = refused(item(row_json='{"x": NaN}'))
    assert nan.reason == reasons.INVALID_ITEM
    assert nan.message.startswith("item JSON cannot be sent: ")
    assert nan.metadata == {"field": "row_json"}
    deep = refused(item(row_json="[" * 100_000 + "]" * 100_000))
    assert deep.reason == reasons.INVALID_ITEM and deep.metadata == {"field": "row_json"}


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("row_json", json.dumps(dict(ROW, note="\ud800"))),
        ("responses_create_params_json", '{"input": "\\udbff x"}'),
        ("response_json", json.dumps({"output": "\udfff"})),
    ],
)
def test_a_lone_surrogate_escape_is_an_invalid_item_naming_its_field(field, text):
    assert "\\ud" in text  # an escape in ASCII JSON text, as proto3 strings carry it
    error = refused(item(**{field: text}))
    assert error.reason == reasons.INVALID_ITEM and error.metadata == {"field": field}
    assert error.message == (
        f'{field} holds a lone surrogate escape (e.g. "\\ud800"): not valid Unicode text, '
        "UTF-8 cannot encode it"
    )


def test_a_surrogate_pair_escape_is_text():
    text = json.dumps(dict(ROW, note="\U0001f600"))
    assert "\\ud83d\\ude00" in text
    verify, _ = check(item(row_json=text))
    assert "\U0001f600".encode() in verify


def test_the_lone_surrogate_detector():
    assert errors.has_lone_surrogate("a\ud800b") and errors.has_lone_surrogate("\udfff")
    assert not errors.has_lone_surrogate("plain \U0001f600 text")
    assert errors.utf8_text("a\ud800b") == "a\ufffdb"
