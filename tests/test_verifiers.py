"""The verifiers 0.4 taskset (nemo_gym_grpc.rewards.verifiers, id `nemo-gym-grpc-verifiers`) as
prime-rl's orchestrator runs it: real verifiers 0.4.0's env server (`EnvServer`, ZMQ) and its
client (`EnvClient`) on loopback, episodes of NeMo Gym's own example rows through a real bridge
to real NeMo Gym 0.7 resources servers of the agent stack (tests/support/agents.py):
example_single_tool_call (a session with a tool) and math_with_judge (whose judge answers 503:
a masked sample). The harness and the policy model are scripted (tests/support/vf_harness.py
says why)."""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.import_module("verifiers.v1")
except ImportError as exc:  # as tests/test_trl.py: a failure in CI, a skip in a smaller venv
    message = f"verifiers is not installed ({exc}); pip install '.[verifiers]'"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)

from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.serve import EnvClient, EnvServer
from verifiers.v1.types import SamplingConfig
from verifiers.v1.utils.loaders import resolve_env_config

from tests.support import start_bridge, vf_harness
from tests.support.agents import MASKED_RESOURCES, WEATHER_RESOURCES
from tests.support.policy_model import ScriptedPolicy
from tests.support.prometheus_scrape import metrics_url, value, wait_for
from tests.support.venv import resources_server_dir

pytestmark = pytest.mark.nemo_gym_07  # the masked judge failure is 0.7's judge_failsafe

TASKSET_ID = "nemo-gym-grpc-verifiers"


@pytest.fixture(scope="module")
def bridge(agent_stack) -> Iterator:
    with start_bridge("--head-url", agent_stack.head_url, "--metrics-port", "0") as started:
        yield started


class Served:
    """A verifiers EnvServer for one taskset config, on its own event loop in a thread."""

    def __init__(self, taskset: dict[str, Any]) -> None:
        config = resolve_env_config(
            {
                "taskset": taskset,
                "agent": {
                    "harness": {"id": vf_harness.install()},
                    "runtime": {"type": "subprocess"},
                },
            }
        )
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(self._make(config))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self.server.run(), self.loop)

    @staticmethod
    async def _make(config: Any) -> EnvServer:
        return EnvServer(config, address="tcp://127.0.0.1:0")

    def stop(self) -> None:
        self.task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def episodes(served: Served, policy: ScriptedPolicy, rows: list[dict]) -> list[Any]:
    """One episode per task data dict, run through an EnvClient at the same time."""

    async def run() -> list[Any]:
        client = EnvClient(served.server.address)
        try:
            await client.wait_for_server_startup()
            model = EvalClientConfig(base_url=policy.base_url, api_key_var="NO_KEY_NEEDED")
            runs = [client.run(model, "scripted", SamplingConfig(), row) for row in rows]
            return await asyncio.gather(*runs)
        finally:
            await client.close()

    return asyncio.run(run())


def task_data(served: Served) -> list[dict]:
    """The taskset's tasks as the orchestrator ships them (dumped TaskData)."""
    return [t.data.model_dump(mode="json") for t in served.server.env.taskset.load()]


def served_rows(bridge, venv: Path, server: str, count: int) -> tuple[Served, list[dict]]:
    """A Served taskset of `server`'s example rows through `bridge`, and its first `count`
    tasks' data."""
    rows = resources_server_dir(server, venv) / "data" / "example.jsonl"
    taskset = {
        "id": TASKSET_ID,
        "dataset": str(rows),
        "task": {"bridge": bridge.target, "resources_server": server},
    }
    served = Served(taskset)
    return served, task_data(served)[:count]


def test_episodes_with_a_tool_call_their_session_and_are_scored_in_it(
    bridge, agent_stack, nemo_gym_venv: Path
):
    served, data = served_rows(bridge, nemo_gym_venv, WEATHER_RESOURCES, 4)
    try:
        results = episodes(served, agent_stack.policy, data)
    finally:
        served.stop()
    for episode in results:
        (trace,) = episode.traces
        assert trace.ok and not trace.errors, trace.errors
        assert trace.reward == 1.0
        assert [m.role for m in trace.messages].count("tool") == 1
    # every tool call went through the bridge into its session, and every session was closed
    url = metrics_url(bridge)
    samples = wait_for(url, lambda s: value(s, "nemo_gym_grpc_open_sessions") == 0)
    assert value(samples, "nemo_gym_grpc_open_sessions") == 0
    calls = value(samples, "nemo_gym_grpc_tool_calls_total", tool="get_weather", code="OK")
    assert calls == len(data)


def test_a_masked_sample_is_an_errored_trace_never_a_reward(
    bridge, agent_stack, nemo_gym_venv: Path
):
    served, data = served_rows(bridge, nemo_gym_venv, MASKED_RESOURCES, 2)
    try:
        results = episodes(served, agent_stack.policy, data)
    finally:
        served.stop()
    for episode in results:
        (trace,) = episode.traces
        # errored (prime-rl leaves it out of training), with NeMo Gym's failure in its info
        assert not trace.ok
        assert [e.type for e in trace.errors] == ["TaskError"]
        assert "UPSTREAM_JUDGE_FAILED" in trace.errors[0].message
        assert trace.rewards["nemo_gym"] is None
        failure = trace.info["nemo_gym"]
        assert failure["failureKind"] == "judge_failed" and failure["step"] == "verify"
    url = metrics_url(bridge)
    samples = wait_for(url, lambda s: value(s, "nemo_gym_grpc_open_sessions") == 0)
    assert value(samples, "nemo_gym_grpc_open_sessions") == 0
