"""The two errors the harness raises (both RuntimeError, so a caller may catch either alone)."""

from __future__ import annotations


class NoSuitablePython(RuntimeError):
    """No interpreter was found that can build the chosen NeMo Gym version's venv."""


class NemoGymError(RuntimeError):
    """The NeMo Gym venv could not be built, or the servers or a bridge did not start."""
