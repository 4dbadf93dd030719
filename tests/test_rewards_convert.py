"""Reward-function arguments -> VerifyRequests, and `reward_env` (no I/O, no servers). Also:
test_rewards_settings.py (argument errors before any I/O), test_rewards_outcomes.py (the
failure policy, the extras for TRL's logs).
"""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn, reward_env
from nemo_gym_grpc.rewards.client import convert, resend
from nemo_gym_grpc.shared.contract import MiB
from nemo_gym_grpc.v1 import verify_pb2

# --------------------------------------------------------------------------------------------
# reward_env: axolotl's behaviour, except for missing rewards and length mismatches


def test_reward_env_passes_a_list_or_tuple_through_as_floats():
    assert reward_env(["a", "b"], env_reward=[1, 0.5]) == [1.0, 0.5]
    assert reward_env(["a", "b"], env_reward=(True, "2")) == [1.0, 2.0]
    assert reward_env(["a", "b"], env_reward=[1, None]) == [1.0, None]  # not 0.0, not a crash


def test_reward_env_refuses_a_list_of_another_length():
    # axolotl's returns the list as given; TRL would then fail far from the cause
    with pytest.raises(ValueError, match="env_reward has 3 entries for 1 completions"):
        reward_env(["a"], env_reward=[1, 2, 3])


def test_reward_env_repeats_a_scalar():
    assert reward_env(["a", "b", "c"], env_reward=0.25) == [0.25, 0.25, 0.25]
    assert reward_env([], env_reward=1.0) == []
    assert all(type(r) is float for r in reward_env(["a"], env_reward=1))


def test_reward_env_refuses_a_missing_env_reward_instead_of_zeros():
    # axolotl gave 0.0 to every completion here: a silent zero for rollouts that never arrived
    with pytest.raises(ValueError, match="env_reward"):
        reward_env(["a", "b"], prompts=["p", "q"])
    with pytest.raises(ValueError, match="env_reward"):
        reward_env(["a", "b"], env_reward=None)


def test_public_names_are_plain_module_level_functions():
    import nemo_gym_grpc.rewards as rewards

    names = (
        "reward_env",
        "reward_nemo_gym_verify",
        "reward_nemo_gym_verify_async",
        "create_nemo_gym_reward_fn",
    )
    for name in names:
        function = getattr(rewards, name)
        assert function.__name__ == name
        assert function.__module__.startswith("nemo_gym_grpc.rewards")
        assert function.__doc__
        # axolotl's loader: importable by dotted path, at least two parameters
        module, _, attr = f"nemo_gym_grpc.rewards.{name}".rpartition(".")
        assert getattr(importlib.import_module(module), attr) is function
        assert len(inspect.signature(function).parameters) >= 2
    # TRL 1.8 recognises async reward functions with inspect.iscoroutinefunction
    assert inspect.iscoroutinefunction(rewards.reward_nemo_gym_verify_async)
    assert not inspect.iscoroutinefunction(rewards.reward_nemo_gym_verify)
    assert inspect.iscoroutinefunction(create_nemo_gym_reward_fn({}, {}, asynchronous=True))


# --------------------------------------------------------------------------------------------
# completion and prompt shapes


def test_a_single_assistant_message_gives_exactly_its_content_like_the_seed():
    completion = [{"role": "assistant", "content": "Final: \\boxed{B}"}]
    assert convert.completion_text(completion) == completion[0]["content"]


def test_plain_string_completion_is_taken_as_is():
    assert convert.completion_text("  \\boxed{B}\n") == "  \\boxed{B}\n"
    assert convert.completion_text("") == ""


def test_conversational_completion_joins_assistant_messages_in_order():
    completion = [
        {"role": "assistant", "content": "calling a tool"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": None},  # a tool-call-only message
        {"role": "assistant", "content": [{"type": "text", "text": "It is "}, "sunny."]},
    ]
    assert convert.completion_text(completion) == "calling a tool\nIt is sunny."
    assert convert.completion_text([]) == ""
    assert convert.completion_text([{"content": "no role"}]) == "no role"


@pytest.mark.parametrize("bad", [None, 3, {"role": "assistant", "content": "x"}, ["x"]])
def test_unusable_completion_shapes_are_type_errors(bad):
    with pytest.raises(TypeError):
        convert.completion_text(bad)


def test_prompts_become_typed_messages():
    assert convert.prompt_messages("What?") == [("user", "What?")]
    assert convert.prompt_messages(None) == []
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "image"}]},
        {"content": "no role"},
    ]
    assert convert.prompt_messages(conversation) == [
        ("system", "Be brief."),
        ("user", "Q"),
        ("user", "no role"),
    ]


