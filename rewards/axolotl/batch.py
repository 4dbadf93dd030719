"""Rollouts -> the batch axolotl's async GRPO trainer takes from a data producer (torch only).

axolotl 0.21's `AsyncGRPOTrainer` (axolotl/core/trainers/grpo/async_trainer.py) scores a
produced batch on its main thread (`_compute_deferred_scores`) from a dict of padded tensors
plus `_deferred_*` entries; its own `NemoGymDataProducer` builds that dict from agent `/run`
replies. `rollout_data` builds the same dict from `trl.rollout_func.run_rows`'s output, with one
change: a failed rollout (its `rollout_error` set; reward NaN, one masked EOS token, see
`stitch.failed_sample`) has `completion_mask` 0 as well as `tool_mask` 0, so no token of it
enters the loss, the token counts or the importance-sampling statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from trl.trainer.utils import pad


def _padded(rows: Sequence[Sequence[float]], value: int, side: str, dtype: Any, device: Any) -> Any:
    """`rows` as one (len(rows), longest) tensor padded with `value` on `side` (TRL's `pad`)."""
    return pad(
        [torch.tensor(list(row), dtype=dtype, device=device) for row in rows],
        padding_value=value,
        padding_side=side,
    )


def rollout_data(
    output: Mapping[str, Sequence[Any]],
    inputs: Sequence[dict[str, Any]],
    *,
    pad_token_id: int,
    decode: Callable[[Any], Sequence[str]],
    rank0_only: bool,
    device: Any = "cpu",
) -> dict[str, Any]:
    """The data-producer dict for one batch (what `RolloutDataset` wraps).

    Args:
        output: `trl.rollout_func.run_rows`'s dict: per sample `prompt_ids`, `completion_ids`,
            `logprobs`, `env_mask`, `env_reward` (NaN for a failure), `num_turns`,
            `rollout_error` (None, or the failure's cause).
        inputs: the prompt dataloader's rows, one per sample; their copies in
            `_deferred_inputs` get `env_reward`, `num_turns` and `rollout_error` (the
            reward functions' keyword columns).
        pad_token_id: the tokenizer's pad token id.
        decode: padded completion ids -> their texts (the tokenizer's `batch_decode`
            without special tokens): the completions the reward functions get.
        rank0_only: axolotl's FSDP rank-0 production flag, passed through.
        device: where the tensors go (the trainer's `accelerator.device`).

    Returns:
        `prompt_ids`/`prompt_mask` (left-padded), `completion_ids`/`completion_mask`,
        `sampling_per_token_logps` (the policy's logprobs as sampled; 0.0 on observation
        tokens), `tool_mask` (1 = generated, padded with 1), `advantages` (zeros, set when
        scored), `num_items_in_batch`, and the `_deferred_*` entries.
    """
    count = len(inputs)
    if any(len(values) != count for values in output.values()):
        raise ValueError(f"every rollout output column must have {count} entries")
    failed = [error is not None for error in output["rollout_error"]]
    prompt_ids = _padded(output["prompt_ids"], pad_token_id, "left", torch.long, device)
    ones = [[1] * len(ids) for ids in output["prompt_ids"]]
    prompt_mask = _padded(ones, 0, "left", torch.long, device)
    completion_ids = output["completion_ids"]
    completion_mask = _padded(
        [[0 if bad else 1] * len(ids) for ids, bad in zip(completion_ids, failed, strict=True)],
        0,
        "right",
        torch.long,
        device,
    )
    padded_completions = _padded(completion_ids, pad_token_id, "right", torch.long, device)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": padded_completions,
        "completion_mask": completion_mask,
        "num_items_in_batch": completion_mask.sum(),
        "advantages": torch.zeros(count, device=device),
        "sampling_per_token_logps": _padded(output["logprobs"], 0, "right", torch.float32, device),
        "tool_mask": _padded(output["env_mask"], 1, "right", torch.long, device),
        "_pending_policy_logps": True,
        **_deferred(output, inputs, list(decode(padded_completions))),
        "_rank0_only": rank0_only,
    }


def _deferred(
    output: Mapping[str, Sequence[Any]], inputs: Sequence[dict[str, Any]], texts: list[str]
) -> dict[str, Any]:
    """The `_deferred_*` entries axolotl's trainer scores from: the input rows with the
    rollouts' reward-function columns, their prompts, the completions' `texts` and ids."""
    columns = ("env_reward", "num_turns", "rollout_error")
    rows = [
        dict(row, **{key: output[key][index] for key in columns})
        for index, row in enumerate(inputs)
    ]
    return {
        "_deferred_inputs": rows,
        "_deferred_prompts": [row.get("prompt", "") for row in rows],
        "_deferred_completions": texts,
        "_deferred_completion_ids_list": [list(ids) for ids in output["completion_ids"]],
    }
