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

Production ends with training (`stop_production`, on axolotl's `on_train_end`): a batch
prefetched for a step that never comes is dropped, and one still running has its `RunStream`
cancelled (`client.stopping`), so the process does not wait at exit for rollouts nobody
trains on.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from axolotl.core.trainers.grpo.async_trainer import (
    AsyncDataProducer,
    GRPODataProducer,
    RolloutDataset,
)

from nemo_gym_grpc.rewards.axolotl.batch import rollout_data
from nemo_gym_grpc.rewards.client.policy import ScoringError
from nemo_gym_grpc.rewards.client.stopping import Stopper
from nemo_gym_grpc.rewards.trl.rollout_func import run_rows
from nemo_gym_grpc.rewards.trl.rows import nemo_gym_row

# The dataset column of axolotl's NeMo Gym dataset loader that holds the whole NeMo Gym row.
ROW_COLUMN = "verify_extra"
# Seconds `stop_production` waits for a cancelled prefetch to return.
STOP_WAIT = 30.0

log = logging.getLogger("nemo_gym_grpc.rewards.axolotl")


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
        self._stopper = Stopper()

    def stop(self) -> None:
        """Cancel the rollouts in flight (from any thread); later batches are not produced."""
        self._stopper.stop()

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
        trainer), or None on a non-main rank in axolotl's rank-0-only mode, and once `stop`
        was called (a batch it cancelled is dropped, logged with its rollout count).

        Raises:
            ScoringError: more than `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION` of the batch's
                rollouts failed (an outage, not a training signal).
        """
        trainer = self._trainer
        if self._stopper.stopped or (_rank0_only and not trainer.accelerator.is_main_process):
            return None
        inputs = self._next_inputs()
        try:
            with self._stopper.running():
                output = run_rows(
                    [self._row(row) for row in inputs],
                    [row.get("prompt") for row in inputs],
                    trainer,
                    target=self._rollouts.target,
                    run_timeout=self._rollouts.run_timeout,
                    where=f"axolotl data producer, step {global_step}, {len(inputs)} rollouts",
                )
        except ScoringError:
            if not self._stopper.stopped:
                raise
        if self._stopper.stopped:
            log.warning(
                "NeMo Gym: training ended while step %d's %d rollouts ran: cancelled, dropped",
                global_step, len(inputs),
            )  # fmt: skip
            return None
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


def stop_production(data_producer: Any) -> None:
    """End `data_producer`'s production when training ends: a prefetched batch no step will
    take is dropped, one in flight is cancelled and waited for (at most STOP_WAIT s), each
    logged with its number of rollouts. For a `NemoGymDataProducer`, or axolotl's
    `AsyncDataProducer` around one; anything else is left alone."""
    inner = data_producer._inner if isinstance(data_producer, AsyncDataProducer) else data_producer
    if not isinstance(inner, NemoGymDataProducer):
        return
    inner.stop()
    if not isinstance(data_producer, AsyncDataProducer):
        return
    pending = list(data_producer._queue)
    data_producer.shutdown()
    for future in pending:
        if future.cancelled():
            continue
        try:
            dataset = future.result(timeout=STOP_WAIT)
        except concurrent.futures.TimeoutError:
            log.warning("NeMo Gym: a cancelled prefetch still runs after %g s", STOP_WAIT)
            continue
        except Exception as exc:  # noqa: BLE001 (the step it was for never came)
            log.warning("NeMo Gym: a prefetch for a step that never came failed: %s", exc)
            continue
        if dataset is not None:
            log.warning(
                "NeMo Gym: training ended with a prefetched batch unused: %d rollouts dropped",
                len(dataset),
            )
