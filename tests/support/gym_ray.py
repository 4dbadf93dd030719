"""NeMo Gym's own environment with nemo-gym-grpc[ray] in it, without changing the shared venv:
for running the bridge fleet on the Ray cluster NeMo Gym's `ng_run` starts.

    path = gym_pythonpath(nemo_gym_venv, workdir)   # PYTHONPATH for the venv's Python

A Ray cluster runs one Python and one Ray version (Ray refuses a driver or node of another),
so on NeMo Gym's cluster the fleet runs on NeMo Gym's venv's interpreter (0.7.0: Python 3.13,
its own ray 2.60). That venv already holds most of what nemo-gym-grpc needs (grpcio, protobuf,
aiohttp, uvloop, PyYAML, requests, tqdm, ray); the rest (MISSING) is installed once with
`pip install --target --no-deps` into a folder of its own next to the venv in the cache, and
this checkout's packages are laid out as `nemo_gym_grpc.{bridge,rewards,v1}` (symlinks) in
`workdir`. PYTHONPATH = that layout, that folder: what `pip install nemo-gym-grpc[ray]` into
NeMo Gym's venv would give, with this checkout's code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.errors import NemoGymError
from tests.support.layout import lay_out
from tests.support.venv import MARKER_NAME, file_lock

REPO = Path(__file__).resolve().parents[2]
# nemo-gym-grpc's dependencies that NeMo Gym 0.7.0's venv lacks (pyproject.toml's own ranges).
MISSING = (
    "googleapis-common-protos>=1.70",
    "msgspec>=0.23,<0.24",
    "grpcio-health-checking>=1.85.1,<1.86",
    "grpcio-reflection>=1.85.1,<1.86",
    "grpcio-status>=1.85.1,<1.86",
    "python-json-logger>=3.1",
    "prometheus-client>=0.20",
)


def deps_dir(venv: Path) -> Path:
    """MISSING installed for `venv`'s interpreter (built on first use, under a lock):
    <venv>.grpc-deps next to it. Raises NemoGymError if pip fails."""
    target = venv.with_name(venv.name + ".grpc-deps")
    if (target / MARKER_NAME).is_file():
        return target
    with file_lock(target.with_name(target.name + ".lock"), 600.0):
        if not (target / MARKER_NAME).is_file():
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
            out = subprocess.run(
                [*pip, "--target", str(target), *MISSING],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if out.returncode != 0:
                raise NemoGymError(f"pip install --target {target} failed:\n{out.stderr[-3000:]}")
            (target / MARKER_NAME).write_text("\n".join(MISSING) + "\n")
    return target


def package_layout(workdir: Path) -> Path:
    """`workdir`/pkg/nemo_gym_grpc/<part> as symlinks into this checkout (`layout.lay_out`)."""
    return lay_out(workdir / "pkg")


def gym_pythonpath(venv: Path, workdir: Path) -> str:
    """PYTHONPATH that gives `venv`'s interpreter nemo-gym-grpc[ray] (module docstring) and
    this repository's tests/ (callers defined there)."""
    return ":".join(map(str, (package_layout(workdir), deps_dir(venv), REPO)))
