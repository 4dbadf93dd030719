"""Loaded by every Python process of a NeMo Gym stack the harness starts without Ray.

tests/support/stack.py puts this folder first on PYTHONPATH for ng_run, which passes its
environment on to every server it starts. Python imports `sitecustomize` at start-up, so in
each of those processes this module makes NeMo Gym's `nemo_gym.server_utils.initialize_ray`
a no-op as soon as that module is loaded. ng_run then starts no Ray cluster (a local Ray binds
the machine's external interface, whatever address it is given), and no server connects to
one. None of the servers the tests run uses Ray for its work (0.7 declares `ray_enabled =
False` on them; on 0.4 they only call `initialize_ray` at start-up).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

TARGET = "nemo_gym.server_utils"


def _no_ray() -> None:
    print("initialize_ray: skipped (nemo-gym-grpc test harness: NeMo Gym runs without Ray)")


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds TARGET with the other finders, runs it, then replaces its `initialize_ray`."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                self._inner = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[union-attr]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)  # type: ignore[union-attr]
        if hasattr(module, "initialize_ray"):
            module.initialize_ray = _no_ray


sys.meta_path.insert(0, _Patcher())
