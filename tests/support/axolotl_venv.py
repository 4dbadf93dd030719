"""Real axolotl 0.21.0 for the tests: a cached venv of axolotl, and a per-checkout overlay that
adds this package to it.

    python = ensure_axolotl()   # Path of <checkout>/build/axolotl-venv/bin/python

- The base, <cache>/axolotl-0.21.0-py3.<minor> (cache as venv.py's: ~/.cache/nemo_gym_grpc),
  built once and shared (rebuilt when that file changes): `pip install --no-deps -r
  tests/locks/axolotl-0.21.0.txt`, the pinned list that file's header explains (pip's own
  resolution less the GPU-only packages).
  axolotl >= 0.20 declares Python >= 3.12: python3.12 / python3.13 on PATH or pyenv's, or env
  AXOLOTL_PYTHON. Cost: BUILD_COST.
- The overlay, <checkout>/build/axolotl-venv: a venv of the same interpreter without pip of its
  own, whose site-packages holds a .pth that adds the base's (with `site.addsitedir`, so the
  base's own .pth files apply too), and this checkout installed editable with the
  dependencies the base lacks (`pip install -e .`; pip installs only into the overlay, never
  the shared base). So `python -m axolotl.cli.train` there imports this checkout's
  `nemo_gym_grpc`, and two checkouts share one base. Rebuilt (seconds) when the base or
  pyproject.toml changes.

A build holds an fcntl lock (venv.py's `file_lock`) and is marked complete last (`.complete`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.support.errors import NemoGymError, NoSuitablePython
from tests.support.locks import digest
from tests.support.procs import tail
from tests.support.venv import MARKER_NAME, cache_dir, file_lock, run_step, venv_is_complete
from tests.support.versions import pyenv_candidates, python_version

AXOLOTL_VERSION = "0.21.0"
ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "tests" / "locks" / f"axolotl-{AXOLOTL_VERSION}.txt"
OVERLAY = ROOT / "build" / "axolotl-venv"
MINORS = (12, 13)  # axolotl 0.21 declares Requires-Python >= 3.12; 3.12 is what it is tested on
BUILD_COST = "about 7 minutes and 6.2 GB of disk on a 2-core machine (measured 2026-12)"
IMPORT_CHECK = ("torch", "trl", "axolotl.cli.train", "axolotl.integrations.nemo_gym")
WHAT = f"the axolotl {AXOLOTL_VERSION} venv"


def find_python() -> str:
    """An interpreter for axolotl: env AXOLOTL_PYTHON, else python3.12 / python3.13 on PATH,
    else pyenv's. Raises NoSuitablePython saying what to install."""
    explicit = os.environ.get("AXOLOTL_PYTHON")
    candidates = [explicit] if explicit else []
    if not explicit:
        for minor in MINORS:
            on_path = shutil.which(f"python3.{minor}")
            candidates += ([on_path] if on_path else []) + pyenv_candidates(minor)
    for candidate in candidates:
        found = python_version(candidate)
        if found is not None and found[:2] >= (3, MINORS[0]):
            return candidate
    raise NoSuitablePython(
        f"axolotl {AXOLOTL_VERSION} needs Python >= 3.{MINORS[0]} (tried: "
        f"{', '.join(candidates) or 'nothing found'}): install one (e.g. `pyenv install 3.12`) "
        "or point AXOLOTL_PYTHON at it"
    )


def base_dir(python: str) -> Path:
    """<cache>/axolotl-<version>-py3.<minor> for `python`."""
    found = python_version(python) or (3, 0, 0)
    return cache_dir() / f"axolotl-{AXOLOTL_VERSION}-py3.{found[1]}"


def _build(steps: list[list[str]], log: Path, timeout: float) -> float:
    """Run `steps` in turn with their output in `log`; seconds taken. NemoGymError on failure."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    started = time.monotonic()
    with open(log, "w") as out:
        for step in steps:
            code = run_step(step, out, log, env, started, started + timeout, what=WHAT)
            if code != 0:
                raise NemoGymError(f"{' '.join(step)} exited {code}; log {log}:\n{tail(log)}")
    return round(time.monotonic() - started, 1)


def _check_imports(python: Path, modules: tuple[str, ...]) -> None:
    done = subprocess.run(
        [str(python), "-c", "import " + ", ".join(modules)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise NemoGymError(f"{python} cannot import {modules}:\n{done.stderr[-3000:]}")


def _mark(venv: Path, **facts: object) -> None:
    tmp = venv / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(facts, indent=2) + "\n")
    tmp.replace(venv / MARKER_NAME)


def ensure_base(python: str | None = None, timeout: float = 3600.0) -> Path:
    """The shared base venv (built on first use; see the module docstring)."""
    python = python or find_python()
    venv = base_dir(python)
    if _built_from_requirements(venv):
        return venv
    log = venv.with_name(venv.name + ".install.log")
    with file_lock(venv.with_name(venv.name + ".lock"), timeout, log, what=WHAT):
        if _built_from_requirements(venv):
            return venv
        if venv.exists():
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"Building {WHAT} {venv} (first use only; later runs reuse it): pip install "
            f"--no-deps -r {REQUIREMENTS.name} with {python}. Cost: {BUILD_COST}. Log: {log}",
            file=sys.stderr,
        )
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps"]
        seconds = _build(
            [[python, "-m", "venv", str(venv)], [*pip, "-r", str(REQUIREMENTS)]], log, timeout
        )
        _check_imports(venv / "bin" / "python", IMPORT_CHECK)
        _mark(venv, axolotl=AXOLOTL_VERSION, requirements=digest(REQUIREMENTS), seconds=seconds)
        print(f"built {venv} in {seconds} s", file=sys.stderr)
    return venv


def _built_from_requirements(venv: Path) -> bool:
    """The base is complete and was built from the current requirements file."""
    if not venv_is_complete(venv):
        return False
    marker = json.loads((venv / MARKER_NAME).read_text())
    return bool(marker.get("requirements") == digest(REQUIREMENTS))


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if not found:
        raise NemoGymError(f"no lib/python3.*/site-packages in {venv}")
    return found[-1]


def ensure_axolotl(timeout: float = 3600.0) -> Path:
    """The overlay's interpreter: axolotl 0.21.0 with this checkout's package (built, or
    rebuilt when the base or pyproject.toml changed, on first use)."""
    base = ensure_base(timeout=timeout)
    facts = {
        "base": str(base),
        "base_marker": digest(base / MARKER_NAME),
        "pyproject": digest(ROOT / "pyproject.toml"),
    }
    python = OVERLAY / "bin" / "python"

    def current() -> bool:
        marker = OVERLAY / MARKER_NAME
        return venv_is_complete(OVERLAY) and json.loads(marker.read_text()) == facts

    if current():
        return python
    log = OVERLAY.with_name(OVERLAY.name + ".install.log")
    with file_lock(OVERLAY.with_name(OVERLAY.name + ".lock"), timeout, log, what=WHAT):
        if current():
            return python
        if OVERLAY.exists():
            shutil.rmtree(OVERLAY)
        base_python = str((base / "bin" / "python").resolve())
        _build([[base_python, "-m", "venv", "--without-pip", str(OVERLAY)]], log, timeout)
        link = f"import site; site.addsitedir({str(_site_packages(base))!r})\n"
        (_site_packages(OVERLAY) / "_axolotl_base.pth").write_text(link)
        _build([[str(python), "-m", "pip", "install", "-q", "-e", str(ROOT)]], log, timeout)
        _check_imports(python, ("nemo_gym_grpc.rewards.axolotl",))
        _mark(OVERLAY, **facts)
    return python
