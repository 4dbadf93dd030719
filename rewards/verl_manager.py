"""verl: a reward manager that scores the samples verl's reward loop has in flight together.

verl 0.9.1's reward loop (`RewardLoopWorker.compute_score_batch`, and the agent loop's
streaming reward) calls `run_single` once per sample, concurrently. `NemoGymRewardManager` is
verl's own `NaiveRewardManager` (decoding, `extra_info`, result handling unchanged) whose
`compute_score` queues the sample and sends every sample queued within `window_seconds` of the
first as one `VerifyStream` call (`stacks.score_items_async`). Needs verl installed.

verl config (Hydra overrides):

    reward.reward_manager.source=importlib
    reward.reward_manager.module.path=pkg://nemo_gym_grpc.rewards.verl_manager
    reward.reward_manager.name=NemoGymRewardManager

Also registered as "nemo_gym" (`reward.reward_manager.name=nemo_gym`) once this module is
imported in the reward worker. Data mapping and results: `verl.py`. Failure policy: `stacks.py`;
a queued batch of several samples also has the `max_failure_fraction` guard, and when the batch
raises, every sample in it raises.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from nemo_gym_grpc.rewards import stacks
from nemo_gym_grpc.rewards.verl import verl_item, verl_results

_Waiter = tuple[stacks.StackItem, "asyncio.Future[dict[str, float]]"]


@register("nemo_gym")
class NemoGymRewardManager(NaiveRewardManager):  # verl: untyped (pyproject mypy override)
    """`NaiveRewardManager` scoring queued samples as one NeMo Gym `VerifyStream` call.

    Attributes:
        window_seconds: how long the first queued sample waits for others (default 0.02 s:
            verl decodes the batch's responses in a thread pool first, so they arrive spread
            out); a batch is also sent as soon as it holds `max_batch` samples.
        max_batch: most samples per call (default 1024).

    The constructor takes verl's arguments (`config`, `tokenizer`, `compute_score` (ignored:
    scoring is NeMo Gym's), `reward_router_address`, `reward_model_tokenizer`).
    """

    window_seconds = 0.02
    max_batch = 1024

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None, **kwargs: Any):
        super().__init__(config, tokenizer, self._queued_score, **kwargs)
        self._pending: list[_Waiter] = []
        self._flush: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()  # referenced until done

    async def _queued_score(
        self,
        data_source: Any,
        solution_str: str,
        ground_truth: Any = None,
        extra_info: Any = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        """verl's `compute_score` arguments (see `verl.compute_score`); the same result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, float]] = loop.create_future()
        self._pending.append((verl_item(data_source, solution_str, extra_info), future))
        if len(self._pending) >= self.max_batch:
            self._send(loop)
        elif self._flush is None:
            self._flush = loop.call_later(self.window_seconds, self._send, loop)
        return await future

    def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        waiters, self._pending = self._pending, []
        if waiters:
            task = loop.create_task(self._score(waiters))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _score(self, waiters: list[_Waiter]) -> None:
        try:
            outcomes = await stacks.score_items_async([item for item, _ in waiters])
            results = verl_results(outcomes, where=f"verl NemoGymRewardManager, {len(waiters)}")
        except Exception as exc:  # every sample of the batch gets the batch's error
            for _, future in waiters:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(waiters, results, strict=True):
            if not future.done():
                future.set_result(result)
