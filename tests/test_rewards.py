"""The reward functions end to end: real NeMo Gym resources servers behind a real bridge.

Dataset rows are what axolotl's NeMo Gym loader hands to TRL: columns `prompt`,
`resources_server_ref` and `verify_extra`, built from NeMo Gym's own example data and passed
through a real HuggingFace `datasets.Dataset` (Arrow fills keys a row lacks with None, nested
ones too), using the `datasets` that nemo-gym installs in its venv.
"""

from __future__ import annotations

import asyncio
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
from aiohttp import web

from nemo_gym_grpc.rewards import (
    ScoringError,
    create_nemo_gym_reward_fn,
    reward_nemo_gym_verify,
    reward_nemo_gym_verify_async,
)
from nemo_gym_grpc.rewards.client import embedded, settings
from tests.support import closed_port, example_rows, selected_version

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

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
def loader_rows(nemo_gym_venv, tmp_path_factory):
    """server -> its example rows as axolotl's loader (through Arrow) yields them; and
    "mcqa_mixed": mcqa's, where only the first row sets two more OpenAI parameters (Arrow
    gives the other rows null for them)."""
    from tests.support import resources_server_dir

    def load(path: Path, server: str) -> list[dict]:
        out = subprocess.run(
            [str(nemo_gym_venv / "bin" / "python"), "-c", _AXOLOTL_LOADER, str(path), server],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    def examples(server: str) -> Path:
        return resources_server_dir(server, nemo_gym_venv) / "data" / "example.jsonl"

    loaded = {
        s: load(examples(s), s) for s in ("mcqa", "equivalence_rule", "example_single_tool_call")
    }
    mixed = [json.loads(line) for line in examples("mcqa").read_text().splitlines() if line]
    mixed[0]["responses_create_params"].update(temperature=0.5, parallel_tool_calls=True)
    mixed_path = tmp_path_factory.mktemp("rows") / "mcqa_mixed.jsonl"
    mixed_path.write_text("".join(json.dumps(row) + "\n" for row in mixed))
    loaded["mcqa_mixed"] = load(mixed_path, "mcqa")
    return loaded


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


def test_nulls_arrow_puts_in_responses_create_params_are_not_sent(via_target, loader_rows):
    rows = loader_rows["mcqa_mixed"]
    params = rows[1]["verify_extra"]["responses_create_params"]
    assert params["parallel_tool_calls"] is None  # as Arrow fills it; mcqa answers it with 422
    answers = [_mcqa_answer(row, right=True) for row in rows]
    assert reward_nemo_gym_verify(**_columns(rows, answers)) == [1.0] * len(rows)


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
    # NeMo Gym 0.4.0's example_single_tool_call gives every response 1.0 by design; 0.7.0's
    # only a get_weather function call (a text completion cannot hold one): 0.0.
    tool = 1.0 if selected_version() == "0.4.0" else 0.0
    assert rewards == [1.0, 0.0, tool, 1.0, 0.0]


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


def test_missing_or_malformed_refs_fail_only_their_items(
    via_target, loader_rows, caplog, monkeypatch
):
    monkeypatch.setenv(settings.MAX_FAILURE_FRACTION_ENV, "1")  # 4 of 5 fail: guard off
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


def test_an_upstream_that_is_down_gives_none_and_the_guard_raises_when_most_fail(
    start_bridge, nemo_gym, loader_rows, monkeypatch, caplog
):
    bridge = start_bridge(
        "--server",
        f"down=http://127.0.0.1:{closed_port()}",
        "--server",
        f"mcqa={nemo_gym.server_urls['mcqa']}",
    )
    monkeypatch.setenv(settings.TARGET_ENV, bridge.target)
    monkeypatch.setenv(settings.BATCH_TIMEOUT_ENV, "60")  # a hang would fail, not block
    row = loader_rows["mcqa"][0]
    names = ("down", "mcqa", "mcqa", "down")
    rows = [dict(row, resources_server_ref={"name": name}) for name in names]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(**_columns(rows, [_mcqa_answer(row, True)] * 4))
    assert rewards == [None, 1.0, 1.0, None]  # 2 of 4: not more than half
    assert "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x2" in caplog.text

    rows[1] = rows[0]  # 3 of 4 down: an outage, not a batch of rewards
    with pytest.raises(ScoringError) as raised:
        reward_nemo_gym_verify(**_columns(rows, [_mcqa_answer(row, True)] * 4))
    assert sorted(raised.value.failures) == [0, 1, 3]
    assert raised.value.causes == {"UNAVAILABLE (UPSTREAM_UNAVAILABLE)": 3}
    assert "3 of 4 items failed, more than max_failure_fraction=0.5 allows" in str(raised.value)
    assert bridge.target in str(raised.value)


# --------------------------------------------------------------------------------------------
# the failure policy: on_error = none | zero | raise, by keyword or env var


def _mixed_batch(loader_rows) -> dict:
    """5 items: right, wrong, an unknown server, a completion with a lone surrogate, right."""
    mcqa = loader_rows["mcqa"]
    rows = [mcqa[0], mcqa[1], dict(mcqa[2], resources_server_ref={"name": "nope"}), mcqa[3]]
    rows.append(mcqa[4])
    answers = [
        _mcqa_answer(mcqa[0], True),
        _mcqa_answer(mcqa[1], False),
        _mcqa_answer(mcqa[2], True),
        _mcqa_answer(mcqa[3], True) + " \ud800",
        _mcqa_answer(mcqa[4], True),
    ]
    return _columns(rows, answers)


@pytest.mark.parametrize(
    ("on_error", "expected"),
    [("none", [1.0, 0.0, None, None, 1.0]), ("zero", [1.0, 0.0, 0.0, 0.0, 1.0])],
)
@pytest.mark.parametrize("configured_by", ["keyword", "env"])
def test_failed_items_give_what_on_error_says_and_the_rest_is_scored(
    bridge_target, loader_rows, monkeypatch, on_error, expected, configured_by
):
    monkeypatch.setenv(settings.TARGET_ENV, bridge_target)
    if configured_by == "keyword":
        monkeypatch.setenv(settings.ON_ERROR_ENV, "raise")  # the keyword wins
        reward_fn = create_nemo_gym_reward_fn({}, {}, on_error=on_error)
    else:
        monkeypatch.setenv(settings.ON_ERROR_ENV, on_error)
        reward_fn = reward_nemo_gym_verify
    assert reward_fn(**_mixed_batch(loader_rows)) == expected


@pytest.mark.parametrize("configured_by", ["keyword", "env"])
def test_on_error_raise_raises_with_each_failure_and_its_cause(
    bridge_target, loader_rows, monkeypatch, configured_by
):
    monkeypatch.setenv(settings.TARGET_ENV, bridge_target)
    if configured_by == "keyword":
        reward_fn = create_nemo_gym_reward_fn({}, {}, on_error="raise")
    else:
        monkeypatch.setenv(settings.ON_ERROR_ENV, "raise")
        reward_fn = reward_nemo_gym_verify
    with pytest.raises(ScoringError) as raised:
        reward_fn(**_mixed_batch(loader_rows))
    error = raised.value
    assert error.size == 5 and sorted(error.failures) == [2, 3]
    assert (error.failures[2].code, error.failures[2].reason) == (
        "NOT_FOUND",
        "UNKNOWN_RESOURCES_SERVER",
    )
    assert (error.failures[3].code, error.failures[3].reason) == (
        "INVALID_ARGUMENT",
        "INVALID_ITEM",
    )
    assert "lone surrogate U+D800" in error.failures[3].message
    assert "2 of 5 items failed (on_error=raise" in str(error)


def test_the_guard_fraction_by_keyword_and_env(bridge_target, loader_rows, monkeypatch):
    monkeypatch.setenv(settings.TARGET_ENV, bridge_target)
    batch = _mixed_batch(loader_rows)  # 2 of 5 fail
    with pytest.raises(ScoringError, match="more than max_failure_fraction=0.25 allows"):
        create_nemo_gym_reward_fn({}, {}, max_failure_fraction=0.25)(**batch)
    monkeypatch.setenv(settings.MAX_FAILURE_FRACTION_ENV, "0.3")
    with pytest.raises(ScoringError, match="more than max_failure_fraction=0.3 allows"):
        reward_nemo_gym_verify(**batch)
    monkeypatch.setenv(settings.MAX_FAILURE_FRACTION_ENV, "0.4")  # exactly 2 of 5: allowed
    assert reward_nemo_gym_verify(**batch) == [1.0, 0.0, None, None, 1.0]


# --------------------------------------------------------------------------------------------
# the async form (grpc.aio)


def test_async_form_gives_the_same_rewards_from_several_loops_and_threads(via_target, loader_rows):
    batch = _mixed_batch(loader_rows)
    expected = reward_nemo_gym_verify(**batch)
    assert expected == [1.0, 0.0, None, None, 1.0]
    for _ in range(3):  # a new event loop each time
        assert asyncio.run(reward_nemo_gym_verify_async(**batch)) == expected

    async def together():  # several calls at once on one loop
        return await asyncio.gather(*(reward_nemo_gym_verify_async(**batch) for _ in range(3)))

    assert asyncio.run(together()) == [expected] * 3

    results, errors = [], []

    def in_a_thread() -> None:  # each thread runs its own loop, all at the same time
        try:
            results.append(asyncio.run(reward_nemo_gym_verify_async(**batch)))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=in_a_thread) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [expected] * 4

    loop = asyncio.new_event_loop()  # one long-lived loop in another thread, like TRL's
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        for _ in range(2):
            future = asyncio.run_coroutine_threadsafe(reward_nemo_gym_verify_async(**batch), loop)
            assert future.result(timeout=120) == expected
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=10)
        loop.close()


