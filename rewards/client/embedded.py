"""Zero configuration: a bridge subprocess started by the first reward call of a process.

When no bridge target is configured (`NEMO_GYM_GRPC_TARGET` unset), the reward functions call
`ensure_bridge(spec)`, which runs

    <sys.executable> -m nemo_gym_grpc.bridge serve --listen 127.0.0.1:0 --ready-file <tmp>
        --exit-with-parent [--head-url URL] [--server NAME=BASE_URL ...]
        [--verify-timeout SECONDS]

and waits (at most `NEMO_GYM_GRPC_STARTUP_TIMEOUT` seconds) until the bridge has
written "host:port" to the ready file (it does so atomically once serving). Later calls with
the same `BridgeSpec` reuse it; a bridge that has exited is replaced on the next call. Each
bridge is stopped at interpreter exit: SIGTERM to its recorded PID (the bridge then drains
gracefully), a wait, then SIGKILL. Nothing is ever signalled by name. If this process dies
without running its exit handlers (SIGKILL, os._exit), `--exit-with-parent` makes the bridge
notice within about a second and stop by itself.

The bridge inherits this process's environment as it is when the bridge starts (so the
token of `settings.py` too).

The bridge runs in the caller's process group (so a signal to the whole job reaches it too),
with its working directory in a private temporary folder that also holds the ready file and
its log (stdout and stderr; a file, so a chatty bridge can never block on a full pipe). The
folder is removed when the bridge is stopped.

A forked child does not share its parent's bridges: its first call starts its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_gym_grpc.rewards.client import per_process, settings
from nemo_gym_grpc.rewards.client.per_process import PerProcess

log = logging.getLogger(__name__)

# Seconds a stopped bridge gets between SIGTERM and SIGKILL (its own drain grace is 10 s).
STOP_GRACE = 15.0
_POLL_INTERVAL = 0.05
_LOG_TAIL_BYTES = 4000


@dataclass(frozen=True)
class BridgeSpec:
    """The configuration of one embedded bridge (the registry key: one bridge per spec).

    Attributes:
        head_url: NeMo Gym head server to discover resources servers from, or None.
        servers: static routes ((name, base URL), ...), base URL without "/verify".
        verify_timeout: the bridge's default seconds per upstream `/verify`, or None for
            the bridge's own default (30 s).
    """

    head_url: str | None = None
    servers: tuple[tuple[str, str], ...] = ()
    verify_timeout: float | None = None

    def command(self, ready_file: Path) -> list[str]:
        """The bridge's command line, writing its address to `ready_file`."""
        command = [
            sys.executable,
            "-m",
            "nemo_gym_grpc.bridge",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready_file),
            "--exit-with-parent",
        ]
        if self.head_url:
            command += ["--head-url", self.head_url]
        for name, url in self.servers:
            command += ["--server", f"{name}={url}"]
        if self.verify_timeout is not None:
            command += ["--verify-timeout", repr(float(self.verify_timeout))]
        return command


def head_server_spec() -> BridgeSpec:
    """The embedded bridge of a call without a target: one that discovers the servers from
    the head server `NEMO_GYM_HEAD_URL`.

    Raises:
        ValueError: `NEMO_GYM_HEAD_URL` is not an http(s) URL with a host.
    """
    return BridgeSpec(head_url=settings.head_url())


def _child_env() -> dict[str, str]:
    """The caller's environment (`per_process.child_env`: without the gRPC fork support set
    for the trainer), with relative PYTHONPATH entries made absolute (the bridge runs in
    another working directory)."""
    env = per_process.child_env()
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) if p else os.getcwd() for p in env["PYTHONPATH"].split(os.pathsep)
        )
    return env


