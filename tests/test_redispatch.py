"""Whole-call redispatch: when the stream to a bridge breaks, the items it left unanswered are
resent, once each, within the call's deadline, to another bridge of the target (or to the same
one once it is back); every item still gets exactly one outcome, in order.

Real parts: NeMo Gym 0.7's mcqa (ng_run), real bridges SIGKILLed by PID while they hold the
call's stream (found by their own `nemo_gym_grpc_active_streams` gauge), real gRPC. Each bridge
reaches mcqa through its own FaultProxy passing everything through, so the `/verify` POSTs that
reached the upstream are counted per bridge.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn, run_rollouts
from nemo_gym_grpc.rewards.client import settings
from tests.support import BridgeProcess, closed_port, example_rows, start_bridge
from tests.support.agents import WEATHER_AGENT, WEATHER_RESOURCES
from tests.support.fault_proxy import FaultProxy
from tests.support.items import mcqa_row, wrong_letter
from tests.support.prometheus_scrape import metrics_url, scrape

ITEMS = 2000


def _total(samples: dict, name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


@dataclass
class Killer:
    """Watches `bridges` and SIGKILLs the first that has answered `after` items since (its
    `done` counter) and is busy (its `busy` gauge above 0, if given: a stream open), calling
    `before_kill` first; `killed` is that bridge, `answered` its count at the kill."""

    bridges: list[BridgeProcess]
    after: int
    busy: str | None = "nemo_gym_grpc_active_streams"
    done: str = "nemo_gym_grpc_items_total"
    before_kill: Callable[[], object] = lambda: None
    killed: BridgeProcess | None = None
    answered: float = 0.0
    urls: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.urls = {b.pid: metrics_url(b) for b in self.bridges}
        self.base = {b.pid: _total(scrape(self.urls[b.pid]), self.done) for b in self.bridges}
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for bridge in self.bridges:
                try:
                    samples = scrape(self.urls[bridge.pid])
                except requests.RequestException:
                    continue  # a bridge gone or too busy to answer just now

                done = _total(samples, self.done) - self.base[bridge.pid]
                busy = self.busy is None or _total(samples, self.busy)
                if busy and done >= self.after:
                    self.before_kill()
                    os.kill(bridge.pid, signal.SIGKILL)
                    self.killed, self.answered = bridge, done
                    return
            time.sleep(0.01)


def mcqa_call(count: int) -> tuple[list[str], dict[str, Any], list[float]]:
    """(completions, reward-function keywords, expected rewards) for `count` mcqa items."""
    row = mcqa_row()
    right = str(row["expected_answer"])
    completions = [f"\\boxed{{{right if i % 2 else wrong_letter(right)}}}" for i in range(count)]
    columns = {"resources_server_ref": [{"name": "mcqa"}] * count, "verify_extra": [row] * count}
    return completions, columns, [float(i % 2) for i in range(count)]


@pytest.fixture
def proxied(nemo_gym) -> Iterator[Any]:
    """proxied(port=0) -> (bridge, proxy): a bridge with metrics, to mcqa through its own
    FaultProxy; `port` fixes its listen port (to start it again on the same address)."""
    started: list[tuple[BridgeProcess, FaultProxy]] = []

    def make(port: int = 0) -> tuple[BridgeProcess, FaultProxy]:
        proxy = FaultProxy(nemo_gym.server_urls["mcqa"]).start()
        args = ("--server", f"mcqa={proxy.url}", "--metrics-port", "0")
        started.append((start_bridge(*args, listen=f"127.0.0.1:{port}"), proxy))
        return started[-1]

    yield make
    for bridge, proxy in started:
        bridge.stop()
        proxy.close()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_items_of_a_killed_bridge_are_resent_to_the_other(proxied, asynchronous, caplog):
    (b1, p1), (b2, p2) = proxied(), proxied()
    fn = create_nemo_gym_reward_fn(
        None, {}, target=f"ipv4:{b1.target},{b2.target}", asynchronous=asynchronous
    )
    completions, columns, expected = mcqa_call(ITEMS)
    killer = Killer([b1, b2], after=200)
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        rewards = fn(completions, **columns)
        if asynchronous:
            rewards = asyncio.run(rewards)
    killer.thread.join()
    assert killer.killed is not None and 200 <= killer.answered < ITEMS  # mid-call
    assert "its " in caplog.text and "unanswered items go out again" in caplog.text
    # every item scored, in order; none None, none twice
    assert rewards == expected, (sum(r is None for r in rewards), caplog.text[-3000:])
    # the upstream saw each item at least once; those in flight at the kill, twice
    assert p1.total + p2.total >= ITEMS


def test_with_one_bridge_the_items_are_resent_to_it_once_it_is_back(proxied, monkeypatch):
    port = closed_port()
    bridge, _ = proxied(port)
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "30")
    fn = create_nemo_gym_reward_fn(None, {}, target=bridge.target, batch_timeout=120)
    completions, columns, expected = mcqa_call(ITEMS)
    killer = Killer([bridge], after=200)

    def restart() -> None:
        killer.thread.join()
        time.sleep(1.0)
        proxied(port)  # a new bridge on the same address

    again = threading.Thread(target=restart)
    again.start()
    rewards = fn(completions, **columns)
    again.join()
    assert killer.killed is bridge and 200 <= killer.answered < ITEMS
    assert rewards == expected


def test_rollouts_are_resent_only_when_their_run_cannot_have_started(agent_stack, request):
    """A bridge that holds 64 rollouts at a time (`--max-stream-items 64`) stops reading the
    stream meanwhile, so gRPC stops taking rows of 50 kB from the client once its buffers are
    full. The bridge is SIGKILLed after 64 rollouts: those gRPC had taken and no result came
    for fail with the call's status (their `/run` may have started); those it never took
    cannot have reached any agent and are resent to the target's other bridge, which is up
    by then (and whose agent refuses connections: each of them fails alone, quickly)."""
    agent = f"{WEATHER_AGENT}={agent_stack.agent_urls[WEATHER_AGENT]}"
    first = start_bridge("--agent", agent, "--max-stream-items", "64", "--metrics-port", "0")
    request.addfinalizer(first.stop)
    port = closed_port()  # the second bridge's, down when the call starts: it goes to `first`

    def start_second() -> None:
        refused = f"{WEATHER_AGENT}=http://127.0.0.1:{closed_port()}"
        request.addfinalizer(start_bridge("--agent", refused, listen=f"127.0.0.1:{port}").stop)

    row = dict(example_rows(WEATHER_RESOURCES)[0], agent_ref={"name": WEATHER_AGENT})
    rows = [dict(row, padding="x" * 50_000) for _ in range(2000)]
    killer = Killer([first], after=64, busy=None, done="nemo_gym_grpc_rollouts_total",
                    before_kill=start_second)  # fmt: skip
    outcomes = run_rollouts(rows, target=f"ipv4:{first.target},127.0.0.1:{port}")
    killer.thread.join()
    ran = [o for o in outcomes if hasattr(o, "rollout")]
    cut = [o for o in outcomes if not hasattr(o, "rollout") and o.whole_call]
    resent = [o for o in outcomes if not hasattr(o, "rollout") and not o.whole_call]
    assert killer.killed is first and len(ran) >= 64
    assert all(o.rollout.reward == 1.0 for o in ran)
    # each stream cut by the kill ends UNAVAILABLE; gRPC words it by what its socket saw
    # ("Stream removed (Socket closed)", "... (sendmsg: Broken pipe (32))": both in CI)
    assert cut and {o.code for o in cut} == {"UNAVAILABLE"} and all(o.message for o in cut)
    assert resent and {o.reason for o in resent} == {"UPSTREAM_UNAVAILABLE"}  # the 2nd's agent
    assert len(ran) + len(cut) + len(resent) == 2000
