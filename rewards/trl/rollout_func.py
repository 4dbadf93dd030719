"""`create_nemo_gym_rollout_func`: TRL's `GRPOTrainer(rollout_func=...)` running each prompt as
a NeMo Gym rollout through the bridge (agent `/run` or environment server episode).

What TRL 1.16 does around it (`trl/trainer/grpo_trainer.py`, `_generate`): it calls
`rollout_func(prompts, trainer)` with this process's slice of the batch. Its sampler
(`RepeatSampler`, `mini_repeat_count=num_generations`) has already repeated every dataset row
`num_generations` times, consecutively, so `prompts` holds each prompt `num_generations` times
(or its share of them on this process) and the function runs exactly one rollout per entry:
`num_generations` rollouts per dataset row in all, none duplicated. It must return, one entry
per prompt, `prompt_ids`, `completion_ids` and `logprobs`, and may return `env_mask` (1 =
trained on); TRL forwards every other key to the reward functions as a keyword argument, one
value per completion. This function returns `env_mask`, `env_reward` (the rollout's reward,
NaN for a failed rollout), `num_turns` and `rollout_error` (None, or `logs.failure_text`: the
failure's cause, e.g. "UNAVAILABLE (AGENT_UNAVAILABLE)", and NeMo Gym's `failure_kind` /
`failure_reason` when it sent them), so `reward_funcs=[reward_env]` trains on the agent's
rewards and logs `rollout_error` to TRL's completions table. Tokens are stitched across turns
as `client/stitch.py` says.

From prompt to dataset row: each prompt is looked up among the dataset rows (`rows.py`): the
trainer's own `train_dataset` and `eval_dataset` by default, or the `rows` given. The NeMo Gym
row sent to the agent is the dataset row's `row_column` (default `verify_extra`); its agent is
its `agent_ref.name`, else `agent`.

A failed rollout (any `Failure`, a masked sample, tokens that cannot be stitched) becomes
`stitch.failed_sample`: a one-token EOS completion with `env_mask` 0 and reward NaN. It never
trains, and TRL leaves it out of the group baseline (docs/rewards.md, "What TRL does with
None"). When more than `max_failure_fraction` of one call's rollouts failed, the call raises
`ScoringError` instead: that is an outage, not a training signal.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_grpc.rewards.client import policy, rollouts, settings
from nemo_gym_grpc.rewards.client.outcomes import Failure, RunOutcome
from nemo_gym_grpc.rewards.client.stitch import failed_sample, sample_of
from nemo_gym_grpc.rewards.trl import logs
from nemo_gym_grpc.rewards.trl.rows import RowIndex, nemo_gym_row, trainer_datasets

log = logging.getLogger("nemo_gym_grpc.rewards")

RolloutFunc = Callable[[list[Any], Any], dict[str, list[Any]]]


def eos_token_id(trainer: Any) -> int:
    """The EOS token id of the trainer's tokenizer (`processing_class`, or its `tokenizer`).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ValueError("the trainer's tokenizer has no eos_token_id (a failed rollout needs one)")
    return eos


def rollout_output(
    outcomes: Sequence[RunOutcome], eos: int, failures: dict[int, Failure] | None = None
) -> dict[str, list[Any]]:
    """TRL's `rollout_func` return value for `outcomes` (one per prompt, in prompt order);
    `failures`, if given, receives index -> `Failure` of each failed rollout.

    Returns:
        {"prompt_ids", "completion_ids", "logprobs", "env_mask": lists per sample;
        "env_reward": float per sample (NaN for a failure); "num_turns": int per sample;
        "rollout_error": None or `logs.failure_text` per sample}.
    """
    output: dict[str, list[Any]] = {
        key: []
        for key in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            "env_reward",
            "num_turns",
            "rollout_error",
        )
    }
    for index, outcome in enumerate(outcomes):
        sample = sample_of(outcome)
        if isinstance(sample, Failure):
            if failures is not None:
                failures[index] = sample
            error: str | None = logs.failure_text(sample)
            reward = math.nan
            sample = failed_sample(eos)
        else:
            error = None
            reward = outcome.rollout.reward  # type: ignore[union-attr]
        output["prompt_ids"].append(sample.prompt_ids)
        output["completion_ids"].append(sample.completion_ids)
        output["logprobs"].append(sample.logprobs)
        output["env_mask"].append(sample.env_mask)
        output["env_reward"].append(reward)
        output["num_turns"].append(sample.num_turns)
        output["rollout_error"].append(error)
    return output


