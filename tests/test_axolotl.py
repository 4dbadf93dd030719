"""Real axolotl 0.21.0 (its own venv, tests/support/axolotl_venv.py) training through
`nemo_gym_grpc.rewards.axolotl.NemoGymPlugin`, run as users do (`python -m axolotl.cli.train
config.yaml` in a working folder), with the configs of docs/axolotl.md as written there, against
real NeMo Gym 0.7.0:

- single-turn: 2 GRPO steps over mcqa's example rows plus a row whose resources server does not
  exist: one NeMo Gym reward column; that row NaN, every other reward equal to mcqa's own
  `/verify` of the same completion;
- multi-turn: 2 steps through axolotl's data producer (with and without `async_prefetch`) on
  the project's agent stack: the weather agent's rollouts with the agent's own rewards, a
  masked rollout, one for an unknown agent and one whose policy call failed NaN with no token
  in `completion_mask`.
In both, a user's reward function is listed next to NeMo Gym's, and what trains is checked:
a completion without a NeMo Gym reward is NaN in every reward column and has advantage 0, and
every other advantage is the one computed over its group's scored completions only (not with
the failure counted as 0.0), and so is the logged `reward`.

The policy is a tiny Llama built here (tests/support/tiny_trl.py), so nothing is downloaded.
What the trainer got is recorded inside axolotl by tests/axolotl_observer.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support import NoSuitablePython, example_rows, grpo, toy_chat
from tests.support.axolotl_venv import ensure_axolotl
from tests.support.errors import NemoGymError
from tests.support.missing import missing
from tests.support.policy_model import Knobs
from tests.test_rollouts_client import masked_row, run_over_http, weather_rows
from tests.test_trl import verify_over_http

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "axolotl.md"
OBSERVER = "tests.axolotl_observer.ObserverPlugin"
USER_REWARD = "tests.axolotl_observer.alternating_reward"
REPLACED_LINE = "takes the place of the first"
MCQA_VOCAB = ["<pad>", "<unk>", "<s>", "</s>", "user:", "assistant:"] + [
    f"\\boxed{{{letter}}}" for letter in "ABCDEI"
]


@pytest.fixture(scope="module")
def axolotl_python() -> Path:
    """The axolotl venv's interpreter (built on first use; fails, never skips, in CI)."""
    try:
        return ensure_axolotl()
    except (NoSuitablePython, NemoGymError) as exc:
        missing(f"axolotl unavailable: {exc}")


def doc_config(name: str) -> dict[str, Any]:
    """The YAML block after `<!-- config: NAME -->` in docs/axolotl.md."""
    text = DOC.read_text()
    block = text[text.index(f"<!-- config: {name} -->") :].split("```yaml\n", 1)[1]
    config: dict[str, Any] = yaml.safe_load(block.split("```", 1)[0])
    return config


