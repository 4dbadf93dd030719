"""`NemoGymDataProducer`: axolotl's data producer whose rollouts run over the bridge's RunStream.

axolotl's async GRPO trainer (`use_data_producer`, optionally `async_prefetch`) asks its data
producer for each batch (`produce`). This one takes the next batch of dataset rows from the
prompt dataloader axolotl built (`GRPODataProducer`: `num_generations` consecutive copies of
each row, one rollout each), runs them as NeMo Gym rollouts with `trl.rollout_func.run_rows` (the
code `create_nemo_gym_rollout_func` runs: one `RunStream` for the batch, tokens stitched
across turns, failed or masked rollouts NaN) and hands back the batch `batch.rollout_data`
builds, which axolotl's trainer scores on its main thread. Each row is routed by its own
`agent_ref.name`; a row without one, or naming an agent the bridge does not know, fails
(INVALID_ARGUMENT or NOT_FOUND: NaN and masked), where axolotl's producer sent it to the first
agent it had discovered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from axolotl.core.trainers.grpo.async_trainer import GRPODataProducer, RolloutDataset

from nemo_gym_grpc.rewards.axolotl.batch import rollout_data
from nemo_gym_grpc.rewards.trl.rollout_func import run_rows
from nemo_gym_grpc.rewards.trl.rows import nemo_gym_row

# The dataset column of axolotl's NeMo Gym dataset loader that holds the whole NeMo Gym row.
ROW_COLUMN = "verify_extra"


@dataclass(frozen=True)
class RolloutSettings:
    """How the producer runs rollouts.

    Attributes:
        target: the bridge's gRPC target.
        run_timeout: seconds per rollout's `/run` (`nemo_gym_run_timeout`).
        max_output_tokens: set in a row's `responses_create_params` when it has none (the
            trainer's `max_completion_length`, as axolotl's producer does).
    """

    target: str
    run_timeout: float
    max_output_tokens: int | None = None


class NemoGymDataProducer(GRPODataProducer):
    """axolotl's `GRPODataProducer` (same constructor, plus keyword `rollouts`) producing
    NeMo Gym rollouts through the bridge (see the module docstring)."""

    _prompt_dl: Any  # axolotl's prompt DataLoader and its iterator (GRPODataProducer)
    _prompt_iter: Any

    def __init__(self, *args: Any, rollouts: RolloutSettings, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rollouts = rollouts

    def _next_inputs(self) -> list[dict[str, Any]]:
        if self._prompt_dl is None:
            self._init_prompt_dataloader()
        try:
            return list(next(self._prompt_iter))
        except StopIteration:
            self._prompt_iter = iter(self._prompt_dl)
            return list(next(self._prompt_iter))

    def _row(self, dataset_row: Mapping[str, Any]) -> dict[str, Any]:
        row = nemo_gym_row(dataset_row, ROW_COLUMN)
        params = row.get("responses_create_params")
        if self._rollouts.max_output_tokens and isinstance(params, Mapping):
            row["responses_create_params"] = {
                "max_output_tokens": self._rollouts.max_output_tokens,
                **params,
            }
        return row

    def produce(
        self,
        model: Any,
        global_step: int,
        *,
        skip_policy_logps: bool = False,
        processing_class: Any = None,
        accelerator: Any = None,
        args: Any = None,
        _rank0_only: bool = False,
        **kwargs: Any,
    ) -> RolloutDataset | None:
        """The next batch as NeMo Gym rollouts (`RolloutDataset`, scored later by the
        trainer), or None on a non-main rank in axolotl's rank-0-only mode.

        Raises:
            ScoringError: more than `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION` of the batch's
                rollouts failed (an outage, not a training signal).
        """
        trainer = self._trainer
        if _rank0_only and not trainer.accelerator.is_main_process:
            return None
        inputs = self._next_inputs()
        output = run_rows(
            [self._row(row) for row in inputs],
            [row.get("prompt") for row in inputs],
            trainer,
            target=self._rollouts.target,
            run_timeout=self._rollouts.run_timeout,
            where=f"axolotl data producer, step {global_step}, {len(inputs)} rollouts",
        )
        tokenizer = trainer.processing_class
        return RolloutDataset(
            rollout_data(
                output,
                inputs,
                pad_token_id=trainer._tokenizer.pad_token_id,
                decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
                rank0_only=_rank0_only,
                device=trainer.accelerator.device,
            )
        )
