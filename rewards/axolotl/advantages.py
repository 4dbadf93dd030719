"""A failed item trains in no group baseline, in the GRPO trainers axolotl 0.21 runs.

A completion whose NeMo Gym reward is NaN (its `/verify` or rollout failed: None from our
reward function) has no verdict, and GRPO must not compare its group-mates with one:

- **Every trainer** (`install`, on `_calculate_rewards`, and `_collect_reward_workers` where
  the trainer has it): such a completion becomes NaN in every reward column (`unscorable`).
  Without that, TRL sums the other reward functions' values (`nansum`), so the missing NeMo
  Gym reward would count as 0.0 in the sum its group-mates are compared with.
- **TRL's `GRPOTrainer`** (single-turn: axolotl's `AxolotlGRPOTrainer`, TRL 1.14.1 there):
  a completion NaN in every column is unscorable since TRL 1.6 (`unscorable_mask` in
  `_generate_and_score_completions`): out of the nan-aware group mean and std, advantage 0.
  Nothing more to do; an older TRL is refused (`MIN_TRL`).
- **axolotl's async GRPO trainer** (the data producer, multi-turn; `AsyncGRPOTrainer` in
  axolotl/core/trainers/grpo/async_trainer.py): it sums rewards with `nansum` and takes the
  plain group mean and std, so an unscorable completion counted as 0.0 there. Its
  `_post_advantage_hook` (axolotl's hook, called right after it set `data["advantages"]`) is
  wrapped: the advantages are computed again over the scored completions only
  (`scored_advantages`, TRL's nan-aware rule) and written over axolotl's before its own hook
  (replay buffer) runs; the logged `reward` / `reward_std` of that batch are those of the
  scored completions too, as TRL logs them.
- A trainer that computes advantages in code of its own (axolotl's context-parallel
  `AxolotlGRPOContextParallelTrainer`, `nansum` and no hook) is refused: a failed item would
  train as 0.0 there.

Methods are wrapped on the trainer instance (axolotl's installed code is not changed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch
from trl.trainer.utils import nanstd

from nemo_gym_grpc.rewards.axolotl.wiring import NAME

# The TRL release whose GRPOTrainer leaves a completion NaN in every reward column out of the
# group baseline with advantage 0 (huggingface/trl#5902, in v1.6.0).
MIN_TRL = (1, 6)
EPSILON = 1e-4  # added to the std before dividing, as TRL and axolotl do
REWARD_METHODS = ("_calculate_rewards", "_collect_reward_workers")
SCORING_METHODS = ("_compute_deferred_scores", "_compute_streaming_group_scores")


def unscorable(rewards_per_func: torch.Tensor, column: int) -> torch.Tensor:
    """`rewards_per_func` (completions x reward functions) with every row whose `column` is
    NaN made NaN in every column (a new tensor; the input is not changed)."""
    failed = torch.isnan(rewards_per_func[:, column])
    if not bool(failed.any()):
        return rewards_per_func
    out = rewards_per_func.clone()
    out[failed] = torch.nan
    return out


def scored_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's weighted reward sum (NaN-skipping), NaN for a completion NaN in
    every column; shape (completions,)."""
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def scored_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: str | bool = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """GRPO advantages computed over the scored completions only (TRL >= 1.6's rule).

    Args:
        rewards_per_func: (completions, reward functions), each group's `num_generations`
            completions consecutive; a row NaN in every column is unscorable.
        weights: (reward functions,) the trainer's `reward_weights`.
        scale_rewards: "group" (divide by the group's std), "batch" (by the batch's) or
            "none" (the trainer's `scale_rewards`; True and False as TRL reads them).
        aggregation: the trainer's `multi_objective_aggregation`: "sum_then_normalize"
            (weighted sum, then each group's mean and std) or "normalize_then_sum" (each
            function normalized in its group, then summed and normalized over the batch).

    Returns:
        (completions,) advantages: 0.0 for an unscorable completion; a scored one's
        computed from its group's scored completions (the mean and the unbiased std of
        those; a group with one scored completion gives it 0.0).

    Raises:
        ValueError: an unknown `scale_rewards` or `aggregation`.
    """
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    if aggregation == "sum_then_normalize":
        rewards = scored_rewards(rewards_per_func, weights)
        grouped = rewards.view(-1, num_generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards)
        elif scale_rewards in ("group", "none"):
            std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
        else:
            raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + EPSILON)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        normalized = ((grouped - mean_k) / (std_k + EPSILON)).view_as(rewards_per_func)
        rewards = scored_rewards(normalized, weights)
        advantages = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + EPSILON)
    else:
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def trl_version() -> tuple[int, int]:
    """The installed TRL's (major, minor)."""
    major, minor = metadata.version("trl").split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_trainer(trainer: Any) -> None:
    """Refuse a trainer in which a failed item would train as 0.0 (see the module docstring).

    Raises:
        ValueError: TRL older than MIN_TRL, or a trainer whose advantages are computed by an
            override of `_generate_and_score_completions` without the async trainer's hook.
    """
    from trl import GRPOTrainer

    if trl_version() < MIN_TRL:
        raise ValueError(
            f"TRL {metadata.version('trl')} counts a completion without a reward as 0.0 in "
            f"its group's baseline; the NeMo Gym plugin needs TRL >= {'.'.join(map(str, MIN_TRL))}"
        )
    own = type(trainer)._generate_and_score_completions
    if own is not GRPOTrainer._generate_and_score_completions and not hasattr(
        trainer, "_post_advantage_hook"
    ):
        raise ValueError(
            f"{type(trainer).__name__} computes GRPO advantages in code of its own, where a "
            "failed NeMo Gym item would train as 0.0 (axolotl's context-parallel GRPO trainer "
            "does: context_parallel_size > 1); the NeMo Gym plugin does not support it"
        )


