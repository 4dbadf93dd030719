"""Public names of a package loaded on first use (PEP 562): importing the package, or a light
module of it, loads none of the modules that define them. The bridge's `__init__` uses it (its
`serve` and `BridgeConfig` load the server), and so does the trainer side's
(`nemo_gym_grpc.rewards`, whose names load the gRPC client)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package` (its `__name__`), whose public
    names are `homes` (name -> the module that defines it): a name is imported from its module
    on first use, then kept in the package's namespace. The `__getattr__` raises
    AttributeError for any other name, as a module does."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
