"""TRL 1.16's `AsyncGRPOTrainer` training on NeMo Gym rollouts as they finish:
`create_nemo_gym_rollout_worker` -> a real bridge (RunStream) -> the real agent stack (NeMo Gym's
simple_agent + vllm_model over the scripted policy, tests/support/agents.py).

The trainer runs on this CPU with its three GPU-only parts replaced (tests/support/
cpu_async_grpo.py: no peak-FLOPs lookup, tree attention in plain torch, weight syncs that drive
the server's routes without NCCL); its vLLM server is the scripted policy, which answers what
TRL's `VLLMClient` asks. The policy is the tiny local Llama over the scripted policy's toy
vocabulary, as in tests/test_trl_rollouts.py. The scripted policy "samples" (Knobs.
tool_call_rate): a conversation calls get_weather (reward 1.0 from example_single_tool_call's
/verify) or not (0.0), so the rollouts of one prompt differ and advantages are not all 0.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from nemo_gym_grpc.rewards import create_nemo_gym_rollout_worker
from tests.support import Knobs, free_ports, start_bridge
from tests.support.docs import python_block
from tests.support.policy_model import WEATHER_TOOL
from tests.support.waiting import wait_until
from tests.test_rollouts_client import masked_row, run_over_http, weather_rows
from tests.test_trl_rollouts import toy_tokenizer

pytestmark = pytest.mark.nemo_gym_07  # the masked row's agent (judge_failsafe) is 0.7 only

ROOT = Path(__file__).resolve().parents[1]
WAIT = 120.0  # s, bound of every wait for a condition below
SLOW_ROW = "humidity in sf"  # a weather row's user message: the slow agent's rollouts


@pytest.fixture(autouse=True)
def _clean(agent_stack, monkeypatch) -> Iterator[None]:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    agent_stack.policy.reset()
    yield
    agent_stack.policy.reset()
    agent_stack.policy.max_model_len = 4096


def dataset_of(rows: list[dict[str, Any]]) -> Any:
    """A `datasets.Dataset` with `prompt` and `verify_extra` (the NeMo Gym row as JSON)."""
    import datasets

    return datasets.Dataset.from_list(
        [
            {"prompt": row["responses_create_params"]["input"], "verify_extra": json.dumps(row)}
            for row in rows
        ]
    )


def config(tmp_path: Path, policy_url: str, **overrides: Any) -> Any:
    from trl.experimental.async_grpo import AsyncGRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_steps": 4,
        "logging_steps": 1,
        "learning_rate": 0.1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "bf16": False,
        "dtype": "float32",
        "vllm_server_base_url": policy_url,
        "seed": 0,
    }
    return AsyncGRPOConfig(**{**settings, **overrides})


def user_text(prompt: Any) -> str:
    return next(m["content"] for m in prompt if m["role"] == "user")


def calls_tool(completion: list[dict[str, Any]]) -> bool:
    return any(
        call.get("name") == WEATHER_TOOL for m in completion for call in m.get("tool_calls", [])
    )


def test_async_grpo_trains_on_the_rollouts_as_they_finish(
    agent_stack, nemo_gym_venv, agent_bridge, tmp_path, caplog
):
    import torch

    from tests.support.tiny_trl import tiny_llama

    policy = agent_stack.policy
    policy.knobs = Knobs(tool_call_rate=0.5, seed=1)
    policy.max_model_len = 256  # TRL's token budget: about two groups per step
    masked = masked_row(nemo_gym_venv)
    dataset = dataset_of([masked, *weather_rows(nemo_gym_venv)])  # the masked row drawn first
    tokenizer = toy_tokenizer()
    model_dir = tmp_path / "model"
    tiny_llama(tokenizer).save_pretrained(model_dir)
    args = config(tmp_path, policy.url)
    worker = create_nemo_gym_rollout_worker(
        dataset, args, target=agent_bridge.target, max_inflight=6
    )
    trainer, before, collated = train_recording(worker, model_dir, tokenizer, args, dataset)

    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 4 and len(collated) >= 4
    masked_prompt = user_text(masked["responses_create_params"]["input"])
    for step, entry in enumerate(steps):
        batches = [samples for logged, samples in collated if logged == step]
        means = [sum(s.metrics["reward"] for s in b) / len(b) for b in batches]
        assert entry["reward"] == pytest.approx(sum(means) / len(means))  # what TRL logged
    trained = [samples for _, samples in collated[:4]]  # a 5th batch may be collated unused
    for samples in trained:
        check_samples(samples, masked_prompt, trainer.model_version)
    advantages = [s.advantage for samples in trained for s in samples]
    assert any(a != 0.0 for a in advantages)  # some group had both rewards
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    counts = worker.counts
    closed_and_dropped = counts["dropped_groups"] - counts["unfinished_groups"]  # not stop's
    assert closed_and_dropped >= 1  # the masked row's group: both rollouts masked
    assert counts["failed_rollouts"] == 2 * closed_and_dropped
    assert counts["failures/judge_failed"] == counts["failed_rollouts"]  # NeMo Gym's failure_kind
    logged = trainer.state.log_history
    assert sum(e.get("nemo_gym/dropped_groups_total", 0) for e in logged) >= 1
    assert sum(e.get("nemo_gym/failures/judge_failed_total", 0) for e in logged) >= 2
    reason = run_over_http(agent_stack, masked)["failure_reason"]  # the agent's own
    warnings = [r.getMessage() for r in caplog.records if r.name == "nemo_gym_grpc.rewards"]
    assert any("judge_failed" in w and reason[:100] in w for w in warnings), warnings
    assert not math.isnan(steps[-1]["reward"])
    paths = [c.path for c in policy.calls]
    for route in ("/health", "/v1/models", "/get_world_size", "/init_weight_transfer_engine"):
        assert route in paths, route
    syncs = 1 + len(steps)  # the first sync before the worker starts, then one per step
    for route in ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update"):
        assert paths.count(route) == syncs, route
    assert paths.count("/resume") == syncs
    worker.check_health(1.0)  # stopped cleanly: nothing to report


def train_recording(
    worker: Any, model_dir: Path, tokenizer: Any, args: Any, dataset: Any
) -> tuple[Any, dict[str, Any], list[tuple[int, list[Any]]]]:
    """Train an AsyncGRPOTrainer (on this CPU) on `worker`'s samples: (the trainer, its
    parameters before training, per batch collated: (steps logged before, its samples))."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer

    from tests.support.cpu_async_grpo import on_cpu

    pushed: dict[int, Any] = {}  # id(input_ids) -> the sample the worker pushed
    put = worker.rollout_buffer.put_nowait

    def recording_put(sample: Any) -> None:
        pushed[id(sample.input_ids)] = sample
        put(sample)

    # The dataloader collates one batch ahead, and TRL's collator logs a batch's rewards when
    # it collates it, so a step's log holds the batches collated since the previous log.
    collated: list[tuple[int, list[Any]]] = []

    class Recording(async_grpo_trainer.DataCollatorForRollout):
        def torch_call(self, examples: list[Any]) -> dict[str, Any]:
            (rows,) = examples
            logged = sum("loss" in entry for entry in trainer.state.log_history)
            samples = [pushed[id(s["input_ids"])] for row in rows for s in row.samples]
            collated.append((logged, samples))
            return super().torch_call(examples)

    worker.rollout_buffer.put_nowait = recording_put
    with on_cpu(), mock.patch.object(async_grpo_trainer, "DataCollatorForRollout", Recording):
        trainer = AsyncGRPOTrainer(
            model=str(model_dir),
            processing_class=tokenizer,
            args=args,
            train_dataset=dataset,
            rollout_worker=worker,
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    return trainer, before, collated


def check_samples(samples: list[Any], masked_prompt: str, model_version: int) -> None:
    """Each trained sample: the agent's reward, not the masked row's, a model version
    trained with, and a completion mask and log-probs that line up with its tokens."""
    for sample in samples:
        # the agent's reward: example_single_tool_call gives 1.0 iff get_weather was called
        assert sample.metrics["reward"] == float(calls_tool(sample.completion))
        assert user_text(sample.prompt) != masked_prompt  # never trained on
        assert 1 <= sample.model_version <= model_version
        mask = sample.completion_mask.tolist()
        assert len(mask) == len(sample.input_ids) == len(sample.old_log_probs)
        assert 1 in mask and all(
            lp == 0.0 for lp, m in zip(sample.old_log_probs, mask, strict=True) if not m
        )


def test_a_slow_agent_holds_back_the_rollout_func_but_not_the_worker(
    agent_stack, nemo_gym_venv, agent_bridge, tmp_path
):
    """One row's rollouts are held by the policy: the worker keeps training samples coming from
    the other rows, while the synchronous rollout_func on the same rows returns only once they
    are released; stop() cancels the held rollouts (the policy sees its client go)."""
    import threading

    from nemo_gym_grpc.rewards import create_nemo_gym_rollout_func

    policy = agent_stack.policy
    policy.knobs = Knobs(hold=True, match=SLOW_ROW)
    rows = weather_rows(nemo_gym_venv)
    assert sum(SLOW_ROW in json.dumps(row) for row in rows) == 1
    dataset = dataset_of(rows)
    args = config(tmp_path, policy.url)
    rollout_func = create_nemo_gym_rollout_func(target=agent_bridge.target, rows=dataset)
    trainer = mock.Mock(temperature=1.0, top_p=1.0, processing_class=toy_tokenizer())
    prompts = [row["prompt"] for row in dataset for _ in range(2)]
    synchronous: list[dict[str, Any]] = []
    sync_call = threading.Thread(target=lambda: synchronous.append(rollout_func(prompts, trainer)))
    worker = create_nemo_gym_rollout_worker(
        dataset, args, target=agent_bridge.target, max_inflight=4
    )
    sync_call.start()
    worker.start()
    try:
        others = len(rows) - 1
        wait_until(lambda: worker.counts["samples"] >= 2 * others, WAIT, "the other rows' samples")
        held = [c for c in policy.in_flight() if SLOW_ROW in json.dumps(c.body)]
        assert len(held) >= 2  # the worker's two (and the rollout_func's) are still held
        assert sync_call.is_alive() and not synchronous  # waits for the slowest rollout
        samples = list(worker.rollout_buffer.queue)
        assert len(samples) >= 2 * others
        assert all(SLOW_ROW not in user_text(s.prompt) for s in samples)
    finally:
        worker.stop()
    wait_until(
        lambda: (
            sum(c.closed_by_client for c in policy.calls if SLOW_ROW in json.dumps(c.body)) >= 2
        ),
        WAIT,
        "the policy to see the cancelled rollouts' requests closed",
    )
    policy.knobs = Knobs()
    policy.release()
    sync_call.join(WAIT)
    assert not sync_call.is_alive() and len(synchronous[0]["env_reward"]) == len(prompts)


def test_a_bridge_that_dies_is_reported_and_its_rollouts_are_sent_again(
    agent_stack, nemo_gym_venv, tmp_path
):
    (port,) = free_ports(1)
    listen = f"127.0.0.1:{port}"
    policy = agent_stack.policy
    dataset = dataset_of(weather_rows(nemo_gym_venv))
    args = config(tmp_path, policy.url)
    worker = create_nemo_gym_rollout_worker(dataset, args, target=listen, max_inflight=4)
    first = start_bridge("--head-url", agent_stack.head_url, listen=listen)
    try:
        worker.start()
        wait_until(lambda: worker.counts["samples"] >= 4, WAIT, "samples")
        policy.knobs = Knobs(hold=True)  # the rollouts in flight when the bridge goes
        wait_until(lambda: len(policy.in_flight()) >= 2, WAIT, "held rollouts")
        first.stop()
        wait_until(lambda: _raises(worker.check_health, 1.0), WAIT, "check_health to raise")
        with pytest.raises(RuntimeError, match=f"no RunStream to the bridge at {listen}"):
            worker.check_health(1.0)
        resent_before = worker.counts["resent_rollouts"]
        assert resent_before >= 2
        policy.knobs = Knobs()
        policy.release()
        with start_bridge("--head-url", agent_stack.head_url, listen=listen):
            done = worker.counts["samples"]
            wait_until(lambda: worker.counts["samples"] >= done + 8, WAIT, "samples again")
            worker.check_health(1.0)
            assert worker.counts["failed_rollouts"] == 0  # sent again, not failed
    finally:
        worker.stop()
        first.stop()


def test_streams_are_rotated_before_their_deadline_without_losing_rollouts(
    agent_stack, nemo_gym_venv, agent_bridge, tmp_path
):
    dataset = dataset_of(weather_rows(nemo_gym_venv))
    args = config(tmp_path, agent_stack.policy.url)
    worker = create_nemo_gym_rollout_worker(
        dataset, args, target=agent_bridge.target, max_inflight=4, stream_timeout=6.0
    )
    worker.start()
    try:
        wait_until(lambda: worker.counts["streams"] >= 3, WAIT, "two rotations")
        done = worker.counts["samples"]
        wait_until(lambda: worker.counts["samples"] >= done + 4, WAIT, "samples after them")
    finally:
        worker.stop()
    counts = worker.counts
    assert counts["failed_rollouts"] == counts["resent_rollouts"] == 0


def test_the_docs_async_example_runs_as_written(agent_stack, nemo_gym_venv, tmp_path):
    from tests.support.tiny_trl import tiny_llama

    policy = agent_stack.policy
    policy.max_model_len = 256
    model_dir = tmp_path / "model"
    tokenizer = toy_tokenizer()
    tiny_llama(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in weather_rows(nemo_gym_venv)))
    script = tmp_path / "example.py"
    script.write_text(
        python_block(ROOT / "docs" / "rollouts.md", "create_nemo_gym_rollout_worker(")
    )
    env = {
        "NEMO_GYM_ROWS": str(rows_file),
        "POLICY_MODEL": str(model_dir),
        "OUTPUT_DIR": str(tmp_path / "out"),
        "NEMO_GYM_HEAD_URL": agent_stack.head_url,  # no target: the embedded bridge
        "VLLM_SERVER_URL": policy.url,
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.cpu_async_grpo", str(script)],
        env=_environment(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rewards = [float(x) for x in re.findall(r"'reward': '?([-0-9.e]+)", done.stdout)]
    assert len(rewards) == 2 and rewards == [1.0, 1.0], done.stdout[-3000:]


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_GRPC_")}
    return {**env, **extra}


def _raises(check: Any, *args: Any) -> bool:
    try:
        check(*args)
    except RuntimeError:
        return True
    return False
