"""Helpers shared by the verl / slime / OpenRLHF adapter tests (test_verl.py, test_slime.py,
test_openrlhf.py, test_export.py): exported example data and the answers that score 1.0/0.0.

export_examples(venv, out_dir, fmt) -> {server: path}  # `nemo-gym-grpc export`, in process
answers(server, row) -> (right, wrong)                 # completions scoring 1.0 and 0.0
SlimeSample                                            # the slime Sample fields read
run_verl(spec, target) -> tests/verl_run.py's JSON      # verl's reward loop, build/verl-venv
run_driver("openrlhf_run.py", spec, target)            # OpenRLHF's reward caller, the same
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_grpc.cli import main as cli_main
from tests.support import resources_server_dir

ROOT = Path(__file__).resolve().parents[1]
VERL_PYTHON = ROOT / "build" / "verl-venv" / "bin" / "python"  # `make dev` builds it
TESTS = Path(__file__).resolve().parent
# NeMo Gym's shipped example data that scores 1.0 / 0.0 on right / wrong text answers.
SERVERS = ("mcqa", "equivalence_rule")
SUFFIX = {"verl": "parquet", "slime": "jsonl", "openrlhf": "jsonl"}


def export_examples(venv: Path, out_dir: Path, fmt: str) -> dict[str, Path]:
    """Run `nemo-gym-grpc export --format fmt --server S` on each of SERVERS' example.jsonl."""
    paths = {}
    for server in SERVERS:
        source = resources_server_dir(server, venv) / "data" / "example.jsonl"
        out = out_dir / f"{server}.{fmt}.{SUFFIX[fmt]}"
        argv = ["export", str(source), "-o", str(out), "--format", fmt, "--server", server]
        assert cli_main(argv) == 0
        paths[server] = out
    return paths


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answers(server: str, row: dict[str, Any]) -> tuple[str, str]:
    """(right, wrong) completions for a NeMo Gym example row of `server`."""
    expected = str(row["expected_answer"])
    if server == "mcqa":
        wrong = "A" if expected != "A" else "C"
        return f"Let me think. \\boxed{{{expected}}}", f"Let me think. \\boxed{{{wrong}}}"
    return expected, "not the needle"


@dataclass
class SlimeSample:
    """The fields of slime's `Sample` (slime/utils/types.py) that the adapter reads; slime
    itself is not on PyPI, so its documented shape stands in for it."""

    prompt: Any
    response: str
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def run_driver(
    script: str, spec: dict[str, Any], target: str, on_error: str | None = None
) -> dict[str, Any]:
    """tests/<script> run by build/verl-venv's Python with `spec` (written to a temporary
    file), pointed at the bridge `target`; the JSON object it prints last."""
    if not VERL_PYTHON.exists():
        pytest.fail(f"{VERL_PYTHON} missing: `make dev` builds it (verl 0.9.1)", pytrace=False)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec_file:
        json.dump(spec, spec_file)
    env = {k: v for k, v in os.environ.items() if k != "NEMO_GYM_GRPC_ON_ERROR"}
    env.update(NEMO_GYM_GRPC_TARGET=target, RAY_USAGE_STATS_ENABLED="0")
    if on_error:
        env["NEMO_GYM_GRPC_ON_ERROR"] = on_error
    try:
        done = subprocess.run(
            [str(VERL_PYTHON), str(TESTS / script), spec_file.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.unlink(spec_file.name)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def run_verl(spec: dict[str, Any], target: str, on_error: str | None = None) -> dict[str, Any]:
    """tests/verl_run.py (verl's own reward loop) with `spec`; its JSON output."""
    return run_driver("verl_run.py", spec, target, on_error)
