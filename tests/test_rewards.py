"""The reward functions end to end: real NeMo Gym resources servers behind a real bridge.

Dataset rows are what axolotl's NeMo Gym loader hands to TRL: columns `prompt`,
`resources_server_ref` and `verify_extra`, built from NeMo Gym's own example data and passed
through a real HuggingFace `datasets.Dataset` (Arrow fills keys a row lacks with None, nested
ones too), using the `datasets` that nemo-gym installs in its venv.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading

import pytest
from nemo_gym_servers import example_rows

from nemo_gym_grpc.rewards import (
    create_nemo_gym_reward_fn,
    embedded,
    reward_nemo_gym_verify,
    settings,
)

LOGGER = "nemo_gym_grpc.rewards"

# The columns axolotl's NeMo Gym loader makes (prompt = the row's first user message), put
# through datasets.Dataset.from_list as it does; prints the rows as JSON.
_AXOLOTL_LOADER = r"""
import json, sys
import datasets
rows = []
for line in open(sys.argv[1]):
    if not line.strip():
        continue
    data = json.loads(line)
    inputs = data.get("responses_create_params", {}).get("input", [])
    users = [m.get("content", "") for m in inputs
             if isinstance(m, dict) and m.get("role") == "user"]
    rows.append({
        "prompt": [{"role": "user", "content": users[0] if users else ""}],
        "resources_server_ref": {"name": sys.argv[2]},
        "verify_extra": data,
    })
json.dump([dict(row) for row in datasets.Dataset.from_list(rows)], sys.stdout)
"""


@pytest.fixture(scope="module")
def loader_rows(nemo_gym_venv):
    """server -> its example rows as axolotl's loader (through Arrow) yields them."""
    from nemo_gym_servers import resources_server_dir

    def load(server: str) -> list[dict]:
        path = resources_server_dir(server, nemo_gym_venv) / "data" / "example.jsonl"
        out = subprocess.run(
            [str(nemo_gym_venv / "bin" / "python"), "-c", _AXOLOTL_LOADER, str(path), server],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    return {s: load(s) for s in ("mcqa", "equivalence_rule", "example_single_tool_call")}


def _letter_other_than(letter: str) -> str:
    return "A" if letter != "A" else "C"


def _mcqa_answer(row: dict, right: bool) -> str:
    expected = row["verify_extra"]["expected_answer"]
    letter = expected if right else _letter_other_than(expected)
    return f"Let me think it through. The answer is \\boxed{{{letter}}}"


def _columns(rows: list[dict], answers: list[str], conversational: bool = True) -> dict:
    """reward-function arguments as TRL passes them for these dataset rows."""
    if conversational:
        completions = [[{"role": "assistant", "content": a}] for a in answers]
        prompts = [row["prompt"] for row in rows]
    else:
        completions = list(answers)
        prompts = [row["prompt"][0]["content"] for row in rows]
    return {
        "completions": completions,
        "prompts": prompts,
        "resources_server_ref": [row["resources_server_ref"] for row in rows],
        "verify_extra": [row["verify_extra"] for row in rows],
    }


@pytest.fixture
def via_target(monkeypatch, bridge_target):
    """reward_nemo_gym_verify uses the session's bridge (NEMO_GYM_GRPC_TARGET)."""
    monkeypatch.setenv(settings.TARGET_ENV, bridge_target)
    return bridge_target


@pytest.fixture
def zero_config(monkeypatch, nemo_gym):
    """No target: the reward functions start embedded bridges; stopped after the test."""
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    monkeypatch.setenv(settings.HEAD_URL_ENV, nemo_gym.head_url)
    yield
    embedded.stop_all()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------------------------
# through a running bridge (NEMO_GYM_GRPC_TARGET)


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "plain"])
def test_mcqa_right_answers_score_1_and_wrong_answers_0(via_target, loader_rows, conversational):
    rows = loader_rows["mcqa"]
    answers = [_mcqa_answer(row, right) for row in rows for right in (True, False)]
    doubled = [row for row in rows for _ in (True, False)]
    rewards = reward_nemo_gym_verify(**_columns(doubled, answers, conversational))
    assert type(rewards) is list
    assert rewards == [1.0, 0.0] * len(rows)


