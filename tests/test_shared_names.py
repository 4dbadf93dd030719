"""What the trainer side shares with the bridge is declared once, in `nemo_gym_grpc.shared`
(proto/nemo_gym_grpc/shared/), beside the contract: the message limit and the variables both
ends read (`contract`), the reasons of failed items (`reasons`), the http(s) URL rule (`flags`).
Both halves import it (the bridge never imports `nemo_gym_grpc.rewards`), so it stays light:
a trainer that loads the client loads no bridge module at all."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from nemo_gym_grpc.bridge.process import cli as bridge_cli
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.rewards.client import channels, outcomes, settings
from nemo_gym_grpc.shared import contract, reasons


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


def test_the_trainer_side_loads_no_bridge_module():
    loaded = _loaded_after(
        "import nemo_gym_grpc.rewards as r; r.reward_nemo_gym_verify; r.run_rollouts;"
        "r.create_nemo_gym_rollout_func; import nemo_gym_grpc.rewards.verl"
    )
    assert "nemo_gym_grpc.rewards.client.stream" in loaded  # the client did load
    assert [m for m in loaded if m.startswith("nemo_gym_grpc.bridge")] == []
    assert "aiohttp" not in loaded


def test_the_bridge_package_loads_serve_and_bridge_config_on_first_use():
    loaded = _loaded_after("import nemo_gym_grpc.bridge")
    assert "nemo_gym_grpc.bridge.rpc.server" not in loaded and "aiohttp" not in loaded
    loaded = _loaded_after("from nemo_gym_grpc.bridge import serve, BridgeConfig")
    assert {"nemo_gym_grpc.bridge.rpc.server", "nemo_gym_grpc.bridge.process.config"} <= loaded
    import nemo_gym_grpc.bridge as package
    from nemo_gym_grpc.bridge import BridgeConfig as public
    from nemo_gym_grpc.bridge import serve
    from nemo_gym_grpc.bridge.process import config
    from nemo_gym_grpc.bridge.rpc import server

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
        value for name, value in vars(reasons).items() if name.isupper() and isinstance(value, str)
    }
    assert reasons.UPSTREAM_TIMEOUT in bridge_reasons  # the scan finds the reason constants
    client_reasons = {
        value for name, value in vars(outcomes).items() if name.isupper() and isinstance(value, str)
    }
    assert outcomes.NO_TOKENS in client_reasons
    assert client_reasons.isdisjoint(bridge_reasons)


def test_both_ends_default_to_the_same_verify_timeout_and_head_server():
    from nemo_gym_grpc.rewards.trl.functions import create_nemo_gym_reward_fn

    default = inspect.signature(create_nemo_gym_reward_fn).parameters["verify_timeout"].default
    assert BridgeConfig().verify_timeout == default == contract.VERIFY_TIMEOUT
    assert settings.head_url() == contract.DEFAULT_HEAD_URL


def test_the_shared_layer_loads_no_bridge_and_no_trainer_side():
    loaded = _loaded_after(
        "import nemo_gym_grpc.shared.child, nemo_gym_grpc.shared.contract,"
        "nemo_gym_grpc.shared.flags, nemo_gym_grpc.shared.lazy, nemo_gym_grpc.shared.reasons"
    )
    assert "nemo_gym_grpc.shared.child" in loaded
    ours = {m for m in loaded if m.startswith("nemo_gym_grpc.")}
    assert not {m for m in ours if m.startswith(("nemo_gym_grpc.bridge", "nemo_gym_grpc.rewards"))}
    assert "aiohttp" not in loaded
