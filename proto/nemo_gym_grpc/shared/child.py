"""The one lifecycle of a child process that serves: the bridge as the embedded bridge, the Ray
actor, the tests and the benchmarks start it (`bridge_command`), and the benchmarks' scripted
servers.

A `Child` runs `command --ready-file <folder>/ready` with its output in `<folder>/output.log`
(a file, so a chatty child never blocks on a full pipe; or a pipe its owner reads), where the
folder is a private temporary one. It is ready once the file holds "host:port" and a newline
(`write_ready_file` writes it atomically once the child serves). It is stopped by its PID, or
its process group when it runs in a session of its own: SIGTERM (a bridge then drains), a
grace, then SIGKILL; the folder is removed. Nothing is ever signalled by name.

A folder outlives its owner only when the owner could not remove it (killed: SIGKILL, the OOM
killer), as a trainer often is; the bridge then exits with it (`--exit-with-parent`), and the
next `Child` with the same prefix removes the folder (`sweep`), which names both processes.

A child started `die_with_parent` is SIGKILLed by the kernel when the thread that started it
ends (Linux `prctl(PR_SET_PDEATHSIG)`; the Ray actor's bridge, whose starting thread waits on
it). The child arms the signal itself, told to by PARENT_DEATH_ENV (`arm_parent_death`, the
bridge's first step), so the thread must outlive that step: the kernel ties the signal to the
thread that is the child's parent when it arms. Armed in a `preexec_fn` instead, it made
`subprocess` fork (not vfork) a process full of threads (a Ray worker) and run Python, and
gRPC's fork handlers, in the child before its exec, which Python's documentation warns can
deadlock.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

POLL_SECONDS = 0.05
LOG_TAIL_BYTES = 4000
# Seconds a stopped child gets between SIGTERM and SIGKILL (a bridge's own drain grace is 10 s).
STOP_GRACE = 15.0
# In a child's folder: "<owner pid> <its start> <child pid> <its start>" (`process_start`;
# a start of 0 or None: not known).
OWNERS_FILE = "owners"
# A folder with no readable owners file (made by an older version, or being made right now) is
# left alone until it is this many seconds old.
UNOWNED_AGE = 3600.0
# Set in the environment of a child started `die_with_parent`: its parent's PID
# (`arm_parent_death`).
PARENT_DEATH_ENV = "NEMO_GYM_GRPC_PARENT_DEATH"
_PR_SET_PDEATHSIG = 1


def arm_parent_death() -> None:
    """In a child started `die_with_parent` (PARENT_DEATH_ENV set): have the kernel SIGKILL
    this process when the thread that started it ends (Linux only; elsewhere nothing is
    armed), and exit at once (status 1) when that parent already exited. The variable is
    removed, so what this process starts does not inherit it. Without it: nothing."""
    parent = os.environ.pop(PARENT_DEATH_ENV, None)
    if parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(parent):  # it ended before the signal was armed
        os._exit(1)


def process_start(pid: int) -> float | None:
    """What tells process `pid` from a later one given its PID: its start time (seconds since
    the epoch, psutil's), None when no such process runs or it exited and awaits its reaping
    (0.0: it runs, its start unknown)."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # e.g. another user's: it runs
        return 0.0


def _runs(pid: str, start: str) -> bool:
    """Whether process `pid`, started at `start` (as `process_start` gave it; 0: not known),
    runs: a process with that PID runs, and its start is not known or is that one."""
    now = process_start(int(pid))
    if now is None:
        return False
    return not now or not float(start) or abs(now - float(start)) < 0.01


def sweep(prefix: str) -> list[Path]:
    """Remove the temporary folders of earlier children with `prefix` whose owner and child
    have both exited (the ones `Child.stop` could not remove); returns them. A folder either
    process still runs in, or one without a readable owners file younger than UNOWNED_AGE, is
    kept."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(glob.escape(prefix) + "*"):
        try:
            owner, owner_start, child, child_start = (folder / OWNERS_FILE).read_text().split()
            gone = not _runs(owner, owner_start) and not _runs(child, child_start)
        except (OSError, ValueError):
            try:
                gone = time.time() - folder.stat().st_mtime > UNOWNED_AGE
            except OSError:
                continue
        if gone and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def bridge_command(*args: str, python: str = sys.executable) -> list[str]:
    """`python -m nemo_gym_grpc.bridge serve *args` (without `--ready-file`: `Child` adds it)."""
    return [python, "-m", "nemo_gym_grpc.bridge", "serve", *args]


def write_ready_file(path: Path, address: str) -> None:
    """Atomically write "host:port\\n" to `path` (readers never see a partial file).

    Raises:
        OSError: `path` cannot be written.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(address + "\n")
    tmp.replace(path)


def read_ready_file(path: Path) -> str | None:
    """The "host:port" that `write_ready_file` wrote to `path`, or None while it is absent or
    not complete."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    if not text.endswith("\n"):
        return None  # not written whole yet
    return text.strip() or None


class NotReady(RuntimeError):
    """The child exited before it was ready, or was not ready in time (it is stopped). The
    message says which (`what`; `timed_out`) and holds the command; `log_tail` is the end of
    its output ("" when its owner reads the output from a pipe)."""

    def __init__(self, what: str, command: Sequence[str], log_tail: str, timed_out: bool) -> None:
        message = f"{what} ({' '.join(command)})"
        if log_tail:
            message += f"\n--- end of its output ---\n{log_tail}"
        super().__init__(message)
        self.what = what
        self.log_tail = log_tail
        self.timed_out = timed_out


class Child:
    """One started child (see the module docstring).

    Args:
        command: the program and its arguments, without `--ready-file`.
        env: its environment (None = this process's).
        cwd: its working directory; None = this process's, "folder" = its private folder.
        pipe: its output (stdout and stderr) to a pipe (`process.stdout`) the owner reads,
            instead of the log file.
        own_session: run it in a new session (process group), which `stop` signals whole.
        die_with_parent: the kernel SIGKILLs it when the thread that started it ends; the
            child must call `arm_parent_death` first (the module docstring).
        prefix: the private folder's name prefix.

    Raises:
        OSError: the program could not be started (the folder is removed).

    Attributes:
        process: the `subprocess.Popen`; `pid` its PID.
        folder, ready_file, log_path: the private folder, its ready file and output log.
        address: "host:port" once `wait_ready` returned, else "".
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        pipe: bool = False,
        own_session: bool = False,
        die_with_parent: bool = False,
        prefix: str = "nemo_gym_grpc_child_",
    ) -> None:
        sweep(prefix)
        self.folder = Path(tempfile.mkdtemp(prefix=prefix))
        self.ready_file = self.folder / "ready"
        self.log_path = self.folder / "output.log"
        self.command = [*command, "--ready-file", str(self.ready_file)]
        self.address = ""
        self._group = own_session
        if die_with_parent:
            env = {**(os.environ if env is None else env), PARENT_DEATH_ENV: str(os.getpid())}
        try:
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if pipe else log,
                    stderr=subprocess.STDOUT,
                    cwd=self.folder if cwd == "folder" else cwd,
                    env=env,
                    start_new_session=own_session,
                )
        except OSError:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.pid = self.process.pid
        owners = [(pid, process_start(pid) or 0.0) for pid in (os.getpid(), self.pid)]
        with contextlib.suppress(OSError):
            (self.folder / OWNERS_FILE).write_text(" ".join(f"{p} {t!r}" for p, t in owners))

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self.process.poll() is None

    def wait_ready(self, timeout: float) -> str:
        """Wait until the child is ready, at most `timeout` seconds; returns its "host:port".

        Raises:
            NotReady: it exited first, or the time ran out (it is then stopped).
        """
        deadline = time.monotonic() + timeout
        while True:
            address = read_ready_file(self.ready_file)
            if address is not None:
                self.address = address
                return address
            exited = self.process.poll() is not None
            if exited:
                what = f"exited with status {self.process.returncode} before it was ready"
            elif time.monotonic() >= deadline:
                what = f"did not start within {timeout:g} s"
            else:
                time.sleep(POLL_SECONDS)
                continue
            tail = self.log_tail()
            self.stop()
            raise NotReady(what, self.command, tail, timed_out=not exited)

    def log_tail(self, limit: int = LOG_TAIL_BYTES) -> str:
        """The last `limit` bytes of its output log, as text ("" when there is none)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - limit))
                return log.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL; remove the folder. Returns the
        exit status. A process that already exited is not signalled (its PID may be another's
        by now), but its group is when it had one (a bridge's `--workers` outlive it)."""
        if self.process.poll() is None or self._group:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.process.returncode

    def _signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self._group:
                os.killpg(self.pid, number)
            else:
                os.kill(self.pid, number)
