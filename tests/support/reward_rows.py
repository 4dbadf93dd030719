"""The dataset rows of the reward-function tests (tests/test_rewards*.py) and TRL's columns.

Dataset rows are what axolotl's NeMo Gym loader hands to TRL: columns `prompt`,
`resources_server_ref` and `verify_extra`, built from NeMo Gym's own example data and passed
through a real HuggingFace `datasets.Dataset` (Arrow fills keys a row lacks with None, nested
ones too), using the `datasets` that nemo-gym installs in its venv. The `loader_rows` fixture
(tests/conftest.py) holds them per test module.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.support.venv import resources_server_dir

# The columns axolotl's NeMo Gym loader makes (prompt = the row's first user message), put
# through datasets.Dataset.from_list as it does; prints the rows as JSON.
AXOLOTL_LOADER = r"""
import json, sys
import datasets
rows = []
for line in open(sys.argv[1]):
    if not line.strip():
        continue
    data = json.loads(line)
    inputs = data.get("responses_create_params", {}).get("input", [])
    users = [m.get("content", "") for m in inputs
             if isinstance(m, dict) and m.get("role") == "user"]
    rows.append({
        "prompt": [{"role": "user", "content": users[0] if users else ""}],
        "resources_server_ref": {"name": sys.argv[2]},
        "verify_extra": data,
    })
json.dump([dict(row) for row in datasets.Dataset.from_list(rows)], sys.stdout)
"""


def axolotl_loader_rows(nemo_gym_venv: Path, folder: Callable[[], Path]) -> dict[str, list[dict]]:
    """server -> its example rows as axolotl's loader (through Arrow) yields them; and
    "mcqa_mixed": mcqa's, where only the first row sets two more OpenAI parameters (Arrow
    gives the other rows null for them), written to a file in `folder()`."""

    def load(path: Path, server: str) -> list[dict]:
        out = subprocess.run(
            [str(nemo_gym_venv / "bin" / "python"), "-c", AXOLOTL_LOADER, str(path), server],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    def examples(server: str) -> Path:
        return resources_server_dir(server, nemo_gym_venv) / "data" / "example.jsonl"

    loaded = {
        s: load(examples(s), s) for s in ("mcqa", "equivalence_rule", "example_single_tool_call")
    }
    mixed = [json.loads(line) for line in examples("mcqa").read_text().splitlines() if line]
    mixed[0]["responses_create_params"].update(temperature=0.5, parallel_tool_calls=True)
    mixed_path = folder() / "mcqa_mixed.jsonl"
    mixed_path.write_text("".join(json.dumps(row) + "\n" for row in mixed))
    loaded["mcqa_mixed"] = load(mixed_path, "mcqa")
    return loaded


def letter_other_than(letter: str) -> str:
    return "A" if letter != "A" else "C"


def mcqa_answer(row: dict, right: bool) -> str:
    expected = row["verify_extra"]["expected_answer"]
    letter = expected if right else letter_other_than(expected)
    return f"Let me think it through. The answer is \\boxed{{{letter}}}"


def reward_columns(rows: list[dict], answers: list[str], conversational: bool = True) -> dict:
    """reward-function arguments as TRL passes them for these dataset rows."""
    if conversational:
        completions = [[{"role": "assistant", "content": a}] for a in answers]
        prompts = [row["prompt"] for row in rows]
    else:
        completions = list(answers)
        prompts = [row["prompt"][0]["content"] for row in rows]
    return {
        "completions": completions,
        "prompts": prompts,
        "resources_server_ref": [row["resources_server_ref"] for row in rows],
        "verify_extra": [row["verify_extra"] for row in rows],
    }
