"""verl: `compute_score` for `reward.custom_reward_function`, scoring with NeMo Gym `/verify`.

verl config (Hydra overrides; verl 0.9.1):

    reward.custom_reward_function.path=pkg://nemo_gym_grpc.rewards.verl
    reward.custom_reward_function.name=compute_score

verl's reward loop calls it once per sample, for all samples at once
(`NaiveRewardManager.run_single`, awaited since it is a coroutine function); the samples
awaited together go to the bridge as one `VerifyStream` call (`stacks.score_one`), each judged
alone. `verl_manager.py`'s reward manager does the same with a batch failure guard.

Data mapping (what `nemo-gym-grpc export --format verl` writes): `extra_info` carries
`resources_server` (the resources server name) and `nemo_gym_row` (the NeMo Gym row as JSON
text); `data_source` is the server name too and is the fallback when `extra_info` has none.
`ground_truth` is not read (the row's own fields, e.g. `expected_answer`, are what `/verify`
reads). `solution_str` is the completion.

Failure policy (`stacks.py`): by default a failed item raises `ScoringError`; with
`NEMO_GYM_GRPC_ON_ERROR=zero` (or `none`) it gives score 0.0 (or NaN) and
`scoring_failed=1.0`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_gym_grpc.rewards import stacks
from nemo_gym_grpc.rewards.client.outcomes import Failure, Outcome

# The keys of every result: verl's reward loop builds `reward_extra_info` arrays from the first
# sample's keys, so every sample must have the same ones (and numbers, for its metrics).
RESULT_KEYS = ("score", "scoring_failed")


def verl_item(
    data_source: Any, solution_str: str, extra_info: Mapping[str, Any] | None
) -> stacks.StackItem:
    """The `StackItem` of one verl sample (the data mapping in the module docstring).

    Raises:
        ValueError: `extra_info["nemo_gym_row"]` is text that is not a JSON object.
    """
    server, row = stacks.nemo_gym_fields(extra_info or {}, "extra_info")
    if not server and isinstance(data_source, str):
        server = data_source
    return stacks.StackItem(server=server, completion=solution_str, row=row)


def verl_results(outcomes: list[Outcome], *, where: str) -> list[dict[str, float]]:
    """One verl result dict (`RESULT_KEYS`) per outcome under the failure policy.

    Raises:
        ScoringError: as `stacks.stack_rewards`.
    """
    scores = stacks.stack_rewards(outcomes, where=where)
    return [
        {"score": score, "scoring_failed": float(isinstance(outcome, Failure))}
        for score, outcome in zip(scores, outcomes, strict=True)
    ]


async def compute_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """verl's `compute_score` hook: one sample's NeMo Gym `/verify` reward.

    Args:
        data_source: the dataset's `data_source` (the resources server name, as exported).
        solution_str: the decoded response (the completion).
        ground_truth: `reward_model.ground_truth`; not read (the row carries the answer).
        extra_info: the dataset's `extra_info` (`resources_server`, `nemo_gym_row`), plus
            what verl adds (`num_turns`, ...), ignored.
        **kwargs: verl's other arguments (`reward_kwargs`, reward router), ignored.

    Returns:
        {"score": reward, "scoring_failed": 0.0}, or for a failed item under
        `NEMO_GYM_GRPC_ON_ERROR=zero|none` {"score": 0.0 or NaN, "scoring_failed": 1.0}.
        verl puts "score" into the reward tensor and both keys into `reward_extra_info`.

    Raises:
        ScoringError: the item failed and `NEMO_GYM_GRPC_ON_ERROR` is unset or `raise`.
        ValueError: `extra_info["nemo_gym_row"]` is not JSON, or an env var is invalid.
    """
    item = verl_item(data_source, solution_str, extra_info)
    outcome = await stacks.score_one(item)
    return verl_results([outcome], where=f"verl compute_score, {item.server or 'no server'}")[0]
