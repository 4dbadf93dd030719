"""slime (THUDM): custom reward functions scoring with NeMo Gym `/verify`.

slime is not on PyPI (the PyPI package `slime` is an unrelated statistics library), so these
follow slime's documented hooks (`slime/rollout/rm_hub/__init__.py`: `async_rm` awaits
`fn(args, sample, **kwargs)`; `batched_async_rm` awaits `fn(args, samples, **kwargs)` when
`--group-rm` is set) and read only the `Sample` fields `response`, `prompt` and `metadata`.

slime flags, one sample per call:

    --custom-rm-path nemo_gym_grpc.rewards.slime.reward

or a whole group per call (one `VerifyStream` per group):

    --group-rm --custom-rm-path nemo_gym_grpc.rewards.slime.group_reward

with the data `nemo-gym-grpc export --format slime` writes:
`--input-key prompt --label-key label --metadata-key metadata --apply-chat-template`.

Data mapping: `sample.metadata` carries `resources_server` and `nemo_gym_row` (the NeMo Gym
row, a dict; JSON text is accepted too); `sample.label` (the row's `expected_answer`) is not
read. Failure policy: `stacks.py` (default: a failed item raises `ScoringError`; with
`NEMO_GYM_GRPC_ON_ERROR=zero|none` 0.0 or NaN). A failed item's `sample.metadata` (when it
is a dict) also gets `scoring_failed` = 1.0 and `scoring_failure` = its cause; a scored one
`scoring_failed` = 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_gym_grpc.rewards import stacks
from nemo_gym_grpc.rewards.client.outcomes import Outcome


def slime_item(sample: Any) -> stacks.StackItem:
    """The `StackItem` of one slime `Sample` (`response`, `prompt`, `metadata`).

    Raises:
        ValueError: `metadata` is text that is not a JSON object, or its row is neither a
            dict nor the JSON text of one (the message names the field).
    """
    server, row = stacks.nemo_gym_fields(getattr(sample, "metadata", None), "sample.metadata")
    response = getattr(sample, "response", "")
    return stacks.StackItem(
        server=server,
        completion=response if isinstance(response, str) else str(response),
        row=row,
        prompt=getattr(sample, "prompt", None),
    )


def _flag(samples: Sequence[Any], outcomes: Sequence[Outcome]) -> None:
    for sample, outcome in zip(samples, outcomes, strict=True):
        metadata = getattr(sample, "metadata", None)
        if isinstance(metadata, dict):
            cause = stacks.failure_cause(outcome)
            metadata["scoring_failed"] = float(bool(cause))
            if cause:
                metadata["scoring_failure"] = cause


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """slime's one-sample hook (`--custom-rm-path nemo_gym_grpc.rewards.slime.reward`).

    Args:
        args: slime's parsed arguments; not read (settings come from `NEMO_GYM_GRPC_*`).
        sample: a slime `Sample` (the data mapping in the module docstring).
        **kwargs: slime's other arguments, ignored.

    Returns:
        The reward; for a failed item under `NEMO_GYM_GRPC_ON_ERROR=zero|none`, 0.0 or NaN.

    Raises:
        ScoringError: the item failed and `NEMO_GYM_GRPC_ON_ERROR` is unset or `raise`.
    """
    item = slime_item(sample)
    outcomes = [await stacks.score_one(item)]  # with the samples slime scores alongside
    _flag([sample], outcomes)
    return stacks.stack_rewards(outcomes, where=f"slime reward, {item.server or 'no server'}")[0]


async def group_reward(args: Any, samples: Sequence[Any], **kwargs: Any) -> list[float]:
    """slime's `--group-rm` hook: every sample of the group in one `VerifyStream` call.

    Arguments, per-item results and errors: as `reward`; one float per sample, in order.
    The call also raises `ScoringError` when more than `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION`
    (default 0.5) of its samples failed.
    """
    outcomes = await stacks.score_items_async([slime_item(sample) for sample in samples])
    _flag(samples, outcomes)
    return stacks.stack_rewards(outcomes, where=f"slime group_reward, {len(samples)} samples")
