"""verl: a reward manager that scores the samples verl's reward loop has in flight together.

verl 0.9.1's reward loop (`RewardLoopWorker.compute_score_batch`, and the agent loop's
streaming reward) calls `run_single` once per sample, concurrently. `NemoGymRewardManager` is
verl's own `NaiveRewardManager` (decoding, `extra_info`, result handling unchanged) whose
`compute_score` queues the sample and sends the samples queued together as one `VerifyStream`
call (`stacks.Coalescer`), then judges them as one batch: the `max_failure_fraction` guard
applies to the batch, and when the batch raises, every sample in it raises. (verl's
`compute_score` of `verl.py` batches the same way but judges each sample alone.) Needs verl.

verl config (Hydra overrides):

    reward.reward_manager.source=importlib
    reward.reward_manager.module.path=pkg://nemo_gym_grpc.rewards.verl_manager
    reward.reward_manager.name=NemoGymRewardManager

Also registered as "nemo_gym" (`reward.reward_manager.name=nemo_gym`) once this module is
imported in the reward worker. Data mapping and results: `verl.py`. Failure policy: `stacks.py`.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from nemo_gym_grpc.rewards import stacks
from nemo_gym_grpc.rewards.client.outcomes import Outcome
from nemo_gym_grpc.rewards.verl import verl_item, verl_results


@register("nemo_gym")
class NemoGymRewardManager(NaiveRewardManager):  # verl: untyped (pyproject mypy override)
    """`NaiveRewardManager` scoring queued samples as one NeMo Gym `VerifyStream` call.

    Attributes:
        window_seconds: how long the first queued sample waits for others (default 0.02 s:
            verl decodes the responses in a thread pool first, so they arrive spread out);
            a batch is also sent as soon as it holds `max_batch` samples (default 1024).

    The constructor takes verl's arguments (`config`, `tokenizer`, `compute_score` (ignored:
    scoring is NeMo Gym's), `reward_router_address`, `reward_model_tokenizer`).
    """

    window_seconds = 0.02
    max_batch = 1024

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None, **kwargs: Any):
        super().__init__(config, tokenizer, self._queued_score, **kwargs)
        self._queue = stacks.Coalescer(self.window_seconds, self.max_batch, self._check)

    @staticmethod
    def _check(outcomes: list[Outcome]) -> None:
        stacks.stack_rewards(outcomes, where=f"verl NemoGymRewardManager, {len(outcomes)}")

    async def _queued_score(
        self,
        data_source: Any,
        solution_str: str,
        ground_truth: Any = None,
        extra_info: Any = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        """verl's `compute_score` arguments (see `verl.compute_score`); the same result."""
        outcome = await self._queue.outcome(verl_item(data_source, solution_str, extra_info))
        # the batch passed _check, so this one item's result is what the batch gave it
        return verl_results([outcome], where="verl NemoGymRewardManager")[0]
