"""The nemo-gym-grpc bridge: gRPC `nemo_gym_grpc.v1.VerifyService` in front of NeMo Gym
resources servers' HTTP `POST /verify`.

Run it with `nemo-gym-grpc serve` (see `cli.py`) or embed it with `serve(BridgeConfig(...))`.

`serve` and `BridgeConfig` load on first use (PEP 562): importing a light module of the
package (`contract`, `errors`, `flags`, `lazy`, which the trainer side imports) loads no server,
aiohttp or event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_gym_grpc.bridge.lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (the `as` marks a re-export)
    from nemo_gym_grpc.bridge.config import BridgeConfig as BridgeConfig
    from nemo_gym_grpc.bridge.server import serve as serve

# Each public name -> the module that defines it.
_HOMES = {"BridgeConfig": "nemo_gym_grpc.bridge.config", "serve": "nemo_gym_grpc.bridge.server"}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = exports(__name__, _HOMES)
