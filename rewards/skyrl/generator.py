"""`NemoGymGenerator`: a SkyRL generator (skyrl 0.4 `GeneratorInterface`) whose trajectories are
whole NeMo Gym agent rollouts, all of a batch over one `RunStream` through the bridge
(docs/skyrl.md). Install it by overriding `BasePPOExp.get_generator`.

Each trajectory's row comes in its `env_extras` as for `NemoGymEnv` (`nemo_gym_row`); the agent
is the row's `agent_ref.name`, else the generator's `agent`. The agents' policy model is NeMo
Gym's: point its model server at SkyRL's inference endpoint
(`inference_engine_client.get_endpoint_url()`) in the NeMo Gym config. SkyRL's sampling
params `temperature` and `top_p`, and `max_tokens` as `max_output_tokens`, go into each
rollout's `responses_create_params`. Token ids, loss masks, logprobs and the masking of a
failed rollout's group: trajectories.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from nemo_gym_grpc.rewards.client.rollouts import arun_rollouts
from nemo_gym_grpc.rewards.skyrl.trajectories import trajectories

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_output_tokens"}


class NemoGymGenerator(GeneratorInterface):
    """Trajectories as NeMo Gym rollouts (module docstring).

    Args:
        tokenizer: the policy's tokenizer (its `eos_token_id` is a failed trajectory's
            response).
        agent: keyword: the agent for rows without `agent_ref.name`.
        target: keyword: the bridge (default `NEMO_GYM_GRPC_TARGET`, else an embedded one).
        run_timeout, batch_timeout: keyword: seconds per rollout and per batch
            (`run_rollouts`'s).

    Raises:
        ValueError: the tokenizer has no integer `eos_token_id`.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        agent: str | None = None,
        target: str | None = None,
        run_timeout: float | None = None,
        batch_timeout: float | None = None,
    ) -> None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ValueError("the tokenizer has no eos_token_id (a failed rollout needs one)")
        self.eos, self.agent, self.target = eos, agent, target
        self.run_timeout, self.batch_timeout = run_timeout, batch_timeout

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        """Run the batch's rollouts; their trajectories in input order.

        Raises:
            ValueError: a trajectory's extras lack `nemo_gym_row`.
        """
        rows = [_row(extras) for extras in input_batch.get("env_extras") or []]
        ids = input_batch.get("trajectory_ids")
        groups = [t.instance_id for t in ids] if ids else [str(k) for k in range(len(rows))]
        sampling = input_batch.get("sampling_params") or {}
        params = {
            to: sampling[key] for key, to in SAMPLING.items() if sampling.get(key) is not None
        }
        outcomes = await arun_rollouts(
            rows,
            agent=self.agent,
            target=self.target,
            run_timeout=self.run_timeout,
            batch_timeout=self.batch_timeout,
            responses_create_params=params or None,
        )
        fields = trajectories(outcomes, groups, self.eos)
        errors = fields.pop("errors")
        failed = sum(error is not None for error in errors)
        masked = sum(mask == [0] for mask in fields["loss_masks"])
        metrics = {
            "nemo_gym/failed_fraction": failed / max(len(errors), 1),
            "nemo_gym/masked_fraction": masked / max(len(errors), 1),
        }
        return GeneratorOutput(
            **fields,
            rollout_metrics=metrics,
            trajectory_ids=ids,
            **dict.fromkeys(_UNUSED),
        )


# GeneratorOutput fields a NeMo Gym rollout does not fill (None, as SkyRL's own generators
# leave them when they have none).
_UNUSED = (
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "rollout_sample_support",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
)


def _row(extras: Mapping[str, Any]) -> dict[str, Any]:
    row = extras.get("nemo_gym_row")
    if isinstance(row, str):
        row = json.loads(row)
    if not isinstance(row, Mapping):
        raise ValueError("each trajectory's env_extras needs nemo_gym_row (a NeMo Gym row)")
    return dict(row)
