"""Which NeMo Gym the harness runs, and with which Python.

Two versions are supported: 0.7.0 (the default, what PyPI serves today) and 0.4.0. Env
NEMO_GYM_VERSION chooses one (selected_version()); every function that takes `version=` uses it
when given None. Each version has its own package set (SPECS) and interpreter rule:

- 0.7.0 declares Requires-Python >= 3.13.14. A real >= 3.13.14 (python3.14, python3.13 on PATH,
  pyenv's versions/3.14*, 3.13*) is preferred; else the newest 3.13.x is used with
  `pip install --ignore-requires-python` (this machine has only CPython 3.13.0, on which 0.7.0
  installs and runs that way).
- 0.4.0 declares >= 3.12; 3.12 is preferred, then 3.13.

Env NEMO_GYM_PYTHON names the interpreter instead (it must meet the version's minor-level
requirement; a too-old micro gets --ignore-requires-python as above).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.errors import NemoGymError, NoSuitablePython

DEFAULT_VERSION = "0.7.0"


@dataclass(frozen=True)
class VersionSpec:
    """What one NeMo Gym version needs: its pip packages, the modules a finished venv must
    import, the Requires-Python it declares, and the minors to look for (preferred first)."""

    version: str
    packages: tuple[str, ...]
    import_check: tuple[str, ...]
    requires_python: tuple[int, int, int]
    minors: tuple[int, ...]
    build_cost: str


SPECS = {
    # The default servers' requirements.txt in the 0.7.0 wheel: mcqa needs tiktoken,
    # reasoning_gym reasoning-gym, math_with_judge math-verify==0.8.0 (and datasets, which
    # nemo-gym itself depends on); the others need nothing beyond nemo-gym.
    "0.7.0": VersionSpec(
        "0.7.0",
        ("nemo-gym==0.7.0", "tiktoken", "math-verify==0.8.0", "reasoning-gym"),
        ("nemo_gym", "tiktoken", "math_verify", "reasoning_gym"),
        (3, 13, 14),
        (14, 13),
        "about 3 minutes and 1.6 GB of disk on a 2-core machine with a fast PyPI mirror",
    ),
    "0.4.0": VersionSpec(
        "0.4.0",
        ("nemo-gym==0.4.0", "reasoning-gym", "math-verify"),
        ("nemo_gym", "reasoning_gym", "math_verify"),
        (3, 12, 0),
        (12, 13),
        "about 3 minutes and 1.5 GB of disk on a 2-core machine with a fast PyPI mirror",
    ),
}


def selected_version() -> str:
    """Env NEMO_GYM_VERSION (one of SPECS), else DEFAULT_VERSION. NemoGymError otherwise."""
    version = os.environ.get("NEMO_GYM_VERSION") or DEFAULT_VERSION
    if version not in SPECS:
        raise NemoGymError(f"NEMO_GYM_VERSION={version} is not one of {', '.join(SPECS)}")
    return version


def spec(version: str | None = None) -> VersionSpec:
    """The VersionSpec of `version` (None: selected_version()). NemoGymError if unknown."""
    version = version or selected_version()
    if version not in SPECS:
        raise NemoGymError(f"NeMo Gym {version} is not supported (only {', '.join(SPECS)})")
    return SPECS[version]


def install_hint(version: str | None = None) -> str:
    """What to install when no interpreter for `version` is found."""
    need = spec(version).requires_python
    return (
        f"The real NeMo Gym {spec(version).version} servers need Python >= "
        f"{need[0]}.{need[1]} (nemo-gym {spec(version).version} declares >= "
        f"{'.'.join(map(str, need))}). Install one (e.g. `pyenv install 3.{need[1]}`), then put "
        f"`python3.{need[1]}` on PATH or point NEMO_GYM_PYTHON at it."
    )


def python_version(executable: str) -> tuple[int, int, int] | None:
    """(major, minor, micro) reported by running the interpreter, or None if it does not run."""
    try:
        out = subprocess.run(
            [executable, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", out.stdout.strip())
    if out.returncode != 0 or not match:
        return None  # e.g. a pyenv shim for a version that is not selected
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def pyenv_candidates(minor: int) -> list[str]:
    """The `bin/python` of pyenv's versions 3.<minor> and 3.<minor>.N ($PYENV_ROOT, else
    ~/.pyenv), newest first; nothing is run."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")

    def key(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path.name))

    folders = sorted((root / "versions").glob(f"3.{minor}*"), key=key, reverse=True)
    return [
        str(f / "bin" / "python") for f in folders if re.fullmatch(rf"3\.{minor}(\.\d+)?", f.name)
    ]


@dataclass(frozen=True)
class PythonChoice:
    """An interpreter to build a version's venv with; `ignore_requires_python` is True when it
    is older than the version's declared Requires-Python (pip then needs the flag)."""

    path: str
    version: tuple[int, int, int]
    ignore_requires_python: bool


def choose_python(version: str | None = None) -> PythonChoice:
    """The interpreter for NeMo Gym `version` (see the module docstring for the order).
    Raises NoSuitablePython saying what to install."""
    need = spec(version).requires_python
    explicit = os.environ.get("NEMO_GYM_PYTHON")
    if explicit:
        found = python_version(explicit)
        if found is None or found[:2] < need[:2]:
            what = "does not run" if found is None else f"is Python {found[0]}.{found[1]}"
            raise NoSuitablePython(f"NEMO_GYM_PYTHON={explicit} {what}. {install_hint(version)}")
        return PythonChoice(explicit, found, found < need)
    tried: list[str] = []
    fallback: PythonChoice | None = None
    for minor in spec(version).minors:
        on_path = shutil.which(f"python3.{minor}")
        for candidate in ([on_path] if on_path else []) + pyenv_candidates(minor):
            tried.append(candidate)
            found = python_version(candidate)
            if found is None or found[:2] != (3, minor):
                continue
            if found >= need:
                return PythonChoice(candidate, found, False)
            if fallback is None or found > fallback.version:
                fallback = PythonChoice(candidate, found, True)
    if fallback is not None:
        return fallback
    detail = f" (tried: {', '.join(tried)})" if tried else ""
    raise NoSuitablePython(
        f"No Python for NeMo Gym {spec(version).version} found{detail}. {install_hint(version)}"
    )


def version_tuple(version: str | None) -> tuple[int, ...]:
    """ "0.7.0" -> (0, 7, 0); None or "" -> ()."""
    return tuple(int(n) for n in re.findall(r"\d+", version or "")[:3])


def has_readiness_endpoints(version: str | None) -> bool:
    """NeMo Gym `version` is 0.7 or newer: its head server has /readyz (503 until every server
    and model endpoint is up) and ng_run reads `model_endpoint_readiness_timeout_seconds`."""
    return version_tuple(version) >= (0, 7)
