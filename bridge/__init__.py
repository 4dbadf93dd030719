"""The nemo-gym-grpc bridge: the gRPC services of `nemo_gym_grpc.v1` in front of NeMo Gym's
HTTP servers (`POST /verify` on resources servers, `POST /run` on agents and environment
servers). Its parts: the gRPC face (`rpc`), the flows from an item to its outcome (`flows`),
NeMo Gym's HTTP API (`nemo_gym`), the running process (`process`) and a bridge per Ray node
(`ray`); `errors` is the per-item failure they all raise.

Run it with `nemo-gym-grpc serve` (`process.cli`) or embed it with `serve(BridgeConfig(...))`;
both load on first use (PEP 562): importing the package loads no server, aiohttp or event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_gym_grpc.shared.lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (the `as` marks a re-export)
    from nemo_gym_grpc.bridge.process.config import BridgeConfig as BridgeConfig
    from nemo_gym_grpc.bridge.rpc.server import serve as serve

# Each public name -> the module that defines it.
_HOMES = {
    "BridgeConfig": "nemo_gym_grpc.bridge.process.config",
    "serve": "nemo_gym_grpc.bridge.rpc.server",
}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = exports(__name__, _HOMES)
