"""`NemoGymGenerator` in real skyrl 0.4.0 (its own venv: tests/support/skyrl_venv.py; the batch
made with skyrl's own types by tests/skyrl_run.py, as its trainer calls a generator), whole
NeMo Gym 0.7 agent rollouts through a real bridge: the agent stack of tests/support/agents.py
(simple_agent on example_single_tool_call, and math_agent whose judge is down, so its rollouts
come back `mask_sample: true`; the policy model is scripted: no LLM runs here).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.errors import NemoGymError, NoSuitablePython
from tests.support.missing import missing
from tests.support.skyrl_venv import ensure_skyrl
from tests.support.toy_chat import EOS
from tests.test_rollouts_client import masked_row, weather_rows

pytestmark = pytest.mark.nemo_gym_07  # the masked agent's judge failsafe is 0.7's

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def skyrl_python() -> Path:
    try:
        return ensure_skyrl()
    except (NoSuitablePython, NemoGymError) as exc:
        missing(f"the skyrl venv: {exc}")


def generate(python: Path, target: str, rows: list[dict], ids: list[tuple[str, int]]) -> dict:
    """tests/skyrl_run.py's output for this batch."""
    spec = {"target": target, "eos": EOS, "rows": rows, "ids": ids}
    done = subprocess.run(
        [str(python), "-m", "tests.skyrl_run"], input=json.dumps(spec), cwd=ROOT,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_rollouts_are_trajectories_and_a_failed_one_masks_its_group(
    skyrl_python, agent_stack, nemo_gym_venv, start_bridge
):
    bridge = start_bridge("--head-url", agent_stack.head_url)
    weather, masked = weather_rows(nemo_gym_venv), masked_row(nemo_gym_venv)
    # groups as SkyRL makes them (instance_id); "mix" puts a masked rollout beside a good one
    rows = [weather[0], weather[0], weather[1], masked, weather[2]]
    ids = [("w0", 0), ("w0", 1), ("w1", 0), ("mix", 0), ("mix", 1)]
    out = generate(skyrl_python, bridge.target, rows, ids)
    assert out["trajectory_ids"] == [f"{i}_{r}" for i, r in ids]
    assert out["stop_reasons"] == ["stop"] * 3 + ["nemo_gym_failed", "nemo_gym_group_failed"]
    assert out["rewards"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    for k in range(3):  # a tool call, its output, the answer: generated and observed tokens
        mask, response = out["loss_masks"][k], out["response_ids"][k]
        assert len(mask) == len(response) == len(out["rollout_logprobs"][k])
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1
        assert all(
            lp == 0.0 for lp, m in zip(out["rollout_logprobs"][k], mask, strict=True) if not m
        )
        assert out["prompt_token_ids"][k]
    assert out["loss_masks"][3:] == [[0], [0]] and out["response_ids"][3:] == [[EOS], [EOS]]
    assert out["rollout_metrics"] == {
        "nemo_gym/failed_fraction": 0.2,
        "nemo_gym/masked_fraction": 0.4,
    }