def test_async_factory_starts_its_embedded_bridge_without_blocking_the_loop(
    zero_config, nemo_gym, loader_rows
):
    endpoints = {"mcqa": f"{nemo_gym.server_urls['mcqa']}/verify"}
    reward_fn = create_nemo_gym_reward_fn({}, endpoints, asynchronous=True, on_error="raise")
    assert asyncio.iscoroutinefunction(reward_fn) and reward_fn.__name__ == "nemo_gym"
    row = loader_rows["mcqa"][0]
    args = _columns([row, row], [_mcqa_answer(row, True), _mcqa_answer(row, False)])

    async def scored_while_ticking():
        ticks = 0
        done = asyncio.Event()

        async def tick():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.02)

        ticker = asyncio.create_task(tick())
        try:
            return await reward_fn(**args), ticks
        finally:
            done.set()
            await ticker

    rewards, ticks = asyncio.run(scored_while_ticking())
    assert rewards == [1.0, 0.0]
    (bridge,) = embedded.running_bridges().values()
    assert bridge.running
    # The bridge took a while to start (a subprocess importing grpc); the loop kept running.
    assert ticks >= 3


# --------------------------------------------------------------------------------------------
# extras for TRL's log_metric / log_extra


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
        **_columns(rows, answers),
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
    answers = [_mcqa_answer(rows[0], True), _mcqa_answer(rows[1], False), "\\boxed{A}"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert reward_fn(**_columns(rows, answers)) == [1.0, 0.0, None]
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
        assert reward_fn(**_columns([row], [_mcqa_answer(row, True)])) == [None]
    assert "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x1" in caplog.text


def test_factory_with_an_explicit_target(bridge_target, loader_rows, monkeypatch):
    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    reward_fn = create_nemo_gym_reward_fn({}, {}, target=bridge_target)
    row = loader_rows["mcqa"][1]
    answers = [_mcqa_answer(row, True), _mcqa_answer(row, False)]
    assert reward_fn(**_columns([row, row], answers)) == [1.0, 0.0]
    assert not embedded.running_bridges()


_FORK_PROBE = """
import json, os, select, signal, sys
from nemo_gym_grpc.rewards import reward_nemo_gym_verify
args = json.loads(sys.stdin.read())
parent = reward_nemo_gym_verify(**args)  # the parent's channel now exists
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
child = json.loads(os.read(read_end, 1 << 20) or b"null") if readable else None
os.waitpid(pid, 0)
print(json.dumps({"parent": parent, "child": child}))
"""


def test_a_forked_child_scores_through_its_own_channel(via_target, loader_rows):
    # In a fresh interpreter: this pytest process has torch and other libraries loaded whose
    # own fork handlers are not ours to test (one of them crashed a forked child here).
    row = loader_rows["mcqa"][0]
    args = _columns([row, row], [_mcqa_answer(row, True), _mcqa_answer(row, False)])
    done = subprocess.run(
        [sys.executable, "-c", _FORK_PROBE],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, settings.TARGET_ENV: via_target},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"parent": [1.0, 0.0], "child": [1.0, 0.0]}


_EMBEDDED_CHILD = r"""
import json, sys, time
from nemo_gym_grpc.rewards import reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import embedded
row = json.loads(sys.argv[1])
answer = "\\boxed{%s}" % row["expected_answer"]
print(reward_nemo_gym_verify([answer], resources_server_ref=[{"name": "mcqa"}], verify_extra=[row]))
(bridge,) = embedded.running_bridges().values()
print(bridge.process.pid, flush=True)
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
        bridge_pid = int(child.stdout.readline())
        assert not _exited(bridge_pid)
        os.kill(child.pid, signal.SIGKILL)  # no atexit handlers run in the child
        child.wait(30)
        for _ in range(200):  # the bridge checks its parent every second
            if _exited(bridge_pid):
                break
            time.sleep(0.1)
        assert _exited(bridge_pid), "the embedded bridge outlived the process that started it"
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        if bridge_pid and not _exited(bridge_pid):
            os.kill(bridge_pid, signal.SIGKILL)
