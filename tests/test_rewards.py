"""The reward functions end to end: real NeMo Gym resources servers behind a real bridge
(NEMO_GYM_GRPC_TARGET): scores, the failure policy, the async form. The dataset rows:
tests/support/reward_rows.py. Also: test_rewards_logs.py (what TRL's log callbacks get),
test_rewards_embedded.py (zero configuration: embedded bridges).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from nemo_gym_grpc.rewards import (
    ScoringError,
    create_nemo_gym_reward_fn,
    reward_nemo_gym_verify,
    reward_nemo_gym_verify_async,
)
from nemo_gym_grpc.rewards.client import embedded, settings
from tests.support import closed_port, example_rows, selected_version
from tests.support.reward_rows import mcqa_answer, reward_columns

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

LOGGER = "nemo_gym_grpc.rewards"


# --------------------------------------------------------------------------------------------
# through a running bridge (NEMO_GYM_GRPC_TARGET)


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "plain"])
def test_mcqa_right_answers_score_1_and_wrong_answers_0(via_target, loader_rows, conversational):
    rows = loader_rows["mcqa"]
    answers = [mcqa_answer(row, right) for row in rows for right in (True, False)]
    doubled = [row for row in rows for _ in (True, False)]
    rewards = reward_nemo_gym_verify(**reward_columns(doubled, answers, conversational))
    assert type(rewards) is list
    assert rewards == [1.0, 0.0] * len(rows)


def test_nulls_arrow_puts_in_responses_create_params_are_not_sent(via_target, loader_rows):
    rows = loader_rows["mcqa_mixed"]
    params = rows[1]["verify_extra"]["responses_create_params"]
    assert params["parallel_tool_calls"] is None  # as Arrow fills it; mcqa answers it with 422
    answers = [mcqa_answer(row, right=True) for row in rows]
    assert reward_nemo_gym_verify(**reward_columns(rows, answers)) == [1.0] * len(rows)


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
    rewards = reward_nemo_gym_verify(**reward_columns(rows, answers))
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
        **reward_columns([row, row], [mcqa_answer(row, True), mcqa_answer(row, False)])
    )
    assert rewards == [1.0, 0.0]


def test_an_unknown_resources_server_gives_none_and_a_warning(via_target, loader_rows, caplog):
    rows = [dict(row) for row in loader_rows["mcqa"][:3]]
    rows[1]["resources_server_ref"] = {"name": "no_such_server"}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(
            **reward_columns(rows, [mcqa_answer(row, True) for row in rows])
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
        rewards = reward_nemo_gym_verify(**reward_columns(rows, [mcqa_answer(row, True)] * 5))
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
            answer = mcqa_answer(row, right)
        rows.append(row)
        answers.append(answer)
        expected.append(1.0 if right else 0.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rewards = reward_nemo_gym_verify(**reward_columns(rows, answers))
    assert rewards == expected
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_messages_over_grpcs_default_4_mib_go_through(via_target, loader_rows):
    row = loader_rows["mcqa"][0]
    padding = "Let me think. " * 8000  # ~110 KB per completion, ~7 MB per 64-item message
    answers = [padding + mcqa_answer(row, i % 2 == 0) for i in range(64)]
    rewards = reward_nemo_gym_verify(**reward_columns([row] * 64, answers))
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
        rewards = reward_nemo_gym_verify(**reward_columns(rows, [mcqa_answer(row, True)] * 4))
    assert rewards == [None, 1.0, 1.0, None]  # 2 of 4: not more than half
    assert "UNAVAILABLE (UPSTREAM_UNAVAILABLE) x2" in caplog.text

    rows[1] = rows[0]  # 3 of 4 down: an outage, not a batch of rewards
    with pytest.raises(ScoringError) as raised:
        reward_nemo_gym_verify(**reward_columns(rows, [mcqa_answer(row, True)] * 4))
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
        mcqa_answer(mcqa[0], True),
        mcqa_answer(mcqa[1], False),
        mcqa_answer(mcqa[2], True),
        mcqa_answer(mcqa[3], True) + " \ud800",
        mcqa_answer(mcqa[4], True),
    ]
    return reward_columns(rows, answers)


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
    args = reward_columns([row, row], [mcqa_answer(row, True), mcqa_answer(row, False)])

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
