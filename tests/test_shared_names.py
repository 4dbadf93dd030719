"""What the trainer side shares with the bridge is declared once, on the bridge side: the message
limit and the variables both ends read (`bridge/contract.py`), the reasons of refused items
(`bridge/errors.py`), the http(s) URL rule (`bridge/flags.py`). The trainer side imports those
modules (the bridge never imports `nemo_gym_grpc.rewards`), so they and the bridge package's
`__init__` must stay light: a trainer that loads the client loads no bridge server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nemo_gym_grpc.bridge import cli as bridge_cli
from nemo_gym_grpc.bridge import contract, errors
from nemo_gym_grpc.bridge.config import BridgeConfig
from nemo_gym_grpc.rewards.client import channels, outcomes, settings

# The bridge modules the trainer side may load: the package and its light modules.
LIGHT = [
    "nemo_gym_grpc.bridge",
    *(f"nemo_gym_grpc.bridge.{m}" for m in ("contract", "errors", "flags", "lazy")),
]


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(*sys.modules)"],
        env={k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"},
        check=True,
        capture_output=True,
        text=True,
    )
    return set(done.stdout.split())


def test_the_trainer_side_loads_only_the_light_bridge_modules():
    loaded = _loaded_after(
        "import nemo_gym_grpc.rewards as r; r.reward_nemo_gym_verify; r.run_rollouts;"
        "r.create_nemo_gym_rollout_func; import nemo_gym_grpc.rewards.verl"
    )
    assert "nemo_gym_grpc.rewards.client.stream" in loaded  # the client did load
    assert sorted(m for m in loaded if m.startswith("nemo_gym_grpc.bridge")) == LIGHT
    assert "aiohttp" not in loaded


def test_the_bridge_package_loads_serve_and_bridge_config_on_first_use():
    loaded = _loaded_after("import nemo_gym_grpc.bridge")
    assert "nemo_gym_grpc.bridge.server" not in loaded and "aiohttp" not in loaded
    loaded = _loaded_after("from nemo_gym_grpc.bridge import serve, BridgeConfig")
    assert {"nemo_gym_grpc.bridge.server", "nemo_gym_grpc.bridge.config"} <= loaded
    import nemo_gym_grpc.bridge as package
    from nemo_gym_grpc.bridge import BridgeConfig as public
    from nemo_gym_grpc.bridge import config, serve, server

    assert public is config.BridgeConfig and serve is server.serve
    with pytest.raises(AttributeError, match="has no attribute 'Serve'"):
        _ = package.Serve


def test_both_ends_read_the_token_and_run_timeout_from_the_same_variables(monkeypatch):
    # An embedded bridge inherits the trainer's environment: one variable sets both ends.
    monkeypatch.setenv(contract.TOKEN_ENV, "t0ken")
    monkeypatch.setenv(contract.RUN_TIMEOUT_ENV, "7.5")
    config = BridgeConfig.from_args(bridge_cli.parse_args(["serve"]))
    assert (config.token, config.run_timeout) == ("t0ken", 7.5)
    assert settings.security(tls=False).token == "t0ken" and settings.run_timeout() == 7.5


def test_both_ends_default_to_the_same_message_limit():
    options = dict(channels.CHANNEL_OPTIONS)
    limit = BridgeConfig().max_message_bytes
    assert options["grpc.max_receive_message_length"] == limit
    assert options["grpc.max_send_message_length"] == limit


def test_client_only_reasons_do_not_collide_with_bridge_reasons():
    bridge_reasons = {
        value for name, value in vars(errors).items() if name.isupper() and isinstance(value, str)
    }
    assert errors.UPSTREAM_TIMEOUT in bridge_reasons  # the scan finds the reason constants
    client_reasons = {
        value for name, value in vars(outcomes).items() if name.isupper() and isinstance(value, str)
    }
    assert outcomes.NO_TOKENS in client_reasons
    assert client_reasons.isdisjoint(bridge_reasons)
