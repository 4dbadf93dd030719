"""The nemo-gym-grpc bridge: gRPC `nemo_gym_grpc.v1.VerifyService` in front of NeMo Gym
resources servers' HTTP `POST /verify`.

Run it with `nemo-gym-grpc serve` (see `cli.py`) or embed it with `serve(BridgeConfig(...))`.

`serve` and `BridgeConfig` load on first use (PEP 562): importing a light module of the
package (`contract`, `errors`, `flags`, which the trainer side imports) loads no server,
aiohttp or event loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers (the `as` marks a re-export)
    from nemo_gym_grpc.bridge.config import BridgeConfig as BridgeConfig
    from nemo_gym_grpc.bridge.server import serve as serve

# Each public name -> the module that defines it.
_HOMES = {"BridgeConfig": "nemo_gym_grpc.bridge.config", "serve": "nemo_gym_grpc.bridge.server"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