def tiny_model(folder: Path, vocab: list[str], **special: str) -> None:
    """A tiny Llama and its word tokenizer saved in `folder` (the config's `./tiny-llama`)."""
    from tests.support.tiny_trl import tiny_llama, word_tokenizer

    tokenizer = word_tokenizer(vocab, **special)
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def train(python: Path, workdir: Path, config: dict[str, Any], head_url: str) -> list[dict]:
    """`python -m axolotl.cli.train config.yaml` in `workdir` with the doc's `config`, the
    head port of `head_url`, the observer plugin and the user's reward function; the
    observer's records."""
    config = dict(config, nemo_gym_head_port=urlsplit(head_url).port)
    config["plugins"] = [*config["plugins"], OBSERVER]
    config["trl"] = dict(config["trl"], reward_funcs=[*config["trl"]["reward_funcs"], USER_REWARD])
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_GRPC_")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled")
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1")
    done = subprocess.run(
        [str(python), "-m", "axolotl.cli.train", "config.yaml"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    (workdir / "train.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert (done.stdout + done.stderr).count(REPLACED_LINE) <= 1
    observed = workdir / config["output_dir"] / "observed.jsonl"
    return [json.loads(line) for line in observed.read_text().splitlines()]


def check_nothing_forks(records: list[dict], prompt_loader: bool) -> None:
    """No DataLoader of the run has worker processes, and the process never forked while it
    trained (a worker forked under live gRPC channels made runs exit 1 after saving)."""
    workers = [r["dataloader_workers"] for r in records if "dataloader_workers" in r]
    assert workers == [{"args": 0, "prompts": 0 if prompt_loader else None}]
    assert [r["forks"] for r in records if "forks" in r] == [0]


def logged_means(records: list[dict]) -> list[float]:
    """The trainer's logged `rewards/nemo_gym/mean`, one per step."""
    key = "rewards/nemo_gym/mean"
    return [r["log"][key] for r in records if key in r.get("log", {})]


def nanmean(values: list[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else math.nan


def check_what_trains(records: list[dict], group: int = 2) -> tuple[int, int]:
    """Per scored batch: a completion without a NeMo Gym reward (column 0) is None in every
    column, the advantages are those over the scored completions only, and the logged
    `reward` is their mean.

    Returns:
        How many advantages differ from those with the failure counted as 0.0 and the user's
        reward kept (what TRL or axolotl alone trains with), and how many groups mix a failed
        completion with a scored one.
    """
    scored = [r["scored"] for r in records if "scored" in r]
    rewards_logged = [r["log"]["reward"] for r in records if "reward" in r.get("log", {})]
    users = [r["rewards"] for r in records if r.get("call") == "alternating_reward"]
    assert len(scored) == len(rewards_logged) == len(users) == 2
    differ = mixed = 0
    for batch, logged, user in zip(scored, rewards_logged, users, strict=True):
        matrix = batch["rewards_per_func"]
        for row in matrix:
            assert row[0] is not None or row == [None, None]
        expected = grpo.advantages(matrix, [1.0, 1.0], group)
        assert batch["advantages"] == pytest.approx(expected, abs=1e-5)
        assert logged == pytest.approx(nanmean(grpo.summed(matrix, [1.0, 1.0])))
        as_zero = [[row[0] or 0.0, u] for row, u in zip(matrix, user, strict=True)]
        alone = grpo.advantages(as_zero, [1.0, 1.0], group)
        differ += sum(abs(a - b) > 1e-3 for a, b in zip(expected, alone, strict=True))
        firsts = [row[0] is None for row in matrix]
        mixed += sum(len(set(firsts[i : i + group])) == 2 for i in range(0, len(matrix), group))
    return differ, mixed


def test_single_turn_grpo_scores_through_the_bridge_once_and_a_failed_row_is_nan(
    axolotl_python, nemo_gym, tmp_path
):
    rows = example_rows("mcqa")
    write_rows(tmp_path / "data" / "mcqa.jsonl", rows)
    write_rows(tmp_path / "data" / "unknown.jsonl", rows[:1])
    tiny_model(tmp_path / "tiny-llama", MCQA_VOCAB)
    config = doc_config("single-turn")
    unknown = {"path": "data/unknown.jsonl", "server_name": "no_such_server"}
    config["nemo_gym_datasets"] = [*config["nemo_gym_datasets"], unknown]
    records = train(axolotl_python, tmp_path, config, nemo_gym.head_url)
    log_text = (tmp_path / "train.log").read_text()
    assert log_text.count(REPLACED_LINE) == 1  # trl.reward_funcs listed ours: said once

    names = [r["reward_funcs"] for r in records if "reward_funcs" in r]
    assert names == [["nemo_gym", "alternating_reward"]]
    calls = [r for r in records if r.get("call") == "nemo_gym"]
    assert len(calls) == 2
    mcqa_url = nemo_gym.server_urls["mcqa"]
    failed = scored = 0
    for call in calls:
        assert len(call["completions"]) == 6
        for text, ref, row, reward in zip(
            call["completions"],
            call["resources_server_ref"],
            call["verify_extra"],
            call["rewards"],
            strict=True,
        ):
            if ref["name"] == "no_such_server":
                assert reward is None  # NaN, not 0.0
                failed += 1
            else:
                assert reward == verify_over_http(mcqa_url, row, text)
                scored += 1
    assert (failed, scored) == (2, 10)  # each of the 6 rows once, 2 generations each
    assert logged_means(records) == pytest.approx([nanmean(c["rewards"]) for c in calls])
    # the failed row's group: the user's reward differs, NeMo Gym's is missing: it must not train
    differ, _ = check_what_trains(records)
    assert differ == 2
    check_nothing_forks(records, prompt_loader=False)


def multi_turn_rows(venv: Path) -> list[dict[str, Any]]:
    """4 weather rows, the masked row, and a weather row naming an agent that does not exist."""
    weather = weather_rows(venv)[:4]
    unknown = dict(weather[0], agent_ref={"type": "responses_api_agents", "name": "no_agent"})
    return [*weather, masked_row(venv), unknown]


def user_message(row: dict[str, Any]) -> str:
    messages = row["responses_create_params"]["input"]
    return next(m["content"] for m in messages if m["role"] == "user")


@pytest.mark.nemo_gym_07  # the masked agent needs 0.7's judge_failsafe
@pytest.mark.parametrize("async_prefetch", [False, True])
def test_multi_turn_rollouts_feed_axolotls_data_producer_and_failures_are_nan_and_masked(
    async_prefetch, axolotl_python, agent_stack, nemo_gym_venv, tmp_path
):
    rows = multi_turn_rows(nemo_gym_venv)
    write_rows(tmp_path / "data" / "rows.jsonl", rows)
    tiny_model(
        tmp_path / "tiny-llama", toy_chat.VOCAB, pad="<pad>", unk="<pad>", bos="<s>", eos="</s>"
    )
    config = doc_config("multi-turn")
    config["trl"] = dict(config["trl"], async_prefetch=async_prefetch)
    sampling = {"temperature": 1.0, "top_p": 1.0}  # the trainer's, set on every row
    truths = {}
    for row in rows[:4]:
        params = {**row["responses_create_params"], **sampling}
        reply = run_over_http(agent_stack, dict(row, responses_create_params=params))
        truths[json.dumps(row["responses_create_params"], sort_keys=True)] = reply["reward"]
    # The first policy call of one weather row's rollouts answers 400: one rollout of that
    # group fails (the agent's /run fails), its group-mate does not.
    agent_stack.policy.knobs = Knobs(status=400, status_times=1, match=user_message(rows[1]))
    try:
        records = train(axolotl_python, tmp_path, config, agent_stack.head_url)
    finally:
        agent_stack.policy.reset()

    names = [r["reward_funcs"] for r in records if "reward_funcs" in r]
    assert names == [["nemo_gym", "alternating_reward"]]
    assert faulted_samples(records) == 1
    calls = [r for r in records if r.get("call") == "nemo_gym"]
    assert len(calls) == 2
    for call in calls:
        assert call["rewards"] == call["env_reward"]
        for row, reward, error in zip(
            call["verify_extra"], call["rewards"], call["rollout_error"], strict=True
        ):
            key = json.dumps(row["responses_create_params"], sort_keys=True)
            assert reward == (None if error else truths[key])
    assert logged_means(records) == pytest.approx([nanmean(c["rewards"]) for c in calls])
    # the faulted rollout's group-mate is compared with nothing (advantage 0), not with a 0.0;
    # the masked and unknown-agent groups get none although the user's function scored them
    differ, mixed = check_what_trains(records)
    assert (differ, mixed) == (2 * 4 + 2, 1)  # per batch 2 groups of 2, and the mixed one
    check_nothing_forks(records, prompt_loader=True)
    # with async_prefetch, step 2's batch was prefetched when training ended: always dropped
    # (cancelled, or finished unused), and said so; nothing else ran on after the last step
    ended = (tmp_path / "train.log").read_text().count("NeMo Gym: training ended")
    assert ended == (1 if async_prefetch else 0)


def faulted_samples(records: list[dict]) -> int:
    """Check each batch the data producer produced (12 samples, 2 of the unknown agent, each
    failed one NaN and fully masked, each other one rewarded 1.0 with its tool turns masked);
    the count of failed samples that were neither the masked agent's nor the unknown one's."""
    produced = [r["produced"] for r in records if "produced" in r]
    assert len(produced) >= 2  # with async_prefetch, the next batch may have been produced too
    faulted = 0
    for batch in produced:
        assert len(batch) == 12 and sorted(s["agent"] for s in batch).count("no_agent") == 2
        for sample in batch:
            if sample["rollout_error"] is not None:
                assert sample["env_reward"] is None
                assert sample["completion_mask"] == sample["tool_mask"] == 0
                faulted += sample["agent"] not in ("math_agent", "no_agent")
            else:
                assert sample["agent"] not in ("math_agent", "no_agent")
                assert sample["env_reward"] == 1.0
                assert sample["completion_mask"] == sample["tokens"] > sample["tool_mask"] > 0
        unknown = [s["rollout_error"] for s in batch if s["agent"] == "no_agent"]
        assert all(error.startswith("NOT_FOUND") for error in unknown)
    return faulted
