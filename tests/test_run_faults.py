"""Rollout faults through a real bridge on the real agent stack: agent down, agent slow past the
deadline, client cancel and bridge shutdown mid-rollout (the agent's HTTP request is closed),
the per-agent concurrency bound, and a 5xx after sending that is not retried.

The scripted policy's knobs (tests/support/policy_model.py) make the real rollout slow or hold
it; tests/support/fault_proxy.py, between the bridge and the real agent, counts the bridge's
`/run` requests in flight and answers a fault on demand.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import rollout_pb2
from tests.support import AgentStack, BridgeProcess, closed_port, example_rows, start_bridge
from tests.support.agents import WEATHER_AGENT, WEATHER_RESOURCES
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import error_info
from tests.support.prometheus_scrape import metrics_url, scrape, value
from tests.support.rollouts import RUN_DEADLINE, by_id, rollout_stub, run_request
from tests.support.waiting import wait_until

WAIT = 60.0  # s, bound of every wait for a condition below
PROXIED = "proxied"  # the weather agent behind the fault proxy


@pytest.fixture(scope="module")
def weather_row(agent_stack: AgentStack) -> dict[str, Any]:
    return example_rows(WEATHER_RESOURCES)[0]


@pytest.fixture(scope="module")
def proxy(agent_stack: AgentStack) -> Iterator[FaultProxy]:
    with FaultProxy(agent_stack.agent_urls[WEATHER_AGENT]) as proxy:
        yield proxy


@pytest.fixture(autouse=True)
def _clean(agent_stack: AgentStack, proxy: FaultProxy) -> Iterator[None]:
    agent_stack.policy.reset()
    proxy.set_faults()
    yield
    agent_stack.policy.reset()  # default knobs, then held calls released
    proxy.set_faults()


def _bridge(proxy: FaultProxy, *args: str) -> BridgeProcess:
    return start_bridge(
        "--agent",
        f"{PROXIED}={proxy.url}",
        "--agent",
        f"down=http://127.0.0.1:{closed_port()}",
        *args,
    )


@pytest.fixture(scope="module")
def bridge(proxy: FaultProxy) -> Iterator[BridgeProcess]:
    with _bridge(proxy, "--agent-concurrency", "2", "--metrics-port", "0") as bridge:
        yield bridge


def test_an_agent_that_is_down_is_unavailable_after_the_retries(bridge):
    with rollout_stub(bridge) as stub:
        result = stub.Run(run_request("d1", "down", {}), timeout=RUN_DEADLINE)
    assert result.error.code == code_pb2.UNAVAILABLE
    info = error_info(result)
    assert info.reason == reasons.UPSTREAM_UNAVAILABLE
    assert info.metadata["attempts"] == "3"  # --retry-attempts' default: it never started


def test_a_5xx_after_sending_is_internal_and_not_retried(bridge, proxy, weather_row):
    proxy.set_faults(Fault("status", status=503, body=b'{"detail": "overloaded"}'))
    with rollout_stub(bridge) as stub:
        result = stub.Run(run_request("e1", PROXIED, weather_row), timeout=RUN_DEADLINE)
    assert result.error.code == code_pb2.INTERNAL
    info = error_info(result)
    assert (info.reason, info.metadata["httpStatus"], info.metadata["attempts"]) == (
        reasons.UPSTREAM_HTTP_ERROR,
        "503",
        "1",
    )
    assert proxy.posts[("/run", "e1")] == 1


def test_a_connection_cut_after_sending_is_not_retried(bridge, proxy, weather_row):
    proxy.set_faults(Fault("drop"))
    with rollout_stub(bridge) as stub:
        result = stub.Run(run_request("cut1", PROXIED, weather_row), timeout=RUN_DEADLINE)
    assert result.error.code == code_pb2.UNAVAILABLE
    assert error_info(result).metadata["attempts"] == "1"
    assert proxy.posts[("/run", "cut1")] == 1


def test_an_agent_slow_past_the_deadline_is_deadline_exceeded(agent_stack, bridge, weather_row):
    agent_stack.policy.knobs.delay = 10.0  # each model call
    with rollout_stub(bridge) as stub:
        by_rpc = stub.Run(run_request("s1", PROXIED, weather_row), timeout=2.0)
        by_item = stub.Run(
            run_request("s2", PROXIED, weather_row, timeout_seconds=1.0), timeout=RUN_DEADLINE
        )
    for result in (by_rpc, by_item):
        assert result.error.code == code_pb2.DEADLINE_EXCEEDED
        info = error_info(result)
        assert (info.reason, info.metadata["attempts"]) == (reasons.UPSTREAM_TIMEOUT, "1")
    assert float(error_info(by_item).metadata["timeoutSeconds"]) == 1.0


def _held(agent_stack: AgentStack, proxy: FaultProxy, count: int) -> None:
    """Wait until `count` of the bridge's /run requests are at the agent and its model calls
    are held (an earlier test's rollout that the agent finishes on its own may hold one more:
    the agent does not stop a rollout whose client left)."""
    wait_until(
        lambda: proxy.in_flight == count and len(agent_stack.policy.in_flight()) >= count,
        WAIT,
        f"{count} held rollouts",
    )


def test_cancelling_a_runstream_closes_the_agents_request(agent_stack, bridge, proxy, weather_row):
    agent_stack.policy.knobs.hold = True
    sent = threading.Event()

    def requests() -> Iterator[rollout_pb2.RunStreamRequest]:
        yield rollout_pb2.RunStreamRequest(items=[run_request("c1", PROXIED, weather_row)])
        sent.set()
        threading.Event().wait(WAIT)  # no half-close: the stream stays open until cancelled

    with rollout_stub(bridge) as stub:
        call = stub.RunStream(requests(), timeout=RUN_DEADLINE)
        _held(agent_stack, proxy, 1)
        call.cancel()
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: proxy.in_flight == 0, WAIT, "the bridge to close its /run request")


def test_cancelling_a_run_closes_the_agents_request(agent_stack, bridge, proxy, weather_row):
    agent_stack.policy.knobs.hold = True
    with rollout_stub(bridge) as stub:
        future = stub.Run.future(run_request("c2", PROXIED, weather_row), timeout=RUN_DEADLINE)
        _held(agent_stack, proxy, 1)
        future.cancel()
    wait_until(lambda: proxy.in_flight == 0, WAIT, "the bridge to close its /run request")


def test_a_bridge_shutting_down_closes_the_agents_requests(agent_stack, proxy, weather_row):
    agent_stack.policy.knobs.hold = True
    with _bridge(proxy, "--grace", "0.5") as bridge, rollout_stub(bridge) as stub:
        future = stub.Run.future(run_request("c3", PROXIED, weather_row), timeout=RUN_DEADLINE)
        _held(agent_stack, proxy, 1)
        assert bridge.stop() == 0
        with pytest.raises(grpc.RpcError) as ended:
            future.result(timeout=WAIT)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: proxy.in_flight == 0, WAIT, "the bridge to close its /run request")


def test_no_more_than_agent_concurrency_rollouts_reach_the_agent(
    agent_stack, bridge, proxy, weather_row
):
    agent_stack.policy.knobs.delay = 0.3  # rollouts overlap
    items = [run_request(f"n{i}", PROXIED, weather_row) for i in range(6)]
    with rollout_stub(bridge) as stub:
        results = by_id(
            stub.RunStream(iter([rollout_pb2.RunStreamRequest(items=items)]), timeout=RUN_DEADLINE)
        )
    assert {rid: r.rollout.reward for rid, r in results.items()} == {f"n{i}": 1.0 for i in range(6)}
    assert proxy.peak_in_flight == 2  # --agent-concurrency 2: reached, never passed
    samples = scrape(metrics_url(bridge))
    assert value(samples, "nemo_gym_grpc_rollouts_total", agent=PROXIED, outcome="ok") >= 6
    assert value(samples, "nemo_gym_grpc_rollouts_in_flight", agent=PROXIED) == 0


def test_a_rollout_waiting_for_a_slot_past_its_deadline_is_deadline_exceeded(
    agent_stack, bridge, proxy, weather_row
):
    agent_stack.policy.knobs.hold = True
    with rollout_stub(bridge) as stub:
        holding = [
            stub.Run.future(run_request(f"h{i}", PROXIED, weather_row), timeout=RUN_DEADLINE)
            for i in range(2)
        ]
        _held(agent_stack, proxy, 2)
        waiting = stub.Run(run_request("late", PROXIED, weather_row), timeout=1.0)
        assert proxy.posts[("/run", "late")] == 0  # it never reached the agent
        agent_stack.policy.reset()  # hold off, held calls released
        done = [future.result(timeout=WAIT) for future in holding]
    assert waiting.error.code == code_pb2.DEADLINE_EXCEEDED
    assert float(error_info(waiting).metadata["queuedSeconds"]) > 0
    assert [r.rollout.reward for r in done] == [1.0, 1.0]
