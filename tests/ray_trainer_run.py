"""A trainer process on a Ray node that is not part of Ray (a TRL run beside the cluster): it
scores mcqa items with `reward_nemo_gym_verify` and NEMO_GYM_GRPC_TARGET=ray:, so the
reward call itself joins the cluster (env RAY_ADDRESS) and picks this node's bridge.

`python tests/ray_trainer_run.py SIZE` prints {"rewards_as_expected", "none", "target"
(what `ray:` resolved to), "ray_was_imported" (before the call: False)}.
"""

from __future__ import annotations

import json
import sys

from nemo_gym_grpc.rewards import reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import ray_target
from tests.support.items import mcqa_row, wrong_letter


def main() -> None:
    size = int(sys.argv[1])
    row = mcqa_row()
    right = str(row["expected_answer"])
    letters = [right if i % 2 == 0 else wrong_letter(right) for i in range(size)]
    before = "ray" in sys.modules
    rewards = reward_nemo_gym_verify(
        [f"\\boxed{{{x}}}" for x in letters],
        resources_server_ref=[{"name": "mcqa"}] * size,
        verify_extra=[row] * size,
    )
    expected = [1.0 if i % 2 == 0 else 0.0 for i in range(size)]
    print(
        json.dumps(
            {
                "rewards_as_expected": rewards == expected,
                "none": sum(r is None for r in rewards),
                "target": ray_target.resolve("ray:"),
                "ray_was_imported": before,
            }
        )
    )


if __name__ == "__main__":
    main()
