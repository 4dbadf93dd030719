"""Bad command-line arguments of `serve` and `score` are refused at parsing: exit status 2 and
a one-line error naming the option, before anything starts (no NeMo Gym, no bridge needed).
The same holds for `serve`'s environment variables, which each flag falls back to (more of
them: test_cli_env.py).

The refusals run `cli.main` in this process (every one happens while parsing, before anything
would start; `_no_start` makes a case that got further fail instead of serving); one case runs
the real `python -m nemo_gym_grpc.bridge` process, for its exit status."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_gym_grpc import cli as top_cli
from nemo_gym_grpc.bridge.process import cli as bridge_cli
from nemo_gym_grpc.bridge.process.cli import PROCESS_FLAGS, parse_args
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.rewards.tools import scorefile


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m nemo_gym_grpc.bridge ARGS...`; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "nemo_gym_grpc.bridge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_refused(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "error:" in last
    for needle in needles:
        assert needle in last, last


@pytest.fixture
def _no_start(monkeypatch):
    """Serving or scoring in this process fails the test: a refusal must come first."""

    def started(*args, **kwargs):
        raise AssertionError("got past argument checking")

    monkeypatch.setattr(bridge_cli, "run", started)
    monkeypatch.setattr(bridge_cli, "run_workers", started)
    monkeypatch.setattr(scorefile, "plan", started)


@pytest.fixture
def main(capsys, _no_start):
    """main(*args) -> CompletedProcess: the `nemo-gym-grpc` console script's `main(args)` in
    this process, its exit status (SystemExit's code or the return value) and what it wrote
    to stderr."""

    def run_main(*args: str) -> subprocess.CompletedProcess:
        try:
            code = top_cli.main(list(args))
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)

    return run_main


def test_the_process_exits_2_on_a_bad_value():
    assert_refused(cli("serve", "--workers", "0"), "argument --workers", "'0'")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--verify-timeout", "-1"),
        ("--verify-timeout", "nan"),
        ("--verify-timeout", "0"),
        ("--max-in-flight", "0"),
        ("--retry-attempts", "0"),
        ("--retry-budget", "-1"),
        ("--retry-budget", "inf"),
        ("--max-stream-items", "0"),
        ("--max-batch-items", "0"),
        ("--max-item-mb", "0"),
        ("--max-streams", "0"),
        ("--max-message-mb", "0"),
        ("--grace", "-1"),
        ("--max-connection-age", "-1"),
        ("--health-interval", "0"),
        ("--workers", "0"),
        ("--workers", "two"),
        ("--metrics-port", "70000"),
        ("--listen", "nonsense"),
        ("--listen", "127.0.0.1:99999"),
        ("--listen", "127.0.0.1:http"),
        ("--listen", "::1:50051"),  # IPv6 needs brackets
        ("--head-url", "127.0.0.1:28013"),  # no scheme: refused like a --server URL
        ("--head-url", "ftp://127.0.0.1:28013"),
        ("--head-url", "http://127.0.0.1:abc"),
        ("--server", "mcqa=http://127.0.0.1:abc"),
        ("--server", "mcqa=http://127.0.0.1:70000"),
        ("--server", "mcqa=http://127.0.0.1:0"),
        ("--server", "mcqa=http://user@127.0.0.1:9"),
        ("--server", "mcqa=http://127.0.0.1:9/verify?x=1"),
        ("--server", "mcqa=http://a b:9"),
        ("--agent", "a=http://127.0.0.1:abc"),
        ("--deny-upstream", "10.0.0.0/40"),
        ("--allow-upstream", "cluster"),
    ],
)
def test_serve_refuses_bad_values(main, flag, value):
    assert_refused(main("serve", flag, value), f"argument {flag}", repr(value))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--agent", "a=http://127.0.0.1:1", "--environment-server", "a=http://127.0.0.1:2"],
            "a: given to both --agent and --environment-server; a name routes to one protocol",
        ),
        (
            ["--max-stream-items", "16", "--max-batch-items", "17"],
            "--max-batch-items 17 exceeds --max-stream-items 16",
        ),
        (
            ["--max-reply-mb", "8", "--max-replies-mb", "4"],
            "--max-replies-mb 4 is below --max-reply-mb 8",
        ),
        (
            ["--fixed-concurrency", "8", "--sharing-bridges", "2"],
            "with --fixed-concurrency there is none",
        ),
        (
            ["--fixed-concurrency", "8", "--sharing-bridges-file", "share"],
            "with --fixed-concurrency there is none",
        ),
    ],
)
def test_serve_refuses_options_that_contradict_each_other(main, args, needle):
    assert_refused(main("serve", *args), "nemo-gym-grpc serve: error: ", needle)


def test_serve_refuses_a_token_file_it_cannot_read(main, tmp_path):
    assert_refused(
        main("serve", "--token-file", "/nonexistent/token"), "--token-file", "/nonexistent/token"
    )
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert_refused(main("serve", "--token-file", str(empty)), "--token-file", "is empty")


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_serve_refuses_a_tls_file_it_cannot_read(main, tmp_path, flag):
    missing = str(tmp_path / "missing.pem")
    assert_refused(main("serve", flag, missing), f"argument {flag}", missing)
    assert_refused(main("serve", flag, str(tmp_path)), f"argument {flag}", str(tmp_path))


def test_serve_refuses_tls_files_that_cannot_serve_before_it_binds(main, tmp_path):
    # was: gRPC's C-core log lines, then "cannot listen on ...: Failed to bind", exit 1
    import trustme

    ca = trustme.CA()
    cert, key, bundle, text = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem", "t.txt"))
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(cert))
    ca.issue_cert("localhost").private_key_pem.write_to_path(str(key))  # another cert's key
    text.write_text("not a certificate\n")
    pair = f"--tls-cert {text} / --tls-key {text}: not a PEM chain and its unencrypted key"
    assert_refused(main("serve", "--tls-cert", str(text), "--tls-key", str(text)), pair)
    mismatch = main("serve", "--tls-cert", str(cert), "--tls-key", str(key))
    assert_refused(mismatch, f"--tls-cert {cert} / --tls-key {key}: not a PEM")
    assert_refused(main("serve", "--tls-cert", str(cert)), "--tls-cert and --tls-key go together")
    args = ["--tls-cert", str(bundle), "--tls-key", str(bundle), "--tls-client-ca", str(text)]
    ca.cert_pem.write_to_path(str(bundle))
    ca.private_key_pem.write_to_path(str(bundle), append=True)  # the CA's own chain and key
    assert_refused(main("serve", *args), f"--tls-client-ca {text}: not a PEM CA bundle")


def test_score_refuses_a_url_as_target_like_the_target_variable(main, tmp_path):
    # was: "cannot connect to the bridge at http://127.0.0.1:50051 (refused?)", exit 1
    rows, out = str(rows_file(tmp_path)), str(tmp_path / "out.jsonl")
    done = main("score", rows, "-o", out, "--target", "http://127.0.0.1:50051")
    assert_refused(done, "argument --target", "is a URL; a gRPC target is host:port")


@pytest.mark.parametrize("command", [["serve"], ["score", "in.jsonl", "-o", "out.jsonl"]])
def test_an_unknown_flag_is_refused_by_its_command_with_that_commands_usage(main, command):
    # was: "usage: nemo-gym-grpc [-h] {serve} ..." and "nemo-gym-grpc: error: ..."
    done = main(*command, "--bogus")
    assert_refused(done, f"nemo-gym-grpc {command[0]}: error: unrecognized arguments: --bogus")
    assert done.stderr.startswith(f"usage: nemo-gym-grpc {command[0]} ")


def test_serve_accepts_ipv6_listen_and_zero_where_zero_means_something(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_gym_grpc.bridge", "serve", "--listen", "[::1]:0"]
        + ["--max-connection-age", "0", "--grace", "0", "--retry-budget", "0"]
        + ["--ready-file", str(ready), "--server", "x=http://127.0.0.1:1"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        exited = proc.poll()  # None: still serving, so the arguments were accepted
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert exited is None, stderr
    assert ready.read_text().startswith("[::1]:")


def rows_file(tmp_path: Path) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"response": {"output": []}}\n')
    return rows


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--batch-timeout", "-1"),
        ("--batch-timeout", "0"),
        ("--batch-timeout", "nan"),
        ("--timeout", "-1"),
        ("--timeout", "nan"),
        ("--timeout", "inf"),
        ("--batch-size", "0"),
        ("--concurrency", "0"),
        ("--server", "mcqa=http://127.0.0.1:abc"),  # was accepted: every row failed, exit 0
        ("--server", "mcqa=http://127.0.0.1:99999"),
    ],
)
def test_score_refuses_bad_values(main, tmp_path, flag, value):
    out = tmp_path / "out.jsonl"
    done = main("score", str(rows_file(tmp_path)), "-o", str(out), flag, value)
    assert_refused(done, f"argument {flag}", repr(value))
    assert not out.exists()


def test_serve_and_score_refuse_a_head_url_without_a_scheme_in_the_same_words(main, tmp_path):
    # One rule (flags.http_url) for both commands' --head-url (and NEMO_GYM_HEAD_URL).
    line = "argument --head-url: expected http://HOST:PORT, got '127.0.0.1:11000'"
    assert_refused(main("serve", "--head-url", "127.0.0.1:11000"), line)
    rows, out = str(rows_file(tmp_path)), str(tmp_path / "out.jsonl")
    assert_refused(main("score", rows, "-o", out, "--head-url", "127.0.0.1:11000"), line)


def test_score_server_takes_a_name_or_name_equals_url_as_serve_does(main, tmp_path):
    rows = str(rows_file(tmp_path))
    out = str(tmp_path / "out.jsonl")
    done = main("score", rows, "-o", out, "--server", "mcqa=127.0.0.1:1")
    assert_refused(done, "argument --server", "expected NAME=http://HOST:PORT")
    done = main("score", rows, "-o", out, "--server", "mcqa=http://h:1", "--target", "t:1")
    assert_refused(done, "nemo-gym-grpc score: error: --server NAME=URL routes NAME through")
    parsed = top_cli.parse_args(["score", rows, "-o", out, "--server", "mcqa=http://h:1/"])
    assert parsed.server == ("mcqa", "http://h:1")
    assert top_cli.parse_args(["score", rows, "-o", out, "--server", "mcqa"]).server == (
        "mcqa",
        None,
    )


def test_score_refuses_an_output_it_cannot_write_before_scoring(main, tmp_path):
    rows = rows_file(tmp_path)
    # --target 127.0.0.1:1: had it got as far as connecting, it would fail differently
    for out, needle in [
        ("/nonexistent/dir/x.jsonl", "folder /nonexistent/dir does not exist"),
        (str(tmp_path), "is a directory"),
    ]:
        done = main("score", str(rows), "-o", out, "--target", "127.0.0.1:1")
        assert_refused(done, "-o/--output", needle)


@pytest.mark.parametrize("name", ["NEMO_GYM_GRPC_BATCH_TIMEOUT", "NEMO_GYM_GRPC_CONNECT_TIMEOUT"])
def test_score_refuses_a_bad_timeout_variable_before_scoring(main, tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "soon")
    done = main("score", str(rows_file(tmp_path)), "-o", str(tmp_path / "out.jsonl"))
    assert_refused(done, "nemo-gym-grpc score: error:", name)


def test_score_does_not_read_the_batch_timeout_variable_when_its_flag_is_given(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("NEMO_GYM_GRPC_BATCH_TIMEOUT", "soon")
    rows, out = str(rows_file(tmp_path)), str(tmp_path / "out.jsonl")
    args = top_cli.parse_args(["score", rows, "-o", out, "--batch-timeout", "5"])
    assert top_cli.refusal(args) is None


# --- environment fallback ----------------------------------------------------------------


def test_serve_refuses_a_bad_environment_value_naming_the_variable(main, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_MAX_IN_FLIGHT", "0")
    assert_refused(main("serve"), "NEMO_GYM_GRPC_MAX_IN_FLIGHT", "'0'")


def test_help_names_every_flag_and_its_variable(main):
    done = main("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines
    flags = [*BridgeConfig.flags(), *PROCESS_FLAGS]
    assert len(flags) == 49
    for flag in flags:
        assert flag.name in text
        assert f"[env: {flag.env_var}" in text
    assert "[env: NEMO_GYM_GRPC_TOKEN]" in text
    assert "(default 127.0.0.1:50051)" in text
    assert "(default 0.0)" in text  # --max-connection-age: a 0 default is still shown


def test_the_bridge_command_line_has_serve_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["score", "in.jsonl", "-o", "out.jsonl"])
    assert exit_.value.code == 2
    assert "invalid choice: 'score'" in capsys.readouterr().err


def test_the_console_script_lists_every_command(main):
    done = main("--help")
    assert done.returncode == 0
    for command in ("serve", "score", "export", "openrlhf-rm"):
        assert command in done.stdout
