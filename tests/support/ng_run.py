"""How the harness launches `ng_run` (tests/support/stack.py): the environment of ng_run and
its servers, the per-server venv links, the command line. Why ng_run runs without Ray here:
stack.py's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

NO_RAY = Path(__file__).with_name("no_ray")  # its sitecustomize makes initialize_ray a no-op


def offline_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for ng_run and its servers: no downloads, no telemetry, unbuffered logs."""
    env = dict(os.environ if base is None else base)
    for key in ("RAY_ADDRESS", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST"):
        env.pop(key, None)
    env.update(
        UV_PYTHON_DOWNLOADS="never",  # ng_run would otherwise let uv fetch a Python
        UV_OFFLINE="1",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_USAGE_STATS_PROMPT_ENABLED="0",
        RAY_DISABLE_IMPORT_WARNING="1",
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        NO_COLOR="1",
        TERM="dumb",
    )
    return env


def environment(
    venv: Path, workdir: Path, ray: bool, extra_env: Mapping[str, str]
) -> dict[str, str]:
    """ng_run's environment: `offline_env()`, the venv's bin first on PATH, Ray's session
    files under `workdir`, NO_RAY on PYTHONPATH unless `ray`, then `extra_env` laid over."""
    env = offline_env()
    env["RAY_TMPDIR"] = str(workdir / "ray")  # this stack's own Ray session files
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if not ray:
        env["PYTHONPATH"] = str(NO_RAY)
    env.update(extra_env)
    return env


def link_server_venvs(workdir: Path, venv: Path, kinds: Iterable[tuple[str, str]]) -> None:
    """Link `venv` as each (server kind, type name)'s venv under `workdir`.

    ng_run's per-server venv is <cwd>/<kind>/<type name>/.venv (its uv_venv_dir default is the
    cwd for a wheel install); with +skip_venv_if_present=true it only sources that venv's
    bin/activate instead of building one with uv.
    """
    for kind, type_name in kinds:
        link = workdir / kind / type_name / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(venv, target_is_directory=True)


def command(venv: Path, config_path: Path, netns: str | None) -> list[str]:
    """ng_run's command line for the config at `config_path` (inside `netns` when given)."""
    line = [
        str(venv / "bin" / "ng_run"),
        f"+config_paths=[{config_path}]",
        "+skip_venv_if_present=true",
    ]
    return ["ip", "netns", "exec", netns, *line] if netns else line
