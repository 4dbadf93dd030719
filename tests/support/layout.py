"""The package as it installs, laid out from a checkout: symlinks to the folders that
pyproject.toml's `[tool.setuptools] package-dir` maps (`nemo_gym_grpc/bridge` -> bridge/, ...,
`nemo_gym_grpc_verifiers` -> rewards/verifiers/taskset_id/), for an interpreter that imports the
checkout without installing it (NeMo Gym's own venv on a Ray node, `python -m benchmarks.walks`
on another checkout)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def package_dirs(code: Path = REPO) -> dict[str, str]:
    """{package: folder} of `code`'s pyproject.toml: "nemo_gym_grpc.bridge" -> "bridge",
    "nemo_gym_grpc.v1" -> "proto/nemo_gym_grpc/v1", ... (the packages it maps)."""
    setuptools = tomllib.loads((code / "pyproject.toml").read_text())["tool"]["setuptools"]
    return dict(setuptools["package-dir"])


def lay_out(root: Path, code: Path = REPO) -> Path:
    """`root`/<package path> (nemo_gym_grpc/bridge, ...) as symlinks into `code` (kept when
    already there); `root`, to put on sys.path / PYTHONPATH."""
    for name, folder in package_dirs(code).items():
        link = root.joinpath(*name.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(code / folder, target_is_directory=True)
    return root


def laid_out_elsewhere(code: Path) -> Path:
    """The checkout `code` laid out (`lay_out`) in a new temporary folder that is removed when
    this process exits (the links only, not what they point to); that folder, for
    PYTHONPATH / sys.path (a benchmark's `--code`)."""
    root = tempfile.mkdtemp(prefix="nemo_gym_grpc_layout_")
    atexit.register(shutil.rmtree, root, True)
    return lay_out(Path(root), code.resolve())
