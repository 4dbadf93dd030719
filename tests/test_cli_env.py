"""`serve`'s environment variables, which each flag falls back to: a bad value exits 2 naming
the variable, a flag beats its variable which beats the default, values convert as the flags'
do, and the defaults are the Python ones (no bridge started). A bad variable refused through the
console script: test_cli_args.py."""

from __future__ import annotations

import pytest

from nemo_gym_grpc.bridge.process.cli import PROCESS_FLAGS, parse_args
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.shared.contract import TOKEN_ENV


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NEMO_GYM_GRPC_LISTEN", "nonsense"),
        ("NEMO_GYM_GRPC_VERIFY_TIMEOUT", "nan"),
        ("NEMO_GYM_GRPC_SERVER", "x=http://127.0.0.1:1,broken"),
        ("NEMO_GYM_GRPC_INSECURE", "maybe"),
        ("NEMO_GYM_GRPC_LOG_FORMAT", "xml"),
        ("NEMO_GYM_GRPC_WORKERS", "two"),
        ("NEMO_GYM_GRPC_HEAD_URL", "127.0.0.1:28013"),
        ("NEMO_GYM_GRPC_TLS_CERT", "/nonexistent/cert.pem"),
    ],
)
def test_bad_environment_values_exit_2_like_bad_flags(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["serve"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: environment variable " + name in last, last


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    monkeypatch.delenv("NEMO_GYM_GRPC_MAX_IN_FLIGHT", raising=False)
    assert BridgeConfig.from_args(parse_args(["serve"])).max_in_flight == 16384
    monkeypatch.setenv("NEMO_GYM_GRPC_MAX_IN_FLIGHT", " 7 ")
    assert BridgeConfig.from_args(parse_args(["serve"])).max_in_flight == 7
    given = parse_args(["serve", "--max-in-flight", "9"])
    assert BridgeConfig.from_args(given).max_in_flight == 9
    monkeypatch.setenv("NEMO_GYM_GRPC_MAX_IN_FLIGHT", "")  # blank = unset
    assert BridgeConfig.from_args(parse_args(["serve"])).max_in_flight == 16384


def test_a_bad_variable_is_not_read_when_its_flag_is_given(monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_GRACE", "soon")
    assert BridgeConfig.from_args(parse_args(["serve", "--grace", "1"])).grace == 1.0


def test_environment_values_convert_like_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("NEMO_GYM_GRPC_SERVER", "a=http://h:1/, a=http://h:2,b=https://h:3")
    monkeypatch.setenv("NEMO_GYM_GRPC_SESSION_SERVER", "a,b")
    monkeypatch.setenv("NEMO_GYM_GRPC_MAX_ITEM_MB", "0.5")
    monkeypatch.setenv("NEMO_GYM_GRPC_RETRY_ATTEMPTS", "1")
    monkeypatch.setenv("NEMO_GYM_GRPC_INSECURE", "yes")
    monkeypatch.setenv("NEMO_GYM_GRPC_READY_FILE", str(tmp_path / "ready"))
    monkeypatch.setenv("NEMO_GYM_GRPC_LOG_LEVEL", "debug")
    args = parse_args(["serve", "--retry-budget", "5"])
    config = BridgeConfig.from_args(args)
    assert config.servers == {"a": ["http://h:1", "http://h:2"], "b": ["https://h:3"]}
    assert config.session_servers == ("a", "b")
    assert config.max_item_bytes == 512 * 1024
    assert (config.retry.attempts, config.retry.budget) == (1, 5.0)
    assert config.insecure is True
    assert config.ready_file == tmp_path / "ready"
    assert args.log_level == "DEBUG"


def test_the_token_comes_from_its_file_else_from_the_token_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(TOKEN_ENV, " from-env \n")
    assert BridgeConfig.from_args(parse_args(["serve"])).token == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    args = parse_args(["serve", "--token-file", str(token_file)])
    assert BridgeConfig.from_args(args).token == "from-file"
    monkeypatch.delenv(TOKEN_ENV)
    assert BridgeConfig.from_args(parse_args(["serve"])).token is None


def test_flag_defaults_are_the_python_defaults(monkeypatch):
    for flag in [*BridgeConfig.flags(), *PROCESS_FLAGS]:
        monkeypatch.delenv(flag.env_var, raising=False)
    assert BridgeConfig.from_args(parse_args(["serve"])) == BridgeConfig()
