"""The one lifecycle of a serving child process (`nemo_gym_grpc.shared.child`): ready once its
ready file is whole, refused with its output when it exits first or is late (and then stopped),
stopped by its PID; a folder whose owner was killed removed by the next child; real
subprocesses, no bridge."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from nemo_gym_grpc.shared.child import (
    PARENT_DEATH_ENV,
    UNOWNED_AGE,
    Child,
    NotReady,
    read_ready_file,
    sweep,
    write_ready_file,
)
from tests.support.waiting import wait_until

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


# An owner that starts a child which outlives it (no `--exit-with-parent`), prints the child's
# folder and PID, and waits to be killed.
OWNS = (
    "import sys, time; from nemo_gym_grpc.shared.child import Child;"
    f"child = Child([sys.executable, '-c', {HANGS!r}], prefix=sys.argv[1]);"
    "print(child.folder, child.pid, flush=True); time.sleep(60)"
)


def test_a_folder_is_removed_by_the_next_child_once_its_owner_and_child_are_gone():
    prefix = f"nemo_gym_grpc_test_{uuid.uuid4().hex[:8]}_"
    owner = subprocess.Popen([*python(OWNS), prefix], stdout=subprocess.PIPE, text=True)
    folder, pid = owner.stdout.readline().split()  # type: ignore[union-attr]
    owner.kill()  # as a trainer is killed: nothing of its own cleans up
    owner.wait(10)
    child_pid = int(pid)
    try:
        Child(python(FAILS), prefix=prefix).stop()
        assert Path(folder).is_dir()  # its child still runs
    finally:
        os.kill(child_pid, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{child_pid}").exists(), 10, "the orphan reaped by init")
    Child(python(FAILS), prefix=prefix).stop()
    assert not Path(folder).exists()


def test_a_folder_without_owners_is_kept_until_it_is_old():
    prefix = f"nemo_gym_grpc_test_{uuid.uuid4().hex[:8]}_"
    folder = Path(tempfile.mkdtemp(prefix=prefix))  # an older version's, or one being made
    assert sweep(prefix) == [] and folder.is_dir()
    old = time.time() - UNOWNED_AGE - 60
    os.utime(folder, (old, old))
    assert sweep(prefix) == [folder] and not folder.exists()


# A child that arms its parent-death signal, then serves (`arm_parent_death`).
ARMS = "from nemo_gym_grpc.shared.child import arm_parent_death; arm_parent_death();" + SERVES


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_a_child_started_die_with_parent_is_killed_when_its_starting_thread_ends(die_with_parent):
    started: list[Child] = []

    def start() -> None:  # the thread ends once the child serves (it armed the signal first)
        started.append(Child(python(ARMS), die_with_parent=die_with_parent))
        started[0].wait_ready(30)

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    child = started[0]
    try:
        if die_with_parent:  # the thread that started it has ended: the kernel kills it
            wait_until(lambda: child.process.poll() is not None, 30, "the child was not killed")
            assert child.process.returncode == -signal.SIGKILL
        else:
            time.sleep(0.5)
            assert child.running
    finally:
        child.stop(5)


def test_a_child_whose_parent_ended_before_it_armed_exits_at_once(tmp_path):
    not_the_parent = str(os.getpid() + 1)  # the child's parent is this process
    command = [*python(ARMS), "--ready-file", str(tmp_path / "ready")]
    done = subprocess.run(command, env={**os.environ, PARENT_DEATH_ENV: not_the_parent}, timeout=30)
    assert done.returncode == 1 and not (tmp_path / "ready").exists()  # else it would serve
