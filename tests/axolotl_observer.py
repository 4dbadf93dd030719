"""An axolotl plugin for tests/test_axolotl.py: records what the trainer got, changes nothing.

Listed after `nemo_gym_grpc.rewards.axolotl.NemoGymPlugin` in the test's `plugins`, it writes
JSON lines to <output_dir>/observed.jsonl:
- {"reward_funcs": [names]}: the trainer's reward columns once every plugin has wired it;
- {"call": ..., "rewards": [...]}: every reward function call: its name, the completions'
  texts, the dataset columns the rewards depend on, and what it returned (None/NaN as null);
- {"produced": [...]}: every batch the data producer hands the trainer: per sample the
  number of completion tokens, of tokens in `completion_mask` and in `tool_mask`, and the
  `env_reward`, `rollout_error` and agent of its row;
- {"scored": {"rewards_per_func": [[...]], "advantages": [...]}}: every batch the trainer
  scored: the reward matrix its advantages were computed from (completions x reward
  functions, after every plugin's wrapping) and the advantages it trains with;
- {"log": {...}}: every metrics dict the trainer logs (`on_log`);
- {"dataloader_workers": {"args": N, "prompts": N}}: the trainer's `dataloader_num_workers`
  and the data producer's prompt DataLoader's `num_workers` (None without a producer);
- {"forks": N}: at the end of training, how many times the process forked (`os.fork`, as a
  DataLoader worker starts; not subprocesses) since the trainer was made.
It also defines `alternating_reward`, a user's own reward function the tests list next to
NeMo Gym's.
Runs in the axolotl venv (tests/support/axolotl_venv.py), imported as `tests.axolotl_observer`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

_lock = threading.Lock()


def _plain(value: Any) -> Any:
    """JSON-ready: NaN -> None, tensors -> lists, dicts and lists recursively."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Writer:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with _lock, open(self.path, "a") as out:
            out.write(json.dumps(_plain(record)) + "\n")


def _completion_text(completion: Any) -> str:
    if isinstance(completion, list):
        return "\n".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _recording_reward(func: Any, name: str, writer: _Writer) -> Any:
    @functools.wraps(func)
    def reward(completions: Any, prompts: Any = None, **kwargs: Any) -> Any:
        rewards = func(completions, prompts, **kwargs)
        columns = ("verify_extra", "resources_server_ref", "env_reward", "rollout_error")
        writer.write(
            {
                "call": name,
                "completions": [_completion_text(c) for c in completions],
                **{key: kwargs.get(key) for key in columns},
                "rewards": [math.nan if r is None else r for r in rewards],
            }
        )
        return rewards

    return reward


def _recording_produce(produce: Any, writer: _Writer) -> Any:
    @functools.wraps(produce)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        dataset = produce(*args, **kwargs)
        if dataset is not None:
            data = dataset._data
            samples = []
            for index, row in enumerate(data["_deferred_inputs"]):
                extra = row.get("verify_extra") or {}
                extra = json.loads(extra) if isinstance(extra, str) else extra
                samples.append(
                    {
                        "tokens": len(data["_deferred_completion_ids_list"][index]),
                        "completion_mask": int(data["completion_mask"][index].sum()),
                        "tool_mask": int(
                            (data["completion_mask"][index] * data["tool_mask"][index]).sum()
                        ),
                        "env_reward": row.get("env_reward"),
                        "rollout_error": row.get("rollout_error"),
                        "agent": (extra.get("agent_ref") or {}).get("name"),
                    }
                )
            writer.write({"produced": samples})
        return dataset

    return recorded


def alternating_reward(completions: Any, prompts: Any = None, **kwargs: Any) -> list[float]:
    """A user's own reward function: 0.0 and 0.25 in turn, so the two completions of every
    group (consecutive, num_generations 2) differ by it."""
    return [0.25 * (index % 2) for index in range(len(completions))]


def _record_scoring(trainer: Any, writer: _Writer) -> None:
    """Wrap the trainer's reward matrix (`_collect_reward_workers` of axolotl's async trainer,
    else TRL's `_calculate_rewards`) and its scoring (`_compute_deferred_scores`, else
    `_generate_and_score_completions`), outermost, to write one "scored" record per batch."""
    rewards_name = next(
        name for name in ("_collect_reward_workers", "_calculate_rewards") if hasattr(trainer, name)
    )
    scoring_name = next(
        name
        for name in ("_compute_deferred_scores", "_generate_and_score_completions")
        if hasattr(trainer, name)
    )
    matrices: list[Any] = []
    rewards, scoring = getattr(trainer, rewards_name), getattr(trainer, scoring_name)

    def recorded_rewards(*args: Any, **kwargs: Any) -> Any:
        matrix = rewards(*args, **kwargs)
        matrices.append(matrix.detach().cpu().clone())
        return matrix

    def recorded_scoring(*args: Any, **kwargs: Any) -> Any:
        matrices.clear()
        scored = scoring(*args, **kwargs)
        (matrix,) = matrices
        writer.write({"scored": {"rewards_per_func": matrix, "advantages": scored["advantages"]}})
        return scored

    setattr(trainer, rewards_name, recorded_rewards)
    setattr(trainer, scoring_name, recorded_scoring)


class _LogCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, writer: _Writer) -> None:
        self.writer = writer
        self.forks = 0
        os.register_at_fork(before=self._forking)

    def _forking(self) -> None:
        self.forks += 1

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.writer.write({"log": dict(logs or {})})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.writer.write({"forks": self.forks})


class ObserverPlugin(BasePlugin):  # type: ignore[misc]
    """Records what the trainer got (see the module docstring)."""

    def _writer(self, cfg: Any) -> _Writer:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        return _Writer(out / "observed.jsonl")

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        writer = self._writer(cfg)
        names = list(trainer.reward_func_names)
        writer.write({"reward_funcs": names})
        trainer.reward_funcs[:] = [
            _recording_reward(func, name, writer)
            for func, name in zip(trainer.reward_funcs, names, strict=True)
        ]
        _record_scoring(trainer, writer)
        producer = getattr(trainer, "data_producer", None)
        inner = getattr(producer, "_inner", producer)
        if inner is not None:
            inner.produce = _recording_produce(inner.produce, writer)
        prompts = getattr(getattr(inner, "_prompt_dl", None), "num_workers", None)
        workers = {"args": trainer.args.dataloader_num_workers, "prompts": prompts}
        writer.write({"dataloader_workers": workers})

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list[Any]:
        return [_LogCallback(self._writer(cfg))]
