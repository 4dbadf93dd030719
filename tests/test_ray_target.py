"""The target `ray:` without a cluster: the order of the bridges (own node first, then a
rotation), the gRPC target built from them, the pick_first channel, the names the two sides
share, and the fleet's refusal of flags it sets itself. The cluster itself:
tests/test_ray_fleet.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

pytest.importorskip("ray")  # the `ray` extra (`make dev` installs it)

from nemo_gym_grpc.bridge.ray import fleet
from nemo_gym_grpc.rewards.client import channels, ray_target
from tests.support import closed_port

TABLE = {node: {"target": f"10.0.0.{i}:50051"} for i, node in enumerate("abcd", start=1)}


@pytest.mark.parametrize(
    ("own", "expected"),
    [
        ("a", [1, 2, 3, 4]),
        ("c", [3, 4, 1, 2]),
        ("d", [4, 1, 2, 3]),
        ("bb", [3, 4, 1, 2]),  # a node without a bridge: the rotation starts after it
        ("z", [1, 2, 3, 4]),
    ],
)
def test_the_own_nodes_bridge_comes_first_then_the_others_in_rotation(own, expected):
    assert ray_target.order(TABLE, own) == [f"10.0.0.{i}:50051" for i in expected]


def test_the_grpc_target_lists_every_bridge_in_one_family():
    assert ray_target.grpc_target(["10.0.0.2:1", "10.0.0.1:1"]) == "ipv4:10.0.0.2:1,10.0.0.1:1"
    assert ray_target.grpc_target(["fd00::2:7", "[fd00::1]:7"]) == "ipv6:[fd00::2]:7,[fd00::1]:7"
    with pytest.raises(ValueError, match="both IPv4 and IPv6"):
        ray_target.grpc_target(["10.0.0.1:1", "fd00::1:1"])
    with pytest.raises(ValueError, match="has no bridges"):
        ray_target.grpc_target([])


def test_only_ray_colon_is_the_ray_form_and_other_targets_pass_through():
    assert ray_target.is_ray("ray:") and ray_target.is_ray(" ray: ")
    assert not ray_target.is_ray("ray:10.0.0.1:6379") and not ray_target.is_ray(None)
    assert ray_target.resolve("ipv4:10.0.0.1:1,10.0.0.2:1") == "ipv4:10.0.0.1:1,10.0.0.2:1"


def test_a_ray_target_falls_back_with_pick_first_and_the_other_options_unchanged(monkeypatch):
    made = []
    monkeypatch.setattr(ray_target, "resolve", lambda target: "ipv4:10.0.0.3:1,10.0.0.1:1")
    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda *a, **k: made.append((a, k)))
    channels.aio_channel("ray:")
    ((args, kwargs),) = made
    assert args == ("ipv4:10.0.0.3:1,10.0.0.1:1",)
    options = dict(kwargs["options"])
    config = json.loads(options.pop("grpc.service_config"))
    assert config == {"loadBalancingConfig": [{"pick_first": {}}]}
    assert options == {k: v for k, v in channels.CHANNEL_OPTIONS if k != "grpc.service_config"}


def test_both_sides_name_the_fleets_ray_namespace_and_registry_alike():
    assert (ray_target.NAMESPACE, ray_target.REGISTRY_NAME) == (
        fleet.NAMESPACE,
        fleet.REGISTRY_NAME,
    )


@pytest.mark.parametrize("flag", ["--listen", "--workers=2", "--ready-file", "--exit-with-parent"])
def test_the_fleet_refuses_the_flags_it_sets_itself(flag):
    with pytest.raises(ValueError, match="the fleet sets"):
        fleet.start_bridges(["--head-url", "http://10.0.0.1:11000", flag, "x"])


def test_the_fleet_loads_nothing_of_the_trainer_side():
    probe = (
        "import sys, nemo_gym_grpc.bridge.ray.__main__, nemo_gym_grpc.bridge.ray.actors;"
        "print([m for m in sys.modules if m.startswith('nemo_gym_grpc.rewards')])"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


class _Context:
    """What `own_node` reads of Ray's runtime context (a stand-in: no cluster here)."""

    gcs_address = "127.0.0.1:6379"

    def get_node_id(self) -> str:
        return "attached"


class _Ray:
    def get_runtime_context(self) -> _Context:
        return _Context()


def test_the_own_node_is_the_one_on_this_hosts_address_else_the_attached_one():
    assert ray_target.local_address("127.0.0.1:6379") == "127.0.0.1"
    here = {"n1": "10.0.0.1", "n2": "127.0.0.1"}
    assert ray_target.own_node(_Ray(), here) == "n2"
    assert ray_target.own_node(_Ray(), {"n1": "10.0.0.1"}) == "attached"
    two = {"n1": "127.0.0.1", "n2": "127.0.0.1"}  # two raylets on one address
    assert ray_target.own_node(_Ray(), two) == "attached"


def test_the_home_address_is_the_first_of_the_target():
    assert ray_target.home("ipv4:10.0.0.3:1,10.0.0.1:1") == "10.0.0.3:1"
    assert ray_target.home("ipv6:[fd00::2]:7,[fd00::1]:7") == "[fd00::2]:7"


def test_a_sync_ray_call_goes_on_the_own_bridges_channel_while_it_answers(monkeypatch):
    own, other = f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"
    bridges = f"ipv4:{own},{other}"
    monkeypatch.setattr(ray_target, "resolve", lambda target: bridges)
    down = channels.shared("ray:")  # own down: pick_first over both, own first
    assert down is not channels.shared(own) and down is not channels.shared(bridges)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_insecure_port(own)
    server.start()
    try:
        deadline = time.monotonic() + 10
        home = channels.shared("ray:")
        while home is down and time.monotonic() < deadline:  # gRPC's reconnect backoff
            home = channels.shared("ray:")
        assert home is channels.shared(own)  # back home as soon as it answers
        assert channels.shared("ray:") is home
    finally:
        server.stop(None)


def test_the_fleet_command_without_ray_says_what_to_install_in_one_line():
    # was: a traceback ending in "ModuleNotFoundError: No module named 'ray'"
    hide_ray = (
        "import runpy, sys; sys.modules['ray'] = None; sys.argv = ['ray', 'status']; "
        "runpy.run_module('nemo_gym_grpc.bridge.ray', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide_ray], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "python -m nemo_gym_grpc.bridge.ray needs Ray 2.60, the [ray] extra: "
        "pip install '.[ray]' in a clone of nemo-gym-grpc"
    ]
