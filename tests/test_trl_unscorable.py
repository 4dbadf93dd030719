"""`nemo_gym_reward_funcs`: NeMo Gym's reward function beside others, called as TRL's
`GRPOTrainer._calculate_rewards` calls them (every function with the same keyword arguments and
the same `completions` list; sync ones first, in list order, then the async ones together on
another thread's event loop). The NeMo Gym functions here are plain functions with the shapes
ours return (None for a failed item); the real trainer and bridge: tests/test_trl_multireward.py.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest

from nemo_gym_grpc.rewards import nemo_gym_reward_funcs, reward_env

COMPLETIONS = ["\\boxed{B}", "answer", "\\boxed{E}", "\\boxed{B}"]
VERDICTS = [1.0, None, 0.0, math.nan]  # items 1 and 3 failed


def format_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 if "\\boxed{" in text else 0.0 for text in completions]


async def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0)
    return [float(len(text)) for text in completions]


class Counted:
    """A NeMo Gym stand-in: VERDICTS for each batch, its calls counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.__name__ = "reward_nemo_gym_verify"

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        self.calls += 1
        return list(VERDICTS)


def as_trl_calls(funcs: list, completions: list[str], **columns: Any) -> list[list]:
    """Each function's values for one batch, called as TRL 1.16 calls them."""
    kwargs = {"prompts": ["p"] * len(completions), "completions": completions, **columns}
    values: dict[int, list] = {}
    for i, func in enumerate(funcs):
        if not asyncio.iscoroutinefunction(func):
            values[i] = func(**kwargs)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        for i, func in enumerate(funcs):
            if asyncio.iscoroutinefunction(func):
                values[i] = asyncio.run_coroutine_threadsafe(func(**kwargs), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    return [values[i] for i in range(len(funcs))]


def nan_to_none(values: list) -> list:
    return [None if v is None or math.isnan(v) else v for v in values]


def test_a_failed_item_is_none_in_every_column_and_nemo_gym_runs_once_per_batch():
    nemo = Counted()
    funcs = nemo_gym_reward_funcs(nemo, format_reward, length_reward)
    assert [f.__name__ for f in funcs] == [
        "reward_nemo_gym_verify",
        "format_reward",
        "length_reward",
    ]
    assert asyncio.iscoroutinefunction(funcs[2]) and not asyncio.iscoroutinefunction(funcs[1])
    ours, formats, lengths = as_trl_calls(funcs, COMPLETIONS)
    assert nan_to_none(ours) == [1.0, None, 0.0, None]
    assert formats == [1.0, None, 1.0, None]
    assert lengths == [9.0, None, 9.0, None]
    assert nemo.calls == 1
    as_trl_calls(funcs, list(COMPLETIONS))  # a new batch (a new list) is scored again
    assert nemo.calls == 2


def test_the_order_of_the_list_does_not_matter():
    nemo = Counted()
    ours, formats = nemo_gym_reward_funcs(nemo, format_reward)
    formats_first = as_trl_calls([formats, ours], COMPLETIONS)
    assert formats_first[0] == [1.0, None, 1.0, None]
    assert nemo.calls == 1


def test_an_async_nemo_gym_function_runs_on_a_loop_of_its_own():
    async def reward_nemo_gym_verify_async(completions: list[str], **kwargs: Any) -> list:
        await asyncio.sleep(0)
        return list(VERDICTS)

    funcs = nemo_gym_reward_funcs(reward_nemo_gym_verify_async, length_reward)
    assert not asyncio.iscoroutinefunction(funcs[0])
    ours, lengths = as_trl_calls(funcs, COMPLETIONS)
    assert nan_to_none(ours) == [1.0, None, 0.0, None]
    assert lengths == [9.0, None, 9.0, None]


def test_on_the_rollout_func_path_a_failed_rollout_masks_the_other_columns():
    # reward_env reads the rollouts' env_reward column (None for a failed rollout)
    funcs = nemo_gym_reward_funcs(reward_env, format_reward)
    ours, formats = as_trl_calls(funcs, COMPLETIONS, env_reward=[0.5, None, 1.0, 0.0])
    assert ours == [0.5, None, 1.0, 0.0]
    assert formats == [1.0, None, 1.0, 1.0]


def test_a_function_that_returns_the_wrong_count_is_an_error_and_one_alone_is_refused():
    funcs = nemo_gym_reward_funcs(Counted(), lambda completions, **kw: [1.0])
    with pytest.raises(ValueError, match="1 rewards for 4 NeMo Gym verdicts"):
        as_trl_calls(funcs, COMPLETIONS)
    with pytest.raises(ValueError, match="at least one other"):
        nemo_gym_reward_funcs(Counted())
