"""slime's custom reward hooks (`--custom-rm-path`, `--group-rm`) through a real bridge and
real NeMo Gym resources servers. slime is not on PyPI: `SlimeSample` has the fields of its
`Sample` that the adapter reads (tests/stacks_common.py)."""

from __future__ import annotations

import json
import math

import pytest

from nemo_gym_grpc.rewards import ScoringError, slime
from tests.stacks_common import SlimeSample, answers
from tests.support.items import mcqa_row


def _sample(completion_right: bool = True, server: str = "mcqa") -> SlimeSample:
    row = mcqa_row()
    right, wrong = answers("mcqa", row)
    return SlimeSample(
        prompt=row["responses_create_params"]["input"],
        response=right if completion_right else wrong,
        label=row["expected_answer"],
        metadata={"resources_server": server, "nemo_gym_row": row},
    )


@pytest.fixture
def via_bridge(bridge_target, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_TARGET", bridge_target)
    monkeypatch.delenv("NEMO_GYM_GRPC_ON_ERROR", raising=False)
    return monkeypatch


async def test_group_reward_scores_the_group_in_order_and_flags_metadata(via_bridge):
    samples = [_sample(True), _sample(False), _sample(True)]
    assert await slime.group_reward(None, samples) == [1.0, 0.0, 1.0]
    assert [s.metadata["scoring_failed"] for s in samples] == [0.0, 0.0, 0.0]


async def test_a_failed_item_raises_by_default(via_bridge):
    samples = [_sample(), _sample(server="no_such_server"), _sample(), _sample()]
    with pytest.raises(ScoringError, match=r"1 of 4 items failed \(on_error=raise") as caught:
        await slime.group_reward(None, samples)
    assert caught.value.causes == {"NOT_FOUND (UNKNOWN_RESOURCES_SERVER)": 1}
    with pytest.raises(ScoringError, match="1 of 1 items failed"):
        await slime.reward(None, _sample(server="no_such_server"))


async def test_on_error_zero_or_none_gives_0_or_nan_flagged_also_for_one_sample(via_bridge):
    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "zero")
    samples = [_sample(), _sample(server="no_such_server"), _sample(False), _sample()]
    assert await slime.group_reward(None, samples) == [1.0, 0.0, 0.0, 1.0]
    assert samples[1].metadata["scoring_failed"] == 1.0
    assert samples[1].metadata["scoring_failure"] == "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)"
    assert samples[2].metadata["scoring_failed"] == 0.0  # wrong, not failed
    # one sample: no max_failure_fraction guard, so on_error applies
    assert await slime.reward(None, _sample(server="no_such_server")) == 0.0
    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "none")
    assert math.isnan(await slime.reward(None, _sample(server="no_such_server")))


async def test_a_group_mostly_failed_raises_whatever_on_error_says(via_bridge):
    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "zero")
    samples = [_sample(server="no_such_server")] * 3 + [_sample()]
    with pytest.raises(ScoringError, match="more than max_failure_fraction=0.5"):
        await slime.group_reward(None, samples)


async def test_metadata_may_be_json_text_and_a_sample_without_a_server_fails_alone(via_bridge):
    text = _sample()
    text.metadata = json.dumps(text.metadata)  # type: ignore[assignment]
    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "zero")
    bare = SlimeSample(prompt="Q?", response="A", metadata={})
    assert await slime.group_reward(None, [text, bare, _sample()]) == [1.0, 0.0, 1.0]
    assert bare.metadata["scoring_failure"] == "INVALID_ARGUMENT (INVALID_ITEM)"


def test_metadata_text_that_is_not_a_json_object_is_an_error():
    with pytest.raises(ValueError, match="sample.metadata: not JSON"):
        slime.slime_item(SlimeSample(prompt="Q", response="A", metadata="{nope"))  # type: ignore[arg-type]


NOT_A_DICT = "must be the NeMo Gym row as a dict (or its JSON text)"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ([{"expected_answer": "B"}], f"{NOT_A_DICT}, got list"),
        ('[{"expected_answer": "B"}]', "a JSON list, not an object"),
        (7, f"{NOT_A_DICT}, got int"),
    ],
)
def test_a_nemo_gym_row_that_is_not_an_object_is_an_error_naming_the_field(row, problem):
    sample = SlimeSample(
        prompt="Q", response="A", metadata={"resources_server": "mcqa", "nemo_gym_row": row}
    )
    with pytest.raises(ValueError) as caught:
        slime.slime_item(sample)  # was TypeError: cannot convert dictionary update sequence
    assert str(caught.value).startswith(f"sample.metadata['nemo_gym_row']: {problem}")


async def test_a_sample_without_its_nemo_gym_row_fails_instead_of_scoring_0(via_bridge):
    # mcqa would score a row-less item 0.0 (no expected answer): a silent zero
    rowless = SlimeSample(prompt="Q?", response="\\boxed{B}", metadata={"resources_server": "mcqa"})
    with pytest.raises(ScoringError, match="1 of 1 items failed") as caught:
        await slime.reward(None, rowless)
    assert caught.value.causes == {"INVALID_ARGUMENT (INVALID_ITEM)": 1}
    via_bridge.setenv("NEMO_GYM_GRPC_ON_ERROR", "zero")
    empty = SlimeSample(
        prompt="Q?", response="A", metadata={"resources_server": "mcqa", "nemo_gym_row": {}}
    )
    assert await slime.group_reward(None, [_sample(), empty]) == [1.0, 0.0]
    assert empty.metadata["scoring_failed"] == 1.0
    assert empty.metadata["scoring_failure"] == "INVALID_ARGUMENT (INVALID_ITEM)"
