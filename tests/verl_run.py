"""Drive verl 0.9.1's own reward loop over a real `DataProto` (run in build/verl-venv).

`python tests/verl_run.py SPEC.json` prints one JSON object. SPEC: {"parquet": the file
`nemo-gym-grpc export --format verl` wrote, "mode": "naive" (verl's NaiveRewardManager calling
`nemo_gym_grpc.rewards.verl.compute_score`, loaded by verl from
`reward.custom_reward_function`) or "manager" (`NemoGymRewardManager`, loaded by verl from
`reward.reward_manager.source=importlib`), "items": [{"row": parquet row index,
"completion": text}, ...], "repeat": how many times to send the items (default 1)}.

verl's `RewardLoopWorker` (the class its Ray actors run) loads the configured manager and
computes each sample's score (`compute_score_batch`, per-sample `run_single` concurrently, as
verl does); the scores then go through verl's `assemble_rm_scores` into the `rm_scores`
tensor and its `reward_extra_info` arrays, as `RewardLoopManager.compute_rm_score` does (that
class itself only adds the Ray actor pool). The output: {"scores", "rm_scores_sum" (per
sample), "extra" (reward_extra_info arrays as lists), "seconds" (the reward loop only)} or
{"error": "Type: message"} when the reward loop raised; both with "calls" (items per
`VerifyStream` call).

The tokenizer is a byte-level one built here (every byte a token, no merges), so a completion
decodes back to exactly its text and no model is downloaded; the policy that would have
generated the responses is what this replaces (no LLM runs here).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl import DataProto
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.experimental.reward_loop.reward_manager import NaiveRewardManager

from nemo_gym_grpc.rewards import stacks

CALLS: list[int] = []  # items per VerifyStream call


def count_calls() -> None:
    """Record the size of every `stacks.score_items_async` call (the adapters' one way to the
    bridge), to show how verl's samples were batched; the call itself is unchanged."""
    real = stacks.score_items_async

    async def counted(items: Any) -> Any:
        CALLS.append(len(items))
        return await real(items)

    stacks.score_items_async = counted  # type: ignore[assignment]


def byte_tokenizer(folder: str) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(folder)  # verl loads it by path (hf_tokenizer)
    return tokenizer


def config(mode: str, tokenizer_dir: str) -> Any:
    none = {"path": None, "name": None}
    if mode == "naive":
        custom = {"path": "pkg://nemo_gym_grpc.rewards.verl", "name": "compute_score"}
        manager = {"source": "register", "name": "naive", "module": none}
    else:
        custom = dict(none)
        manager = {
            "source": "importlib",
            "name": "NemoGymRewardManager",
            "module": {"path": "pkg://nemo_gym_grpc.rewards.verl_manager", "name": None},
        }
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": tokenizer_dir, "tokenizer_path": None}},
            "reward": {
                "custom_reward_function": {**custom, "reward_kwargs": {}},
                "reward_manager": manager,
                "reward_model": {"enable": False},
                "num_workers": 1,
            },
        }
    )


def data_proto(tokenizer: Any, frame: pd.DataFrame, items: list[dict[str, Any]]) -> DataProto:
    prompts = [tokenizer.encode(frame.iloc[i["row"]]["prompt"][-1]["content"]) for i in items]
    responses = [tokenizer.encode(i["completion"]) + [tokenizer.eos_token_id] for i in items]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(len(items), p_len, dtype=torch.long)
    response_ids = torch.zeros(len(items), r_len, dtype=torch.long)
    mask = torch.zeros(len(items), p_len + r_len, dtype=torch.long)
    for n, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[n, p_len - len(p) :] = torch.tensor(p)  # left-padded, as verl's rollout
        response_ids[n, : len(r)] = torch.tensor(r)  # right-padded
        mask[n, p_len - len(p) : p_len + len(r)] = 1
    rows = [frame.iloc[i["row"]] for i in items]
    batch = TensorDict(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": mask,
        },
        batch_size=len(items),
    )

    def column(name: str) -> np.ndarray:
        values = np.empty(len(rows), dtype=object)
        values[:] = [dict(r[name]) if isinstance(r[name], dict) else r[name] for r in rows]
        return values

    return DataProto(
        batch=batch,
        non_tensor_batch={k: column(k) for k in ("data_source", "reward_model", "extra_info")},
    )


async def run(spec: dict[str, Any], tokenizer_dir: str) -> dict[str, Any]:
    count_calls()
    tokenizer = byte_tokenizer(tokenizer_dir)
    frame = pd.read_parquet(spec["parquet"])
    items = spec["items"] * int(spec.get("repeat", 1))
    data = data_proto(tokenizer, frame, items)
    worker = RewardLoopWorker(config(spec["mode"], tokenizer_dir))  # on this running loop
    started = time.perf_counter()
    try:
        outputs = await worker.compute_score_batch(data)
    except Exception as exc:  # the reward loop's own failure is the result
        return {"error": f"{type(exc).__name__}: {exc}", "calls": CALLS}
    seconds = time.perf_counter() - started
    scores = [o["reward_score"] for o in outputs]
    rm_scores = NaiveRewardManager.assemble_rm_scores(data, scores)
    infos = [o.get("reward_extra_info", {}) for o in outputs]
    extra = {k: np.array([info[k] for info in infos]).tolist() for k in infos[0]}
    return {
        "scores": scores,
        "rm_scores_sum": rm_scores.sum(dim=-1).tolist(),
        "extra": {k: v for k, v in extra.items() if k in ("score", "scoring_failed", "acc")},
        "seconds": seconds,
        "calls": CALLS,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        result = asyncio.run(run(spec, tokenizer_dir))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