def run_rows(
    rows: Sequence[Mapping[str, Any]],
    prompts: Sequence[Any],
    trainer: Any,
    *,
    agent: str | None = None,
    target: str | None = None,
    batch_timeout: float | None = None,
    run_timeout: float | None = None,
    trainer_sampling: bool = True,
    max_failure_fraction: float | None = None,
    where: str = "rollouts",
) -> dict[str, list[Any]]:
    """NeMo Gym rows (one per prompt, already looked up) run as rollouts for a GRPO trainer:
    the part `rollout_func` and axolotl's data producer (`nemo_gym_grpc.rewards.axolotl`)
    share. Keywords as `create_nemo_gym_rollout_func`'s (None = the env var, read now);
    `where` names the caller in the failure message.

    Returns:
        `rollout_output`'s dict, one entry per row (failed rollouts: NaN, masked).

    Raises:
        ScoringError: more than `max_failure_fraction` of the rollouts failed.
        What `rollouts.run_rollouts` raises.
    """
    sampling = (
        {"temperature": float(trainer.temperature), "top_p": float(trainer.top_p)}
        if trainer_sampling
        else None
    )
    outcomes = rollouts.run_rollouts(
        rows,
        agent=agent,
        target=target,
        batch_timeout=batch_timeout,
        run_timeout=run_timeout,
        prompts=prompts,
        responses_create_params=sampling,
    )
    failures: dict[int, Failure] = {}
    output = rollout_output(outcomes, eos_token_id(trainer), failures)
    policy.guard(
        failures,
        len(rows),
        max_failure_fraction=settings.resolve(max_failure_fraction, settings.max_failure_fraction),
        where=where,
        what="rollouts",
        gives="reward NaN, completion masked",
    )
    return output


def create_nemo_gym_rollout_func(
    agent: str | None = None,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    row_column: str = "verify_extra",
    target: str | None = None,
    batch_timeout: float | None = None,
    run_timeout: float | None = None,
    trainer_sampling: bool = True,
    max_failure_fraction: float | None = None,
) -> RolloutFunc:
    """A TRL `rollout_func` that runs each prompt as one NeMo Gym rollout (see the module
    docstring for what TRL passes, the row lookup and the failure rules).

    Keyword settings left None take their environment variable (`client/settings.py`) at each call.

    Args:
        agent: the agent (or environment server) for rows without `agent_ref.name`.
        rows: keyword: dataset rows to look prompts up in (dicts with `prompt`); default the
            trainer's `train_dataset` and `eval_dataset`, read at the first call.
        row_column: keyword: the dataset column holding the NeMo Gym row.
        target: keyword: the bridge's gRPC target (`NEMO_GYM_GRPC_TARGET`; unset too = an
            embedded bridge over the head server).
        batch_timeout: keyword: gRPC deadline of one call's `RunStream`, seconds
            (`NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT`).
        run_timeout: keyword: seconds per rollout's `/run` (`NEMO_GYM_GRPC_RUN_TIMEOUT`).
        trainer_sampling: keyword: set `temperature` and `top_p` of every row's
            `responses_create_params` to the trainer's (`GRPOConfig.temperature`, `top_p`),
            so the agent's policy model samples as the trainer assumes. Default True.
        max_failure_fraction: keyword: raise `ScoringError` when more than this fraction of
            one call's rollouts failed (`NEMO_GYM_GRPC_MAX_FAILURE_FRACTION`).

    Returns:
        `rollout_func(prompts, trainer) -> dict` for `GRPOTrainer(rollout_func=...)`.

    Raises:
        ValueError: a keyword is out of range (at creation); at a call: a prompt matches no
            row (KeyError) or several different rows, a setting's env var is invalid.
        ScoringError: at a call: too many rollouts failed.
    """
    return _RolloutFunc(
        agent=agent,
        given=RowIndex(rows) if rows is not None else None,
        row_column=row_column,
        target=target,
        batch_timeout=settings.optional(settings.check_seconds, batch_timeout, "batch_timeout"),
        run_timeout=settings.optional(settings.check_seconds, run_timeout, "run_timeout"),
        trainer_sampling=trainer_sampling,
        max_failure_fraction=settings.optional(
            settings.check_fraction, max_failure_fraction, "max_failure_fraction"
        ),
    )


@dataclass
class _RolloutFunc:
    """What `create_nemo_gym_rollout_func` returns: its settings (None = the environment's,
    read at each call) and the row index of each trainer it served."""

    agent: str | None
    given: RowIndex | None
    row_column: str
    target: str | None
    batch_timeout: float | None
    run_timeout: float | None
    trainer_sampling: bool
    max_failure_fraction: float | None
    # id(trainer) -> (trainer, the index of its datasets)
    built: dict[int, tuple[Any, RowIndex]] = field(default_factory=dict)

    def index_for(self, trainer: Any) -> RowIndex:
        """The rows given, else the index of `trainer`'s datasets (built on first use)."""
        if self.given is not None:
            return self.given
        entry = self.built.get(id(trainer))
        if entry is None or entry[0] is not trainer:
            dataset_rows = [row for dataset in trainer_datasets(trainer) for row in dataset]
            entry = self.built[id(trainer)] = (trainer, RowIndex(dataset_rows))
        return entry[1]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """NeMo Gym rollouts for TRL's `prompts` (one per entry); see
        `create_nemo_gym_rollout_func`."""
        index = self.index_for(trainer)
        return run_rows(
            [nemo_gym_row(index.row(prompt), self.row_column) for prompt in prompts],
            prompts,
            trainer,
            agent=self.agent,
            target=self.target,
            batch_timeout=self.batch_timeout,
            run_timeout=self.run_timeout,
            trainer_sampling=self.trainer_sampling,
            max_failure_fraction=self.max_failure_fraction,
            where=f"rollout_func, {len(prompts)} prompts",
        )
