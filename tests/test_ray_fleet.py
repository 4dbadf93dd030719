"""Across machines on Ray, for real: three network namespaces made by the test (hosts with their
own addresses on a link of their own, tests/support/hosts.py), a Ray node in each
(tests/support/ray_nodes.py), NeMo Gym 0.7's mcqa behind its head server on host 1 (ng_run
inside that host, bound to its address), the fleet (`nemo_gym_grpc.bridge.ray`: a bridge actor
per node) and trainer-side callers as Ray actors on every node, each scoring through
`create_nemo_gym_reward_fn(..., target="ray:")` (tests/ray_fleet_run.py drives them).

Needs root (network namespaces); CI runs as root, and there a missing capability fails the
module instead of skipping it. The numbers of the throughput curve go to
build/ray_fleet_results.json (docs/performance.md quotes a run).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stacks_common import VERL_PYTHON, answers, export_examples
from tests.support import ensure_venv
from tests.support.hosts import Hosts, hosts_for_test
from tests.support.listeners import stray_sockets
from tests.support.ray_nodes import REPO, RayNodes
from tests.support.stack import NemoGymServers

pd = pytest.importorskip("pandas")  # the test-trl group of `make dev` installs it

pytestmark = pytest.mark.nemo_gym

TOKEN = "ray-fleet-test-token"
RESULTS = REPO / "build" / "ray_fleet_results.json"


def record(key: str, value: Any) -> None:
    """Add `value` under `key` to RESULTS (the numbers docs/performance.md quotes)."""
    RESULTS.parent.mkdir(exist_ok=True)
    found = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps(dict(found, **{key: value}), indent=2) + "\n")


class Fleet:
    """The module's cluster: hosts, Ray nodes, the NeMo Gym stack and the bridges' flags."""

    def __init__(self, hosts: Hosts, cluster: RayNodes, gym: NemoGymServers, workdir: Path):
        self.hosts, self.cluster, self.gym = hosts, cluster, gym
        self.addresses = [h.address for h in hosts.hosts]
        token = workdir / "token"
        token.write_text(TOKEN + "\n")
        self.serve_args = ["--head-url", gym.head_url, "--token-file", str(token)]
        self.serve_args += ["--metrics-port", "9464", "--metrics-host", "0.0.0.0"]
        self.workdir = workdir

    def start(self, on: list[str] | None = None) -> dict[str, Any]:
        """A `start` step: bridges on the hosts `on` (default all)."""
        return {"do": "start", "serve_args": self.serve_args, "on": on or self.addresses}

    def score(self, size: int = 200, batches: int = 2, **extra: Any) -> dict[str, Any]:
        """A `score` step: callers on every host."""
        return {"do": "score", "size": size, "batches": batches, "on": self.addresses, **extra}

    def run(self, *steps: dict[str, Any]) -> list[dict[str, Any]]:
        """Run tests/ray_fleet_run.py with `steps` on the head host; its results."""
        result: list[dict[str, Any]] = self.drive("ray_fleet_run.py", list(steps))
        return result

    def drive(self, script: str, spec: Any, python: str | None = None) -> Any:
        """tests/<script> SPEC.json run on the head host; the JSON it printed last."""
        path = self.workdir / "spec.json"
        path.write_text(json.dumps(spec))
        out = self.cluster.driver(
            [str(REPO / "tests" / script), str(path)],
            env={"NEMO_GYM_GRPC_TOKEN": TOKEN},
            python=python,
        )
        assert out.returncode == 0, f"driver failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("ray_fleet")
    hosts = hosts_for_test(3)
    cluster = RayNodes(hosts, workdir, cpus=2)
    try:
        cluster.start()
        gym = NemoGymServers(("mcqa",), host=hosts[1].address, netns=hosts[1].name)
        gym.start()
        try:
            yield Fleet(hosts, cluster, gym, workdir)
        finally:
            gym.stop()
    finally:
        cluster.stop()


def _listeners(fleet: Fleet, port: int) -> dict[str, list[str]]:
    """{host address: local addresses listening on `port` inside that host}."""
    found = {}
    for host in fleet.hosts.hosts:
        out = fleet.hosts.run(host, ["ss", "-Htln", "sport", "=", str(port)]).stdout
        found[host.address] = [line.split()[3] for line in out.splitlines()]
    return found


def test_each_callers_items_go_to_its_own_nodes_bridge(fleet: Fleet) -> None:
    table, scored = fleet.run(fleet.start(), fleet.score())
    assert sorted(e["address"] for e in table.values()) == sorted(fleet.addresses)
    assert {e["target"] for e in table.values()} == {f"{a}:50051" for a in fleet.addresses}
    for caller in scored["callers"]:
        assert caller["as_expected"] and caller["none"] == 0, caller
        assert scored["bridges"][caller["address"]] == caller["items"]  # its own node's bridge
    # every bridge listens on its own host's address only; nothing of the test's beyond
    # loopback in the machine's own namespace
    for address, local in _listeners(fleet, 50051).items():
        assert [a.replace("[::ffff:", "").replace("]", "") for a in local] == [f"{address}:50051"]
    assert stray_sockets() == []


def test_items_per_second_with_1_2_and_3_bridge_nodes(fleet: Fleet) -> None:
    curve = {}
    for count in (1, 2, 3):
        on = fleet.addresses[:count]
        *_, scored = fleet.run({"do": "stop"}, fleet.start(on), fleet.score(256, 4))
        for caller in scored["callers"]:
            assert caller["as_expected"], caller
        assert {a for a, n in scored["bridges"].items() if n} == set(on)
        assert sum(scored["bridges"].values()) == 3 * 256 * 4
        curve[count] = round(scored["items_per_second"], 1)
    record("items_per_second_by_bridge_nodes", curve)


def test_bridges_started_before_the_fleet_grew_keep_their_share_of_its_size(fleet: Fleet) -> None:
    first = fleet.addresses[:1]
    _, _, alone, _, grown = fleet.run(
        {"do": "stop"},
        fleet.start(first),
        {"do": "shares", "on": first, "want": 1},
        fleet.start(),  # two nodes join: their bridges start told 3, the first is told by its actor
        {"do": "shares", "on": fleet.addresses, "want": 3},
    )
    assert alone == {first[0]: 1}
    assert grown == {address: 3 for address in fleet.addresses}


def test_a_bridge_actor_sigkilled_mid_batch_every_item_one_outcome_then_ray_restarts_it(
    fleet: Fleet,
) -> None:
    victim = fleet.addresses[1]
    kill = fleet.score(2000, 1, do="kill", address=victim, after=300)
    backoff = {"do": "sleep", "seconds": 6}  # gRPC's reconnect backoff (at most 5 s)
    _, killed, restarted, _, later = fleet.run(
        fleet.start(), kill, {"do": "wait_restart", "address": victim}, backoff, fleet.score()
    )
    assert 300 <= killed["answered_before_kill"] < 2000  # mid-batch
    for caller in killed["callers"]:
        assert caller["items"] == 2000 and caller["wrong"] == 0, caller
        assert caller["as_expected"], caller  # every item scored (redispatched)
    record(
        "kill",
        {
            "answered_before_kill": killed["answered_before_kill"],
            "callers": killed["callers"],
            "restart_seconds": round(restarted["restart_seconds"], 2),
            "later_by_bridge": later["bridges"],
        },
    )
    assert restarted["restarted"] and restarted["actor_pid"] != killed["killed"]
    assert restarted["target"] == f"{victim}:50051"
    for caller in later["callers"]:
        assert caller["as_expected"], caller
        assert later["bridges"][caller["address"]] == caller["items"]  # the restarted one too


def test_a_nodes_bridge_gone_its_callers_fall_back_to_another_nodes(fleet: Fleet) -> None:
    gone, alive = fleet.addresses[2], fleet.addresses[:2]
    _, dropped, scored, shrunk, _ = fleet.run(
        fleet.start(),
        {"do": "drop", "address": gone},
        fleet.score(),
        {"do": "shares", "on": alive, "want": 2},  # once the gone one's entry lapsed (30 s)
        fleet.start(),
    )
    assert dropped["killed"]
    record("fallback", {"gone": gone, "by_bridge": scored["bridges"], "callers": scored["callers"]})
    for caller in scored["callers"]:
        assert caller["as_expected"] and caller["none"] == 0, caller
    assert scored["bridges"].get(gone, 0) == 0  # no bridge answers there
    others = {a: n for a, n in scored["bridges"].items() if a != gone}
    assert sum(others.values()) == 3 * 400  # the fallen-back caller's items went to another
    assert shrunk == {address: 2 for address in alive}  # the others' share grew back


def test_the_fleet_command_line_starts_lists_and_stops_bridges(fleet: Fleet) -> None:
    module = ["-m", "nemo_gym_grpc.bridge.ray"]
    stopped = fleet.cluster.driver([*module, "stop", "--grace", "5"])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    started = fleet.cluster.driver([*module, "start", "--", *fleet.serve_args])
    assert started.returncode == 0, started.stderr[-3000:]
    table = json.loads(started.stdout)
    assert sorted(e["address"] for e in table.values()) == sorted(fleet.addresses)
    status = fleet.cluster.driver([*module, "status"])
    assert json.loads(status.stdout) == table
    bad = fleet.cluster.driver([*module, "start", "--", "--listen", "0.0.0.0:1"])
    assert bad.returncode == 2 and "the fleet sets --listen" in bad.stderr
    assert json.loads(fleet.cluster.driver([*module, "status"]).stdout) == table
    stopped = fleet.cluster.driver([*module, "stop", "--grace", "5"])
    assert stopped.stdout.strip().endswith("stopped 3 bridges")
    assert all(not local for local in _listeners(fleet, 50051).values())
    # a bridge on a node's address without a token, TLS or --insecure refuses to start
    open_flags = [f for f in fleet.serve_args if f != "--token-file" and "token" not in f]
    refused = fleet.cluster.driver([*module, "start", "--", *open_flags])
    assert refused.returncode == 1 and "refusing to listen on non-loopback" in refused.stderr
    again = fleet.cluster.driver([*module, "start", "--", *fleet.serve_args])  # then it starts
    assert again.returncode == 0 and len(json.loads(again.stdout)) == 3


def test_verls_own_ray_reward_loop_scores_through_each_workers_node_bridge(fleet: Fleet) -> None:
    # verl's NaiveRewardManager calling compute_score (tests/test_verl.py has both managers)
    if not VERL_PYTHON.exists():
        pytest.fail(f"{VERL_PYTHON} missing: `make dev` builds it (verl 0.9.1)", pytrace=False)
    parquet = export_examples(ensure_venv(), fleet.workdir, "verl")["mcqa"]
    rows = pd.read_parquet(parquet)
    items, expected = [], []
    for index in range(30):
        record = rows.iloc[index % len(rows)]
        right, wrong = answers("mcqa", json.loads(record["extra_info"]["nemo_gym_row"]))
        items.append({"row": index % len(rows), "completion": right if index % 2 else wrong})
        expected.append(1.0 if index % 2 else 0.0)
    fleet.run(fleet.start())
    env = {"NEMO_GYM_GRPC_TARGET": "ray:", "NEMO_GYM_GRPC_TOKEN": TOKEN}
    spec = {"parquet": str(parquet), "mode": "naive", "items": items, "workers": 3, "env": env}
    result = fleet.drive("verl_ray_run.py", spec, python=str(VERL_PYTHON))
    assert result["scores"] == expected and result["rm_scores_sum"] == expected
    # verl placed a worker on every node; each worker's chunk went to its own node's bridge
    assert sorted(result["worker_nodes"]) == sorted(fleet.addresses)
    by_node = dict(zip(result["worker_nodes"], result["chunks"], strict=True))
    assert result["bridges"] == by_node
