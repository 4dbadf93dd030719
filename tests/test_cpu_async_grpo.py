"""The CPU stand-in for AsyncGRPOTrainer's FlashAttention-3 tree attention
(tests/support/cpu_async_grpo.py) computes what the model computes without packing: two samples
that share a prompt, packed by TRL's own `TreeRow` into one row (the shared tokens forwarded
once), give through TRL's `tree_attention` the same next-token logits at every trained token as
each sample's plain forward with eager attention."""

from __future__ import annotations

import pytest

# the test-trl group of `make dev` installs them
np = pytest.importorskip("numpy")
pytest.importorskip("trl")


def test_tree_attention_on_cpu_equals_plain_forwards():
    import torch
    from trl.experimental.async_grpo import packing

    from tests.support import toy_chat
    from tests.support.cpu_async_grpo import on_cpu
    from tests.support.tiny_trl import tiny_llama, word_tokenizer

    tokenizer = word_tokenizer(toy_chat.VOCAB, pad="<pad>", unk="<pad>", bos="<s>", eos="</s>")
    model = tiny_llama(tokenizer)
    with torch.no_grad():  # tiny_llama zeroes the output layer: give the logits some shape
        model.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    prompt = [1, 4, 9, 10, 11, 5]
    samples = [[*prompt, 20, 21, 2], [*prompt, 30, 31, 32, 2]]
    row = packing.TreeRow()
    for group, ids in enumerate(samples):
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        row.add(
            {
                "input_ids": np.asarray(ids),
                "completion_mask": np.asarray(mask),
                "old_log_probs": np.zeros(len(ids), dtype=np.float32),
                "advantage": 0.0,
                "group_id": group,
            }
        )
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(map(len, samples))  # the prompt is shared
    packing.register_tree_attention()
    with on_cpu(), torch.no_grad():
        model.config._attn_implementation = packing.TREE_ATTENTION
        tree = {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
        seqlen_q, seqlen_k = packed["tree_max_seqlens"].tolist()
        logits = model(
            input_ids=packed["input_ids"].unsqueeze(0),
            position_ids=packed["position_ids"].unsqueeze(0),
            tree_max_seqlen_q=seqlen_q,
            tree_max_seqlen_k=seqlen_k,
            **tree,
        ).logits[0]
        model.config._attn_implementation = "eager"
        expected = []
        for ids in samples:
            plain = model(input_ids=torch.tensor([ids])).logits[0]
            expected += [plain[p - 1] for p in range(len(prompt), len(ids))]
    got = logits[packed["token_index"]]
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-5, atol=1e-5)
