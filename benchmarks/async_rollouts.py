"""Rollouts as they finish (issue 21): time to the first training sample and rollouts/s of TRL's
synchronous `rollout_func` against the AsyncGRPOTrainer rollout worker, on the same rows in the
same run, with one slow agent.

    .venv/bin/python -m benchmarks.async_rollouts [--rounds 3] [--delay 1.0] [--calls 6]

(from the repository root). It starts the real agent stack (tests/support/agents.py: NeMo
Gym's simple_agent + vllm_model over the scripted policy, NeMo Gym 0.7.0 unless
NEMO_GYM_VERSION says otherwise) and one bridge, and makes one of the five weather rows slow:
the scripted policy waits `--delay` s before each of that row's model calls (a rollout makes
two). Then, in each round, back to back in alternating order:

- synchronous: `create_nemo_gym_rollout_func` called `--calls` times, each with every row
  twice (num_generations 2: 10 rollouts, as TRL's sampler passes them); a call returns when
  its slowest rollout is back, and only then are its samples available;
- asynchronous: `create_nemo_gym_rollout_worker` on the same rows, 10 rollouts in flight (the
  same concurrency), until as many rollouts as the synchronous side ran are in closed groups.

Time to first sample: from the start to the first sample a trainer could take (the first call's
return; the first sample in the worker's buffer). Rollouts/s: rollouts done / time until the
last was done. Per-round values and medians go to --out (async_rollouts.json and .md), and the
markdown is printed. Every server is stopped by its recorded PID.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
import types
from pathlib import Path
from typing import Any

from nemo_gym_grpc.rewards import create_nemo_gym_rollout_func, create_nemo_gym_rollout_worker
from tests.support import AgentStack, Knobs, example_rows, start_bridge
from tests.support.agents import WEATHER_AGENT, WEATHER_RESOURCES

SLOW_ROW = "humidity in sf"  # the user message of the weather row made slow
GENERATIONS = 2
WAIT = 600.0  # s, bound of every wait


def dataset_rows(venv: Path | None = None) -> list[dict[str, Any]]:
    """The weather rows as dataset rows (`prompt`, `verify_extra`)."""
    rows = example_rows(WEATHER_RESOURCES, venv)
    agent = {"type": "responses_api_agents", "name": WEATHER_AGENT}
    return [
        {
            "prompt": row["responses_create_params"]["input"],
            "verify_extra": json.dumps(dict(row, agent_ref=agent)),
        }
        for row in rows
    ]


def synchronous(target: str, rows: list[dict[str, Any]], calls: int) -> dict[str, float]:
    rollout_func = create_nemo_gym_rollout_func(target=target, rows=rows)
    # what rollout_func reads of the trainer: its sampling and its tokenizer's EOS
    trainer = types.SimpleNamespace(
        temperature=1.0, top_p=1.0, processing_class=types.SimpleNamespace(eos_token_id=2)
    )
    prompts = [row["prompt"] for row in rows for _ in range(GENERATIONS)]
    start = time.monotonic()
    first = None
    for _ in range(calls):
        output = rollout_func(prompts, trainer)
        assert all(error is None for error in output["rollout_error"]), output["rollout_error"]
        first = first or time.monotonic() - start
    elapsed = time.monotonic() - start
    done = calls * len(prompts)
    return {"first_sample_s": first or 0.0, "rollouts": done, "rollouts_per_s": done / elapsed}


def asynchronous(target: str, rows: list[dict[str, Any]], rollouts: int) -> dict[str, float]:
    args = types.SimpleNamespace(  # the AsyncGRPOConfig fields the worker reads
        num_generations=GENERATIONS,
        max_staleness=4,
        queue_maxsize=0,
        max_inflight_tasks=len(rows) * GENERATIONS,
        temperature=1.0,
        top_p=1.0,
    )
    worker = create_nemo_gym_rollout_worker(rows, args, target=target)
    start = time.monotonic()
    worker.start()
    try:
        worker.rollout_buffer.get(timeout=WAIT)
        first = time.monotonic() - start
        deadline = start + WAIT
        while worker.counts["rollouts"] < rollouts and time.monotonic() < deadline:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        done = worker.counts["rollouts"]
        assert done >= rollouts and worker.counts["failed_rollouts"] == 0, worker.counts
    finally:
        worker.stop()
    return {"first_sample_s": first, "rollouts": done, "rollouts_per_s": done / elapsed}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Slow row: `{SLOW_ROW}`, {result['delay_s']} s before each of its model calls; "
        f"{result['rounds']} rounds, medians (per round: {result['per_round_note']}).",
        "",
        "| | time to first sample (s) | rollouts/s |",
        "|---|---|---|",
    ]
    for side in ("synchronous", "asynchronous"):
        median = result["median"][side]
        lines.append(
            f"| {side} | {median['first_sample_s']:.2f} | {median['rollouts_per_s']:.2f} |"
        )
    ratio = result["median"]["ratios"]
    lines += [
        "",
        f"asynchronous / synchronous: first sample {ratio['first_sample']:.2f}x the time, "
        f"{ratio['rollouts_per_s']:.2f}x the rollouts/s (ratios taken within each round).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay", type=float, default=1.0, help="s per model call, slow row")
    parser.add_argument("--calls", type=int, default=6, help="synchronous rollout_func calls")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    options = parser.parse_args()
    # What a trainer process has loaded before the worker starts (AsyncGRPOTrainer imports it):
    # the worker's first sample would otherwise pay this import (seconds) in round 1.
    importlib.import_module("trl.experimental.async_grpo.async_rollout_worker")
    rounds: list[dict[str, Any]] = []
    with AgentStack() as stack, start_bridge("--head-url", stack.head_url) as bridge:
        rows = dataset_rows()
        assert sum(SLOW_ROW in row["verify_extra"] for row in rows) == 1
        for number in range(options.rounds):
            stack.policy.reset()
            stack.policy.knobs = Knobs(delay=options.delay, match=SLOW_ROW)
            sides = {
                "synchronous": lambda: synchronous(bridge.target, rows, options.calls),
                "asynchronous": lambda: asynchronous(
                    bridge.target, rows, options.calls * len(rows) * GENERATIONS
                ),
            }
            order = list(sides) if number % 2 == 0 else list(reversed(sides))
            measured = {side: sides[side]() for side in order}
            rounds.append({"order": order, **measured})
            print(f"round {number + 1}: {json.dumps(measured)}", flush=True)
        stack.policy.reset()
    per_call = len(rows) * GENERATIONS
    median = {
        side: {
            key: statistics.median(r[side][key] for r in rounds)
            for key in ("first_sample_s", "rollouts_per_s")
        }
        for side in ("synchronous", "asynchronous")
    }
    median["ratios"] = {
        "first_sample": statistics.median(
            r["asynchronous"]["first_sample_s"] / r["synchronous"]["first_sample_s"] for r in rounds
        ),
        "rollouts_per_s": statistics.median(
            r["asynchronous"]["rollouts_per_s"] / r["synchronous"]["rollouts_per_s"] for r in rounds
        ),
    }
    result = {
        "delay_s": options.delay,
        "calls": options.calls,
        "rounds": options.rounds,
        "per_round_note": f"{options.calls} rollout_func calls of {per_call} rollouts; the "
        f"worker until as many rollouts are done, {per_call} in flight",
        "per_round": rounds,
        "median": median,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "async_rollouts.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (options.out / "async_rollouts.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
