"""The Ray fleet tells each bridge how many bridges share the NeMo Gym servers
(`--sharing-bridges`: the fleet's bridges, one per node) unless the caller did, and a bridge
process passes it on to its adaptive limits (the rule: tests/test_adaptive_limits.py). Bridges
that keep following the fleet's size as it grows: tests/test_ray_fleet.py and, for the file
they read it from, tests/test_metrics.py.
"""

from __future__ import annotations

import pytest

from nemo_gym_grpc.bridge.process.cli import parse_args
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from tests.support.missing import require

require("ray", "pip install '.[ray]' (`make dev` installs it)")

from nemo_gym_grpc.bridge.ray.fleet import _check_flags, with_share  # noqa: E402


def test_the_fleet_adds_its_node_count_unless_given():
    args = ["--head-url", "http://127.0.0.1:11000"]
    assert with_share(args, 3) == [*args, "--sharing-bridges", "3"]
    assert with_share([*args, "--sharing-bridges", "8"], 3) == [*args, "--sharing-bridges", "8"]
    assert with_share(["--sharing-bridges=8"], 3) == ["--sharing-bridges=8"]
    assert with_share([], 0) == ["--sharing-bridges", "1"]
    fixed = ["--fixed-concurrency", "8"]
    assert with_share(fixed, 3) == fixed  # no adaptive limit: nothing to share


def test_the_flag_reaches_the_config():
    def sharing(*flags: str) -> int:
        return BridgeConfig.from_args(parse_args(["serve", *flags])).sharing_bridges

    assert (sharing("--sharing-bridges", "4"), sharing()) == (4, 1)


def test_the_file_a_bridge_follows_is_the_fleets_own():
    with pytest.raises(ValueError, match="the fleet sets"):
        _check_flags(["--head-url", "http://127.0.0.1:11000", "--sharing-bridges-file=x"])
