"""The real-NeMo-Gym harness itself: servers answer /verify with the expected rewards, the head
server publishes their ports, stopping a stack leaves no process behind, and each NeMo Gym
version (0.7.0, 0.4.0) gets its own venv, interpreter and launch rules."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

import pytest
import requests
import yaml

from tests.support import (
    NemoGymError,
    NemoGymServers,
    ensure_venv,
    example_rows,
    group_processes,
    ng_run,
    procs,
    selected_version,
    venv_version,
    versions,
)
from tests.support import venv as support_venv
from tests.support.items import mcqa_row
from tests.support.listeners import stray_sockets

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

http = requests.Session()
http.trust_env = False  # loopback only: never through an HTTP(S)_PROXY from the environment


def assistant_response(text: str) -> dict:
    """A Responses API object with one assistant message holding `text` as output_text."""
    return {
        "id": "resp_harness",
        "object": "response",
        "created_at": 1_700_000_000,
        "model": "harness-policy",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg_harness",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
    }


def verify(gym: NemoGymServers, server: str, row: dict, text: str) -> dict:
    reply = http.post(
        f"{gym.server_urls[server]}/verify",
        json={**row, "response": assistant_response(text)},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text[:2000]
    return reply.json()


def other_letter(row: dict) -> str:
    letters = [key for option in row["options"] for key in option]
    return next(letter for letter in letters if letter != row["expected_answer"])


CASES = {
    # server: (right answer, wrong answer) as functions of the first example row
    "mcqa": (
        lambda row: f"Let me think. \\boxed{{{row['expected_answer']}}}",
        lambda row: f"Let me think. \\boxed{{{other_letter(row)}}}",
    ),
    "equivalence_rule": (
        lambda row: row["expected_answer"],
        lambda row: "Something else entirely.",
    ),
    "reasoning_gym": (
        lambda row: f"Reasoning done. <answer>{row['answer']}</answer>",
        lambda row: "Reasoning done. <answer>no idea</answer>",
    ),
}


@pytest.mark.parametrize("server", sorted(CASES))
def test_verify_rewards_right_and_wrong_answers(nemo_gym, server):
    row = example_rows(server)[0]
    right, wrong = CASES[server]
    good = verify(nemo_gym, server, row, right(row))
    bad = verify(nemo_gym, server, row, wrong(row))
    assert (good["reward"], bad["reward"]) == (1.0, 0.0)
    assert good["response"]["output"][0]["content"][0]["text"] == right(row)  # echoed back


def test_mcqa_reports_what_it_extracted(nemo_gym):
    row = example_rows("mcqa")[0]
    reply = verify(nemo_gym, "mcqa", row, f"\\boxed{{{row['expected_answer']}}}")
    assert reply["expected_answer"] == reply["extracted_answer"] == row["expected_answer"]


def test_example_single_tool_call_rewards_as_its_version_says(nemo_gym):
    """0.4.0 rewards every response 1.0; 0.7.0 rewards 1.0 only a get_weather function call."""
    rows = example_rows("example_single_tool_call")[:2]
    texts = [
        verify(nemo_gym, "example_single_tool_call", row, t)["reward"]
        for row, t in zip(rows, ["sunny", ""], strict=True)
    ]
    call = {
        "id": "fc_harness",
        "type": "function_call",
        "call_id": "call_harness",
        "name": "get_weather",
        "arguments": json.dumps({"city": "San Francisco"}),
        "status": "completed",
    }
    reply = http.post(
        f"{nemo_gym.server_urls['example_single_tool_call']}/verify",
        json={**rows[0], "response": {**assistant_response(""), "output": [call]}},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text[:2000]
    if versions.version_tuple(nemo_gym.version) >= (0, 7):
        assert (texts, reply.json()["reward"]) == ([0.0, 0.0], 1.0)
    else:
        assert (texts, reply.json()["reward"]) == ([1.0, 1.0], 1.0)


def test_head_server_lists_every_server_with_its_port(nemo_gym):
    reply = http.get(f"{nemo_gym.head_url}/global_config_dict_yaml", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("application/json")
    text = json.loads(reply.content)
    assert isinstance(text, str)  # YAML inside a JSON string
    config = yaml.safe_load(text)
    for name, url in nemo_gym.server_urls.items():
        block = config[name]["resources_servers"][name]
        assert f"http://{block['host']}:{block['port']}" == url
        assert block["entrypoint"] == "app.py" and block["domain"]
    head = config["head_server"]
    assert f"http://{head['host']}:{head['port']}" == nemo_gym.head_url


def test_every_server_process_is_in_the_recorded_session(nemo_gym):
    instances = http.get(f"{nemo_gym.head_url}/server_instances", timeout=10).json()
    assert sorted(i["name"] for i in instances) == sorted(nemo_gym.server_urls)
    members = {p.pid for p in nemo_gym.processes()}
    assert nemo_gym.pid in members
    assert {i["pid"] for i in instances} <= members


def _alive(pid: int) -> bool:
    """The pid exists and is not a zombie (an exited process its reaper has not collected)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) == 0


