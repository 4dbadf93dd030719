"""Every Python name the README and docs/ show resolves where they show it: dotted paths
(`nemo_gym_grpc.rewards.reward_nemo_gym_verify`, `pkg://nemo_gym_grpc.rewards.verl`), the
names of `from nemo_gym_grpc... import ...` lines, and the attribute a verl config names next
to its `pkg://` module. A gRPC service name (`nemo_gym_grpc.v1.VerifyService`) must be a
service of the contract. Names in verl_manager (which imports verl) resolve in verl's venv,
those of the axolotl plugin (which imports axolotl) in axolotl's (tests/support/axolotl_venv.py;
skipped where it is not built, failed in CI, as tests/test_axolotl.py), those of the SkyRL
generator (which imports skyrl) in skyrl's (tests/support/skyrl_venv.py), alike."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

from nemo_gym_grpc.v1 import rollout_pb2, session_pb2, verify_pb2  # noqa: F401 (in the pool)
from tests.stacks_common import VERL_PYTHON
from tests.support.axolotl_venv import AXOLOTL
from tests.support.missing import missing
from tests.support.skyrl_venv import SKYRL
from tests.support.trainer_venv import Trainer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\bnemo_gym_grpc(?:\.\w+)+")
FROM_IMPORT = re.compile(r"from (nemo_gym_grpc[\w.]*) import ([\w, ]+)")
# verl's Hydra keys: `...path=pkg://MODULE` then, on a line after it, `...name=ATTRIBUTE`
PKG_THEN_NAME = re.compile(r"pkg://(nemo_gym_grpc[\w.]+)\s*\n[#\s]*[\w.]*\.name=(\w+)")
NEEDS_VERL = "nemo_gym_grpc.rewards.verl_manager"
NEEDS_AXOLOTL = "nemo_gym_grpc.rewards.axolotl."
NEEDS_SKYRL = "nemo_gym_grpc.rewards.skyrl.generator"


def shown_names() -> list[str]:
    """Every dotted name the docs show, once."""
    names: set[str] = set()
    for path in DOCS:
        text = path.read_text()
        names.update(DOTTED.findall(text))
        for module, imported in FROM_IMPORT.findall(text):
            names.update(f"{module}.{name.strip()}" for name in imported.split(","))
        names.update(f"{module}.{name}" for module, name in PKG_THEN_NAME.findall(text))
    return sorted(names)


def resolve(name: str) -> object:
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not name.startswith(exc.name):
                raise  # a dependency is missing, not this name
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(name)


def test_the_docs_show_the_public_names():
    names = shown_names()
    for expected in (
        "nemo_gym_grpc.rewards.reward_nemo_gym_verify",
        "nemo_gym_grpc.rewards.verl.compute_score",
        "nemo_gym_grpc.rewards.slime.group_reward",
        "nemo_gym_grpc.rewards.create_nemo_gym_rollout_func",
        "nemo_gym_grpc.rewards.openrlhf.reward_func",
        "nemo_gym_grpc.rewards.verl_manager.NemoGymRewardManager",
    ):
        assert expected in names  # the scan finds each kind of mention


@pytest.mark.parametrize(
    "name",
    [n for n in shown_names() if not n.startswith((NEEDS_VERL, NEEDS_AXOLOTL, NEEDS_SKYRL))],
)
def test_each_name_the_docs_show_resolves(name):
    if name.startswith("nemo_gym_grpc.bridge.ray."):
        pytest.importorskip("ray")  # the `ray` extra (`make dev` installs it)
    if name.startswith("nemo_gym_grpc.v1.") and name.endswith("Service"):
        assert descriptor_pool.Default().FindServiceByName(name)
        return
    assert resolve(name) is not None


def resolves_in(python: Path, name: str) -> None:
    """`name` (module.attribute) imports with `python` and names what it says."""
    module, _, attribute = name.rpartition(".")
    code = f"import {module} as m; print(getattr(m, {attribute!r}).__name__)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == attribute


@pytest.mark.trainer_venv
def test_the_verl_names_the_docs_show_resolve_in_verls_venv():
    names = [n for n in shown_names() if n.startswith(NEEDS_VERL)]
    assert names
    if not VERL_PYTHON.exists():
        pytest.fail(f"{VERL_PYTHON} missing: `make dev` builds it (verl 0.9.1)", pytrace=False)
    resolves_in(VERL_PYTHON, max(names))


def trainer_python(trainer: Trainer) -> Path:
    """The interpreter of `trainer`'s overlay venv (skipped where it is not built, failed in
    CI)."""
    python = trainer.overlay / "bin" / "python"
    if not python.exists():
        missing(f"{python} missing: `python -m tests.support ensure-{trainer.name}` builds it")
    return python


@pytest.mark.trainer_venv
def test_the_axolotl_plugin_names_the_docs_show_resolve_in_axolotls_venv():
    names = [n for n in shown_names() if n.startswith(NEEDS_AXOLOTL)]
    assert names
    python = trainer_python(AXOLOTL)
    for name in names:
        resolves_in(python, name)


@pytest.mark.trainer_venv
def test_the_skyrl_generator_names_the_docs_show_resolve_in_skyrls_venv():
    names = [n for n in shown_names() if n.startswith(NEEDS_SKYRL)]
    assert names
    resolves_in(trainer_python(SKYRL), max(names))  # the class, through its module
