"""The NeMo Gym HTTP adapter (`bridge.nemo_gym`): its pure parts, and what a Verifier sends
to a loopback stand-in server. No NeMo Gym."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors, nemo_gym
from nemo_gym_grpc.bridge.metrics import Metrics
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.bridge.verifier import RetryPolicy, Verifier
from nemo_gym_grpc.v1 import verify_pb2

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
                Upstreams({"stateful": url}, None, session),
                session,
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
