"""A rollout's per-turn tokens -> one training sample (`rewards/client/stitch.py`); no servers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_grpc.rewards.client import outcomes
from nemo_gym_grpc.rewards.client.stitch import Sample, StitchError, failed_sample, stitch
from nemo_gym_grpc.v1 import rollout_pb2


@dataclass
class T:
    """A turn as plain lists (stitch reads any object with the three `Turn` fields)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


tokens = st.lists(st.integers(0, 50_000), max_size=8)
logprob = st.floats(-20.0, 0.0, allow_nan=False)


@st.composite
def episodes(draw: st.DrawFn) -> tuple[list[int], list[tuple[list[int], list[int], list[float]]]]:
    """A first prompt and, per turn, (observation before it, generation, logprobs); turn 0
    has no observation, and at least one turn generates something."""
    prompt = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=8))
    count = draw(st.integers(1, 5))
    turns = []
    for k in range(count):
        observation = draw(tokens) if k else []
        generation = draw(tokens)
        turns.append((observation, generation, [draw(logprob) for _ in generation]))
    if not any(generation for _, generation, _ in turns):
        turns[-1] = (turns[-1][0], [7], [-0.5])
    return prompt, turns


def as_turns(prompt: list[int], parts: list[tuple[list[int], list[int], list[float]]]) -> list[T]:
    """What a model server reports: each call's whole context, its generation, logprobs."""
    context = list(prompt)
    turns = []
    for observation, generation, logprobs in parts:
        context += observation
        turns.append(T(list(context), list(generation), list(logprobs)))
        context += generation
    return turns


@given(episodes())
def test_the_sample_is_the_last_context_with_only_generated_tokens_unmasked(episode):
    prompt, parts = episode
    turns = as_turns(prompt, parts)
    sample = stitch(turns)
    assert sample.prompt_ids == prompt
    assert sample.prompt_ids + sample.completion_ids == (
        turns[-1].prompt_token_ids + turns[-1].generation_token_ids
    )
    expected_mask: list[int] = []
    expected_logprobs: list[float] = []
    for observation, generation, logprobs in parts:
        expected_mask += [0] * len(observation) + [1] * len(generation)
        expected_logprobs += [0.0] * len(observation) + logprobs
    assert sample.env_mask == expected_mask
    assert sample.logprobs == expected_logprobs
    assert sample.generated == sum(len(g) for _, g, _ in parts)
    assert sample.num_turns == len(parts)


def test_two_turns_with_a_tool_output_between_them():
    turns = [
        rollout_pb2.Turn(
            prompt_token_ids=[1, 2, 3], generation_token_ids=[10, 11], generation_log_probs=[-1, -2]
        ),
        rollout_pb2.Turn(
            prompt_token_ids=[1, 2, 3, 10, 11, 20, 21, 22],
            generation_token_ids=[12],
            generation_log_probs=[-0.25],
        ),
    ]
    assert stitch(turns) == Sample(
        prompt_ids=[1, 2, 3],
        completion_ids=[10, 11, 20, 21, 22, 12],
        env_mask=[1, 1, 0, 0, 0, 1],
        logprobs=[-1.0, -2.0, 0.0, 0.0, 0.0, -0.25],
        num_turns=2,
    )


@given(episodes(), st.data())
def test_a_turn_that_does_not_continue_the_previous_one_cannot_be_stitched(episode, data):
    prompt, parts = episode
    turns = as_turns(prompt, parts)
    if len(turns) < 2:  # a second turn whose context differs at its first token
        seen = turns[0].prompt_token_ids + turns[0].generation_token_ids
        turns.append(T([seen[0] + 1, *seen[1:]], [5], [-1.0]))
    else:
        k = data.draw(st.integers(1, len(turns) - 1))
        seen = turns[k - 1].prompt_token_ids + turns[k - 1].generation_token_ids
        at = data.draw(st.integers(0, len(seen) - 1))
        turns[k].prompt_token_ids[at] += 1  # e.g. a re-rendered earlier turn
    with pytest.raises(StitchError) as caught:
        stitch(turns)
    assert caught.value.reason == outcomes.TURNS_NOT_CONTIGUOUS


def test_a_shorter_prompt_than_the_previous_context_cannot_be_stitched():
    turns = [T([1, 2], [3, 4], [-1, -1]), T([1, 2, 3], [5], [-1])]  # the context lost token 4
    with pytest.raises(StitchError, match="turn 1's prompt") as caught:
        stitch(turns)
    assert caught.value.reason == outcomes.TURNS_NOT_CONTIGUOUS


@pytest.mark.parametrize(
    "turns",
    [[], [T([], [1], [-1.0])], [T([1], [], [])], [T([1], [], []), T([1, 2], [], [])]],
    ids=["no turn", "empty first prompt", "nothing generated", "two turns, nothing generated"],
)
def test_a_rollout_without_tokens_cannot_be_stitched(turns):
    with pytest.raises(StitchError) as caught:
        stitch(turns)
    assert caught.value.reason == outcomes.NO_TOKENS


def test_logprobs_that_do_not_match_the_tokens_cannot_be_stitched():
    with pytest.raises(StitchError, match="2 generated tokens and 1 logprobs") as caught:
        stitch([T([1], [2, 3], [-1.0])])
    assert caught.value.reason == outcomes.LOGPROBS_MISMATCH


def test_a_failed_rollout_is_one_masked_eos_token():
    assert failed_sample(2) == Sample([2], [2], [0], [0.0], num_turns=0)
    assert failed_sample(2, [5, 6]).prompt_ids == [5, 6]
    assert failed_sample(2).generated == 0


def test_a_sample_with_misaligned_lists_is_refused():
    with pytest.raises(ValueError, match="differ in length"):
        Sample([1], [2, 3], [1], [0.0, 0.0])
