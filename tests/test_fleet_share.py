"""The Ray fleet tells each bridge how many bridges share the NeMo Gym servers
(`--sharing-bridges`: the fleet's bridges, one per node) unless the caller did, and a bridge
process passes it on to its adaptive limits (the rule: tests/test_adaptive_limits.py).
"""

from __future__ import annotations

from nemo_gym_grpc.bridge.process.cli import parse_args
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from tests.support.missing import require

require("ray", "pip install '.[ray]' (`make dev` installs it)")

from nemo_gym_grpc.bridge.ray.fleet import with_share  # noqa: E402


def test_the_fleet_adds_its_node_count_unless_given():
    args = ["--head-url", "http://127.0.0.1:11000"]
    assert with_share(args, 3) == [*args, "--sharing-bridges", "3"]
    assert with_share([*args, "--sharing-bridges", "8"], 3) == [*args, "--sharing-bridges", "8"]
    assert with_share(["--sharing-bridges=8"], 3) == ["--sharing-bridges=8"]
    assert with_share([], 0) == ["--sharing-bridges", "1"]


def test_the_flag_reaches_the_config():
    def sharing(*flags: str) -> int:
        return BridgeConfig.from_args(parse_args(["serve", *flags])).sharing_bridges

    assert (sharing("--sharing-bridges", "4"), sharing()) == (4, 1)
