"""The NeMo Gym HTTP adapter (`bridge.nemo_gym`): its pure parts, and what a Verifier sends
to a loopback stand-in server. No NeMo Gym."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.flows.verify import Verifier
from nemo_gym_grpc.bridge.nemo_gym import http, scores, sessions, verify
from nemo_gym_grpc.bridge.process.metrics import Metrics
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2

URL = "http://127.0.0.1:1/verify"


def test_the_request_id_header_is_the_id_when_printable_ascii_else_percent_encoded():
    assert http.request_id_header("batch-0 7") == "batch-0 7"
    assert http.request_id_header("é\r\n") == "%C3%A9%0D%0A"
    assert http.request_id_header("x" * 500) == "x" * 200


def test_a_reply_gives_its_reward_components_and_only_on_request_its_other_fields():
    raw = json.dumps(
        {"reward": 1, "reward_components": {"a": 0.5}, "response": {}, "extracted": "B"}
    ).encode()
    assert verify.read_verify_reply(raw, URL, False) == scores.Scored(1.0, {"a": 0.5}, "")
    scored = verify.read_verify_reply(raw, URL, True)
    assert json.loads(scored.reply_json) == {"extracted": "B"}


@pytest.mark.parametrize(
    ("reply", "code", "reason"),
    [
        (b"not json", code_pb2.INTERNAL, reasons.UPSTREAM_BAD_REPLY),
        (b'{"reward": true}', code_pb2.INTERNAL, reasons.UPSTREAM_BAD_REPLY),
        (
            b'{"reward": 1, "reward_components": {"a": "x"}}',
            code_pb2.INTERNAL,
            "UPSTREAM_BAD_REPLY",
        ),
        (
            b'{"reward": 0, "_ng_failure_class": "judge_failed"}',
            code_pb2.UNAVAILABLE,
            reasons.UPSTREAM_JUDGE_FAILED,
        ),
        (
            b'{"reward": 0, "mask_sample": true}',
            code_pb2.UNKNOWN,
            reasons.UPSTREAM_MASKED_SAMPLE,
        ),
    ],
)
def test_a_reply_without_a_usable_reward_is_a_failure_that_is_not_retried(reply, code, reason):
    with pytest.raises(errors.ItemError) as caught:
        verify.read_verify_reply(reply, URL, False)
    assert (caught.value.code, caught.value.reason) == (code, reason)
    assert not caught.value.retryable and caught.value.metadata["upstreamUrl"] == URL


# NeMo Gym 0.7's reply vocabulary: the cases of the 0.7 notes' Step 4 table (A-I), plus the
# legacy `_ng_failure_class` with another class. mask_sample decides; failure_kind /
# failure_reason are diagnostics (orthogonal to it).
JUDGE_FAILSAFE = {  # judge.py::judge_failsafe's row, as a real 0.7.0 math_with_judge sent it
    "reward": 0.0,
    "mask_sample": True,
    "failure_kind": "judge_failed",
    "failure_reason": "ClientResponseError: 500, message='Internal Server Error'",
    "instance_config": {"mask_sample": True},
    "_ng_failure_class": "judge_failed",
    "_ng_failure_judge_error": "ClientResponseError: 500, message='Internal Server Error'",
}
SCORED_07 = {
    "A": ({"reward": 0.7, "mask_sample": False, "failure_kind": "judge_unparseable"}, 0.7),
    "B": (
        {
            "reward": 0.0,
            "mask_sample": False,
            "failure_kind": "usersim:assistant_timeout",
            "failure_reason": "assistant model timed out",
        },
        0.0,
    ),
    "C": (
        {"reward": 1.0, "mask_sample": False, "failure_kind": None, "failure_reason": "none"},
        1.0,
    ),
    "D": ({"reward": 1.0, "mask_sample": False, "failure_kind": None, "failure_reason": None}, 1.0),
    "0.4": ({"reward": 1.0, "extracted_answer": "B"}, 1.0),
}
MASKED_07 = {
    # case: (reply, code, reason, metadata expected (None = absent), message ends with)
    "E": (
        {"reward": 0.0, "mask_sample": True},
        code_pb2.UNKNOWN,
        reasons.UPSTREAM_MASKED_SAMPLE,
        {"failureKind": None, "failureReason": None},
        "masked the sample (mask_sample)",
    ),
    "F": (
        {
            "reward": 0.0,
            "mask_sample": True,
            "failure_kind": "judge_failed",
            "failure_reason": "judge down",
        },
        code_pb2.UNAVAILABLE,
        reasons.UPSTREAM_JUDGE_FAILED,
        {"failureKind": "judge_failed", "failureReason": "judge down", "failureClass": None},
        "reported judge_failed: judge down",
    ),
    "G": (
        JUDGE_FAILSAFE,
        code_pb2.UNAVAILABLE,
        reasons.UPSTREAM_JUDGE_FAILED,
        {
            "failureKind": "judge_failed",
            "failureReason": JUDGE_FAILSAFE["failure_reason"],
            "failureClass": "judge_failed",
        },
        "reported judge_failed: ClientResponseError: 500, message='Internal Server Error'",
    ),
    "H": (
        {
            "reward": 0.5,
            "reward_components": {"a": 0.5},
            "mask_sample": True,
            "failure_kind": "provider_oom_killed",
        },
        code_pb2.UNKNOWN,
        reasons.UPSTREAM_MASKED_SAMPLE,
        {"failureKind": "provider_oom_killed", "failureReason": None},
        "reported provider_oom_killed",
    ),
    "I": (
        {"reward": 0.0, "instance_config": {"mask_sample": True}},
        code_pb2.UNKNOWN,
        reasons.UPSTREAM_MASKED_SAMPLE,
        {"failureKind": None},
        "masked the sample (mask_sample)",
    ),
    "legacy class": (
        {"reward": 0.0, "_ng_failure_class": "verifier_crashed"},
        code_pb2.UNKNOWN,
        reasons.UPSTREAM_MASKED_SAMPLE,
        {"failureClass": "verifier_crashed", "failureKind": None},
        "reported verifier_crashed",
    ),
}


@pytest.mark.parametrize("case", sorted(SCORED_07))
def test_a_failure_kind_without_a_mask_keeps_its_reward_and_carries_the_diagnostics(case):
    reply, reward = SCORED_07[case]
    scored = verify.read_verify_reply(json.dumps(reply).encode(), URL, True)
    assert scored.reward == reward
    assert scored.failure_kind == (reply.get("failure_kind") or "")
    assert scored.failure_reason == (reply.get("failure_reason") or "")


@pytest.mark.parametrize("case", sorted(MASKED_07))
def test_a_masked_reply_is_a_failure_naming_its_kind_and_reason_never_retried(case):
    reply, code, reason, metadata, ending = MASKED_07[case]
    with pytest.raises(errors.ItemError) as caught:
        verify.read_verify_reply(json.dumps(reply).encode(), URL, True)
    error = caught.value
    assert (error.code, error.reason, error.retryable) == (code, reason, False)
    for key, value in metadata.items():
        assert error.metadata.get(key) == value, key
    assert error.metadata["upstreamUrl"] == URL
    assert error.message == f"{URL} {ending}"
    assert "None" not in error.message


def test_failure_texts_are_cut_and_made_utf8():
    reply = {
        "reward": 0.0,
        "mask_sample": False,
        "failure_kind": "k" * 500,
        "failure_reason": "\ud800" + "r" * 5000,
    }
    scored = verify.read_verify_reply(json.dumps(reply).encode(), URL, False)
    assert scored.failure_kind == "k" * scores.MAX_FAILURE_KIND
    assert len(scored.failure_reason) == scores.MAX_FAILURE_REASON
    assert scored.failure_reason.startswith("\ufffdrrr")
    with pytest.raises(errors.ItemError) as caught:
        verify.read_verify_reply(json.dumps({**reply, "mask_sample": True}).encode(), URL, False)
    assert len(caught.value.metadata["failureReason"]) == scores.MAX_FAILURE_REASON
    assert len(caught.value.message) < 500  # the message holds the first 200 characters


def test_the_seed_body_is_the_verify_body_without_the_response():
    body = {"question": "é", "responses_create_params": {"input": []}, "response": {}}
    assert json.loads(sessions.seed_body(body)) == {
        "question": "é",
        "responses_create_params": {"input": []},
    }


async def test_both_calls_of_a_session_item_carry_its_request_id_and_the_seed_cookie():
    """A real loopback HTTP server stands in for a resources server and records what the
    bridge's Verifier sends."""
    seen: list[tuple[str, str | None, str | None]] = []

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        seen.append((request.path, request.headers.get("X-Request-Id"), request.cookies.get("s")))
        if request.path == "/seed_session":
            response = web.json_response({})
            response.set_cookie("s", "state-1")
            return response
        return web.json_response({"reward": 1.0})

    app = web.Application()
    app.router.add_post("/{route}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            verifier = Verifier(
                Upstreams({"stateful": url}),
                http.Client(session),
                default_timeout=5.0,
                max_in_flight=4,
                retry=RetryPolicy(attempts=1, budget=5.0),
                max_item_bytes=1 << 20,
                session_servers=(),
                metrics=Metrics(),
            )
            request = verify_pb2.VerifyRequest(
                request_id="item-é", resources_server="stateful", seed_session=True
            )
            result = await verifier.verify(request, None)
    finally:
        await runner.cleanup()
    assert result.WhichOneof("outcome") == "reward" and result.reward == 1.0
    assert seen == [("/seed_session", "item-%C3%A9", None), ("/verify", "item-%C3%A9", "state-1")]
