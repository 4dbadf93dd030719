"""Real `trl.GRPOTrainer` steps whose completions are real NeMo Gym rollouts: `rollout_func` from
`create_nemo_gym_rollout_func`, `reward_funcs=[reward_env]`, a real bridge, the real agent stack
(NeMo Gym's simple_agent + vllm_model over the scripted policy, tests/support/agents.py).

The policy TRL trains is the tiny local Llama of tests/support/tiny_trl.py over the scripted
policy's toy vocabulary (tests/support/toy_chat.py: 64 ids, EOS 2), so it trains on the very
token ids the agent's rollouts carry. The dataset: NeMo Gym's example_single_tool_call rows (the
policy calls the weather tool, then answers: reward from the resources server's `/verify`) and
one math_with_judge row for the agent whose judge is down (NeMo Gym masks that sample). The
rewards TRL logs must equal what the agent's own `/run` gives for each row (plain HTTP; the
policy is deterministic), and the masked row's completions must reach TRL as NaN, masked.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_grpc.rewards import create_nemo_gym_rollout_func, reward_env
from nemo_gym_grpc.rewards.client import settings
from tests.support import start_bridge as _start_bridge
from tests.support import toy_chat
from tests.support.docs import python_block
from tests.test_rollouts_client import masked_row, run_over_http, weather_rows

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # GRPOConfig's defaults, set on every row


def toy_tokenizer() -> Any:
    """A tokenizer over the scripted policy's 64 ids (`toy_chat.VOCAB`). torch, trl and
    datasets are imported in the tests, not at collection (the fast tier collects this module
    without running it, and torch alone takes seconds to import)."""
    from tests.support.tiny_trl import word_tokenizer

    return word_tokenizer(toy_chat.VOCAB, pad="<pad>", unk="<pad>", bos="<s>", eos="</s>")


def dataset_rows(venv: Path) -> list[dict[str, Any]]:
    """Dataset rows (`prompt`, `verify_extra`) of 5 weather rows and the masked math row."""
    rows = [*weather_rows(venv), masked_row(venv)]
    return [
        {"prompt": row["responses_create_params"]["input"], "verify_extra": json.dumps(row)}
        for row in rows
    ]


def truth_of(agent_stack, dataset_row: dict[str, Any]) -> float:
    """The agent's own reward for a dataset row (NaN when it masks the sample)."""
    row = json.loads(dataset_row["verify_extra"])
    params = dict(row["responses_create_params"], **SAMPLING)
    reply = run_over_http(agent_stack, dict(row, responses_create_params=params))
    return math.nan if reply.get("mask_sample") else float(reply["reward"])


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True)


Calls = list[tuple[list[Any], dict[str, list[Any]]]]  # (prompts, rollout_func output) per step


def _train(
    agent_stack, rows: list[dict[str, Any]], output_dir: Path, monkeypatch
) -> tuple[Any, Calls]:
    """Train the tiny Llama for two_step_grpo_config's 2 steps on `rows`, its completions the
    agent's rollouts through a bridge to `agent_stack` (rollout_func), scored by reward_env.
    Returns (the trainer, each rollout_func call)."""
    import datasets
    import trl

    from tests.support.tiny_trl import tiny_llama, two_step_grpo_config

    tokenizer = toy_tokenizer()
    rollout_func = create_nemo_gym_rollout_func()
    calls: Calls = []

    def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        output = rollout_func(prompts, trainer)
        calls.append((prompts, output))
        return output

    args = two_step_grpo_config(output_dir)  # 3 rows x 2 generations per step: 6 rows in 2 steps
    with _start_bridge("--head-url", agent_stack.head_url) as bridge:
        monkeypatch.setenv(settings.TARGET_ENV, bridge.target)
        trainer = trl.GRPOTrainer(
            model=tiny_llama(tokenizer),
            processing_class=tokenizer,
            reward_funcs=[reward_env],
            rollout_func=recording,
            train_dataset=datasets.Dataset.from_list(rows),
            args=args,
        )
        trainer.train()
    return trainer, calls


