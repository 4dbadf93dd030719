"""A failed item trains in no group baseline (`rewards/axolotl/advantages.py`), fast tier: the
advantages over the scored completions only, against the plain-Python reference
(tests/support/grpo.py); the wrapping of a trainer's methods. Inside real axolotl (both of its
GRPO trainers) this runs in test_axolotl.py."""

from __future__ import annotations

import math
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")  # the test-trl group of `make dev` installs it
trl = pytest.importorskip("trl")

from nemo_gym_grpc.rewards.axolotl import advantages  # noqa: E402
from tests.support import grpo  # noqa: E402

N = None
# Two reward functions (NeMo Gym's first), groups of 4: a group with one failed completion, a
# group with every completion failed, a group with a failure another function still scored
# (made unscorable by `unscorable`), a group where nothing failed.
MATRIX = [
    [1.0, 0.0], [0.5, 0.25], [N, N], [0.0, 0.25],
    [N, N], [N, N], [N, N], [N, N],
    [1.0, 0.25], [N, 0.5], [0.0, 0.0], [1.0, 0.5],
    [0.0, 0.0], [1.0, 0.25], [0.5, 0.0], [1.0, 0.25],
]  # fmt: skip
WEIGHTS = [1.0, 0.5]


def tensor(matrix: list[list[float | None]]) -> Any:
    return torch.tensor([[math.nan if v is None else v for v in row] for row in matrix])


def as_lists(values: Any) -> list[list[float | None]]:
    return [[None if math.isnan(v) else v for v in row] for row in values.tolist()]


def test_a_completion_without_a_nemo_gym_reward_is_unscorable_in_every_column():
    given = tensor(MATRIX)
    made = advantages.unscorable(given, column=0)
    rows = as_lists(made)
    assert rows[9] == [N, N]  # the other function's 0.5 is dropped
    assert [row for i, row in enumerate(rows) if i != 9] == [
        row for i, row in enumerate(MATRIX) if i != 9
    ]
    assert torch.isnan(given[9, 0]) and given[9, 1] == 0.5  # the input is not changed
    nothing_failed = tensor(MATRIX[12:])
    assert advantages.unscorable(nothing_failed, column=0) is nothing_failed


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_advantages_are_those_computed_over_the_scored_completions_only(scale_rewards):
    matrix = as_lists(advantages.unscorable(tensor(MATRIX), column=0))
    got = advantages.scored_advantages(
        tensor(matrix), torch.tensor(WEIGHTS), 4, scale_rewards=scale_rewards
    )
    scale = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    expected = grpo.advantages(matrix, WEIGHTS, 4, scale_rewards=scale)
    assert got.tolist() == pytest.approx(expected, abs=1e-5)
    assert got[[2, 4, 5, 6, 7, 9]].tolist() == [0.0] * 6  # the failed: no advantage
    assert got[0] != 0 and got[8] != 0  # their group-mates are compared with each other


def test_normalize_then_sum_leaves_the_unscorable_out_too():
    matrix = as_lists(advantages.unscorable(tensor(MATRIX), column=0))
    got = advantages.scored_advantages(
        tensor(matrix), torch.tensor(WEIGHTS), 4, aggregation="normalize_then_sum"
    )
    expected = grpo.normalized_then_summed(matrix, WEIGHTS, 4)
    assert got.tolist() == pytest.approx(expected, abs=1e-4)


def test_with_nothing_failed_they_are_axolotls_own():
    rewards = tensor(MATRIX[12:]) @ torch.tensor(WEIGHTS)  # axolotl: plain mean and std
    grouped = rewards.view(-1, 4)
    mean = grouped.mean(dim=1).repeat_interleave(4)
    std = grouped.std(dim=1).repeat_interleave(4)
    got = advantages.scored_advantages(tensor(MATRIX[12:]), torch.tensor(WEIGHTS), 4)
    assert got.tolist() == pytest.approx(((rewards - mean) / (std + 1e-4)).tolist(), abs=1e-6)


def test_unknown_settings_are_errors():
    with pytest.raises(ValueError, match="scale_rewards"):
        advantages.scored_advantages(tensor(MATRIX), torch.tensor(WEIGHTS), 4, scale_rewards="x")
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        advantages.scored_advantages(tensor(MATRIX), torch.tensor(WEIGHTS), 4, aggregation="x")


class OwnAdvantages(trl.GRPOTrainer):
    """A GRPO trainer computing advantages in code of its own, as axolotl's context-parallel
    one does (never constructed: check_trainer looks at the class)."""

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        raise NotImplementedError


def test_trainers_where_a_failure_would_train_as_zero_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="computes GRPO advantages in code of its own"):
        advantages.check_trainer(OwnAdvantages.__new__(OwnAdvantages))
    advantages.check_trainer(trl.GRPOTrainer.__new__(trl.GRPOTrainer))  # TRL's own: fine
    monkeypatch.setattr(advantages, "trl_version", lambda: (1, 5))
    with pytest.raises(ValueError, match=r"needs TRL >= 1\.6"):
        advantages.check_trainer(trl.GRPOTrainer.__new__(trl.GRPOTrainer))


class AsyncLike(trl.GRPOTrainer):
    """The call sequence of axolotl's async GRPO trainer's `_compute_deferred_scores` (axolotl
    is not installed in the fast tier; test_axolotl.py runs the real one): rewards, advantages
    with nansum and the plain group mean and std, the hook, the logged `reward`."""

    def _calculate_rewards(self, *args: Any) -> Any:
        return tensor(MATRIX)

    def _post_advantage_hook(
        self, data: dict, rewards: Any, given: Any, *args: Any, **kw: Any
    ) -> None:
        self.hooked = given.clone()

    def _compute_deferred_scores(self, rollout: dict) -> dict:
        rewards_per_func = self._calculate_rewards()
        rewards = (rewards_per_func * self.reward_weights).nansum(dim=1)
        grouped = rewards.view(-1, 4)
        mean, std = grouped.mean(dim=1), grouped.std(dim=1)
        rollout["advantages"] = (rewards - mean.repeat_interleave(4)) / (
            std.repeat_interleave(4) + 1e-4
        )
        self._post_advantage_hook(rollout, rewards_per_func, rollout["advantages"], [], 4, "train")
        self._metrics["train"]["reward"].append(rewards_per_func.nansum(dim=1).mean().item())
        self._metrics["train"]["reward_std"].append(rewards_per_func.nansum(dim=1).std().item())
        return rollout


def test_in_axolotls_async_trainer_the_hook_gets_the_scored_advantages_and_so_does_the_log():
    trainer = AsyncLike.__new__(AsyncLike)
    trainer.__dict__.update(
        reward_func_names=["nemo_gym", "user"],
        reward_weights=torch.tensor(WEIGHTS),
        scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize",
        accelerator=types.SimpleNamespace(process_index=0),
        _metrics={"train": {"reward": [], "reward_std": []}},
    )
    advantages.install(trainer)
    data = trainer._compute_deferred_scores({})

    matrix = as_lists(advantages.unscorable(tensor(MATRIX), column=0))
    expected = grpo.advantages(matrix, WEIGHTS, 4)
    assert data["advantages"].tolist() == pytest.approx(expected, abs=1e-5)
    assert trainer.hooked.tolist() == pytest.approx(expected, abs=1e-5)  # axolotl's hook too
    sums = [v for v in grpo.summed(matrix, WEIGHTS) if v is not None]
    assert trainer._metrics["train"]["reward"] == pytest.approx([sum(sums) / len(sums)])
