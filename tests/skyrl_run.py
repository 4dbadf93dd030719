"""Runs in the skyrl venv (tests/support/skyrl_venv.py), for tests/test_skyrl_generator.py:
`NemoGymGenerator.generate` on a batch made with skyrl 0.4.0's own types (`GeneratorInput`,
`TrajectoryID`), as SkyRL's trainer calls a generator; its output printed as JSON.

    python -m tests.skyrl_run < batch.json

batch.json: {"target": bridge, "eos": id, "rows": [NeMo Gym row, ...],
"ids": [[instance_id, repetition_id], ...]} (one id per row).
"""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, TrajectoryID

from nemo_gym_grpc.rewards.skyrl.generator import NemoGymGenerator


def main() -> None:
    spec = json.load(sys.stdin)
    rows = spec["rows"]
    batch = GeneratorInput(
        prompts=[row["responses_create_params"]["input"] for row in rows],
        env_classes=["nemo_gym"] * len(rows),
        env_extras=[{"nemo_gym_row": json.dumps(row)} for row in rows],
        sampling_params={"temperature": 1.0, "max_tokens": 64},
        trajectory_ids=[TrajectoryID(instance_id=i, repetition_id=r) for i, r in spec["ids"]],
        batch_metadata=None,
    )
    tokenizer = SimpleNamespace(eos_token_id=spec["eos"])
    generator = NemoGymGenerator(tokenizer, target=spec["target"])
    assert isinstance(generator, GeneratorInterface)
    output = dict(asyncio.run(generator.generate(batch)))
    output["trajectory_ids"] = [t.to_string() for t in output["trajectory_ids"]]
    json.dump(output, sys.stdout)


if __name__ == "__main__":
    main()