def test_every_example_server_scores_its_rows(via_target, loader_rows):
    eq = loader_rows["equivalence_rule"]
    tool = loader_rows["example_single_tool_call"]
    rows = [eq[0], eq[1], tool[0]]
    answers = [eq[0]["verify_extra"]["expected_answer"], "not the needle", "It is sunny."]
    # reasoning_gym's example rows cannot go through Arrow together (mixed metadata types),
    # so those rows are given as the raw dict plus Arrow-style None for absent keys.
    for raw in example_rows("reasoning_gym")[:2]:
        extra = {"expected_answer": None, "options": None, **raw}
        rows.append(
            {
                "prompt": [{"role": "user", "content": raw["question"]}],
                "resources_server_ref": {"name": "reasoning_gym"},
                "verify_extra": extra,
            }
        )
    answers += [f"<answer>{rows[3]['verify_extra']['answer']}</answer>", "<answer>?</answer>"]
    rewards = reward_nemo_gym_verify(**_columns(rows, answers))
    # NeMo Gym's example_single_tool_call gives every response 1.0 by design.
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_a_row_without_responses_create_params_is_scored_from_the_prompt(via_target, loader_rows):
    row = dict(loader_rows["mcqa"][0])
    row["verify_extra"] = {
        k: v for k, v in row["verify_extra"].items() if k != "responses_create_params"
    }
    rewards = reward_nemo_gym_verify(
        **_columns([row, row], [_mcqa_answer(row, True), _mcqa_answer(row, False)])
    )
    assert rewards == [1.0, 0.0]


def test_an_unknown_resources_server_gives_none_and_a_warning(via_target, loader_rows, caplog):
    rows = [dict(row) for row in loader_rows["mcqa"][:3]]
    rows[1]["resources_server_ref"] = {"name": "no_such_server"}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(
            **_columns(rows, [_mcqa_answer(row, True) for row in rows])
        )
    assert rewards == [1.0, None, 1.0]
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "1 of 3 items failed" in record.getMessage()
    assert "NOT_FOUND (UNKNOWN_RESOURCES_SERVER) x1" in record.getMessage()
    assert "no_such_server" in record.getMessage()


def test_missing_or_malformed_refs_fail_only_their_items(via_target, loader_rows, caplog):
    row = loader_rows["mcqa"][0]
    refs = [None, {}, {"name": ""}, "mcqa", {"name": "mcqa"}]
    rows = [dict(row, resources_server_ref=ref) for ref in refs]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(**_columns(rows, [_mcqa_answer(row, True)] * 5))
    assert rewards == [None, None, None, None, 1.0]
    assert "INVALID_ARGUMENT (INVALID_ITEM) x4" in caplog.text


