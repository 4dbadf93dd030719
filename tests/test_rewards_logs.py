"""The reward functions' extras for TRL's log_metric / log_extra, through a real bridge (the
dataset rows: tests/support/reward_rows.py).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn, reward_nemo_gym_verify
from tests.support.reward_rows import reward_columns

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)


def test_trl_callbacks_get_failures_latency_and_the_servers_numeric_reply_fields(
    via_target, loader_rows
):
    eq = loader_rows["equivalence_rule"]
    right = dict(eq[0], verify_extra=dict(eq[0]["verify_extra"], difficulty=3))  # echoed back
    rows = [right, eq[1], dict(eq[1], resources_server_ref={"name": "nope"}), eq[0]]
    answers = [
        eq[0]["verify_extra"]["expected_answer"],
        "not it",
        "not it",
        eq[0]["verify_extra"]["expected_answer"],
    ]
    metrics, columns = {}, {}
    rewards = reward_nemo_gym_verify(
        **reward_columns(rows, answers),
        log_metric=lambda name, value: metrics.setdefault(name, value),
        log_extra=lambda column, values: columns.setdefault(column, values),
    )
    assert rewards == [1.0, 0.0, None, 1.0]
    name = "reward_nemo_gym_verify"
    assert metrics[f"rewards/{name}/failed_fraction"] == 0.25
    assert metrics[f"rewards/{name}/latency_seconds"] > 0
    assert metrics[f"rewards/{name}/reply/equivalence_score"] == pytest.approx(2 / 3)
    assert columns[f"{name}/error"] == [None, None, "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)", None]
    assert columns[f"{name}/reply/equivalence_score"] == [1.0, 0.0, None, 1.0]
    # row fields the server echoes (difficulty) are inputs, not metrics
    assert not [key for key in {**metrics, **columns} if "difficulty" in key]
    assert sorted(metrics) == sorted(
        f"rewards/{name}/{key}"
        for key in (
            "failed_fraction",
            "degraded_fraction",
            "latency_seconds",
            "reply/equivalence_score",
        )
    )


@pytest.fixture
def multireward_upstream():
    """A scripted NeMo Gym resources server (none of the session's servers returns
    `reward_components`): replies like NeMo Gym's example_tool_call_multireward, reward =
    sum of components; an answer "wrong" scores 0 on correctness."""

    async def verify(request: web.Request) -> web.Response:
        body = await request.json()
        text = body["response"]["output"][0]["content"][0]["text"]
        components = {"correctness": 0.0 if text == "wrong" else 1.0, "format": 0.5}
        reply = {**body, "reward": sum(components.values()), "reward_components": components}
        return web.json_response({**reply, "predicted_calls": 1, "checked": True})

    app = web.Application()
    app.router.add_post("/verify", verify)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_reward_components_reach_trl_callbacks_through_a_real_bridge(
    start_bridge, multireward_upstream, asynchronous
):
    bridge = start_bridge("--server", f"multi={multireward_upstream}")
    reward_fn = create_nemo_gym_reward_fn({}, {}, target=bridge.target, asynchronous=asynchronous)
    metrics, columns = [], []
    args = {
        "completions": ["right", "wrong", "right", "right"],
        "resources_server_ref": [{"name": n} for n in ("multi", "multi", "nope", "multi")],
        "verify_extra": [{"expected_call": {"name": "get_weather"}, "n": 1}] * 4,
        "log_metric": lambda name, value: metrics.append((name, value)),
        "log_extra": lambda column, values: columns.append((column, values)),
    }
    result = reward_fn(**args)
    rewards = asyncio.run(result) if asynchronous else result
    assert rewards == [1.5, 0.5, None, 1.5]
    values = dict(metrics)
    assert values["rewards/nemo_gym/components/correctness"] == pytest.approx(2 / 3)
    assert values["rewards/nemo_gym/components/format"] == 0.5
    assert values["rewards/nemo_gym/reply/predicted_calls"] == 1.0
    assert "rewards/nemo_gym/reply/checked" not in values  # a bool
    assert "rewards/nemo_gym/reply/n" not in values  # the row's own field, echoed
    assert dict(columns)["nemo_gym/components/correctness"] == [1.0, 0.0, None, 1.0]
    assert dict(columns)["nemo_gym/error"] == [
        None,
        None,
        "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)",
        None,
    ]
