"""The one lifecycle of a serving child process (`nemo_gym_grpc.shared.child`): ready once its
ready file is whole, refused with its output when it exits first or is late (and then stopped),
stopped by its PID; real subprocesses, no bridge."""

from __future__ import annotations

import sys

import pytest

from nemo_gym_grpc.shared.child import Child, NotReady, read_ready_file, write_ready_file

# A child that takes `--ready-file PATH` as its last two arguments.
SERVES = (
    "import sys, time; from pathlib import Path;"
    "from nemo_gym_grpc.shared.child import write_ready_file;"
    "write_ready_file(Path(sys.argv[-1]), '127.0.0.1:7'); time.sleep(60)"
)
FAILS = "import sys; print('bad flag', file=sys.stderr); sys.exit(2)"
HANGS = "import time; time.sleep(60)"


def python(code: str) -> list[str]:
    """`python -c code` (a `--ready-file PATH` after it lands in its sys.argv)."""
    return [sys.executable, "-c", code]


def test_a_child_is_ready_with_its_address_and_stopped_by_its_pid():
    child = Child(python(SERVES))
    assert child.wait_ready(30) == "127.0.0.1:7" == child.address and child.running
    assert child.stop(5) == -15  # SIGTERM
    assert not child.folder.exists() and not child.running


def test_a_child_that_exits_first_is_refused_with_its_output():
    child = Child(python(FAILS))
    with pytest.raises(NotReady, match="exited with status 2 before it was ready") as refused:
        child.wait_ready(30)
    assert "bad flag" in refused.value.log_tail and not refused.value.timed_out
    assert not child.folder.exists()


def test_a_late_child_is_stopped():
    child = Child(python(HANGS))
    with pytest.raises(NotReady, match="did not start within 0.2 s") as late:
        child.wait_ready(0.2)
    assert late.value.timed_out and child.process.returncode == -15


def test_a_ready_file_is_read_only_when_whole(tmp_path):
    path = tmp_path / "ready"
    assert read_ready_file(path) is None
    path.write_text("127.0.0.1:5")  # no newline yet: being written
    assert read_ready_file(path) is None
    write_ready_file(path, "127.0.0.1:5")
    assert read_ready_file(path) == "127.0.0.1:5"