def test_a_batch_of_256_comes_back_in_input_order(via_target, loader_rows, caplog):
    mcqa, eq = loader_rows["mcqa"], loader_rows["equivalence_rule"]
    rows, answers, expected = [], [], []
    for i in range(256):
        right = (i * 7) % 3 != 0
        if i % 4 == 3:
            row = eq[i % len(eq)]
            answer = row["verify_extra"]["expected_answer"] if right else f"wrong {i}"
        else:
            row = mcqa[i % len(mcqa)]
            answer = _mcqa_answer(row, right)
        rows.append(row)
        answers.append(answer)
        expected.append(1.0 if right else 0.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(**_columns(rows, answers))
    assert rewards == expected
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_messages_over_grpcs_default_4_mib_go_through(via_target, loader_rows):
    row = loader_rows["mcqa"][0]
    padding = "Let me think. " * 8000  # ~110 KB per completion, ~7 MB per 64-item message
    answers = [padding + _mcqa_answer(row, i % 2 == 0) for i in range(64)]
    rewards = reward_nemo_gym_verify(**_columns([row] * 64, answers))
    assert rewards == [1.0, 0.0] * 32


def test_an_upstream_that_is_down_gives_none_promptly(
    start_bridge, nemo_gym, loader_rows, monkeypatch, caplog
):
    bridge = start_bridge(
        "--server",
        f"down=http://127.0.0.1:{_closed_port()}",
        "--server",
        f"mcqa={nemo_gym.server_urls['mcqa']}",
    )
    monkeypatch.setenv(settings.TARGET_ENV, bridge.target)
    monkeypatch.setenv(settings.BATCH_TIMEOUT_ENV, "60")  # a hang would fail, not block
    row = loader_rows["mcqa"][0]
    rows = [dict(row, resources_server_ref={"name": name}) for name in ("down", "mcqa", "down")]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(**_columns(rows, [_mcqa_answer(row, True)] * 3))
    assert rewards == [None, 1.0, None]
    assert "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x2" in caplog.text


# --------------------------------------------------------------------------------------------
# zero configuration: embedded bridges


def test_zero_config_starts_one_embedded_bridge_and_reuses_it(zero_config, nemo_gym, loader_rows):
    rows = loader_rows["mcqa"][:2]
    args = _columns(rows, [_mcqa_answer(rows[0], True), _mcqa_answer(rows[1], False)])
    assert reward_nemo_gym_verify(**args) == [1.0, 0.0]
    bridges = embedded.running_bridges()
    spec = embedded.BridgeSpec(head_url=nemo_gym.head_url)
    assert list(bridges) == [spec]
    bridge = bridges[spec]
    assert reward_nemo_gym_verify(**args) == [1.0, 0.0]
    assert embedded.running_bridges()[spec] is bridge and bridge.running

    embedded.stop_all()
    assert bridge.process.returncode == 0  # SIGTERM: graceful stop
    assert not bridge.workdir.exists() and not embedded.running_bridges()


def test_concurrent_first_calls_share_one_embedded_bridge(zero_config, loader_rows):
    rows = loader_rows["mcqa"]
    args = _columns(rows, [_mcqa_answer(row, True) for row in rows])
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
    args = _columns([row], [_mcqa_answer(row, True)])
    assert reward_nemo_gym_verify(**args) == [1.0]
    (first,) = embedded.running_bridges().values()
    first.process.kill()
    first.process.wait()
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards.embedded"):
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
    answers = [_mcqa_answer(rows[0], True), _mcqa_answer(rows[1], False), "\\boxed{A}"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert reward_fn(**_columns(rows, answers)) == [1.0, 0.0, None]
    assert "NOT_FOUND (UNKNOWN_RESOURCES_SERVER) x1" in caplog.text
    (spec,) = embedded.running_bridges()
    assert spec.head_url is None and spec.verify_timeout == 10.0
    assert dict(spec.servers) == nemo_gym.server_urls


def test_factory_with_a_down_endpoint_gives_none(zero_config, loader_rows, caplog):
    reward_fn = create_nemo_gym_reward_fn(
        {}, {"mcqa": f"http://127.0.0.1:{_closed_port()}/verify"}, verify_timeout=2
    )
    row = loader_rows["mcqa"][0]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert reward_fn(**_columns([row], [_mcqa_answer(row, True)])) == [None]
    assert "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x1" in caplog.text


def test_factory_with_an_explicit_target(bridge_target, loader_rows, monkeypatch):
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    reward_fn = create_nemo_gym_reward_fn({}, {}, target=bridge_target)
    row = loader_rows["mcqa"][1]
    answers = [_mcqa_answer(row, True), _mcqa_answer(row, False)]
    assert reward_fn(**_columns([row, row], answers)) == [1.0, 0.0]
    assert not embedded.running_bridges()


def test_a_forked_child_scores_through_its_own_channel(via_target, loader_rows):
    row = loader_rows["mcqa"][0]
    args = _columns([row, row], [_mcqa_answer(row, True), _mcqa_answer(row, False)])
    assert reward_nemo_gym_verify(**args) == [1.0, 0.0]  # the parent's channel exists
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: score, report, leave without running the parent's cleanup
        try:
            os.write(write_end, json.dumps(reward_nemo_gym_verify(**args)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    readable, _, _ = select.select([read_end], [], [], 120)
    if not readable:  # a hung child must fail the test, not block it
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read_end) as pipe:
        reported = pipe.read() if readable else ""
    os.waitpid(pid, 0)
    assert reported and json.loads(reported) == [1.0, 0.0]
