"""Rollouts of more than 2 MiB each, as long agentic trajectories with their token ids and
log-probs reach, through a real bridge in front of the real agent stack (NeMo Gym's simple_agent
and vllm_model over the scripted policy, tests/support/agents.py): 64 of 64 come back whole
through `RunStream` (`run_rollouts`), through `create_nemo_gym_rollout_func` and through the
AsyncGRPOTrainer rollout worker, although together they are several times the 64 MiB message
limit (the bridge splits the results that finish together across messages).

The policy answers every rollout with LONG_ANSWER (no tool call), whose tokens, ids and
log-probs make the agent's `/run` reply and the rollout's `output_json` over 2 MiB.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

from nemo_gym_grpc.rewards import (
    create_nemo_gym_rollout_func,
    create_nemo_gym_rollout_worker,
    run_rollouts,
)
from nemo_gym_grpc.v1 import rollout_pb2
from tests.support.policy_model import Knobs
from tests.support.waiting import wait_until
from tests.test_rollout_worker import args as worker_args
from tests.test_rollouts_client import weather_rows
from tests.test_trl_async import dataset_of

MiB = 1024 * 1024
WORDS = 40_000  # each one token: its 48 letters, id and log-prob make 60 bytes of /run reply
LONG_ANSWER = " ".join(["w" * 48] * WORDS)
ROLLOUTS = 64
WAIT = 600.0  # s, bound of every wait below


@pytest.fixture(autouse=True)
def long_answers(agent_stack, monkeypatch) -> Iterator[None]:
    """The policy answers LONG_ANSWER at once (no tool call), and takes prompts that long."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    policy = agent_stack.policy
    policy.reset()
    policy.knobs = Knobs(tool_turns=0)
    answers, length = policy.answers, policy.max_model_len
    policy.answers = [("", LONG_ANSWER)]
    policy.max_model_len = 4 * WORDS
    yield
    policy.answers, policy.max_model_len = answers, length
    policy.reset()


def rows_of(nemo_gym_venv) -> list[dict[str, Any]]:
    """ROLLOUTS weather rows (the stack's own, repeated)."""
    rows = weather_rows(nemo_gym_venv)
    return [rows[k % len(rows)] for k in range(ROLLOUTS)]


def test_64_rollouts_of_over_2_mib_all_come_back_through_runstream(agent_bridge, nemo_gym_venv):
    outcomes = run_rollouts(rows_of(nemo_gym_venv), target=agent_bridge.target, batch_timeout=WAIT)
    assert len(outcomes) == ROLLOUTS
    for outcome in outcomes:
        assert isinstance(outcome, rollout_pb2.RunResponse), outcome
        assert len(outcome.rollout.output_json) > 2 * MiB
        (turn,) = outcome.rollout.turns
        assert len(turn.generation_token_ids) >= WORDS
    assert sum(o.ByteSize() for o in outcomes) > 2 * 64 * MiB  # several messages' worth


def test_the_rollout_func_gets_64_rollouts_of_over_2_mib(agent_bridge, nemo_gym_venv):
    dataset = dataset_of(weather_rows(nemo_gym_venv))
    rollout_func = create_nemo_gym_rollout_func(target=agent_bridge.target, rows=dataset)
    tokenizer = types.SimpleNamespace(eos_token_id=2)  # what the rollout_func reads of TRL's
    trainer = types.SimpleNamespace(temperature=1.0, top_p=1.0, processing_class=tokenizer)
    prompts = [dataset[k % len(dataset)]["prompt"] for k in range(ROLLOUTS)]
    output = rollout_func(prompts, trainer)
    assert output["rollout_error"] == [None] * ROLLOUTS
    assert all(len(ids) >= WORDS for ids in output["completion_ids"])


def test_the_rollout_worker_trains_on_rollouts_of_over_2_mib(agent_bridge, nemo_gym_venv):
    dataset = dataset_of(weather_rows(nemo_gym_venv))
    worker = create_nemo_gym_rollout_worker(
        dataset, worker_args(max_inflight_tasks=16), target=agent_bridge.target
    )
    worker.start()
    try:
        wait_until(lambda: worker.counts["samples"] >= ROLLOUTS, WAIT, f"{ROLLOUTS} samples")
    finally:
        worker.stop()
    counts = worker.counts
    assert counts["failed_rollouts"] == 0 and counts["resent_rollouts"] == 0
    samples = list(worker.rollout_buffer.queue)
    assert all(len(s.input_ids) >= WORDS for s in samples)