def test_stop_leaves_no_process_of_the_stack_behind(nemo_gym_venv):
    gym = NemoGymServers(("example_single_tool_call",), venv=nemo_gym_venv)
    with gym:
        url = gym.server_urls["example_single_tool_call"]
        assert http.get(f"{url}/", timeout=5).json() == {"status": "ok"}
        running = gym.processes()
        commands = " ".join(p.cmdline for p in running)
        assert "app.py" in commands
        # ng_run runs without Ray (tests/support/no_ray), so nothing binds beyond loopback
        assert "gcs_server" not in commands and "raylet" not in commands
        assert "initialize_ray: skipped" in gym.log_path.read_text()
        assert stray_sockets({p.pid for p in running}) == []
        workdir = gym.workdir
    assert gym.startup_seconds and gym.startup_seconds < gym.startup_timeout
    assert gym.returncode == 0  # SIGINT reached ng_run, which shut down its servers itself
    assert group_processes(gym.pid) == []
    assert [p for p in running if _alive(p.pid)] == []
    assert not _port_open(gym.head_url)
    assert not _port_open(gym.server_urls["example_single_tool_call"])
    assert not workdir.exists()
    gym.stop()  # idempotent


# --------------------------------------------------------------------------------------------
# Cheap checks of the harness's own logic (no servers)


def test_ensure_venv_rebuilds_an_unmarked_venv_once_under_a_lock(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "half-built").write_text("left by an interrupted build")
    builds = []
    real_build = support_venv._build_venv

    def counting_build(*args):
        builds.append(args[0])
        time.sleep(0.5)  # the other caller must wait for the lock meanwhile
        real_build(*args)

    monkeypatch.setattr(support_venv, "_build_venv", counting_build)
    results = []

    def call():
        results.append(ensure_venv(venv, python=sys.executable, packages=(), import_check=()))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [venv, venv] and builds == [venv]
    assert not (venv / "half-built").exists()
    marker = json.loads((venv / support_venv.MARKER_NAME).read_text())
    assert marker["nemo_gym"] == selected_version() == venv_version(venv)
    assert ensure_venv(venv, python="/nonexistent") == venv  # marked: no rebuild, no python


def test_ensure_venv_honours_nemo_gym_venv(tmp_path, monkeypatch):
    venv = tmp_path / "from-env"
    monkeypatch.setenv("NEMO_GYM_VENV", str(venv))
    built = ensure_venv(python=sys.executable, packages=(), import_check=())
    assert built == venv and support_venv.venv_is_complete(venv)


def test_a_users_unmarked_nemo_gym_venv_is_used_as_it_is_never_deleted(
    nemo_gym_venv, tmp_path, monkeypatch, capsys
):
    """A hand-built venv (here: a fresh venv whose .pth line reaches the harness venv's
    site-packages, so it imports the real nemo_gym) without the harness's marker."""
    mine = tmp_path / "hand-built"
    subprocess.run(
        [str(nemo_gym_venv / "bin" / "python"), "-m", "venv", "--without-pip", str(mine)],
        check=True,
        timeout=120,
    )
    pth = support_venv.site_packages(mine) / "reach.pth"
    pth.write_text(f"{support_venv.site_packages(nemo_gym_venv)}\n")
    monkeypatch.setenv("NEMO_GYM_VENV", str(mine))
    monkeypatch.delenv("NEMO_GYM_VERSION", raising=False)
    version = venv_version(nemo_gym_venv)
    assert ensure_venv(python="/nonexistent") == mine  # no build: no interpreter needed
    assert f"using NEMO_GYM_VENV={mine} as it is: nemo-gym {version}" in capsys.readouterr().err
    assert pth.exists() and not (mine / support_venv.MARKER_NAME).exists()
    other = "0.4.0" if version == "0.7.0" else "0.7.0"
    with pytest.raises(NemoGymError, match=f"has nemo-gym {version}, but NeMo Gym {other}"):
        ensure_venv(version=other)

    pth.unlink()  # now it cannot import nemo_gym: a clear error, and the venv stays
    with pytest.raises(NemoGymError, match="(?s)not built by the harness.*never deletes it"):
        ensure_venv()
    assert (mine / "bin" / "python").exists()


def test_the_stack_runs_the_selected_version(nemo_gym, nemo_gym_venv):
    assert nemo_gym.version == selected_version() == venv_version(nemo_gym_venv)
    assert support_venv.site_packages(nemo_gym_venv).parent.name.startswith("python3.")
    readyz = http.get(f"{nemo_gym.head_url}/readyz", timeout=10)
    if versions.has_readiness_endpoints(nemo_gym.version):
        assert (readyz.status_code, readyz.json()) == (200, {"status": "ok"})
    else:
        assert readyz.status_code == 404  # 0.4.0's head server has no readiness route


