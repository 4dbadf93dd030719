"""The bridge's JSON codec (`nemo_gym.codec`: msgspec with the standard library's rules) as
items see it through `verify_checks.check_item`: pure, no network, no NeMo Gym."""

from __future__ import annotations

import json

import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.verify_checks import check_item
from nemo_gym_grpc.bridge.nemo_gym import codec
from nemo_gym_grpc.v1 import verify_pb2


def body_of(row_json: str) -> dict:
    request = verify_pb2.VerifyRequest(
        request_id="r1", resources_server="mcqa", row_json=row_json, completion="x"
    )
    verify, _ = check_item(request, max_item_bytes=1 << 20, session_servers=())
    return json.loads(verify)


def test_integers_beyond_64_bits_reach_the_upstream_exactly():
    big = [2**64, -(2**63) - 1, 2**200, 10**4000]
    assert body_of(json.dumps({"ids": big}))["ids"] == big


def test_a_duplicate_key_keeps_the_last_value_as_the_standard_library_does():
    assert body_of('{"a": 1, "a": 2}')["a"] == json.loads('{"a": 1, "a": 2}')["a"] == 2


def test_floats_keep_their_value():
    values = [0.1, -0.0, 1e16, 5e-324, 1.7976931348623157e308, 1.0000000000000002]
    assert body_of(json.dumps({"f": values}))["f"] == values


@pytest.mark.parametrize("text", ['{"x": 1e400}', '{"x": -Infinity}', '{"x": [NaN]}'])
def test_what_the_standard_library_reads_as_nan_or_infinity_is_refused_not_sent_as_null(text):
    with pytest.raises(errors.ItemError) as caught:
        body_of(text)
    assert caught.value.code == code_pb2.INVALID_ARGUMENT
    assert caught.value.message.startswith("item JSON cannot be sent: ")


def test_text_msgspec_refuses_is_read_by_the_standard_library_and_marked():
    loose = codec.loads('{"x": NaN}')
    assert isinstance(loose, codec.StdlibParsed) and loose["x"] != loose["x"]
    assert type(codec.loads('{"x": 1}')) is dict
    with pytest.raises(ValueError, match="Expecting value"):  # the standard library's text
        codec.loads('{"x": }')
    with pytest.raises(ValueError, match="Exceeds the limit"):
        codec.loads('{"x": %s}' % ("9" * 5000))


def test_dumps_refuses_nan_unless_told_the_value_is_exact():
    assert codec.dumps({"x": float("nan")}) == b'{"x":null}'  # msgspec's own rule
    with pytest.raises(ValueError):
        codec.dumps({"x": float("nan")}, exact=False)
    with pytest.raises(UnicodeEncodeError):
        codec.dumps({"x": "\ud800"})
