"""Reward-function arguments -> VerifyRequests, and `reward_env` (no I/O, no servers)."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_grpc.rewards import client, convert, reward_env, reward_nemo_gym_verify, settings
from nemo_gym_grpc.v1 import verify_pb2

# --------------------------------------------------------------------------------------------
# reward_env: exactly axolotl's behaviour


def test_reward_env_passes_a_list_or_tuple_through_as_floats():
    assert reward_env(["a", "b"], env_reward=[1, 0.5]) == [1.0, 0.5]
    assert reward_env(["a", "b"], env_reward=(True, "2")) == [1.0, 2.0]
    # the seed does not compare lengths: the env_reward list is returned as given
    assert reward_env(["a"], env_reward=[1, 2, 3]) == [1.0, 2.0, 3.0]


def test_reward_env_repeats_a_scalar_and_gives_zeros_when_missing():
    assert reward_env(["a", "b", "c"], env_reward=0.25) == [0.25, 0.25, 0.25]
    assert reward_env(["a", "b"], prompts=["p", "q"]) == [0.0, 0.0]
    assert reward_env(["a", "b"], env_reward=None) == [0.0, 0.0]
    assert reward_env([], env_reward=1.0) == []
    assert all(type(r) is float for r in reward_env(["a"], env_reward=1))


def test_public_names_are_plain_module_level_functions():
    import nemo_gym_grpc.rewards as rewards

    for name in ("reward_env", "reward_nemo_gym_verify", "create_nemo_gym_reward_fn"):
        function = getattr(rewards, name)
        assert function.__name__ == name
        assert function.__module__.startswith("nemo_gym_grpc.rewards")
        assert function.__doc__


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
    assert batch.repaired == []


def test_missing_ref_still_makes_an_item_with_an_empty_name():
    batch = _batch(2, resources_server_refs=[None, {"name": "mcqa"}])
    assert [r.resources_server for r in batch.requests] == ["", "mcqa"]


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


def test_a_row_json_cannot_represent_is_a_type_error_naming_the_item():
    with pytest.raises(TypeError, match=r"verify_extra\[1\]"):
        _batch(2, verify_extras=[{}, {"raw": b"bytes"}])


def test_lone_surrogates_are_replaced_and_reported():
    batch = _batch(
        3,
        completions=["fine", "bad \ud800 text", "pair \ud83d\ude00"],
        prompts=["p", "p", "q \udfff"],
    )
    assert batch.requests[1].completion == "bad \ufffd text"
    assert batch.requests[2].completion == "pair \U0001f600"  # a pair is joined, not replaced
    assert batch.requests[2].prompt[0].content == "q \ufffd"
    assert batch.repaired == [1, 2]


@given(
    st.lists(st.text(st.characters(codec=None, categories=None, exclude_categories=())), max_size=5)
)
def test_any_text_becomes_a_serializable_request(texts):
    batch = _batch(
        len(texts),
        completions=texts,
        prompts=texts,
        verify_extras=[{"expected_answer": t} for t in texts],
    )
    for request, text in zip(batch.requests, texts, strict=True):
        parsed = verify_pb2.VerifyRequest.FromString(request.SerializeToString())
        assert json.loads(parsed.row_json) == {"expected_answer": text}


# --------------------------------------------------------------------------------------------
# message chunking


def test_items_go_in_messages_of_at_most_64():
    items = [verify_pb2.VerifyRequest(request_id=str(i)) for i in range(130)]
    sizes = [len(m.items) for m in client._messages(items)]
    assert sizes == [64, 64, 2]
    assert list(client._messages([])) == []


def test_big_items_close_a_message_early_and_a_huge_one_travels_alone():
    big = "x" * (10 * client.MiB)
    items = [verify_pb2.VerifyRequest(request_id=str(i), completion=big) for i in range(3)]
    assert [len(m.items) for m in client._messages(items)] == [1, 1, 1]


# --------------------------------------------------------------------------------------------
# argument errors surface before any I/O


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_argument_errors_raise_before_contacting_a_bridge(monkeypatch):
    monkeypatch.setenv(settings.TARGET_ENV, f"127.0.0.1:{_closed_port()}")
    with pytest.raises(ValueError, match="verify_extra has 1 entries for 2 completions"):
        reward_nemo_gym_verify(
            ["a", "b"], resources_server_ref=[{"name": "x"}] * 2, verify_extra=[{}]
        )
    assert reward_nemo_gym_verify([], prompts=[], resources_server_ref=[], verify_extra=[]) == []


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_invalid_timeout_env_values_name_the_variable(monkeypatch, value):
    monkeypatch.setenv(settings.BATCH_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=settings.BATCH_TIMEOUT_ENV):
        settings.batch_timeout()


def test_env_defaults(monkeypatch):
    for name in (
        settings.TARGET_ENV,
        settings.HEAD_URL_ENV,
        settings.BATCH_TIMEOUT_ENV,
        settings.CONNECT_TIMEOUT_ENV,
        settings.STARTUP_TIMEOUT_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    assert settings.target() is None
    assert settings.head_url() == "http://127.0.0.1:11000"
    assert (settings.batch_timeout(), settings.connect_timeout()) == (600.0, 60.0)
    assert settings.startup_timeout() == 60.0
    monkeypatch.setenv(settings.HEAD_URL_ENV, "http://h:1/")
    monkeypatch.setenv(settings.TARGET_ENV, "  ")
    assert settings.head_url() == "http://h:1" and settings.target() is None
