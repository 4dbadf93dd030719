"""A tiny local policy for real TRL `GRPOTrainer` runs in tests: nothing is downloaded.

    tokenizer = word_tokenizer(["<pad>", "<unk>", "<s>", "</s>", "user:", "assistant:", ...])
    model = tiny_llama(tokenizer)          # a 1-layer Llama, output layer zeroed
    args = two_step_grpo_config(tmp_path)  # trl.GRPOConfig: 2 steps of 3 prompts x 2

The tokenizer is a WordLevel one over the given vocabulary (token id = position in the list),
split on whitespace, with a plain "role: content" chat template. The model is built from a
config, seeded, with its output layer zeroed so that it samples uniformly at first. Moved here
from tests/test_trl.py so that test_trl.py and test_trl_rollouts.py share it, with the GRPO
settings both train with.

Needs torch, transformers and tokenizers (and trl for two_step_grpo_config): import this module
only after checking for them (as the TRL tests do).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def word_tokenizer(
    vocab: Sequence[str],
    *,
    pad: str = "<pad>",
    unk: str = "<unk>",
    bos: str = "<s>",
    eos: str = "</s>",
) -> Any:
    """A `PreTrainedTokenizerFast` whose token ids are the positions of `vocab`'s words; the
    special tokens must be among them. Decoding joins tokens with spaces."""
    model = tokenizers.models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=unk)
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece()  # joins tokens with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, unk_token=unk, bos_token=bos, eos_token=eos
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(tokenizer: Any) -> Any:
    """A seeded 1-layer `LlamaForCausalLM` over `tokenizer`'s vocabulary, output layer zeroed
    (uniform sampling over the vocabulary at first)."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def two_step_grpo_config(output_dir: str | Path, **extra: Any) -> Any:
    """A `trl.GRPOConfig` for 2 GRPO steps of 6 completions each (3 prompts x 2 generations),
    logged every step with TRL's completions tables (`output_dir/completions/*.parquet`), on
    the CPU, seeded, saving nothing; `extra`: GRPOConfig keywords added or overridden."""
    import trl

    settings: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=6,
        num_generations=2,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        log_completions=True,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    return trl.GRPOConfig(**{**settings, **extra})
