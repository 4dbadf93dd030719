"""The AsyncGRPOTrainer rollout worker (`create_nemo_gym_rollout_worker`) against a real bridge
process without NeMo Gym (its agent is a closed port): failed rollouts are left out and their
groups dropped and counted, never a sample; a refused token stops the worker and check_health
says why; stop() counts the rollouts it cancels (a scripted agent that never answers); no bridge
at all makes check_health raise past the bound; the settings are checked. The worker on the real
agent stack: tests/test_trl_async.py."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("numpy")  # the worker's (TRL installs it)

from nemo_gym_grpc.rewards import create_nemo_gym_rollout_worker
from tests.support import BridgeProcess, closed_port, start_bridge
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.waiting import wait_until

WAIT = 60.0  # s, bound of every wait for a condition below
TOKEN = "w0rker-t0ken"
ROWS = [{"prompt": "hi", "responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}]


def args(**fields: object) -> types.SimpleNamespace:
    """The AsyncGRPOConfig fields the worker reads."""
    defaults = {
        "num_generations": 2,
        "max_staleness": 4,
        "queue_maxsize": 0,
        "max_inflight_tasks": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
    }
    return types.SimpleNamespace(**{**defaults, **fields})


@pytest.fixture(scope="module")
def bridge(tmp_path_factory) -> Iterator[BridgeProcess]:
    token = Path(tmp_path_factory.mktemp("worker_token")) / "token"
    token.write_text(TOKEN)
    down = f"down=http://127.0.0.1:{closed_port()}"
    with start_bridge("--agent", down, "--token-file", str(token), "--retry-attempts", "1") as b:
        yield b


def test_failed_rollouts_are_left_out_and_their_groups_dropped_and_counted(bridge, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_TOKEN", TOKEN)
    worker = create_nemo_gym_rollout_worker(ROWS, args(), "down", target=bridge.target)
    worker.start()
    try:
        wait_until(lambda: worker.counts["dropped_groups"] >= 3, WAIT, "dropped groups")
        worker.check_health(WAIT)  # the bridge is fine: only the agent is down
    finally:
        worker.stop()
    counts = worker.counts
    assert worker.rollout_buffer.empty() and counts["samples"] == 0
    assert counts["failed_rollouts"] == counts["rollouts"] == 2 * counts["groups"]
    # every group closed was dropped, and so was every group the stop cut
    assert counts["dropped_groups"] == counts["groups"] + counts["unfinished_groups"]
    assert counts["failures/UPSTREAM_UNAVAILABLE"] == counts["failed_rollouts"]  # by cause
    pushed = []
    while not worker.metrics_queue.empty():
        pushed.append(worker.metrics_queue.get_nowait())
    assert sum(m["nemo_gym/dropped_groups_total"] for m in pushed) == counts["dropped_groups"]


def test_a_refused_token_stops_the_worker_and_check_health_says_why(bridge, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_TOKEN", "wrong")
    worker = create_nemo_gym_rollout_worker(ROWS, args(), "down", target=bridge.target)
    worker.start()
    try:
        wait_until(lambda: _raises(worker.check_health, WAIT), WAIT, "check_health to raise")
    finally:
        worker.stop()
    with pytest.raises(RuntimeError, match="has failed") as failed:
        worker.check_health(WAIT)
    assert "UNAUTHENTICATED" in str(failed.value.__cause__)


def test_stop_counts_the_rollouts_it_cancels_and_the_groups_it_cuts(monkeypatch, tmp_path):
    """An agent that never answers (a scripted one: `hang`) holds 4 rollouts of 2 groups until
    stop(), which counts them as cancelled and their groups as unfinished and dropped."""
    monkeypatch.setenv("NEMO_GYM_GRPC_TOKEN", TOKEN)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with FaultProxy(None) as agent:
        agent.set_faults(Fault("hang"))
        with start_bridge("--agent", f"hung={agent.url}", "--token-file", str(token)) as bridge:
            worker = create_nemo_gym_rollout_worker(ROWS, args(), "hung", target=bridge.target)
            worker.start()
            try:
                wait_until(lambda: agent.in_flight == 4, WAIT, "4 rollouts held by the agent")
            finally:
                worker.stop()
            wait_until(lambda: agent.in_flight == 0, WAIT, "the agent's requests closed")
    counts = worker.counts
    assert (counts["cancelled_rollouts"], counts["unfinished_groups"]) == (4, 2)
    assert counts["dropped_groups"] == 2 and counts["groups"] == 0
    pushed = []
    while not worker.metrics_queue.empty():
        pushed.append(worker.metrics_queue.get_nowait())
    assert pushed[-1]["nemo_gym/cancelled_rollouts_total"] == 4.0


def test_check_health_raises_when_no_bridge_answers():
    target = f"127.0.0.1:{closed_port()}"
    worker = create_nemo_gym_rollout_worker(ROWS, args(), "down", target=target)
    worker.check_health(0.0)  # not started: nothing to report
    worker.start()
    try:
        worker.check_health(WAIT)
        wait_until(lambda: _raises(worker.check_health, 0.5), WAIT, "check_health to raise")
        with pytest.raises(RuntimeError, match=f"no RunStream to the bridge at {target}"):
            worker.check_health(0.5)
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("rows", "keywords", "error"),
    [
        (iter(ROWS), {}, TypeError),
        (ROWS, {"min_group_size": 3}, ValueError),
        (ROWS, {"max_staleness": -1}, ValueError),
        (ROWS, {"stream_timeout": 0}, ValueError),
    ],
)
def test_settings_are_checked(rows, keywords, error):
    with pytest.raises(error):
        create_nemo_gym_rollout_worker(rows, args(), "down", target="127.0.0.1:1", **keywords)


def test_max_inflight_follows_trls_rule_when_the_config_says_auto():
    config = args(max_inflight_tasks=-1, max_staleness=3, gradient_accumulation_steps=2)
    worker = create_nemo_gym_rollout_worker(ROWS, config, "down", target="127.0.0.1:1")
    assert worker.config.max_inflight == 3 * 4 * 2  # max_staleness x batch x accumulation
    assert worker.config.sampling == {"temperature": 1.0, "top_p": 1.0}


def _raises(check, *arguments) -> bool:
    try:
        check(*arguments)
    except RuntimeError:
        return True
    return False
