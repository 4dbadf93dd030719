"""The gRPC bridge as a subprocess: `python -m nemo_gym_grpc.bridge serve` on a free port.

with start_bridge("--head-url", gym.head_url) as bridge:
    bridge.target           -> "127.0.0.1:PORT"
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from nemo_gym_grpc.shared.child import STOP_GRACE, Child, NotReady, bridge_command
from tests.support import procs
from tests.support.errors import NemoGymError
from tests.support.procs import tail

PREFIX = "nemo_gym_grpc_bridge_"


class BridgeProcess:
    """A running `python -m nemo_gym_grpc.bridge serve` (see start_bridge): a `Child` of
    `nemo_gym_grpc.shared.child`, whose output log (`stderr_path`: the bridge writes only to
    stderr) holds its JSON log lines."""

    def __init__(self, child: Child, args: Sequence[str]) -> None:
        self.child = child
        self.proc = child.process
        self.pid = child.pid
        self.target = child.address
        self.args = tuple(args)
        self.stderr_path = child.log_path
        self.returncode: int | None = None

    def __enter__(self) -> BridgeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"BridgeProcess(pid={self.pid}, target={self.target!r})"

    def stderr_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the bridge's stderr."""
        return tail(self.stderr_path, lines)

    def stop(self, timeout: float = STOP_GRACE) -> int | None:
        """SIGTERM (graceful), wait up to `timeout`, then SIGKILL. Returns the exit code.

        A bridge that had already exited (a negative code: the signal that ended it) gets its
        status and log tail written to stderr first, since stopping removes the log: pytest
        shows it beside a failed test, so a bridge that died mid-module names its cause."""
        status = self.proc.poll()
        if status is not None and self.returncode is None:  # not stopped here before
            print(
                f"{self!r} had exited with status {status} before it was stopped; "
                f"the end of its log:\n{self.stderr_tail()}",
                file=sys.stderr,
            )
        self.returncode = self.child.stop(timeout)
        procs.live.discard(self)
        return self.returncode


def start_bridge(
    *args: str,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 30.0,
    listen: str = "127.0.0.1:0",
) -> BridgeProcess:
    """Start `sys.executable -m nemo_gym_grpc.bridge serve --listen 127.0.0.1:0 --ready-file F
    *args` and wait (at most `timeout` s) until it wrote "host:port" to F.

    `env` entries are laid over os.environ (a None value removes the variable). Raises
    NemoGymError with the bridge's stderr tail if it exits first or does not get ready.
    """
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    child = Child(bridge_command("--listen", listen, *args), env=full_env, prefix=PREFIX)
    bridge = BridgeProcess(child, args)
    procs.live.add(bridge)
    try:
        bridge.target = child.wait_ready(timeout)
    except NotReady as exc:
        procs.live.discard(bridge)
        raise NemoGymError(f"the bridge {exc}") from None
    return bridge
