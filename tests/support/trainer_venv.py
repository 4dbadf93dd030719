"""A real trainer for the tests, in a venv of its own: a cached base venv of the trainer, and a
per-checkout overlay that adds this package to it (axolotl 0.21.0: axolotl_venv.py; skyrl
0.4.0: skyrl_venv.py; each a `Trainer`).

    python = ensure(AXOLOTL)   # Path of <checkout>/build/axolotl-venv/bin/python

- The base, <cache>/<name>-<version>-py3.<minor> (cache as venv.py's: ~/.cache/nemo_gym_grpc),
  built once and shared (rebuilt when its requirements file changes): `pip install --no-deps
  -r tests/locks/<name>-<version>.txt`, the pinned list that file's header explains (pip's own
  resolution less the GPU-only packages). Both trainers declare Python >= 3.12: python3.12 /
  python3.13 on PATH or pyenv's, or the trainer's env variable (`Trainer.python_env`).
- The overlay, <checkout>/build/<name>-venv: a venv of the same interpreter without pip of its
  own, whose site-packages holds a .pth that adds the base's (with `site.addsitedir`, so the
  base's own .pth files apply too), and this checkout installed editable with the
  dependencies the base lacks (`pip install -e .`; pip installs only into the overlay, never
  the shared base). So the trainer there imports this checkout's `nemo_gym_grpc`, and two
  checkouts share one base. Rebuilt (seconds) when the base or pyproject.toml changes.

A build holds an fcntl lock (venv.py's `file_lock`) and is marked complete last (`.complete`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.errors import NemoGymError, NoSuitablePython
from tests.support.locks import digest
from tests.support.procs import tail
from tests.support.venv import MARKER_NAME, cache_dir, file_lock, run_step, venv_is_complete
from tests.support.versions import pyenv_candidates, python_version

ROOT = Path(__file__).resolve().parents[2]
MINORS = (12, 13)  # what both trainers declare (>= 3.12); 3.12 is what they are tested on


@dataclass(frozen=True)
class Trainer:
    """One trainer's venv.

    Attributes:
        name, version: e.g. "axolotl", "0.21.0" (its requirements file:
            tests/locks/<name>-<version>.txt; its overlay: build/<name>-venv).
        build_cost: what building the base took, for the message printed before a build.
        imports: modules the base must import once built.
        ours: a module of this package the overlay must import once built.
        python_env: env variable naming the interpreter to use.
    """

    name: str
    version: str
    build_cost: str
    imports: tuple[str, ...]
    ours: str
    python_env: str

    @property
    def requirements(self) -> Path:
        return ROOT / "tests" / "locks" / f"{self.name}-{self.version}.txt"

    @property
    def overlay(self) -> Path:
        return ROOT / "build" / f"{self.name}-venv"

    @property
    def what(self) -> str:
        return f"the {self.name} {self.version} venv"


def find_python(trainer: Trainer) -> str:
    """An interpreter for `trainer`: its env variable, else python3.12 / python3.13 on PATH,
    else pyenv's. Raises NoSuitablePython saying what to install."""
    explicit = os.environ.get(trainer.python_env)
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
        f"{trainer.name} {trainer.version} needs Python >= 3.{MINORS[0]} (tried: "
        f"{', '.join(candidates) or 'nothing found'}): install one (e.g. `pyenv install 3.12`) "
        f"or point {trainer.python_env} at it"
    )


def base_dir(trainer: Trainer, python: str) -> Path:
    """<cache>/<name>-<version>-py3.<minor> for `python`."""
    found = python_version(python) or (3, 0, 0)
    return cache_dir() / f"{trainer.name}-{trainer.version}-py3.{found[1]}"


def _build(steps: list[list[str]], log: Path, timeout: float, what: str) -> float:
    """Run `steps` in turn with their output in `log`; seconds taken. NemoGymError on failure."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    started = time.monotonic()
    with open(log, "w") as out:
        for step in steps:
            code = run_step(step, out, log, env, started, started + timeout, what=what)
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


def ensure_base(trainer: Trainer, python: str | None = None, timeout: float = 3600.0) -> Path:
    """`trainer`'s shared base venv (built on first use; see the module docstring)."""
    python = python or find_python(trainer)
    venv = base_dir(trainer, python)
    if _built_from_requirements(venv, trainer.requirements):
        return venv
    log = venv.with_name(venv.name + ".install.log")
    with file_lock(venv.with_name(venv.name + ".lock"), timeout, log, what=trainer.what):
        if _built_from_requirements(venv, trainer.requirements):
            return venv
        if venv.exists():
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"Building {trainer.what} {venv} (first use only; later runs reuse it): pip install "
            f"--no-deps -r {trainer.requirements.name} with {python}. Cost: "
            f"{trainer.build_cost}. Log: {log}",
            file=sys.stderr,
        )
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps"]
        steps = [[python, "-m", "venv", str(venv)], [*pip, "-r", str(trainer.requirements)]]
        seconds = _build(steps, log, timeout, trainer.what)
        _check_imports(venv / "bin" / "python", trainer.imports)
        facts = {trainer.name: trainer.version, "requirements": digest(trainer.requirements)}
        _mark(venv, **facts, seconds=seconds)
        print(f"built {venv} in {seconds} s", file=sys.stderr)
    return venv


def _built_from_requirements(venv: Path, requirements: Path) -> bool:
    """The base is complete and was built from the current requirements file."""
    if not venv_is_complete(venv):
        return False
    marker = json.loads((venv / MARKER_NAME).read_text())
    return bool(marker.get("requirements") == digest(requirements))


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if not found:
        raise NemoGymError(f"no lib/python3.*/site-packages in {venv}")
    return found[-1]


def ensure(trainer: Trainer, timeout: float = 3600.0) -> Path:
    """The overlay's interpreter: `trainer` with this checkout's package (built, or rebuilt when
    the base or pyproject.toml changed, on first use)."""
    base = ensure_base(trainer, timeout=timeout)
    facts = {
        "base": str(base),
        "base_marker": digest(base / MARKER_NAME),
        "pyproject": digest(ROOT / "pyproject.toml"),
    }
    overlay = trainer.overlay
    python = overlay / "bin" / "python"

    def current() -> bool:
        marker = overlay / MARKER_NAME
        return venv_is_complete(overlay) and json.loads(marker.read_text()) == facts

    if current():
        return python
    log = overlay.with_name(overlay.name + ".install.log")
    with file_lock(overlay.with_name(overlay.name + ".lock"), timeout, log, what=trainer.what):
        if current():
            return python
        if overlay.exists():
            shutil.rmtree(overlay)
        base_python = str((base / "bin" / "python").resolve())
        steps = [[base_python, "-m", "venv", "--without-pip", str(overlay)]]
        _build(steps, log, timeout, trainer.what)
        link = f"import site; site.addsitedir({str(_site_packages(base))!r})\n"
        (_site_packages(overlay) / f"_{trainer.name}_base.pth").write_text(link)
        install = [[str(python), "-m", "pip", "install", "-q", "-e", str(ROOT)]]
        _build(install, log, timeout, trainer.what)
        _check_imports(python, (trainer.ours,))
        _mark(overlay, **facts)
    return python