def test_extra_config_adds_a_model_server_and_0_7_skips_its_endpoint_wait(nemo_gym_venv):
    judge = {"responses_api_models": {"openai_model": {"openai_base_url": "http://x/v1"}}}
    gym = NemoGymServers(("mcqa",), venv=nemo_gym_venv, extra_config={"judge": judge})
    gym.version = venv_version(nemo_gym_venv)
    config = gym.build_config(1, {"mcqa": 2, "judge": 3}, nemo_gym_venv)
    block = config["judge"]["responses_api_models"]["openai_model"]
    assert block == {
        "entrypoint": "app.py",
        "host": "127.0.0.1",
        "port": 3,
        "openai_base_url": "http://x/v1",
    }
    skip = config.get("model_endpoint_readiness_timeout_seconds")
    assert skip == (0 if versions.has_readiness_endpoints(gym.version) else None)
    with pytest.raises(ValueError, match="must be"):
        NemoGymServers(("mcqa",), extra_config={"bad": {"a": {}, "b": {}}})._extra_blocks()


def test_example_rows_are_the_shipped_rows(nemo_gym_venv):
    rows = example_rows("mcqa", nemo_gym_venv)
    assert len(rows) >= 1 and all("responses_create_params" in row for row in rows)
    rows[0]["expected_answer"] = "changed"
    assert example_rows("mcqa", nemo_gym_venv)[0]["expected_answer"] != "changed"
    with pytest.raises(NemoGymError, match="no_such_server"):
        example_rows("no_such_server", nemo_gym_venv)


def test_start_bridge_reports_a_bridge_that_dies_with_its_stderr(start_bridge):
    with pytest.raises(NemoGymError, match="unrecognized arguments"):
        start_bridge("--no-such-flag")


def test_started_bridge_has_a_target_and_stops_on_sigterm(start_bridge):
    bridge = start_bridge("--server", "x=http://127.0.0.1:9")
    host, port = bridge.target.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert _port_open(f"http://{bridge.target}")
    assert bridge.stop() == 0  # graceful
    assert not _alive(bridge.pid)


def test_free_ports_are_distinct_and_bindable():
    ports = procs.free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_offline_env_never_lets_uv_download_python():
    env = ng_run.offline_env({"RAY_ADDRESS": "x:1", "PATH": os.defpath})
    assert env["UV_PYTHON_DOWNLOADS"] == "never"
    assert "RAY_ADDRESS" not in env and env["RAY_USAGE_STATS_ENABLED"] == "0"


def test_the_checked_in_mcqa_row_is_the_shipped_first_row(nemo_gym_venv):
    assert mcqa_row() == example_rows("mcqa", nemo_gym_venv)[0]


def test_a_build_step_reports_elapsed_seconds_and_its_last_log_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(support_venv, "PROGRESS_EVERY", 0.3)
    log = tmp_path / "install.log"
    step = ["sh", "-c", "echo Collecting nemo-gym; sleep 1; echo Installing collected packages"]
    started = time.monotonic()
    with open(log, "w") as out:
        code = support_venv.run_step(step, out, log, dict(os.environ), started, started + 60)
    assert code == 0
    progress = capsys.readouterr().err.splitlines()
    assert len(progress) >= 2 and all(line.strip().split()[1] == "s" for line in progress)
    assert any(line.endswith("Collecting nemo-gym") for line in progress)
    assert "Installing collected packages" in log.read_text()


def test_a_build_step_past_its_deadline_is_killed_and_reported(tmp_path):
    log = tmp_path / "install.log"
    started = time.monotonic()
    with open(log, "w") as out, pytest.raises(NemoGymError, match="took over"):
        support_venv.run_step(["sleep", "30"], out, log, dict(os.environ), started, started + 0.5)
    assert time.monotonic() - started < 10


def test_what_the_venv_build_says_is_shown_not_captured(tmp_path):
    # `make test` built a NeMo Gym venv for minutes without a word: pytest captured the harness's
    # progress lines. A stand-in venv the harness did not build (a fake `nemo-gym 0.7.0`
    # distribution: building the real one takes minutes) makes ensure_venv say one line.
    fake = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(fake)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.check_output([fake / "bin" / "python", "-c", where], text=True).strip())
    (site / "nemo_gym").mkdir()
    (site / "nemo_gym" / "__init__.py").write_text("")
    (site / "nemo_gym-0.7.0.dist-info").mkdir()
    (site / "nemo_gym-0.7.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nemo-gym\nVersion: 0.7.0\n"
    )
    (tmp_path / "test_uses_the_venv.py").write_text("def test_it(nemo_gym_venv):\n    pass\n")
    env = {**os.environ, "NEMO_GYM_VENV": str(fake), "NEMO_GYM_VERSION": "0.7.0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q"]
        + ["--rootdir", str(tmp_path), str(tmp_path / "test_uses_the_venv.py")],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"using NEMO_GYM_VENV={fake} as it is: nemo-gym 0.7.0" in done.stdout + done.stderr
