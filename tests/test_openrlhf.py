"""OpenRLHF's two `--remote_rm_url` forms through a real bridge and real NeMo Gym resources
servers: the `reward_func` file hook, and the HTTP contract served by
`nemo-gym-grpc openrlhf-rm` (a real process). Both are driven by OpenRLHF 0.11.2's own reward
caller, `SingleTurnAgentExecutor` (tests/openrlhf_run.py, in build/verl-venv: openrlhf itself
does not install here, since it needs flash-attn 2.8.3, which builds only with CUDA; its
package is installed without dependencies for this), and called directly. Also the
`openrlhf-rm` process's start: its ready line, and a port already taken."""

from __future__ import annotations

import json
import math
import os
import select
import socket
import subprocess
import sys

import pytest
import requests

from nemo_gym_grpc.rewards import ScoringError, openrlhf
from tests.stacks_common import answers, run_driver
from tests.support import free_ports
from tests.support.items import mcqa_row
from tests.support.waiting import wait_until

PROMPT = "<|user|>Which test?<|assistant|>"


def _call(*items: tuple[bool, str]) -> tuple[list[str], list[str], list[str]]:
    """queries, prompts, labels for mcqa items given as (right answer?, server)."""
    row = mcqa_row()
    right, wrong = answers("mcqa", row)
    queries = [PROMPT + (right if ok else wrong) for ok, _ in items]
    labels = [json.dumps({"resources_server": s, "nemo_gym_row": row}) for _, s in items]
    return queries, [PROMPT] * len(items), labels


@pytest.fixture
def via_bridge(bridge_target, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_TARGET", bridge_target)
    monkeypatch.delenv("NEMO_GYM_GRPC_ON_ERROR", raising=False)
    return monkeypatch


def test_reward_func_returns_tensors_and_raises_on_a_failed_item_by_default(via_bridge):
    result = openrlhf.reward_func(*_call((True, "mcqa"), (False, "mcqa")))
    assert result["rewards"].tolist() == [1.0, 0.0]
    assert result["scores"].tolist() == [1.0, 0.0]
    with pytest.raises(ScoringError, match=r"1 of 3 items failed \(on_error=raise"):
        openrlhf.reward_func(*_call((True, "mcqa"), (True, "nope"), (True, "mcqa")))


def test_reward_func_on_error_zero_counts_failures_in_extra_logs(via_bridge):
    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "zero")
    result = openrlhf.reward_func(*_call((True, "mcqa"), (True, "nope"), (False, "mcqa")))
    assert result["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert result["extra_logs"]["scoring_failed"].tolist() == [0.0, 1.0, 0.0]


def test_completion_is_the_query_after_its_prompt():
    assert openrlhf.completion_of("P: hi A: yes", "P: hi ", 0) == "A: yes"
    assert openrlhf.completion_of("<bos>P: hi A: yes", "P: hi ", 0) == "A: yes"
    with pytest.raises(ValueError, match="query 3 does not contain its prompt"):
        openrlhf.completion_of("something else", "P: hi", 3)
    with pytest.raises(ValueError, match="2 queries, 1 prompts and 2 labels"):
        openrlhf.openrlhf_items(["a", "b"], ["a"], ["{}", "{}"])


@pytest.fixture(scope="module")
def sidecar(bridge_target):
    """`nemo-gym-grpc openrlhf-rm` on a free loopback port, pointed at the session's bridge;
    its URL. Stopped by PID at the end of the module."""
    (port,) = free_ports(1)
    env = {**os.environ, "NEMO_GYM_GRPC_TARGET": bridge_target}
    env.pop("NEMO_GYM_GRPC_ON_ERROR", None)
    cli = [sys.executable, "-m", "nemo_gym_grpc.cli", "openrlhf-rm", "--port", str(port)]
    proc = subprocess.Popen(cli, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}{openrlhf.PATH}"

    def up() -> bool:
        try:
            return requests.post(url, json={}, timeout=2).status_code == 400
        except requests.ConnectionError:
            return proc.poll() is not None  # exited: fail below

    try:
        wait_until(up, timeout=30, what="openrlhf-rm to serve")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _post(url: str, queries: list[str], prompts: list[str], labels: list[str]) -> requests.Response:
    body = {"query": queries, "prompts": prompts, "labels": labels}
    return requests.post(url, json=body, headers={"Content-Type": "application/json"}, timeout=60)


def test_the_http_sidecar_answers_openrlhfs_remote_reward_contract(sidecar):
    reply = _post(sidecar, *_call((True, "mcqa"), (False, "mcqa"), (True, "mcqa")))
    assert reply.status_code == 200
    assert reply.json() == {
        "rewards": [1.0, 0.0, 1.0],
        "scores": [1.0, 0.0, 1.0],
        "extra_logs": {"scoring_failed": [0.0, 0.0, 0.0]},
    }


def test_the_http_sidecar_answers_500_for_a_failed_item_and_400_for_a_bad_request(sidecar):
    reply = _post(sidecar, *_call((True, "mcqa"), (True, "nope")))
    assert reply.status_code == 500
    assert "1 of 2 items failed (on_error=raise" in reply.json()["error"]
    queries, prompts, _ = _call((True, "mcqa"))
    reply = requests.post(sidecar, json={"query": queries, "prompts": prompts}, timeout=60)
    assert reply.status_code == 400
    assert "--data.label_key" in reply.json()["error"]
    assert requests.post(sidecar, data=b"{not json", timeout=60).status_code == 400


async def test_the_http_app_on_error_none_sends_nan_that_pythons_json_reads(via_bridge):
    from aiohttp import web

    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "none")
    runner = web.AppRunner(openrlhf.app())
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        import asyncio

        url = f"http://127.0.0.1:{port}/"
        reply = await asyncio.to_thread(_post, url, *_call((True, "mcqa"), (True, "nope")))
    finally:
        await runner.cleanup()
    assert reply.status_code == 200
    rewards = reply.json()["rewards"]
    assert rewards[0] == 1.0 and math.isnan(rewards[1])
    assert reply.json()["extra_logs"] == {"scoring_failed": [0.0, 1.0]}


