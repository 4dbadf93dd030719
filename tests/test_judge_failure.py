"""A real NeMo Gym 0.7 judge failure: math_with_judge whose judge model answers HTTP 503.

The stack is real NeMo Gym 0.7.0 (`ng_run`): the math_with_judge resources server with
`should_use_judge: true`, whose `judge_model_server` is a NeMo Gym `openai_model` model server
(instance `judge_503`). That model server's `openai_base_url` points at `scripted_judge`, the
only stand-in here: no LLM can run on this machine, so the judge's upstream is a tiny HTTP
server that answers every request with 503. The model server retries it and fails, math_with_judge's
`judge_failsafe` turns that into HTTP 200 with `reward: 0.0` (a placeholder),
`mask_sample: true`, `failure_kind: "judge_failed"`. Through the bridge and the reward
functions the wrong answer (which math-verify rejects, so the judge is asked) must be None, never
0.0, with cause UNAVAILABLE (UPSTREAM_JUDGE_FAILED); the right answer is 1.0, decided by
math-verify without calling the judge. NeMo Gym's `failure_kind` and `failure_reason` (0.7.0's
whole failure report) reach the item's error metadata and TRL's completions table.

A rollout's judge failure runs on the agent stack (tests/support/agents.py: `math_agent`, whose
judge model's upstream answers 503 too): the agent's own `/run` reply and the rollout's
`Failure` through the bridge name the same kind and reason. 0.4.0 has no judge_failsafe (a judge
failure is HTTP 500 there), hence `nemo_gym_07`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import grpc
import pytest
import requests
from aiohttp import web

from nemo_gym_grpc.bridge.nemo_gym.scores import MAX_FAILURE_REASON
from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn, run_rollouts
from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.rewards.trl.logs import MAX_LOGGED_TEXT
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import BridgeProcess, NemoGymServers, example_rows, start_bridge
from tests.support.items import error_info
from tests.test_rollouts_client import masked_row, run_over_http

pytestmark = pytest.mark.nemo_gym_07

SERVER = "math_with_judge"
RIGHT, WRONG = "The answer is \\boxed{32}.", "The answer is \\boxed{31}."  # expected: 32


class ScriptedJudge:
    """The judge model's upstream: an OpenAI-style base URL where every request gets HTTP 503
    (stand-in for an overloaded LLM endpoint; none can run here). `hits` counts requests."""

    def __init__(self) -> None:
        self.hits = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _answer(self, request: web.Request) -> web.Response:
        self.hits += 1
        await request.read()
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    def start(self) -> ScriptedJudge:
        """Listen on a free loopback port (url = http://127.0.0.1:PORT/v1)."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and the loop's thread."""
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture(scope="module")
def scripted_judge() -> Iterator[ScriptedJudge]:
    judge = ScriptedJudge().start()
    yield judge
    judge.stop()


def judge_config(judge_url: str) -> tuple[dict, dict]:
    """(config_overrides, extra_config) for NemoGymServers: math_with_judge asks the model
    server `judge_503`, an openai_model whose upstream is `judge_url`."""
    overrides = {
        SERVER: {
            "should_use_judge": True,
            "judge_model_server": {"type": "responses_api_models", "name": "judge_503"},
            "judge_responses_create_params": {"input": []},
        }
    }
    model = {"openai_base_url": judge_url, "openai_api_key": "dummy", "openai_model": "judge"}
    return overrides, {"judge_503": {"responses_api_models": {"openai_model": model}}}


@pytest.fixture(scope="module")
def judge_gym(nemo_gym_venv, scripted_judge) -> Iterator[NemoGymServers]:
    overrides, extra = judge_config(scripted_judge.url)
    with NemoGymServers(
        (SERVER,), venv=nemo_gym_venv, config_overrides=overrides, extra_config=extra
    ) as gym:
        yield gym


@pytest.fixture(scope="module")
def bridge(judge_gym) -> Iterator[BridgeProcess]:
    with start_bridge("--head-url", judge_gym.head_url) as process:
        yield process


@pytest.fixture(scope="module")
def row(judge_gym) -> dict:
    return example_rows(SERVER)[0]


def test_the_0_7_server_reports_the_judge_failure_as_a_masked_placeholder(
    judge_gym, scripted_judge, row
):
    """What the bridge reads: NeMo Gym 0.7.0's own reply to a wrong answer."""
    assert judge_gym.version == "0.7.0"
    hits = scripted_judge.hits
    body = verify_over_http(judge_gym, row)
    assert (body["reward"], body["mask_sample"], body["failure_kind"]) == (
        0.0,
        True,
        "judge_failed",
    )
    assert body["failure_reason"]
    assert scripted_judge.hits > hits  # the judge was asked (and answered 503)


def verify_over_http(judge_gym: NemoGymServers, row: dict) -> dict:
    """math_with_judge's own `/verify` reply to the wrong answer (plain HTTP, no bridge)."""
    response = {
        "id": "resp_judge",
        "object": "response",
        "created_at": 0,
        "model": "policy",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg_judge",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": WRONG, "annotations": []}],
            }
        ],
    }
    with requests.Session() as http:
        http.trust_env = False
        reply = http.post(
            f"{judge_gym.server_urls[SERVER]}/verify",
            json={**row, "response": response},
            timeout=60,
        )
    assert reply.status_code == 200
    return reply.json()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_failed_judge_is_none_in_trl_never_zero(
    judge_gym, bridge, scripted_judge, row, asynchronous
):
    """The reward function as TRL's GRPOTrainer calls it (its log_metric / log_extra
    callbacks included), sync and async reward paths; the completions table shows NeMo Gym's
    own failure kind and reason (bounded)."""
    reason = verify_over_http(judge_gym, row)["failure_reason"]
    reward_fn = create_nemo_gym_reward_fn(
        {}, {}, target=bridge.target, on_error="none", asynchronous=asynchronous
    )
    metrics: dict[str, float] = {}
    columns: dict[str, list] = {}
    prompt = [{"role": "user", "content": row["responses_create_params"]["input"][0]["content"]}]
    hits = scripted_judge.hits
    result = reward_fn(
        prompts=[prompt, prompt],
        completions=[[{"role": "assistant", "content": t}] for t in (RIGHT, WRONG)],
        resources_server_ref=[{"name": SERVER}] * 2,
        verify_extra=[row, row],
        log_metric=lambda name, value: metrics.setdefault(name, value),
        log_extra=lambda column, values: columns.setdefault(column, values),
    )
    rewards = asyncio.run(result) if asynchronous else result
    assert rewards == [1.0, None]
    assert columns["nemo_gym/error"] == [None, "UNAVAILABLE (UPSTREAM_JUDGE_FAILED)"]
    assert columns["nemo_gym/failure_kind"] == [None, "judge_failed"]
    logged = columns["nemo_gym/failure_reason"]
    assert logged[0] is None and logged[1] and len(logged[1]) <= MAX_LOGGED_TEXT
    assert reason.startswith(logged[1].removesuffix("..."))
    assert metrics["rewards/nemo_gym/failed_fraction"] == 0.5
    assert scripted_judge.hits > hits