@pytest.mark.parametrize(
    ("ref", "name"),
    [
        ({"name": "mcqa"}, "mcqa"),
        ({"name": ""}, ""),
        ({"name": None}, ""),
        ({}, ""),
        (None, ""),
        ("mcqa", ""),
    ],
)
def test_resources_server_ref_gives_the_routing_key_or_empty(ref, name):
    assert convert.resources_server_name(ref) == name


# --------------------------------------------------------------------------------------------
# build_batch


def _batch(n=2, **overrides):
    args = {
        "completions": [[{"role": "assistant", "content": f"answer {i}"}] for i in range(n)],
        "prompts": [[{"role": "user", "content": f"question {i}"}] for i in range(n)],
        "resources_server_refs": [{"name": "mcqa"} for _ in range(n)],
        "verify_extras": [{"expected_answer": "B", "uuid": None, "n": i} for i in range(n)],
    }
    args.update(overrides)
    return convert.build_batch(**args, model="m", timeout_seconds=7.5, batch_id="b1")


def _positions(batch):
    """The input position of each request, from its request_id."""
    return [int(r.request_id.removeprefix(f"{batch.batch_id}-")) for r in batch.requests]


def test_one_request_per_completion_with_every_field_set():
    batch = _batch(3)
    assert [r.request_id for r in batch.requests] == ["b1-0", "b1-1", "b1-2"]
    first = batch.requests[1]
    assert first.resources_server == "mcqa"
    assert first.completion == "answer 1"
    assert [(m.role, m.content) for m in first.prompt] == [("user", "question 1")]
    assert first.model == "m" and first.timeout_seconds == 7.5
    # the whole row, None values included (the bridge drops them)
    assert json.loads(first.row_json) == {"expected_answer": "B", "uuid": None, "n": 1}
    assert not first.responses_create_params_json and not first.response_json
    assert _positions(batch) == [0, 1, 2] and not batch.rejected


def test_a_missing_or_malformed_ref_fails_its_item_naming_the_shape():
    batch = _batch(3, resources_server_refs=[None, {"name": "mcqa"}, "mcqa"])
    assert [r.resources_server for r in batch.requests] == ["mcqa"]
    assert _positions(batch) == [1]
    assert {i: (f.code, f.reason) for i, f in batch.rejected.items()} == {
        0: ("INVALID_ARGUMENT", "INVALID_ITEM"),
        2: ("INVALID_ARGUMENT", "INVALID_ITEM"),
    }
    assert batch.rejected[2].message == (
        "resources_server_ref[2] is 'mcqa'; each item needs {'name': <resources server>}"
    )


def test_without_verify_extra_or_prompts_items_have_no_row_and_no_prompt():
    batch = _batch(2, verify_extras=None, prompts=None)
    assert [r.row_json for r in batch.requests] == ["", ""]
    assert [list(r.prompt) for r in batch.requests] == [[], []]
    assert _batch(1, verify_extras=[None]).requests[0].row_json == ""


@pytest.mark.parametrize("column", ["resources_server_refs", "verify_extras", "prompts"])
def test_a_column_of_another_length_is_a_value_error(column):
    with pytest.raises(ValueError, match="3 entries for 2 completions"):
        _batch(2, **{column: [None, None, None]})


def test_missing_resources_server_ref_column_is_a_value_error():
    with pytest.raises(ValueError, match="resources_server_ref"):
        _batch(2, resources_server_refs=None)


def test_a_verify_extra_of_json_text_is_the_row_it_holds_as_rollout_func_takes_it():
    # was: sent as a JSON string, so the bridge failed it: "row_json must be a JSON object"
    batch = _batch(3, verify_extras=['{"expected_answer": "B"}', {"expected_answer": "C"}, "B"])
    rows = [json.loads(r.row_json) for r in batch.requests]
    # text that is not JSON travels as a JSON string, which the bridge fails alone
    assert rows == [{"expected_answer": "B"}, {"expected_answer": "C"}, "B"]


