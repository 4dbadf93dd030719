"""verl 0.9.1's own Ray reward loop through the bridge fleet, on the multi-host cluster of
tests/test_ray_fleet.py: run by build/verl-venv's Python on the head host,
`python tests/verl_ray_run.py SPEC.json`, it prints one JSON object.

verl's `RewardLoopManager` starts `reward.num_workers` `RewardLoopWorker` actors, round-robin
over the cluster's nodes with soft node affinity, splits the `DataProto` into one chunk per
worker and gathers `compute_rm_score`, exactly as in a verl trainer; each worker's reward
manager (SPEC "mode", as in tests/verl_run.py) scores through `nemo_gym_grpc.rewards` with the
target `ray:`, so its items go to its own node's bridge. The job's workers run verl-venv's
Python (`runtime_env` `py_executable`; the nodes run .venv's, the same Python and Ray
versions). SPEC: {"parquet", "mode", "items", "workers", "env": worker environment}. Output:
{"scores", "rm_scores_sum", "worker_nodes": node address of each worker, "chunks": items per
worker, "bridges": items each bridge answered meanwhile, by address}.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

import pandas as pd
import ray
from verl.experimental.reward_loop.reward_loop import RewardLoopManager

from nemo_gym_grpc.bridge.ray import bridge_table
from tests.ray_fleet_run import answered
from tests.verl_run import byte_tokenizer, config, data_proto


def run(spec: dict[str, Any], tokenizer_dir: str) -> dict[str, Any]:
    tokenizer = byte_tokenizer(tokenizer_dir)
    frame = pd.read_parquet(spec["parquet"])
    data = data_proto(tokenizer, frame, spec["items"])
    cfg = config(spec["mode"], tokenizer_dir)
    cfg.reward.num_workers = spec["workers"]
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    bridges = [e["address"] for e in bridge_table().values()]
    before = {a: answered(a) for a in bridges}
    manager = RewardLoopManager(cfg)
    where = ray.get(
        [
            w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            for w in manager.reward_loop_workers
        ]
    )
    output = manager.compute_rm_score(data)
    after = {a: answered(a) for a in bridges}
    rm_scores = output.batch["rm_scores"]
    return {
        "scores": output.non_tensor_batch["score"].tolist(),
        "rm_scores_sum": rm_scores.sum(dim=-1).tolist(),
        "worker_nodes": [addresses[node] for node in where],
        "chunks": [len(chunk) for chunk in data.chunk(spec["workers"])],
        "bridges": {a: after[a] - before[a] for a in bridges},
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    ray.init(
        runtime_env={"py_executable": sys.executable, "env_vars": spec["env"]},
        log_to_driver=False,
    )
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        print(json.dumps(run(spec, tokenizer_dir)))


if __name__ == "__main__":
    main()
