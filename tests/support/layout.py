"""The package as it installs, laid out from a checkout: `nemo_gym_grpc/<part>` symlinks to the
folders that pyproject.toml's `[tool.setuptools] package-dir` maps (`nemo_gym_grpc.bridge` ->
bridge/, ...), for an interpreter that imports the checkout without installing it (NeMo Gym's
own venv on a Ray node, `python -m benchmarks.walks` on another checkout)."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def package_dirs(code: Path = REPO) -> dict[str, str]:
    """{part: folder} of `code`'s pyproject.toml: "bridge" -> "bridge", "v1" ->
    "proto/nemo_gym_grpc/v1", ... (the subpackages of `nemo_gym_grpc` it maps)."""
    setuptools = tomllib.loads((code / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools["package-dir"]
    return {name.split(".", 1)[1]: folder for name, folder in mapped.items()}


def lay_out(root: Path, code: Path = REPO) -> Path:
    """`root`/nemo_gym_grpc/<part> as symlinks into `code` (kept when already there); `root`,
    to put on sys.path / PYTHONPATH."""
    (root / "nemo_gym_grpc").mkdir(parents=True, exist_ok=True)
    for name, folder in package_dirs(code).items():
        link = root / "nemo_gym_grpc" / name
        if not link.is_symlink():
            link.symlink_to(code / folder, target_is_directory=True)
    return root