def test_a_row_json_cannot_represent_is_a_type_error_naming_the_item():
    with pytest.raises(TypeError, match=r"verify_extra\[1\]"):
        _batch(2, verify_extras=[{}, {"raw": b"bytes"}])


def test_text_that_is_not_valid_unicode_fails_its_item_locally_and_is_not_sent():
    batch = _batch(
        4,
        completions=["fine", "bad \ud800 text", "pair \ud83d\ude00", "fine"],
        prompts=["p", "p", "p", [{"role": "user", "content": "q \udfff"}]],
    )
    assert [r.request_id for r in batch.requests] == ["b1-0", "b1-2"]
    assert _positions(batch) == [0, 2]
    assert batch.requests[1].completion == "pair \U0001f600"  # a pair is joined, not an error
    assert sorted(batch.rejected) == [1, 3]
    failure = batch.rejected[1]
    assert (failure.code, failure.reason) == ("INVALID_ARGUMENT", "INVALID_ITEM")
    assert "completion is not valid Unicode: lone surrogate U+D800 at character 4" in (
        failure.message
    )
    assert "prompt message 0 content" in batch.rejected[3].message
    # outcomes are looked up by request_id in input order, the rejected items' failures included
    sent = {
        r.request_id: verify_pb2.VerifyResponse(request_id=r.request_id, reward=7.0)
        for r in batch.requests
    }
    outcomes = batch.outcomes(sent)
    assert outcomes[0] is sent["b1-0"] and outcomes[2] is sent["b1-2"]
    assert outcomes[1] is batch.rejected[1] and outcomes[3] is batch.rejected[3]
    with pytest.raises(ValueError, match="no outcome for request_id 'b1-2'"):
        batch.outcomes({"b1-0": sent["b1-0"]})


def test_a_lone_surrogate_in_the_server_name_or_a_role_fails_the_item():
    batch = _batch(2, resources_server_refs=[{"name": "mc\udc80qa"}, {"name": "mcqa"}])
    assert list(batch.rejected) == [0] and _positions(batch) == [1]
    assert "resources_server_ref name" in batch.rejected[0].message
    batch = _batch(1, prompts=[[{"role": "user\ud800", "content": "q"}]])
    assert "prompt message 0 role" in batch.rejected[0].message


def test_a_lone_surrogate_in_the_row_travels_as_a_json_escape():
    batch = _batch(1, verify_extras=[{"expected_answer": "x\ud800"}])
    assert not batch.rejected
    assert json.loads(batch.requests[0].row_json) == {"expected_answer": "x\ud800"}


def _utf16(text: str) -> bytes:
    return text.encode("utf-16-le", "surrogatepass")


@given(
    st.lists(st.text(st.characters(codec=None, categories=None, exclude_categories=())), max_size=5)
)
def test_any_text_gives_each_item_exactly_one_outcome(texts):
    batch = _batch(
        len(texts),
        completions=texts,
        prompts=texts,
        verify_extras=[{"expected_answer": t} for t in texts],
    )
    assert sorted(_positions(batch) + list(batch.rejected)) == list(range(len(texts)))
    for request, position in zip(batch.requests, _positions(batch), strict=True):
        parsed = verify_pb2.VerifyRequest.FromString(request.SerializeToString())
        assert json.loads(parsed.row_json) == {"expected_answer": texts[position]}
        assert _utf16(parsed.completion) == _utf16(texts[position])  # same text
    for position, failure in batch.rejected.items():
        assert failure.code == "INVALID_ARGUMENT"
        with pytest.raises(UnicodeDecodeError):  # it really has a lone surrogate
            _utf16(texts[position]).decode("utf-16-le")


# --------------------------------------------------------------------------------------------
# message chunking


def test_items_go_in_messages_of_at_most_64():
    items = [verify_pb2.VerifyRequest(request_id=str(i)) for i in range(130)]
    sizes = [len(chunk) for chunk in resend.chunks(items)]
    assert sizes == [64, 64, 2]
    assert list(resend.chunks([])) == []


def test_big_items_close_a_message_early_and_a_huge_one_travels_alone():
    big = "x" * (10 * MiB)
    items = [verify_pb2.VerifyRequest(request_id=str(i), completion=big) for i in range(3)]
    assert [len(chunk) for chunk in resend.chunks(items)] == [1, 1, 1]