@pytest.fixture
def reward_func_file(tmp_path):
    """The `.py` file an OpenRLHF user passes as --remote_rm_url."""
    path = tmp_path / "reward_func.py"
    path.write_text("from nemo_gym_grpc.rewards.openrlhf import reward_func  # noqa: F401\n")
    return str(path)


def _executor_items(*items: tuple[bool, str]) -> list[dict[str, str]]:
    queries, prompts, labels = _call(*items)
    return [
        {"prompt": p, "completion": q[len(p) :], "label": label}
        for q, p, label in zip(queries, prompts, labels, strict=True)
    ]


@pytest.mark.parametrize("form", ["reward_func file", "openrlhf-rm HTTP"])
def test_openrlhfs_own_reward_caller_gets_nemo_gym_rewards(form, reward_func_file, sidecar,
                                                          bridge_target):  # fmt: skip
    url = reward_func_file if form == "reward_func file" else sidecar
    items = _executor_items((True, "mcqa"), (False, "mcqa"), (True, "mcqa"), (True, "nope"))
    result = run_driver("openrlhf_run.py", {"remote_rm_url": url, "items": items}, bridge_target)
    outputs = result["outputs"]
    # one sample per reward call, as OpenRLHF 0.11.2 does; rewards come back as 1-item lists
    assert [o["reward"] for o in outputs[:3]] == [[1.0], [0.0], [1.0]]
    assert [o["extra_logs"] for o in outputs[:3]] == [{"scoring_failed": [0.0]}] * 3
    # a failed item raises (or answers 500); OpenRLHF logs that and leaves the reward None
    assert outputs[3] == {"reward": None, "scores": None, "extra_logs": {}}


# --------------------------------------------------------------------------------------------
# the openrlhf-rm process itself (no bridge needed before the first request)


def _openrlhf_rm(port: int) -> subprocess.Popen:
    cli = [sys.executable, "-m", "nemo_gym_grpc.cli", "openrlhf-rm", "--port", str(port)]
    return subprocess.Popen(cli, stderr=subprocess.PIPE, text=True)


def test_openrlhf_rm_says_where_it_listens_once_it_serves():
    (port,) = free_ports(1)
    proc = _openrlhf_rm(port)
    try:
        assert proc.stderr is not None
        readable, _, _ = select.select([proc.stderr], [], [], 30)
        assert readable, "no line from openrlhf-rm within 30 s"
        line = proc.stderr.readline()  # the whole line (or "" if it died)
        url = f"http://127.0.0.1:{port}{openrlhf.PATH}"
        assert line.rstrip().endswith(f"nemo-gym-grpc openrlhf-rm listening on {url}"), line
        reply = requests.post(url, json={}, timeout=10)  # served already: no retry needed
        assert reply.status_code == 400 and "must be lists" in reply.json()["error"]
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0, rest  # SIGTERM: a clean stop


def test_openrlhf_rm_on_a_taken_port_exits_1_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _openrlhf_rm(port)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"nemo-gym-grpc openrlhf-rm: cannot listen on http://127.0.0.1:{port}")
    assert "address already in use" in line
