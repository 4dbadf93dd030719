"""A Ray driver for tests/test_ray_fleet.py, run on the head host of a multi-host Ray cluster
(tests/support/ray_nodes.py): `python tests/ray_fleet_run.py STEPS.json` prints one JSON list,
one result per step.

Steps ({"do": ..., ...}):
- "start": `start_bridges(serve_args, nodes=<bridges' host addresses>)` -> the registry table.
- "stop": `stop_bridges()`; "drop" (address): that node's bridge ends for good (Ray does not
  restart it) -> {"killed": actor pid}.
- "score" (size, batches, on: caller host addresses): a caller actor on each of those nodes
  scores `batches` calls of `size` mcqa items through `create_nemo_gym_reward_fn(...,
  target="ray:")` at the same time, each reading the bridge table afresh first (a caller
  would otherwise keep it up to `ray_target.CACHE_SECONDS`) -> per caller its node address,
  rewards right/wrong as expected, None count, seconds; "bridges": items each bridge answered
  meanwhile (from its Prometheus `nemo_gym_grpc_items_total`), by address; "items_per_second"
  over all callers.
- "kill" (address, after, plus score's keys): as "score", but once the bridge on `address`
  has answered `after` items of this step, its actor process is SIGKILLed -> score's result
  with "killed" (actor pid) and "answered_before_kill"; "wait_restart" (address) waits until
  the registry shows that node's bridge again, restarted -> its entry and "restart_seconds"
  (from the kill until it served again); "sleep" (seconds).
- "shares" (on, want): waits up to 90 s until each bridge on those addresses reports `want`
  limiters sharing each upstream's queue (`nemo_gym_grpc_sharing_limiters`) -> {address: the
  last value read}.

Callers are detached actors named per node (made once, reused by later drivers), holding no
CPU; the bridges' metrics port is METRICS_PORT on every node (serve args must set it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import ray
import requests
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_gym_grpc.bridge.ray import NAMESPACE, bridge_table, start_bridges, stop_bridges
from nemo_gym_grpc.bridge.ray.fleet import bridge_name
from tests.support.items import mcqa_row, wrong_letter
from tests.support.prometheus_scrape import Samples

METRICS_PORT = 9464
http = requests.Session()
http.trust_env = False


class Caller:
    """A trainer-side caller: the reward function TRL/axolotl would call, target `ray:`."""

    def __init__(self) -> None:
        from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn

        self.fn = create_nemo_gym_reward_fn(
            None, {}, target="ray:", batch_timeout=120, max_failure_fraction=1.0
        )

    def score(self, size: int, batches: int) -> dict[str, Any]:
        from nemo_gym_grpc.rewards.client import ray_target

        ray_target.forget()  # read the bridge table now (a step may have just changed it)
        row = mcqa_row()
        right = str(row["expected_answer"])
        letters = [right if i % 2 == 0 else wrong_letter(right) for i in range(size)]
        completions = [f"Let me think. \\boxed{{{x}}}" for x in letters]
        expected = [1.0 if i % 2 == 0 else 0.0 for i in range(size)]
        began = time.monotonic()
        rewards: list[Any] = []
        for _ in range(batches):
            rewards += self.fn(
                completions,
                resources_server_ref=[{"name": "mcqa"}] * size,
                verify_extra=[row] * size,
            )
        return {
            "address": ray.util.get_node_ip_address(),
            "items": size * batches,
            "as_expected": rewards == expected * batches,
            "none": sum(r is None for r in rewards),
            "wrong": sum(
                r is not None and r != e for r, e in zip(rewards, expected * batches, strict=True)
            ),
            "seconds": time.monotonic() - began,
        }


def nodes_by_address() -> dict[str, str]:
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}


def caller(address: str) -> Any:
    node = nodes_by_address()[address]
    env = {k: v for k, v in os.environ.items() if k.startswith("NEMO_GYM_GRPC_")}
    return (
        ray.remote(Caller)
        .options(
            name=f"caller-{node}",
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            runtime_env={"env_vars": env},
        )
        .remote()
    )


def metric(address: str, name: str) -> float:
    """The sum of the bridge on `address`'s samples called `name` (0 while it does not serve
    metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = http.get(f"http://{address}:{METRICS_PORT}/metrics", timeout=5).text
    except requests.RequestException:
        return 0.0
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return sum(v for (found, _), v in samples.items() if found == name)


