"""Bad command-line arguments of `serve` and `score` are refused at parsing: exit status 2 and
a one-line error naming the option, before anything starts (no NeMo Gym, no bridge needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


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
    ],
)
def test_serve_refuses_bad_values(flag, value):
    assert_refused(cli("serve", flag, value), f"argument {flag}", repr(value))


def test_serve_refuses_a_token_file_it_cannot_read(tmp_path):
    assert_refused(
        cli("serve", "--token-file", "/nonexistent/token"), "--token-file", "/nonexistent/token"
    )
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert_refused(cli("serve", "--token-file", str(empty)), "--token-file", "is empty")


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
        _, stderr = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # still serving: the arguments were accepted
        stderr = None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert stderr is None, stderr
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
    ],
)
def test_score_refuses_bad_values(tmp_path, flag, value):
    out = tmp_path / "out.jsonl"
    done = cli("score", str(rows_file(tmp_path)), "-o", str(out), flag, value)
    assert_refused(done, f"argument {flag}", repr(value))
    assert not out.exists()


def test_score_refuses_an_output_it_cannot_write_before_scoring(tmp_path):
    rows = rows_file(tmp_path)
    # --target 127.0.0.1:1: had it got as far as connecting, it would fail differently
    for out, needle in [
        ("/nonexistent/dir/x.jsonl", "folder /nonexistent/dir does not exist"),
        (str(tmp_path), "is a directory"),
    ]:
        done = cli("score", str(rows), "-o", out, "--target", "127.0.0.1:1")
        assert_refused(done, "-o/--output", needle)
