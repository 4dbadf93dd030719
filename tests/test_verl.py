"""verl: `compute_score` and `NemoGymRewardManager` through a real bridge and real NeMo Gym
resources servers, driven by verl 0.9.1's own reward loop (`RewardLoopWorker`, its managers,
`assemble_rm_scores`) over a real `DataProto` built from `nemo-gym-grpc export --format verl`
data. verl runs in its own venv, build/verl-venv (`make dev`): it requires transformers<5.11,
the TRL tests >=5.14. tests/verl_run.py is the driver run there."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_grpc.rewards import ScoringError, verl
from tests.stacks_common import answers, export_examples, run_verl

pd = pytest.importorskip("pandas")  # the test-trl group of `make dev` installs it


@pytest.fixture(scope="module")
def verl_data(nemo_gym_venv, tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """One verl parquet of mcqa's and equivalence_rule's exported example rows plus a row
    routed to an unknown resources server (last); and the right/wrong items over it."""
    out = tmp_path_factory.mktemp("verl")
    frames = [pd.read_parquet(p) for p in export_examples(nemo_gym_venv, out, "verl").values()]
    frame = pd.concat(frames, ignore_index=True)
    unknown = frame.iloc[0].to_dict()
    unknown["data_source"] = "no_such_server"
    unknown["extra_info"] = dict(unknown["extra_info"], resources_server="no_such_server")
    frame = pd.concat([frame, pd.DataFrame([unknown])], ignore_index=True)
    path = out / "all.parquet"
    frame.to_parquet(path)
    items = []
    for index, record in enumerate(frame.to_dict("records")[:-1]):
        row = json.loads(record["extra_info"]["nemo_gym_row"])
        right, wrong = answers(record["data_source"], row)
        items += [
            {"row": index, "completion": right, "expected": 1.0},
            {"row": index, "completion": wrong, "expected": 0.0},
        ]
    return path, items


@pytest.mark.parametrize("mode", ["naive", "manager"])
def test_verls_reward_loop_scores_exported_rows_1_right_and_0_wrong(mode, verl_data, bridge_target):
    path, items = verl_data
    result = run_verl({"parquet": str(path), "mode": mode, "items": items}, bridge_target)
    expected = [item["expected"] for item in items]
    assert result.get("error") is None
    assert result["scores"] == expected
    assert result["rm_scores_sum"] == expected  # verl's rm_scores: the score on the last token
    assert result["extra"] == {"score": expected, "scoring_failed": [0.0] * len(items)}
    # verl awaits every sample at once; those go to the bridge together, not one call each
    assert sum(result["calls"]) == len(items) and len(result["calls"]) < len(items)


@pytest.mark.parametrize("mode", ["naive", "manager"])
def test_a_failed_sample_stops_verls_reward_loop_by_default(mode, verl_data, bridge_target):
    path, items = verl_data
    failed = {"row": len(items) // 2, "completion": "\\boxed{B}"}  # the unknown-server row
    spec = {"parquet": str(path), "mode": mode, "items": [items[0], failed, items[1]]}
    result = run_verl(spec, bridge_target)
    assert result["error"].startswith("ScoringError: 1 of ")
    assert "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)" in result["error"]


@pytest.mark.parametrize("mode", ["naive", "manager"])
def test_on_error_zero_gives_the_failed_sample_0_and_scoring_failed(mode, verl_data, bridge_target):
    path, items = verl_data
    failed = {"row": len(items) // 2, "completion": "\\boxed{B}"}
    spec = {"parquet": str(path), "mode": mode, "items": [items[0], failed, items[1], items[2]]}
    result = run_verl(spec, bridge_target, on_error="zero")
    assert result["scores"] == [1.0, 0.0, 0.0, 1.0]
    assert result["extra"]["scoring_failed"] == [0.0, 1.0, 0.0, 0.0]


async def test_compute_score_routes_by_extra_info_else_data_source(bridge_target, monkeypatch):
    from tests.support.items import mcqa_row

    monkeypatch.setenv("NEMO_GYM_GRPC_TARGET", bridge_target)
    monkeypatch.delenv("NEMO_GYM_GRPC_ON_ERROR", raising=False)
    row = mcqa_row()
    right, _ = answers("mcqa", row)
    info = {"nemo_gym_row": json.dumps(row), "num_turns": None}  # no resources_server
    assert await verl.compute_score("mcqa", right, "B", info) == {
        "score": 1.0,
        "scoring_failed": 0.0,
    }
    with pytest.raises(ScoringError, match="1 of 1 items failed"):
        await verl.compute_score("nope", right, "B", info)
    monkeypatch.setenv("NEMO_GYM_GRPC_ON_ERROR", "none")
    result = await verl.compute_score("nope", right, "B", info)
    assert math.isnan(result["score"]) and result["scoring_failed"] == 1.0