def install(trainer: Any) -> None:
    """Wrap `trainer`'s methods as the module docstring says (after `check_trainer`)."""
    check_trainer(trainer)
    for name in REWARD_METHODS:
        if hasattr(trainer, name):
            setattr(trainer, name, _nan_rows(trainer, getattr(trainer, name)))
    if hasattr(trainer, "_post_advantage_hook"):
        logged: list[torch.Tensor] = []
        trainer._post_advantage_hook = _rescored(trainer, trainer._post_advantage_hook, logged)
        for name in SCORING_METHODS:
            if hasattr(trainer, name):
                setattr(trainer, name, _logging_scored(trainer, getattr(trainer, name), logged))


def _nan_rows(trainer: Any, method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(method)
    def rewards(*args: Any, **kwargs: Any) -> torch.Tensor:
        return unscorable(method(*args, **kwargs), trainer.reward_func_names.index(NAME))

    return rewards


def _rescored(trainer: Any, hook: Callable[..., None], logged: list[torch.Tensor]) -> Any:
    """axolotl's `_post_advantage_hook` after the advantages are made those over the scored
    completions (in `advantages`, the local part, and in `data["advantages"]`)."""

    @functools.wraps(hook)
    def rescored(
        data: dict[str, Any],
        rewards_per_func: torch.Tensor,
        advantages: torch.Tensor,
        inputs: list[Any],
        num_generations: int,
        mode: str,
        s_start: int | None = None,
        s_end: int | None = None,
        is_last_chunk: bool = True,
    ) -> None:
        fixed = scored_advantages(
            rewards_per_func,
            trainer.reward_weights,
            num_generations,
            scale_rewards=trainer.scale_rewards,
            aggregation=trainer.multi_objective_aggregation,
        )
        count = advantages.size(0)  # this process's completions (the hook gets its slice)
        first = trainer.accelerator.process_index * count if fixed.size(0) > count else 0
        local = fixed[first : first + count].to(advantages.device, advantages.dtype)
        advantages.copy_(local)
        start = s_start or 0
        data["advantages"][start : start + count] = local
        logged.append(scored_rewards(rewards_per_func, trainer.reward_weights))
        hook(
            data,
            rewards_per_func,
            advantages,
            inputs,
            num_generations,
            mode,
            s_start=s_start,
            s_end=s_end,
            is_last_chunk=is_last_chunk,
        )

    return rescored


def _logging_scored(trainer: Any, method: Callable[..., Any], logged: list[torch.Tensor]) -> Any:
    """A scoring method of axolotl's async trainer whose last logged `reward` and
    `reward_std` are made those of the scored completions (nanmean, nanstd)."""

    @functools.wraps(method)
    def scored(*args: Any, **kwargs: Any) -> Any:
        logged.clear()
        result = method(*args, **kwargs)
        metrics = trainer._metrics["train"]
        if logged and metrics.get("reward"):
            rewards = logged[-1]
            metrics["reward"][-1] = torch.nanmean(rewards).item()
            metrics["reward_std"][-1] = nanstd(rewards).item()
        return result

    return scored