def _check_rollouts(calls: Calls, truths: dict[str, float]) -> None:
    """Each step's rollouts against the agent's own reward per row (`truths`, by _key): masked
    rows NaN with one masked EOS token, the others the agent's reward with tool output masked."""
    # TRL passed each step's rows already repeated num_generations times: one rollout each
    assert len(calls) == 2
    seen_rows: list[str] = []
    for prompts, output in calls:
        assert len(prompts) == 6 and len(output["completion_ids"]) == 6
        keys = [_key(p) for p in prompts]
        assert all(keys.count(k) == 2 for k in keys)
        seen_rows += sorted(set(keys))
        for key, reward, mask, ids, logprobs, error in zip(
            keys,
            output["env_reward"],
            output["env_mask"],
            output["completion_ids"],
            output["logprobs"],
            output["rollout_error"],
            strict=True,
        ):
            truth = truths[key]
            assert len(mask) == len(ids) == len(logprobs)
            if math.isnan(truth):  # masked by NeMo Gym: NaN, one masked EOS token
                assert math.isnan(reward) and error.startswith("UNKNOWN"), error
                assert (ids, mask, logprobs) == ([toy_chat.EOS], [0], [0.0])
            else:
                assert reward == truth and error is None
                assert 0 in mask and 1 in mask  # tool output masked, generations trained
                assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    assert sorted(seen_rows) == sorted(truths)  # every row once over the two steps


def _check_logged(trainer: Any, output_dir: Path, calls: Calls, truths: dict[str, float]) -> None:
    """What TRL logged: the agents' rewards, NaN left out of the mean, env_mask honoured."""
    import pandas

    name = reward_env.__name__
    steps = [entry for entry in trainer.state.log_history if f"rewards/{name}/mean" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    tables = sorted((output_dir / "completions").glob("*.parquet"))
    assert len(tables) == 2
    nan_seen = 0
    for entry, table, (_, output) in zip(steps, tables, calls, strict=True):
        frame = pandas.read_parquet(table)
        assert len(frame) == 6
        for prompt, reward in zip(frame["prompt"], frame[name], strict=True):
            messages = [dict(m) for m in prompt] if not isinstance(prompt, str) else prompt
            truth = truths[_key(messages)]
            if math.isnan(truth):
                assert math.isnan(reward)  # not 0.0
                nan_seen += 1
            else:
                assert reward == truth
        assert entry[f"rewards/{name}/mean"] == pytest.approx(frame[name].mean(skipna=True))
        generated = [sum(mask) for mask in output["env_mask"]]
        assert entry["completions/mean_length"] == pytest.approx(sum(generated) / len(generated))
    assert nan_seen == 2  # the masked row's two generations


def test_two_grpo_steps_train_on_the_agents_rollouts_and_masked_ones_reach_trl_as_nan(
    agent_stack, nemo_gym_venv, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rows = dataset_rows(nemo_gym_venv)
    truths = {_key(row["prompt"]): truth_of(agent_stack, row) for row in rows}
    assert sum(math.isnan(t) for t in truths.values()) == 1  # the masked row, and only it
    trainer, calls = _train(agent_stack, rows, tmp_path, monkeypatch)
    _check_rollouts(calls, truths)
    _check_logged(trainer, tmp_path, calls, truths)


def test_the_docs_example_runs_as_written(agent_stack, nemo_gym_venv, tmp_path):
    from tests.support.tiny_trl import tiny_llama

    model_dir = tmp_path / "model"
    tokenizer = toy_tokenizer()
    tiny_llama(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows_file = tmp_path / "rows.jsonl"
    rows = weather_rows(nemo_gym_venv)
    rows_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = tmp_path / "example.py"
    script.write_text(python_block(ROOT / "docs" / "rollouts.md", "create_nemo_gym_rollout_func("))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_GRPC_")}
    env.update(
        NEMO_GYM_ROWS=str(rows_file),
        POLICY_MODEL=str(model_dir),
        OUTPUT_DIR=str(tmp_path / "out"),
        NEMO_GYM_HEAD_URL=agent_stack.head_url,  # no target: the embedded bridge
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    logged = [
        float(x) for x in re.findall(r"'rewards/reward_env/mean': '?([-0-9.e]+)", done.stdout)
    ]
    truths = {run_over_http(agent_stack, row)["reward"] for row in rows}
    assert len(logged) == 2 and len(truths) == 1, (logged, truths, done.stdout[-2000:])
    assert logged == [truths.pop()] * 2
