"""A Ray bridge actor removes the pid files (and share files) that bridges no longer running
left in the temp folder (an actor ended with its cluster leaves its pair), and keeps those of
bridges that run: `actors.sweep_pidfiles`, on files in a test folder with real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")  # the `ray` extra (`make dev` installs it)

from nemo_gym_grpc.bridge.ray.actors import PIDFILE, SHARE_SUFFIX, sweep_pidfiles


@pytest.fixture
def processes() -> Iterator[dict[str, int]]:
    """A process whose command line names the bridge's module, one that does not, and the PID
    of one that has exited."""
    sleep = "import time; time.sleep(60)"
    bridge = subprocess.Popen([sys.executable, "-c", sleep, "nemo_gym_grpc.bridge", "serve"])
    other = subprocess.Popen([sys.executable, "-c", sleep])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    yield {"bridge": bridge.pid, "other": other.pid, "gone": gone.pid}
    for process in (bridge, other):
        process.kill()
        process.wait()


def test_only_the_files_of_running_bridges_stay(tmp_path: Path, processes: dict[str, int]) -> None:
    for name, pid in processes.items():
        pidfile = tmp_path / PIDFILE.format(node=name, port=50051)
        pidfile.write_text(str(pid))
        pidfile.with_suffix(SHARE_SUFFIX).write_text("2\n")
    (tmp_path / PIDFILE.format(node="empty", port=50051)).write_text("")  # being written
    (tmp_path / "unrelated.pid").write_text(str(processes["gone"]))
    sweep_pidfiles(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "nemo_gym_grpc-bridge-50051.pid",
        "nemo_gym_grpc-bridge-50051.share",
        "nemo_gym_grpc-empty-50051.pid",
        "unrelated.pid",
    ]
