"""The wheel: PEP 420 namespace layout, the .proto inside, no shadowing by a user's rewards.py."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
    )
    (built,) = out.glob("nemo_gym_grpc-*.whl")
    return built


def test_wheel_ships_the_proto_and_generated_code_under_the_namespace(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "nemo_gym_grpc/v1/verify.proto",
        "nemo_gym_grpc/v1/verify_pb2.py",
        "nemo_gym_grpc/v1/verify_pb2.pyi",
        "nemo_gym_grpc/v1/verify_pb2_grpc.py",
        "nemo_gym_grpc/bridge/rpc/server.py",
        "nemo_gym_grpc/bridge/flows/verify.py",
        "nemo_gym_grpc/bridge/process/config.py",
        "nemo_gym_grpc/bridge/nemo_gym/verify.py",
        "nemo_gym_grpc/shared/contract.py",
        "nemo_gym_grpc/cli/__init__.py",
        "nemo_gym_grpc/rewards/__init__.py",
        "nemo_gym_grpc/rewards/verifiers/taskset.py",
        "nemo_gym_grpc/rewards/skyrl/env.py",
        "nemo_gym_grpc/rewards/trl/unscorable.py",
        # verifiers' loader takes a taskset id as one top-level module (docs/verifiers.md)
        "nemo_gym_grpc_verifiers/__init__.py",
    ):
        assert name in names
    assert "nemo_gym_grpc/__init__.py" not in names  # PEP 420 namespace
    assert not any(n.startswith(("tests/", "bridge/", "rewards/", "proto/")) for n in names)


def test_installed_wheel_is_not_shadowed_by_a_users_rewards_py(wheel, tmp_path):
    # A venv of its own gets the wheel; its dependencies come from this environment's
    # site-packages through a .pth line (which does not run that directory's own .pth files,
    # so this checkout's editable install stays out): no PyPI round trip in the fast tier.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.check_output([python, "-c", where], text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
    )
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "rewards.py").write_text("raise ImportError('the user rewards.py was imported')\n")
    probe = (
        "import nemo_gym_grpc.rewards as r, nemo_gym_grpc.bridge, nemo_gym_grpc.v1.verify_pb2;"
        "print(r.reward_nemo_gym_verify.__name__, r.reward_nemo_gym_verify.__module__,"
        " r.__file__)"
    )
    out = subprocess.run(
        [python, "-c", probe], cwd=workdir, check=True, capture_output=True, text=True
    )
    name, module, path = out.stdout.split()
    assert name == "reward_nemo_gym_verify" and module.startswith("nemo_gym_grpc.rewards")
    assert Path(path).is_relative_to(site)  # the installed wheel, not this checkout
    # torch stays out of the core install
    with zipfile.ZipFile(wheel) as built:
        (metadata,) = (n for n in built.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line
            for line in built.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    assert requires and not any("torch" in line.lower() for line in requires)


def _probe(code: str) -> list[str]:
    """Run `code` in a fresh interpreter without GRPC_ENABLE_FORK_SUPPORT; its stdout lines."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.splitlines()


# What the probes print: the nemo_gym_grpc.rewards modules loaded, and the fork support variable.
_LOADED = (
    "print(sorted(m for m in sys.modules if m.startswith('nemo_gym_grpc.rewards')));"
    "print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))"
)


def test_no_bridge_module_imports_the_trainer_side():
    # `nemo_gym_grpc.rewards.client` sets GRPC_ENABLE_FORK_SUPPORT for the trainer; the bridge
    # must not load it, nor anything else of rewards/.
    lines = _probe(
        "import importlib, importlib.util, os, pkgutil, sys, nemo_gym_grpc.bridge as b;"
        "names = [m.name for m in pkgutil.walk_packages(b.__path__, 'nemo_gym_grpc.bridge.')];"
        "has_ray = importlib.util.find_spec('ray') is not None;"  # the `ray` extra
        "[importlib.import_module(n) for n in names if not n.endswith('__main__')"
        " and (has_ray or '.ray' not in n)];"
        "print(len(names));" + _LOADED
    )
    assert int(lines[0]) > 20  # the walk found the bridge's modules
    assert lines[1:] == ["[]", "None"]


def test_serve_through_the_console_script_loads_no_trainer_client():
    # `nemo-gym-grpc serve` is the bridge's own command line: the console script sits above
    # both halves, and `serve` loads nothing of the trainer side (no gRPC client, no
    # GRPC_ENABLE_FORK_SUPPORT).
    lines = _probe(
        "import os, sys; from nemo_gym_grpc.bridge.process import cli as bridge_cli;"
        "from nemo_gym_grpc import cli;"
        "bridge_cli.run = lambda config: print(config.servers);"
        "cli.main(['serve', '--server', 'x=http://127.0.0.1:1']);" + _LOADED
    )
    assert lines == [
        "{'x': ['http://127.0.0.1:1']}",
        "[]",
        "None",
    ]


def test_the_public_names_load_the_client_which_sets_fork_support():
    lines = _probe(
        "import os, sys, nemo_gym_grpc.rewards as r;" + _LOADED + ";"
        "r.reward_nemo_gym_verify;" + _LOADED
    )
    assert lines[:2] == ["['nemo_gym_grpc.rewards']", "None"]  # importing changes nothing
    assert "'nemo_gym_grpc.rewards.client.per_process'" in lines[2]
    assert lines[3] == "1"


def test_the_console_script_is_the_top_command_line(wheel):
    with zipfile.ZipFile(wheel) as built:
        (entry_points,) = (n for n in built.namelist() if n.endswith("entry_points.txt"))
        text = built.read(entry_points).decode()
    assert "nemo-gym-grpc = nemo_gym_grpc.cli:main" in text