def test_the_grpc_error_names_the_judge_failure_and_the_right_answer_needs_no_judge(
    bridge, scripted_judge, row
):
    def item(request_id: str, text: str) -> verify_pb2.VerifyRequest:
        return verify_pb2.VerifyRequest(
            request_id=request_id,
            resources_server=SERVER,
            completion=text,
            row_json=json.dumps(row),
        )

    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        hits = scripted_judge.hits
        right = stub.Verify(item("right", RIGHT), timeout=60)
        assert (right.HasField("error"), right.reward) == (False, 1.0)
        assert scripted_judge.hits == hits  # math-verify decided; the judge was not asked
        wrong = stub.Verify(item("wrong", WRONG), timeout=60)
    assert wrong.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    info = error_info(wrong)
    assert info.reason == "UPSTREAM_JUDGE_FAILED"
    assert info.metadata["attempts"] == "1"  # a judge failure is not retried
    assert "judge_failed" in wrong.error.message
    assert info.metadata["failureKind"] == "judge_failed"
    assert info.metadata["failureReason"]


def test_a_rollouts_judge_failure_keeps_the_agents_kind_and_reason(agent_stack, nemo_gym_venv):
    """A real 0.7 rollout whose judge fails: `run_rollouts` gives a `Failure` whose metadata
    holds the kind and reason the agent's own `/run` reply names."""
    row = masked_row(nemo_gym_venv)
    own = run_over_http(agent_stack, row)
    assert (own["mask_sample"], own["failure_kind"]) == (True, "judge_failed")
    assert own["failure_reason"]
    with start_bridge("--head-url", agent_stack.head_url) as bridge:
        (outcome,) = run_rollouts([row], target=bridge.target)
    assert isinstance(outcome, Failure) and outcome.reason == "UPSTREAM_MASKED_SAMPLE"
    assert outcome.metadata["failureKind"] == "judge_failed"
    assert outcome.metadata["failureReason"] == own["failure_reason"][:MAX_FAILURE_REASON]
