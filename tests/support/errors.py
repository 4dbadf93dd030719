"""The two errors the harness raises (both RuntimeError, so a caller may catch either alone)."""

from __future__ import annotations


class NoSuitablePython(RuntimeError):
    """No Python >= 3.12 interpreter was found to build the NeMo Gym venv with."""


class NemoGymError(RuntimeError):
    """The NeMo Gym venv could not be built, or the servers or a bridge did not start."""
