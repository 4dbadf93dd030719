"""The reward functions with zero configuration: embedded bridges over real NeMo Gym resources
servers (the dataset rows: tests/support/reward_rows.py), and embedded bridges that cannot start.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn, reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import embedded, settings
from nemo_gym_grpc.shared.child import sweep
from tests.support import closed_port, example_rows
from tests.support.reward_rows import mcqa_answer, reward_columns

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

LOGGER = "nemo_gym_grpc.rewards"


def test_zero_config_starts_one_embedded_bridge_and_reuses_it(zero_config, nemo_gym, loader_rows):
    rows = loader_rows["mcqa"][:2]
    args = reward_columns(rows, [mcqa_answer(rows[0], True), mcqa_answer(rows[1], False)])
    assert reward_nemo_gym_verify(**args) == [1.0, 0.0]
    bridges = embedded.running_bridges()
    spec = embedded.BridgeSpec(head_url=nemo_gym.head_url)
    assert list(bridges) == [spec]
    bridge = bridges[spec]
    assert reward_nemo_gym_verify(**args) == [1.0, 0.0]
    assert embedded.running_bridges()[spec] is bridge and bridge.running

    embedded.stop_all()
    assert bridge.process.returncode == 0  # SIGTERM: graceful stop
    assert not bridge.child.folder.exists() and not embedded.running_bridges()


def test_concurrent_first_calls_share_one_embedded_bridge(zero_config, loader_rows):
    rows = loader_rows["mcqa"]
    args = reward_columns(rows, [mcqa_answer(row, True) for row in rows])
    results, errors = [], []

    def call() -> None:
        try:
            results.append(reward_nemo_gym_verify(**args))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [[1.0] * len(rows)] * 4
    assert len(embedded.running_bridges()) == 1


def test_an_embedded_bridge_that_died_is_replaced(zero_config, loader_rows, caplog):
    row = loader_rows["mcqa"][0]
    args = reward_columns([row], [mcqa_answer(row, True)])
    assert reward_nemo_gym_verify(**args) == [1.0]
    (first,) = embedded.running_bridges().values()
    first.process.kill()
    first.process.wait()
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards.client.embedded"):
        assert reward_nemo_gym_verify(**args) == [1.0]
    (second,) = embedded.running_bridges().values()
    assert second.process.pid != first.process.pid
    assert "exited with status -9" in caplog.text


def test_factory_routes_to_its_verify_endpoints(zero_config, nemo_gym, loader_rows, caplog):
    endpoints = {name: f"{url}/verify" for name, url in nemo_gym.server_urls.items()}
    reward_fn = create_nemo_gym_reward_fn(
        global_config={}, verify_endpoints=endpoints, model_name="policy-x", verify_timeout=10
    )
    assert reward_fn.__name__ == "nemo_gym"
    rows = [dict(row) for row in loader_rows["mcqa"][:3]]
    rows[2]["resources_server_ref"] = {"name": "not_an_endpoint"}
    answers = [mcqa_answer(rows[0], True), mcqa_answer(rows[1], False), "\\boxed{A}"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert reward_fn(**reward_columns(rows, answers)) == [1.0, 0.0, None]
    assert "NOT_FOUND (UNKNOWN_RESOURCES_SERVER) x1" in caplog.text
    (spec,) = embedded.running_bridges()
    assert spec.head_url is None and spec.verify_timeout == 10.0
    assert dict(spec.servers) == nemo_gym.server_urls


def test_factory_with_a_down_endpoint_gives_none(zero_config, loader_rows, caplog):
    reward_fn = create_nemo_gym_reward_fn(
        {},
        {"mcqa": f"http://127.0.0.1:{closed_port()}/verify"},
        verify_timeout=2,
        max_failure_fraction=1.0,  # a batch of one that fails: not an error with the guard off
    )
    row = loader_rows["mcqa"][0]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert reward_fn(**reward_columns([row], [mcqa_answer(row, True)])) == [None]
    assert "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x1" in caplog.text


def test_factory_with_an_explicit_target(bridge_target, loader_rows, monkeypatch):
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    reward_fn = create_nemo_gym_reward_fn({}, {}, target=bridge_target)
    row = loader_rows["mcqa"][1]
    answers = [mcqa_answer(row, True), mcqa_answer(row, False)]
    assert reward_fn(**reward_columns([row, row], answers)) == [1.0, 0.0]
    assert not embedded.running_bridges()


_FORK_PROBE = """
import json, os, select, signal, sys, time
from nemo_gym_grpc.rewards import reward_nemo_gym_verify
args = json.loads(sys.stdin.read())
parent = reward_nemo_gym_verify(**args)  # the parent's channel now exists
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:  # child: score on its own channel, report, then a normal exit (atexit, gRPC's)
    os.close(read_end)
    os.write(write_end, json.dumps(reward_nemo_gym_verify(**args)).encode())
    os.close(write_end)
    sys.exit(0)
