"""The reward functions' argument and environment errors surface before any I/O (no servers)."""

from __future__ import annotations

import pytest

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn, reward_nemo_gym_verify
from nemo_gym_grpc.rewards.client import settings
from tests.support import closed_port


def test_argument_errors_raise_before_contacting_a_bridge(monkeypatch):
    monkeypatch.setenv(settings.TARGET_ENV, f"127.0.0.1:{closed_port()}")
    with pytest.raises(ValueError, match="verify_extra has 1 entries for 2 completions"):
        reward_nemo_gym_verify(
            ["a", "b"], resources_server_ref=[{"name": "x"}] * 2, verify_extra=[{}]
        )
    assert reward_nemo_gym_verify([], prompts=[], resources_server_ref=[], verify_extra=[]) == []
    for column in ("completions", "prompts"):  # a string would be scored letter by letter
        args = {"completions": ["a", "b"], "prompts": None, column: "ab"}
        with pytest.raises(TypeError, match=f"{column} must be a list"):
            reward_nemo_gym_verify(**args, resources_server_ref=[{"name": "x"}] * 2)


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
        settings.ON_ERROR_ENV,
        settings.MAX_FAILURE_FRACTION_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    assert (settings.on_error(), settings.max_failure_fraction()) == ("none", 0.5)
    assert settings.target() is None
    assert settings.head_url() == "http://127.0.0.1:11000"
    assert (settings.batch_timeout(), settings.connect_timeout()) == (600.0, 60.0)
    assert settings.startup_timeout() == 60.0
    monkeypatch.setenv(settings.HEAD_URL_ENV, "http://h:1/")
    monkeypatch.setenv(settings.TARGET_ENV, "  ")
    assert settings.head_url() == "http://h:1" and settings.target() is None


@pytest.mark.parametrize("value", ["notaurl", "127.0.0.1:11000", "ftp://h:1", "http://"])
def test_a_head_url_that_is_not_an_http_url_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(settings.HEAD_URL_ENV, value)
    with pytest.raises(ValueError, match=f"^{settings.HEAD_URL_ENV}: expected http://HOST:PORT"):
        settings.head_url()


@pytest.mark.parametrize("value", ["http://127.0.0.1:50051", "https://bridge:443"])
def test_a_url_as_the_grpc_target_is_refused_at_once(monkeypatch, value):
    monkeypatch.setenv(settings.TARGET_ENV, value)
    with pytest.raises(ValueError, match="is a URL; a gRPC target is host:port"):
        settings.target()


def test_a_url_as_a_target_keyword_is_refused_at_once(monkeypatch):
    # was: run_rollouts(target="http://...") waited for a connection that could never come
    from nemo_gym_grpc.rewards.client.stream import Route

    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    with pytest.raises(ValueError, match="^target='http://127.0.0.1:50051' is a URL; a gRPC"):
        Route.resolve(target="http://127.0.0.1:50051", timeout=1.0)
    assert Route.resolve(target="127.0.0.1:50051", timeout=1.0).target == "127.0.0.1:50051"


def test_policy_env_values_are_read_and_checked(monkeypatch):
    monkeypatch.setenv(settings.ON_ERROR_ENV, " Zero ")
    monkeypatch.setenv(settings.MAX_FAILURE_FRACTION_ENV, "1")
    assert (settings.on_error(), settings.max_failure_fraction()) == ("zero", 1.0)
    monkeypatch.setenv(settings.ON_ERROR_ENV, "skip")
    with pytest.raises(ValueError, match=f"{settings.ON_ERROR_ENV}='skip' must be one of"):
        settings.on_error()
    for bad in ("1.5", "-0.1", "nan", "half"):
        monkeypatch.setenv(settings.MAX_FAILURE_FRACTION_ENV, bad)
        with pytest.raises(ValueError, match=settings.MAX_FAILURE_FRACTION_ENV):
            settings.max_failure_fraction()


def test_factory_policy_keywords_are_checked_when_the_function_is_made():
    with pytest.raises(ValueError, match="on_error='ignore' must be one of none, zero, raise"):
        create_nemo_gym_reward_fn({}, {}, on_error="ignore")
    with pytest.raises(ValueError, match="max_failure_fraction=2 must be a fraction"):
        create_nemo_gym_reward_fn({}, {}, max_failure_fraction=2)
    for keyword in ("verify_timeout", "batch_timeout"):
        for bad in (0, -1, float("nan"), "soon"):
            with pytest.raises(ValueError, match=f"{keyword}=.* number of seconds"):
                create_nemo_gym_reward_fn({}, {}, **{keyword: bad})
