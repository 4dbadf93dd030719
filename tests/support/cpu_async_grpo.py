"""TRL 1.16's `AsyncGRPOTrainer` on a CPU: the three GPU-only parts replaced, nothing else.

    with on_cpu():                       # unittest.mock patches, undone on exit
        trainer = AsyncGRPOTrainer(...)  # weight_transfer=None gets ControlOnlyWeightTransfer
        trainer.train()

    python -m tests.support.cpu_async_grpo SCRIPT   # runs SCRIPT (a docs example) on_cpu()

Why stand-ins: `AsyncGRPOTrainer` needs an NVIDIA GPU in three places, and this machine has
none (nor NCCL, nor vLLM):
- `get_peak_flops_per_device` (its `__init__`) asks `torch.cuda.get_device_name`, which raises
  without CUDA; here it answers None, which is TRL's own answer for an unknown device (MFU
  metrics off, throughput still logged).
- its tree attention (`packing.tree_attention`, the `tree_fa3` attention of every training
  forward) calls the FlashAttention-3 kernel that `kernels` downloads for Hopper GPUs; here
  `_flash_attn()` returns `cpu_flash_attn_varlen_func`, the same variable-length causal
  attention in plain torch (tests/test_cpu_async_grpo.py checks it against a plain forward).
- `WeightTransferClient` streams the weights to vLLM over NCCL; here `ControlOnlyWeightTransfer`
  (same constructor) drives the same HTTP routes with TRL's own `VLLMClient` (readiness, world
  size, pause, the weight-update routes, resume), so the server sees each step of a sync, but
  moves no tensor: the policy server here is the scripted one (tests/support/policy_model.py).

Needs torch and TRL >= 1.16: import this module only where they are.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from trl.experimental.async_grpo import async_grpo_trainer, packing


def cpu_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> torch.Tensor:
    """FlashAttention's `flash_attn_varlen_func` in plain torch (scaled dot-product attention
    per segment): q (total_q, heads, dim), k and v (total_k, kv_heads, dim); segment i is
    q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] against k/v[cu_seqlens_k[i]:cu_seqlens_k[i+1]];
    causal as FlashAttention >= 2 aligns it (query j sees keys up to j + len_k - len_q).
    Returns (total_q, heads, dim). Sliding windows and softcap are not supported (the tiny
    test model has neither).

    Raises:
        NotImplementedError: a sliding window, or non-causal attention, was asked for.
    """
    if window_size != (-1, -1) or not causal:
        raise NotImplementedError("only causal attention without a window")
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        query = q[qs:qe].transpose(0, 1)
        key = k[ks:ke].transpose(0, 1).repeat_interleave(repeat, 0)
        value = v[ks:ke].transpose(0, 1).repeat_interleave(repeat, 0)
        seen = torch.arange(qe - qs).unsqueeze(1) + ((ke - ks) - (qe - qs))
        mask = torch.arange(ke - ks).unsqueeze(0) <= seen
        attended = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=softmax_scale
        )
        out[qs:qe] = attended.transpose(0, 1)
    return out


class ControlOnlyWeightTransfer:
    """TRL's `WeightTransferProtocol` without NCCL: every HTTP step of TRL's
    `WeightTransferClient`, through TRL's `VLLMClient`, and no tensor moved (see the module
    docstring). Same constructor as `WeightTransferClient`.

    Attributes:
        syncs: weight syncs done (each: pause, start/update/finish_weight_update, resume).
        names: the parameter names of the last sync, as the trainer streamed them.
    """

    def __init__(
        self, vllm_client: Any, weight_update_info: dict[str, Any], weight_sync_timeout: int = 1800
    ) -> None:
        self.vllm = vllm_client
        self.info = weight_update_info
        self.timeout = weight_sync_timeout
        self.syncs = 0
        self.names: list[str] = []

    def init_weight_transfer(self) -> None:
        self.vllm.wait_for_server_ready()
        world_size = self.vllm.get_world_size() + 1
        init = {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1}
        self.vllm.init_weight_transfer_engine({**init, "world_size": world_size}, self.timeout)

    def pause(self) -> None:
        self.vllm.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.vllm.start_weight_update()
        self.names = [name for name, _ in iterator]
        if self.names != list(self.info["names"]):
            raise AssertionError("the trainer streamed other parameters than it announced")
        self.vllm.update_weights(self.info, self.timeout)
        self.vllm.finish_weight_update(self.timeout)
        self.syncs += 1

    def resume(self) -> None:
        self.vllm.resume()

    def destroy(self) -> None:
        pass


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Patch the three GPU-only parts of the module docstring for the block's duration."""
    kernel = types.SimpleNamespace(flash_attn_varlen_func=cpu_flash_attn_varlen_func)
    with (
        mock.patch.object(async_grpo_trainer, "get_peak_flops_per_device", lambda *_: None),
        mock.patch.object(packing, "_flash_attn", lambda: kernel),
        mock.patch.object(async_grpo_trainer, "WeightTransferClient", ControlOnlyWeightTransfer),
    ):
        yield


if __name__ == "__main__":
    with on_cpu():
        runpy.run_path(sys.argv[1], run_name="__main__")