os.close(write_end)
readable, _, _ = select.select([read_end], [], [], 60)
child = json.loads(os.read(read_end, 1 << 20) or b"null") if readable else "no answer in 60 s"
for _ in range(600):  # a child hung at exit must fail the test, not block it
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        status = os.waitstatus_to_exitcode(status)
        break
    time.sleep(0.1)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    status = "hung at exit"
after = reward_nemo_gym_verify(**args)  # the child's exit left the parent's channel working
print(json.dumps({"parent": parent, "child": child, "exit": status, "after": after}))
"""


def test_a_forked_child_scores_through_its_own_channel_and_exits_0(via_target, loader_rows):
    # In a fresh interpreter: this pytest process has torch and other libraries loaded whose
    # own fork handlers are not ours to test (one of them crashed a forked child here).
    # Without gRPC's fork support (GRPC_ENABLE_FORK_SUPPORT=0) such a child got no scores and
    # died of SIGABRT (3 of 3, 2026-12); the client turns it on. A fork while another thread
    # is inside a call is outside what gRPC supports (the child can hang in its fork handler:
    # 1 hang in 21 tries here), and warned about: test_rewards_client.py.
    row = loader_rows["mcqa"][0]
    scores = [1.0, 0.0]
    args = reward_columns([row, row], [mcqa_answer(row, True), mcqa_answer(row, False)])
    done = subprocess.run(
        [sys.executable, "-c", _FORK_PROBE],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, settings.TARGET_ENV: via_target},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"parent": scores, "child": scores, "exit": 0, "after": scores}


_EMBEDDED_CHILD = r"""
import json, sys, time
from nemo_gym_grpc.rewards import reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import embedded
row = json.loads(sys.argv[1])
answer = "\\boxed{%s}" % row["expected_answer"]
print(reward_nemo_gym_verify([answer], resources_server_ref=[{"name": "mcqa"}], verify_extra=[row]))
(bridge,) = embedded.running_bridges().values()
print(bridge.process.pid, bridge.child.folder, flush=True)
time.sleep(600)
"""


def _exited(pid: int) -> bool:
    """The process is gone or a zombie (exited, not yet reaped by its new parent)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def test_an_embedded_bridge_exits_when_its_process_is_killed(nemo_gym, tmp_path):
    env = {**os.environ, settings.HEAD_URL_ENV: nemo_gym.head_url}
    env.pop(settings.TARGET_ENV, None)
    row = example_rows("mcqa")[0]
    child = subprocess.Popen(
        [sys.executable, "-c", _EMBEDDED_CHILD, json.dumps(row)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    bridge_pid = None
    try:
        readable, _, _ = select.select([child.stdout], [], [], 120)
        assert readable, "the child printed nothing within 120 s"
        assert child.stdout.readline().strip() == "[1.0]"
        pid, folder = child.stdout.readline().split()
        bridge_pid = int(pid)
        assert not _exited(bridge_pid)
        os.kill(child.pid, signal.SIGKILL)  # no atexit handlers run in the child
        child.wait(30)
        for _ in range(200):  # the bridge checks its parent every second
            if _exited(bridge_pid):
                break
            time.sleep(0.1)
        assert _exited(bridge_pid), "the embedded bridge outlived the process that started it"
        assert Path(folder).is_dir()  # nobody could remove it: the next bridge's start does
        assert Path(folder) in sweep(embedded._PREFIX) and not Path(folder).exists()
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        if bridge_pid and not _exited(bridge_pid):
            os.kill(bridge_pid, signal.SIGKILL)


# embedded bridges that cannot start (real subprocesses, no NeMo Gym)


@pytest.fixture
def no_target(monkeypatch):
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    yield
    embedded.stop_all()


def test_a_bridge_that_exits_at_startup_raises_with_its_stderr(no_target):
    reward_fn = create_nemo_gym_reward_fn({}, {"bad": "ftp://example/verify"})
    with pytest.raises(RuntimeError) as raised:
        reward_fn(completions=["x"], resources_server_ref=[{"name": "bad"}])
    message = str(raised.value)
    assert "exited with status 2" in message
    assert "expected NAME=http://HOST:PORT" in message  # the bridge CLI's own words
    assert not embedded.running_bridges()


def test_a_bridge_that_does_not_start_in_time_is_stopped(no_target, monkeypatch):
    monkeypatch.setenv(settings.STARTUP_TIMEOUT_ENV, "0.01")
    reward_fn = create_nemo_gym_reward_fn({}, {"x": "http://127.0.0.1:1/verify"})
    with pytest.raises(RuntimeError, match="did not start within 0.01 s") as raised:
        reward_fn(completions=["x"], resources_server_ref=[{"name": "x"}])
    pid = int(str(raised.value).split("(pid ")[1].split(")")[0])
    assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped
    assert not embedded.running_bridges()
