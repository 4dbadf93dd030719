"""What a test does when something it needs is not there: CI installs everything the tests
need, so there it fails; in a smaller checkout it is skipped, saying what is missing."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def missing(message: str, *, module_level: bool = False) -> NoReturn:
    """Fail under CI (env CI set), else skip (the whole module with `module_level`)."""
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=module_level)


def require(name: str, hint: str) -> ModuleType:
    """Module `name`, imported; `missing` (module level) when it is not installed, with `hint`
    (how to install it)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{name} is not installed ({exc}); {hint}", module_level=True)