class EmbeddedBridge:
    """A bridge subprocess owned by this process.

    Attributes:
        spec: its configuration.
        process: the `subprocess.Popen` (its `pid` is what `stop` signals).
        target: "host:port" it serves on.
        workdir: private folder with `ready` and `bridge.log`.
    """

    def __init__(
        self, spec: BridgeSpec, process: subprocess.Popen[bytes], target: str, workdir: Path
    ) -> None:
        self.spec = spec
        self.process = process
        self.target = target
        self.workdir = workdir

    @classmethod
    def start(cls, spec: BridgeSpec, startup_timeout: float) -> EmbeddedBridge:
        """Start a bridge and wait until it serves.

        Raises:
            RuntimeError: it exited before writing its ready file, or did not write it within
                `startup_timeout` seconds (it is then stopped); the message holds the tail of
                its log.
        """
        workdir = Path(tempfile.mkdtemp(prefix="nemo-gym-grpc-bridge-"))
        ready_file = workdir / "ready"
        log_path = workdir / "bridge.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                spec.command(ready_file),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=_child_env(),
            )
        log.info("starting embedded bridge (pid %d), log %s", process.pid, log_path)
        deadline = time.monotonic() + startup_timeout
        while True:
            text = ready_file.read_text() if ready_file.exists() else ""
            if text.endswith("\n") and text.strip():
                target = text.strip()
                log.info("embedded bridge (pid %d) serving on %s", process.pid, target)
                return cls(spec, process, target, workdir)
            exited = process.poll() is not None
            if exited or time.monotonic() >= deadline:
                what = (
                    f"exited with status {process.returncode}"
                    if exited
                    else f"did not start within {startup_timeout:g} s "
                    f"({settings.STARTUP_TIMEOUT_ENV})"
                )
                bridge = cls(spec, process, "", workdir)
                tail = bridge.log_tail()
                bridge.stop()
                raise RuntimeError(
                    f"embedded nemo-gym-grpc bridge (pid {process.pid}) {what}; "
                    f"command: {' '.join(spec.command(ready_file))}\n"
                    f"--- end of its log ---\n{tail}"
                )
            time.sleep(_POLL_INTERVAL)

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self.process.poll() is None

    def log_tail(self) -> str:
        """The last few KB of the bridge's log, as text."""
        try:
            with open(self.workdir / "bridge.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the process, wait up to `grace` seconds, then SIGKILL; remove its folder.

        Does nothing to a process that already exited (its PID may belong to another).
        """
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("embedded bridge (pid %d) ignored SIGTERM; killing", self.process.pid)
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


_bridges: PerProcess[BridgeSpec, EmbeddedBridge] = PerProcess()
_atexit_registered = False


def ensure_bridge(spec: BridgeSpec) -> str:
    """The "host:port" of this process's embedded bridge for `spec`, started if needed.

    Thread-safe: concurrent callers wait for the one start. A bridge that has exited since
    the last call is reported (warning with its log tail) and replaced.

    Raises:
        RuntimeError: the bridge did not start (see `EmbeddedBridge.start`).
        ValueError: `NEMO_GYM_GRPC_STARTUP_TIMEOUT` is not a positive number.
    """
    global _atexit_registered
    with _bridges.lock:
        bridge = _bridges.entries.get(spec)
        if bridge is not None and not bridge.running:
            log.warning(
                "embedded bridge (pid %d) exited with status %s; starting a new one. "
                "End of its log:\n%s",
                bridge.process.pid,
                bridge.process.returncode,
                bridge.log_tail(),
            )
            bridge.stop()
            del _bridges.entries[spec]
            bridge = None
        if bridge is None:
            bridge = EmbeddedBridge.start(spec, settings.startup_timeout())
            _bridges.entries[spec] = bridge
            if not _atexit_registered:
                atexit.register(stop_all)
                _atexit_registered = True
        return bridge.target


def running_bridges() -> dict[BridgeSpec, EmbeddedBridge]:
    """A snapshot of this process's embedded bridges, by spec."""
    with _bridges.lock:
        return dict(_bridges.entries)


def stop_all(grace: float = STOP_GRACE) -> None:
    """Stop every embedded bridge this process started (registered with `atexit`).

    All get SIGTERM first, then each is waited for (up to `grace` s) and SIGKILLed if needed.
    Bridges a parent process started (inherited over fork) are left alone.
    """
    with _bridges.lock:
        bridges = list(_bridges.entries.values())
        _bridges.entries.clear()
    for bridge in bridges:
        if bridge.running:
            bridge.process.terminate()
    for bridge in bridges:
        bridge.stop(grace)
