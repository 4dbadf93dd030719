"""Real `trl.GRPOTrainer` steps scored by our reward functions: real NeMo Gym mcqa server, real
bridge, real gRPC.

Nothing is downloaded (tests/support/tiny_trl.py): the policy is a tiny Llama built from a config
(output layer zeroed: uniform sampling), a WordLevel tokenizer. Its vocabulary: special tokens,
the chat template's role words, a marker per prompt ("q0", ...; TRL 1.8 logs prompts as decoded
token ids, so the marker is what identifies a row there) and two `\\boxed{X}` answers; the
policy may sample only the answers, "answer" and the end token, so its completions hold mcqa
answers, right or wrong. The dataset has axolotl's NeMo Gym loader columns (`prompt`,
`resources_server_ref`, `verify_extra`) over NeMo Gym's own mcqa example rows, plus one row
naming a resources server that does not exist, whose completions must reach TRL as NaN, not 0.

TRL writes each step's completions table (prompt, completion, one reward column per reward
function, our `log_extra` columns) to `output_dir/completions/*.parquet` when
`log_completions` is set; the test checks every reward there against the mcqa server itself
(a plain HTTP `/verify`, without our code), and the step's logged reward mean against those.

Needs torch, trl and transformers (the `trl` extra / the test dependency group), imported when
a test runs: without them the tests are skipped locally and fail under CI.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import time
from typing import Any

import pytest
import requests

from nemo_gym_grpc.rewards.client import settings
from tests.support.missing import require

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)


def _import(name: str):
    return require(name, "install torch==2.13.0, trl and transformers")


def _trl_stack():
    """(trl, datasets, pandas), with torch, transformers and tokenizers checked first, imported
    when a test runs rather than at collection (torch alone takes seconds to import, and the
    fast tier collects this module without running it)."""
    for name in ("torch", "transformers", "tokenizers"):
        _import(name)
    return _import("trl"), _import("datasets"), _import("pandas")


RIGHT, WRONG = "B", "E"  # the answer tokens the policy can sample
ANSWERS = [f"\\boxed{{{RIGHT}}}", f"\\boxed{{{WRONG}}}", "answer"]
MARKERS = [f"q{i}" for i in range(6)]  # one per prompt
MISSING_SERVER = "no_such_server"


def load_reward_func(dotted: str):
    """Load a reward function by dotted path the way axolotl's GRPO builder does
    (`importlib` + `getattr`, at least two parameters)."""
    module, _, name = dotted.rpartition(".")
    func = getattr(importlib.import_module(module), name)
    assert len(inspect.signature(func).parameters) >= 2
    return func


def _tokenizer():
    from tests.support.tiny_trl import word_tokenizer  # torch: see _trl_stack

    return word_tokenizer(
        ["<pad>", "<unk>", "<s>", "</s>", "user:", "assistant:", *MARKERS, *ANSWERS]
    )


def _loader_rows(nemo_gym_venv) -> list[dict]:
    """axolotl's NeMo Gym loader columns over mcqa's example rows: the 3 with answer B or E,
    two of them twice, and one routed to a server that does not exist (6 prompts: 2 steps of
    3)."""
    from tests.support import example_rows

    rows = []
    for data in example_rows("mcqa", nemo_gym_venv):
        user = [m["content"] for m in data["responses_create_params"]["input"]]
        rows.append(
            {
                "prompt": [{"role": "user", "content": user[0]}],
                "resources_server_ref": {"name": "mcqa"},
                "verify_extra": data,
            }
        )
    scored = [r for r in rows if r["verify_extra"]["expected_answer"] in (RIGHT, WRONG)]
    (unscored,) = [r for r in rows if r["verify_extra"]["expected_answer"] == "C"]
    unscored = dict(unscored, resources_server_ref={"name": MISSING_SERVER})
    chosen = []
    for marker, row in zip(MARKERS, [*scored, scored[0], scored[1], unscored], strict=True):
        content = f"{marker} {row['prompt'][0]['content']}"  # the marker leads the prompt
        chosen.append(dict(row, prompt=[{"role": "user", "content": content}]))
    return chosen


def _row_of(prompt, rows: list[dict]) -> dict:
    """The dataset row of a completions-table prompt, by its marker (TRL 1.8 logs the decoded
    prompt text, newer versions the messages)."""
    text = prompt if isinstance(prompt, str) else prompt[0]["content"]
    (marker,) = re.findall(r"\bq(\d)\b", text)
    return rows[int(marker)]


def verify_over_http(url: str, row: dict, text: str) -> float:
    """What the mcqa server itself says about `text` for `row` (plain HTTP, no bridge)."""
    body = {k: v for k, v in row.items() if v is not None}
    body["response"] = {
        "id": "resp_test",
        "object": "response",
        "created_at": 0,
        "model": "test",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg_test",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
    }
    reply = requests.post(f"{url}/verify", json=body, timeout=60)
    reply.raise_for_status()
    return reply.json()["reward"]


def _grpo_trainer(trl, datasets, reward_funcs, rows: list[dict], output_dir, **config) -> Any:
    """A `trl.GRPOTrainer` of the tiny Llama over `rows`, scored by `reward_funcs` (one function
    or a list), whose policy can sample only ANSWERS and the end token (two_step_grpo_config: 2
    steps of 3 prompts x 2 generations unless `config` says otherwise, completions tables in
    `output_dir`)."""
    from tests.support.tiny_trl import tiny_llama, two_step_grpo_config

    tokenizer = _tokenizer()
    sampled = {*ANSWERS, tokenizer.eos_token}
    tokens = [t for t in tokenizer.get_vocab() if t not in sampled]
    args = two_step_grpo_config(
        output_dir,
        max_completion_length=4,
        generation_kwargs={"suppress_tokens": [tokenizer.convert_tokens_to_ids(t) for t in tokens]},
        **config,
    )
    return trl.GRPOTrainer(
        model=tiny_llama(tokenizer),
        processing_class=tokenizer,
        reward_funcs=reward_funcs if isinstance(reward_funcs, list) else [reward_funcs],
        train_dataset=datasets.Dataset.from_list(rows),
        args=args,
    )


def _check_rewards(frame, name: str, rows: list[dict], mcqa_url: str, pandas, seen: dict) -> None:
    """Each reward in one step's completions table `frame` (reward column `name`) against the
    mcqa server at `mcqa_url` itself, NaN with its error for the missing server's row; counts
    the NaN, 0.0 and 1.0 rewards in `seen`."""
    for prompt, completion, reward, error in zip(
        frame["prompt"], frame["completion"], frame[name], frame[f"{name}/error"], strict=True
    ):
        row = _row_of(prompt, rows)
        if row["resources_server_ref"]["name"] == MISSING_SERVER:
            assert math.isnan(reward)  # None from us, NaN in TRL: not 0
            assert error == "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)"
            seen["nan"] += 1
        else:
            text = completion if isinstance(completion, str) else completion[0]["content"]
            truth = verify_over_http(mcqa_url, row["verify_extra"], text)
            assert reward == truth, (text, row["verify_extra"]["expected_answer"])
            assert pandas.isna(error)  # no failure (pandas reads a missing string as NaN)
            seen[truth] += 1


@pytest.mark.parametrize(
    "dotted",
    [
        "nemo_gym_grpc.rewards.reward_nemo_gym_verify",
        "nemo_gym_grpc.rewards.reward_nemo_gym_verify_async",
    ],
    ids=["sync", "async"],
)
def test_two_grpo_steps_score_with_nemo_gym_and_failed_items_reach_trl_as_nan(
    dotted, nemo_gym, nemo_gym_venv, bridge_target, monkeypatch, tmp_path
):
    trl, datasets, pandas = _trl_stack()
    monkeypatch.setenv(settings.TARGET_ENV, bridge_target)
    reward_func = load_reward_func(dotted)
    name = reward_func.__name__
    rows = _loader_rows(nemo_gym_venv)
    trainer = _grpo_trainer(trl, datasets, reward_func, rows, tmp_path)
    began = time.monotonic()
    trainer.train()
    print(f"{dotted}: 2 GRPO steps in {time.monotonic() - began:.2f} s")

    steps = [entry for entry in trainer.state.log_history if "rewards/" + name + "/mean" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    tables = sorted((tmp_path / "completions").glob("*.parquet"))
    assert len(tables) == 2
    seen = {"nan": 0, 0.0: 0, 1.0: 0}
    for entry, table in zip(steps, tables, strict=True):
        frame = pandas.read_parquet(table)
        assert len(frame) == 6
        _check_rewards(frame, name, rows, nemo_gym.server_urls["mcqa"], pandas, seen)
        # the logged mean leaves the NaN rows out
        assert entry[f"rewards/{name}/mean"] == pytest.approx(frame[name].mean(skipna=True))
        failed = frame[name].isna().mean()
        assert entry[f"rewards/{name}/failed_fraction"] == pytest.approx(failed)
        assert entry[f"rewards/{name}/latency_seconds"] > 0
    # the missing server's prompt was drawn (at most once per step: 2 of 6 items, under the
    # guard's half), and the policy's samples held right and wrong answers
    assert seen["nan"] in (2, 4), seen
    assert seen[1.0] and seen[0.0], seen
