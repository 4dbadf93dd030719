"""NeMo Gym's reward beside a format reward in a real `trl.GRPOTrainer` (two steps, the tiny
Llama of tests/test_trl.py, real mcqa behind a real bridge): with `nemo_gym_reward_funcs`, a
completion whose `/verify` failed is None in both columns, so TRL leaves it out of its group's
mean and std and gives it advantage 0, and its group-mates' advantages are those of the scored
completions alone. A FaultProxy in front of mcqa answers the first `/verify` with HTTP 400
(a fault on demand: no real server fails one chosen call), which the bridge does not retry.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from nemo_gym_grpc.rewards import nemo_gym_reward_funcs, reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import settings
from tests.support.fault_proxy import Fault, FaultProxy
from tests.test_trl import MISSING_SERVER, _grpo_trainer, _loader_rows, _row_of, _trl_stack

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0

NEMO_GYM, FORMAT = "reward_nemo_gym_verify", "format_reward"
EPSILON = 1e-4  # what TRL adds to the group's std


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for a completion that boxes an answer."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if "\\boxed{" in text else 0.0 for text in texts]


def test_a_failed_verify_beside_a_format_reward_trains_nothing_and_leaves_its_group_alone(
    nemo_gym, nemo_gym_venv, start_bridge, monkeypatch, tmp_path
):
    trl, datasets, pandas = _trl_stack()
    rows = _loader_rows(nemo_gym_venv)[:-1]  # without the last, MISSING_SERVER's
    assert all(r["resources_server_ref"]["name"] != MISSING_SERVER for r in rows)
    with FaultProxy(nemo_gym.server_urls["mcqa"]) as proxy:
        proxy.set_faults(Fault("status", path="/verify", status=400, times=1, body=b"{}"))
        bridge = start_bridge("--head-url", nemo_gym.head_url, "--server", f"mcqa={proxy.url}")
        monkeypatch.setenv(settings.TARGET_ENV, bridge.target)
        funcs = nemo_gym_reward_funcs(reward_nemo_gym_verify, format_reward)
        trainer = _grpo_trainer(trl, datasets, funcs, rows, tmp_path, num_generations=3)
        trainer.train()
    tables = sorted((tmp_path / "completions").glob("*.parquet"))
    frames = [pandas.read_parquet(table) for table in tables]
    assert [len(frame) for frame in frames] == [6, 6]
    (frame,) = [f for f in frames if f[NEMO_GYM].isna().any()]  # the step with the fault
    failed = frame[frame[NEMO_GYM].isna()]
    assert len(failed) == 1
    assert failed[FORMAT].isna().all()  # None from the wrapped format reward too
    assert failed["advantage"].tolist() == [0.0]
    row = _row_of(failed["prompt"].iloc[0], rows)
    same = frame["prompt"].map(lambda prompt: _row_of(prompt, rows) is row)
    mates = frame[same & frame[NEMO_GYM].notna()]
    assert len(mates) == 2
    rewards = (mates[NEMO_GYM] + mates[FORMAT]).tolist()
    mean = sum(rewards) / 2
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards))  # Bessel: n - 1 = 1
    expected = [(r - mean) / (std + EPSILON) for r in rewards]
    assert mates["advantage"].tolist() == pytest.approx(expected, abs=1e-5)
