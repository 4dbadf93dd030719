"""Helpers shared by the verl / slime / OpenRLHF adapter tests (test_verl.py, test_slime.py,
test_openrlhf.py, test_export.py): exported example data and the answers that score 1.0/0.0.

export_examples(venv, out_dir, fmt) -> {server: path}  # `nemo-gym-grpc export`, in process
answers(server, row) -> (right, wrong)                 # completions scoring 1.0 and 0.0
SlimeSample                                            # the slime Sample fields read
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_grpc.bridge.cli import main as cli_main
from tests.support import resources_server_dir

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