def answered(address: str) -> float:
    """Items the bridge on `address` answered so far (0 while it does not serve metrics)."""
    return metric(address, "nemo_gym_grpc_items_total")


def shares(addresses: list[str], want: float) -> dict[str, float]:
    """The "shares" step (module docstring)."""
    deadline = time.monotonic() + 90
    while True:
        found = {a: metric(a, "nemo_gym_grpc_sharing_limiters") for a in addresses}
        if set(found.values()) == {want} or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def score(step: dict[str, Any]) -> dict[str, Any]:
    bridges = [e["address"] for e in bridge_table().values()]
    before = {a: answered(a) for a in bridges}
    began = time.monotonic()
    refs = [caller(a).score.remote(step["size"], step["batches"]) for a in step["on"]]
    result: dict[str, Any] = {}
    if step["do"] == "kill":
        result.update(kill_when(step["address"], before[step["address"]], step["after"]))
    callers = ray.get(refs)
    seconds = time.monotonic() - began
    after = {a: answered(a) for a in bridges}
    result.update(
        callers=callers,
        bridges={a: after[a] - before[a] for a in bridges},
        items_per_second=sum(c["items"] for c in callers) / seconds,
    )
    return result


def entry(address: str) -> dict[str, Any]:
    return next(e for e in bridge_table().values() if e["address"] == address)


def kill_when(address: str, base: float, count: float) -> dict[str, Any]:
    """SIGKILL the bridge actor on `address` once its bridge answered `count` items more than
    `base`."""
    deadline = time.monotonic() + 120
    while answered(address) - base < count and time.monotonic() < deadline:
        time.sleep(0.02)
    at = answered(address) - base
    pid = entry(address)["actor_pid"]
    os.kill(pid, signal.SIGKILL)
    return {"killed": pid, "answered_before_kill": at, "killed_at": time.time()}


def wait_restart(address: str, old_pid: int) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = entry(address)
        if found["actor_pid"] != old_pid and found["restarted"]:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"the bridge on {address} was not restarted")


def drop(address: str) -> dict[str, Any]:
    """End the bridge on `address` for good; returns once its actor and bridge are gone."""
    node = nodes_by_address()[address]
    found = entry(address)
    ray.kill(ray.get_actor(bridge_name(node), namespace=NAMESPACE), no_restart=True)
    deadline = time.monotonic() + 60
    while any(running(found[k]) for k in ("actor_pid", "pid")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"killed": found["actor_pid"]}


def running(pid: int) -> bool:
    """The process exists and is not a zombie (the hosts share one process table)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run(step: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    match step["do"]:
        case "start":
            nodes = [nodes_by_address()[a] for a in step["on"]]
            return start_bridges(step["serve_args"], nodes=nodes, cpus=step.get("cpus", 1))
        case "stop":
            return {"stopped": stop_bridges(grace=step.get("grace", 5.0))}
        case "drop":
            return drop(step["address"])
        case "score" | "kill":
            return score(step)
        case "wait_restart":
            found = wait_restart(step["address"], last["killed"])
            return dict(found, restart_seconds=found["serving_since"] - last["killed_at"])
        case "sleep":
            time.sleep(step["seconds"])
            return {}
        case "shares":
            return shares(step["on"], step["want"])
    raise ValueError(f"unknown step {step}")


def main() -> None:
    steps = json.loads(open(sys.argv[1]).read())
    ray.init(namespace=NAMESPACE, log_to_driver=False)
    results: list[dict[str, Any]] = []
    for step in steps:
        results.append(run(step, results[-1] if results else {}))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
