"""NeMo Gym's reward beside other reward functions in TRL: a completion NeMo Gym could not score
is unscorable in every column, so it trains nothing and its group-mates are compared with each
other only.

TRL's `GRPOTrainer` (>= 1.6) leaves a completion out of its group's mean and std, with
advantage 0, only when *every* reward function returned None for it (`unscorable_mask`). Beside
a format or length reward, a failed NeMo Gym item (None: its `/verify` or rollout failed) still
has the other functions' values, which TRL sums with `nansum`: against its group-mates it would
train as if NeMo Gym had said 0.0. `nemo_gym_reward_funcs` wraps the functions so that the
others return None wherever NeMo Gym's returned None (or NaN) for the same completion:

    trainer = GRPOTrainer(..., reward_funcs=nemo_gym_reward_funcs(reward_nemo_gym_verify,
                                                                  format_reward))

How: TRL calls every reward function of one batch with the same `completions` list (the sync
ones in list order, then the async ones together on its event loop). The first wrapped function
called for a batch runs NeMo Gym's function, once; the result is kept with that list until the
next batch, and every wrapped function returns its own values with None where NeMo Gym failed.
The order of the list does not matter, and each function keeps its name (TRL's column).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

RewardFunc = Callable[..., Any]  # TRL's reward function: (completions, prompts, **kwargs)


def nemo_gym_reward_funcs(nemo_gym: RewardFunc, *others: RewardFunc) -> list[RewardFunc]:
    """TRL's `reward_funcs`: `nemo_gym` (e.g. `reward_nemo_gym_verify`, its `_async` form, a
    `create_nemo_gym_reward_fn` function, or `reward_env` on the `rollout_func` path) first,
    then `others`, each wrapped as the module docstring says. A wrapped function is async when
    the function it wraps is, except NeMo Gym's, which is sync either way (its async form runs
    on an event loop of its own, in a worker thread).

    Raises:
        ValueError: no other function (nothing to wrap: pass `nemo_gym` to TRL as it is).
    """
    if not others:
        raise ValueError("nemo_gym_reward_funcs needs at least one other reward function")
    shared = _Verdicts(nemo_gym)
    return [_nemo_gym(nemo_gym, shared), *(_masked(func, shared) for func in others)]


def failed(value: Any) -> bool:
    """A reward function's value for a completion it could not score: None or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def masked(values: Sequence[Any], verdicts: Sequence[Any]) -> list[Any]:
    """`values` with None wherever `verdicts` (NeMo Gym's, same order) failed.

    Raises:
        ValueError: the two differ in length (a reward function returned the wrong count).
    """
    if len(values) != len(verdicts):
        raise ValueError(f"{len(values)} rewards for {len(verdicts)} NeMo Gym verdicts")
    return [None if failed(v) else value for value, v in zip(values, verdicts, strict=True)]


class _Verdicts:
    """NeMo Gym's values for the latest batch (its `completions` list), computed once."""

    def __init__(self, func: RewardFunc) -> None:
        self._func = func
        self._lock = threading.Lock()
        self._batch: object = None  # the completions list the values belong to (kept alive)
        self._values: list[Any] = []

    def of(self, kwargs: dict[str, Any]) -> list[Any]:
        """NeMo Gym's values for the batch of `kwargs` (the reward functions' arguments)."""
        with self._lock:
            if self._batch is not kwargs["completions"]:
                self._values = list(_call(self._func, kwargs))
                self._batch = kwargs["completions"]
            return self._values


def _call(func: RewardFunc, kwargs: dict[str, Any]) -> Any:
    """`func(**kwargs)`; an async `func` runs to its end on a new event loop in a worker thread
    (the caller may be on TRL's running loop)."""
    if not inspect.iscoroutinefunction(func):
        return func(**kwargs)
    with ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-verdicts") as pool:
        return pool.submit(asyncio.run, func(**kwargs)).result()


def _nemo_gym(func: RewardFunc, shared: _Verdicts) -> RewardFunc:
    @functools.wraps(func)
    def reward(completions: Sequence[Any], prompts: Any = None, **kwargs: Any) -> list[Any]:
        return list(shared.of({"completions": completions, "prompts": prompts, **kwargs}))

    return reward


def _masked(func: RewardFunc, shared: _Verdicts) -> RewardFunc:
    if inspect.iscoroutinefunction(func):
        run: Callable[..., Awaitable[Any]] = func

        @functools.wraps(func)
        async def reward_async(completions: Sequence[Any], prompts: Any = None, **kw: Any) -> Any:
            values = await run(completions=completions, prompts=prompts, **kw)
            return masked(values, shared.of({"completions": completions, "prompts": prompts, **kw}))

        return reward_async

    @functools.wraps(func)
    def reward(completions: Sequence[Any], prompts: Any = None, **kwargs: Any) -> list[Any]:
        values = func(completions=completions, prompts=prompts, **kwargs)
        return masked(values, shared.of({"completions": completions, "prompts": prompts, **kwargs}))

    return reward
