"""Lock files of the test environments (tests/locks/): every venv the tests run in is built
with pip constraints kept in the repository, so that a release upstream cannot turn a clean
clone's CI red overnight. Users' own installs are untouched: pyproject.toml keeps its ranges.

- `dev.txt`: .venv (`make dev`: the package, its dev tools, TRL), built with `python3`;
- `verl.txt`: build/verl-venv (`make dev`: verl 0.9.1), the same;
- `nemo-gym-<version>-py3.<minor>.txt`: the NeMo Gym venvs (`venv.py`), one per version, used
  when the venv is built with that minor (another minor builds unconstrained, and says so);
- axolotl's venv installs a pinned list with `--no-deps` (`axolotl-0.21.0.txt`, whose
  header says how it was made; `make lock` leaves it alone).

Each file is `pip freeze --exclude-editable` of a venv built without constraints, given to
pip as `-c`. `make lock` rebuilds .venv and build/verl-venv without them (`LOCKED=no`), then
`python -m tests.support refresh-locks` (`refresh`) writes their files and builds each NeMo Gym
venv afresh in build/locks/ for its file; then `make test` runs on the result.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.support.versions import python_version

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "tests" / "locks"


def nemo_gym_lock(version: str, minor: int) -> Path | None:
    """The lock file of NeMo Gym `version`'s venv built with Python 3.`minor` (None: none)."""
    lock = _nemo_gym_path(version, minor)
    return lock if lock.is_file() else None


def _nemo_gym_path(version: str, minor: int) -> Path:
    return LOCKS / f"nemo-gym-{version}-py3.{minor}.txt"


def built_from(marker: Path, lock: Path | None) -> bool:
    """The venv whose marker file (JSON) is `marker` was built with `lock`'s content as its
    constraints (None: with none); else it is rebuilt."""
    built = json.loads(marker.read_text()).get("constraints")
    return bool(built == (digest(lock) if lock else None))


def digest(path: Path) -> str:
    """A short digest of a file's content: a cached venv records those it was built from and
    is rebuilt when one changes (here and in trainer_venv.py)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def freeze(python: Path | str, lock: Path, what: str) -> None:
    """Write `pip freeze --exclude-editable` of `python`'s venv to `lock`, under a header
    naming `what` it locks, the Python and the date."""
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    version = ".".join(map(str, python_version(str(python)) or ()))
    header = (
        f"# {what}: pip constraints (`pip install -c`), tests/support/locks.py.\n"
        f"# pip freeze of it built without constraints on Python {version}, "
        f"{time.strftime('%Y-%m-%d')}; `make lock` refreshes it.\n"
    )
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(header + frozen)
    print(f"wrote {lock.relative_to(ROOT)} ({len(frozen.splitlines())} packages)")


def refresh() -> None:
    """Write every lock file: .venv's and build/verl-venv's as they are now (`make lock` has
    just built them without constraints), and each NeMo Gym version's from a venv built
    without constraints in build/locks/ (removed after). Raises what `ensure_venv` raises, or
    FileNotFoundError when .venv or build/verl-venv is missing."""
    from tests.support.venv import ensure_venv
    from tests.support.versions import SPECS

    for name, venv, what in (
        ("dev", ROOT / ".venv", ".venv (make dev)"),
        ("verl", ROOT / "build" / "verl-venv", "build/verl-venv (make dev)"),
    ):
        freeze(venv / "bin" / "python", LOCKS / f"{name}.txt", what)
    for version in SPECS:
        venv = ROOT / "build" / "locks" / f"nemo-gym-{version}"
        shutil.rmtree(venv, ignore_errors=True)
        ensure_venv(venv, version=version, locked=False)
        python = venv / "bin" / "python"
        found = python_version(str(python))
        minor = found[1] if found else sys.version_info.minor
        freeze(python, _nemo_gym_path(version, minor), f"the NeMo Gym {version} venv")
        shutil.rmtree(venv)
