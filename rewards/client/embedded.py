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
from dataclasses import dataclass

from nemo_gym_grpc.rewards.client import per_process, settings
from nemo_gym_grpc.rewards.client.per_process import PerProcess
from nemo_gym_grpc.shared.child import STOP_GRACE, Child, NotReady, bridge_command

log = logging.getLogger(__name__)

_PREFIX = "nemo-gym-grpc-bridge-"


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

    def command(self) -> list[str]:
        """The bridge's command line (`Child` adds its `--ready-file`)."""
        command = bridge_command("--listen", "127.0.0.1:0", "--exit-with-parent")
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
    """A bridge subprocess owned by this process (`nemo_gym_grpc.shared.child.Child`: its
    working directory is its private folder, which holds its ready file and its log).

    Attributes:
        spec: its configuration.
        child: the process; `process` its `subprocess.Popen` (whose `pid` `stop` signals).
        target: "host:port" it serves on.
    """

    def __init__(self, spec: BridgeSpec, child: Child) -> None:
        self.spec = spec
        self.child = child
        self.process = child.process
        self.target = child.address

    @classmethod
    def start(cls, spec: BridgeSpec, startup_timeout: float) -> EmbeddedBridge:
        """Start a bridge and wait until it serves.

        Raises:
            RuntimeError: it exited before it was ready, or was not ready within
                `startup_timeout` seconds (it is then stopped); the message holds the end of
                its log.
        """
        child = Child(spec.command(), env=_child_env(), cwd="folder", prefix=_PREFIX)
        log.info("starting embedded bridge (pid %d), log %s", child.pid, child.log_path)
        try:
            child.wait_ready(startup_timeout)
        except NotReady as exc:
            what = exc.what
            if exc.timed_out:
                what += f" ({settings.STARTUP_TIMEOUT_ENV})"
            raise RuntimeError(
                f"embedded nemo-gym-grpc bridge (pid {child.pid}) {what}; command: "
                f"{' '.join(child.command)}\n--- end of its log ---\n{exc.log_tail}"
            ) from None
        log.info("embedded bridge (pid %d) serving on %s", child.pid, child.address)
        return cls(spec, child)

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self.child.running

    def log_tail(self) -> str:
        """The last few KB of the bridge's log, as text."""
        return self.child.log_tail()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the process, wait up to `grace` seconds, then SIGKILL; remove its folder.

        Does nothing to a process that already exited (its PID may belong to another).
        """
        if self.child.running:
            log.info("stopping embedded bridge (pid %d)", self.child.pid)
        self.child.stop(grace)


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
