"""NeMo Gym rollouts as SkyRL trajectories: the fields of SkyRL's `GeneratorOutput` (skyrl 0.4.0,
skyrl/train/generators/base.py), from one `RunOutcome` per trajectory. Pure: no skyrl import,
no I/O.

A rollout becomes one sequence as for TRL (rewards/client/stitch.py): the first model call's
prompt ids, then the generated and observation tokens of every turn, the loss mask 1 on
generated tokens only, the policy's logprobs (0.0 on observation tokens). A rollout that failed
or was masked (`mask_sample`), or whose turns cannot be stitched, has no verdict, and GRPO must
not compare its group-mates with one: as SkyRL's own harbor generator does, every trajectory
of its group (same `TrajectoryID.instance_id`) gets a loss mask of zeros and reward 0.0, so
none of them trains and none enters an advantage baseline; its response is the EOS token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_gym_grpc.rewards.client.outcomes import Failure, RunOutcome
from nemo_gym_grpc.rewards.client.stitch import Sample, sample_of
from nemo_gym_grpc.rewards.trl.logs import failure_text

FAILED = "nemo_gym_failed"  # stop reason of a failed rollout
GROUP_FAILED = "nemo_gym_group_failed"  # of a rollout whose group-mate failed
STOPPED = "stop"


def trajectories(
    outcomes: Sequence[RunOutcome], groups: Sequence[str], eos: int
) -> dict[str, list[Any]]:
    """`GeneratorOutput` fields for `outcomes`, in order; `groups` holds each one's group
    (`TrajectoryID.instance_id`), `eos` the tokenizer's EOS id.

    Returns:
        {"prompt_token_ids", "response_ids", "rewards" (float per trajectory),
        "loss_masks", "stop_reasons", "rollout_logprobs", "errors" (None, or the failure's
        text, per trajectory; for the generator's metrics)}.

    Raises:
        ValueError: `groups` differs from `outcomes` in length.
    """
    if len(groups) != len(outcomes):
        raise ValueError(f"{len(groups)} groups for {len(outcomes)} rollouts")
    samples = [sample_of(outcome) for outcome in outcomes]
    failed = {group for group, s in zip(groups, samples, strict=True) if isinstance(s, Failure)}
    keys = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons")
    out: dict[str, list[Any]] = {key: [] for key in (*keys, "rollout_logprobs", "errors")}
    for outcome, sample, group in zip(outcomes, samples, groups, strict=True):
        if group in failed:
            prompt = sample.prompt_ids if isinstance(sample, Sample) else [eos]
            reason = FAILED if isinstance(sample, Failure) else GROUP_FAILED
            error = failure_text(sample) if isinstance(sample, Failure) else None
            row: tuple[Any, ...] = (prompt, [eos], 0.0, [0], reason, [0.0], error)
        else:
            assert isinstance(sample, Sample) and not isinstance(outcome, Failure)
            reward = float(outcome.rollout.reward)
            row = (sample.prompt_ids, sample.completion_ids, reward, sample.env_mask, STOPPED)
            row += (sample.logprobs, None)
        for key, value in zip(out, row, strict=True):
            out[key].append(value)
    return out
