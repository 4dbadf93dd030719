"""The NeMo Gym HTTP adapter's pure parts (`bridge.nemo_gym`): no network, no NeMo Gym."""

from __future__ import annotations

import json

import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors, nemo_gym

URL = "http://127.0.0.1:1/verify"


def test_the_request_id_header_is_the_id_when_printable_ascii_else_percent_encoded():
    assert nemo_gym.request_id_header("batch-0 7") == "batch-0 7"
    assert nemo_gym.request_id_header("é\r\n") == "%C3%A9%0D%0A"
    assert nemo_gym.request_id_header("x" * 500) == "x" * 200


def test_a_reply_gives_its_reward_components_and_only_on_request_its_other_fields():
    raw = json.dumps(
        {"reward": 1, "reward_components": {"a": 0.5}, "response": {}, "extracted": "B"}
    ).encode()
    assert nemo_gym.read_verify_reply(raw, URL, False) == nemo_gym.Scored(1.0, {"a": 0.5}, "")
    scored = nemo_gym.read_verify_reply(raw, URL, True)
    assert json.loads(scored.reply_json) == {"extracted": "B"}


@pytest.mark.parametrize(
    ("reply", "code", "reason"),
    [
        (b"not json", code_pb2.INTERNAL, errors.UPSTREAM_BAD_REPLY),
        (b'{"reward": true}', code_pb2.INTERNAL, errors.UPSTREAM_BAD_REPLY),
        (
            b'{"reward": 1, "reward_components": {"a": "x"}}',
            code_pb2.INTERNAL,
            "UPSTREAM_BAD_REPLY",
        ),
        (
            b'{"reward": 0, "_ng_failure_class": "judge_failed"}',
            code_pb2.UNAVAILABLE,
            errors.UPSTREAM_JUDGE_FAILED,
        ),
        (
            b'{"reward": 0, "mask_sample": true}',
            code_pb2.INTERNAL,
            errors.UPSTREAM_REPORTED_FAILURE,
        ),
    ],
)
def test_a_reply_without_a_usable_reward_is_a_failure_that_is_not_retried(reply, code, reason):
    with pytest.raises(errors.ItemError) as caught:
        nemo_gym.read_verify_reply(reply, URL, False)
    assert (caught.value.code, caught.value.reason) == (code, reason)
    assert not caught.value.retryable and caught.value.metadata["upstreamUrl"] == URL


def test_the_seed_body_is_the_verify_body_without_the_response():
    body = {"question": "é", "responses_create_params": {"input": []}, "response": {}}
    assert json.loads(nemo_gym.seed_body(body)) == {
        "question": "é",
        "responses_create_params": {"input": []},
    }
