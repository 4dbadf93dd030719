"""Scoring time of one single-turn GRPO step: this project's axolotl plugin vs axolotl's own.

Runs in the axolotl venv (tests/support/axolotl_venv.py) against a running NeMo Gym with mcqa:

    build/axolotl-venv/bin/python benchmarks/axolotl_scoring.py --head-port PORT \\
        --rows mcqa.jsonl [--batch 64 256] [--rounds 5]

Both reward functions are built the way each plugin builds its own in `post_trainer_create`
(axolotl's `create_nemo_gym_reward_fn` over the endpoints its `register` discovered; ours over
an embedded bridge on the same head server), and get the same batch: the rows repeated to
`--batch` completions, half right and half wrong answers, with the columns axolotl's loader
makes. A round calls each once, in alternating order; the median wall time per batch size is
printed as JSON, with the two functions' rewards checked equal. One warm-up call each first
(the embedded bridge's start and discovery are not part of a step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from axolotl.integrations.nemo_gym import rewards as axolotl_rewards
from axolotl.integrations.nemo_gym import server as axolotl_server

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn
from nemo_gym_grpc.rewards.client import embedded


def batch_of(rows: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """`size` completions over `rows` (in turn), right and wrong answers alternating."""
    completions, refs, extras, prompts = [], [], [], []
    for index in range(size):
        row = rows[index % len(rows)]
        letter = row["expected_answer"] if index % 2 == 0 else "Z"
        completions.append([{"role": "assistant", "content": f"\\boxed{{{letter}}}"}])
        refs.append({"name": "mcqa"})
        extras.append(row)
        prompts.append(
            [{"role": "user", "content": row["responses_create_params"]["input"][0]["content"]}]
        )
    return {
        "completions": completions,
        "prompts": prompts,
        "resources_server_ref": refs,
        "verify_extra": extras,
    }


def timed(func: Any, batch: dict[str, Any]) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    rewards = func(**batch)
    return time.perf_counter() - started, list(rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-port", type=int, required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.rows) if line.strip()]
    config = axolotl_server.get_server_configs(head_port=args.head_port)
    endpoints = {"mcqa": axolotl_server.get_verify_endpoint(config, "mcqa")}
    theirs = axolotl_rewards.create_nemo_gym_reward_fn(config, endpoints, "axolotl-model", 30)
    target = embedded.ensure_bridge(
        embedded.BridgeSpec(head_url=f"http://127.0.0.1:{args.head_port}", verify_timeout=30)
    )
    ours = create_nemo_gym_reward_fn(config, endpoints, "axolotl-model", 30, target=target)
    results = {}
    for size in args.batch:
        batch = batch_of(rows, size)
        timed(theirs, batch_of(rows, 2))
        timed(ours, batch_of(rows, 2))
        times: dict[str, list[float]] = {"axolotl": [], "nemo_gym_grpc": []}
        for round_ in range(args.rounds):
            order = [("axolotl", theirs), ("nemo_gym_grpc", ours)]
            for name, func in order if round_ % 2 == 0 else order[::-1]:
                seconds, rewards = timed(func, batch)
                times[name].append(seconds)
                assert rewards == [1.0 if i % 2 == 0 else 0.0 for i in range(size)], name
        medians = {name: statistics.median(values) for name, values in times.items()}
        results[size] = {
            "median_seconds": medians,
            "ratio_axolotl_over_ours": medians["axolotl"] / medians["nemo_gym_grpc"],
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
