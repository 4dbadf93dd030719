"""The fleet on NeMo Gym's own Ray cluster, with the commands of docs/operating.md (Scaling out):
`ng_run` (NeMo Gym 0.7.0, its Ray kept) inside host 0 of two test hosts starts Ray and prints
its address; host 1 joins it with `ray start --address`; `python -m nemo_gym_grpc.bridge.ray
start --address ...` puts a bridge on both nodes; a trainer process on host 1 that is not part
of Ray scores with NEMO_GYM_GRPC_TARGET=ray: and reaches host 1's bridge.

Everything runs on NeMo Gym's venv's interpreter (a Ray cluster has one Python and one Ray
version) with nemo-gym-grpc[ray] on its PYTHONPATH (tests/support/gym_ray.py). Needs root
(network namespaces), as tests/test_ray_fleet.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ensure_venv
from tests.support.gym_ray import gym_pythonpath
from tests.support.hosts import hosts_for_test
from tests.support.ray_nodes import REPO, RayNodes
from tests.support.stack import NemoGymServers

pytestmark = [pytest.mark.nemo_gym, pytest.mark.nemo_gym_07]

TOKEN = "gym-cluster-test-token"
STARTED_RAY = re.compile(r"Started Ray cluster at (\S+)")


class GymCluster:
    """NeMo Gym's stack (with its Ray) on host 0, a second Ray node on host 1."""

    def __init__(self, gym: NemoGymServers, cluster: RayNodes, address: str, token: Path):
        self.gym, self.cluster, self.address, self.token = gym, cluster, address, token

    def run(self, args: list[str], host: int = 0, **env: str) -> Any:
        """`python ARGS` on host `host` with RAY_ADDRESS = NeMo Gym's cluster and `env`; its
        output."""
        env.update(NEMO_GYM_GRPC_TOKEN=TOKEN)
        out = self.cluster.driver(args, host=self.cluster.hosts[host], env=env)
        assert out.returncode == 0, f"{args}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        return out.stdout


@pytest.fixture(scope="module")
def gym_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymCluster]:
    workdir = tmp_path_factory.mktemp("gym_cluster")
    hosts = hosts_for_test(2)
    venv = ensure_venv(version="0.7.0")
    path = gym_pythonpath(venv, workdir)
    env = {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled"}
    gym = NemoGymServers(
        ("mcqa",), venv=venv, host=hosts[0].address, netns=hosts[0].name, ray=True, extra_env=env
    )
    python = str(venv / "bin" / "python")
    cluster: RayNodes | None = None
    try:
        gym.start()
        found = STARTED_RAY.search(gym.log_path.read_text())
        assert found, f"ng_run started no Ray:\n{gym.log_tail()}"
        cluster = RayNodes(
            hosts, workdir, python=python, cpus=2, pythonpath=path, join=found.group(1)
        )
        cluster.start()
        token = workdir / "token"
        token.write_text(TOKEN + "\n")
        yield GymCluster(gym, cluster, found.group(1), token)
    finally:
        gym.stop()
        (cluster or hosts).stop()


def test_the_fleet_runs_on_nemo_gyms_own_ray_cluster(gym_cluster: GymCluster) -> None:
    cluster, gym = gym_cluster.cluster, gym_cluster.gym
    assert gym_cluster.address.startswith(f"{cluster.hosts[0].address}:")  # in host 0 only
    serve = ["--head-url", gym.head_url, "--token-file", str(gym_cluster.token)]
    module = ["-m", "nemo_gym_grpc.bridge.ray"]
    table = json.loads(
        gym_cluster.run([*module, "start", "--address", gym_cluster.address, "--", *serve])
    )
    addresses = sorted(h.address for h in cluster.hosts.hosts)
    assert sorted(e["address"] for e in table.values()) == addresses
    trainer = str(REPO / "tests" / "ray_trainer_run.py")
    out = gym_cluster.run([trainer, "64"], host=1, NEMO_GYM_GRPC_TARGET="ray:")
    result = json.loads(out.splitlines()[-1])
    assert result["rewards_as_expected"] and result["none"] == 0
    assert not result["ray_was_imported"]  # the reward call joined Ray itself
    own, other = cluster.hosts[1].address, cluster.hosts[0].address
    assert result["target"] == f"ipv4:{own}:50051,{other}:50051"  # its node's bridge first
    stopped = gym_cluster.run([*module, "stop", "--address", gym_cluster.address, "--grace", "5"])
    assert stopped.strip().endswith("stopped 2 bridges")
