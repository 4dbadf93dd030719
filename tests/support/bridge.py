"""The gRPC bridge as a subprocess: `python -m nemo_gym_grpc.bridge serve` on a free port.

with start_bridge("--head-url", gym.head_url) as bridge:
    bridge.target           -> "127.0.0.1:PORT"
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support import procs
from tests.support.errors import NemoGymError
from tests.support.procs import tail


class BridgeProcess:
    """A running `python -m nemo_gym_grpc.bridge serve` (see start_bridge)."""

    def __init__(
        self, proc: subprocess.Popen[bytes], target: str, tmpdir: Path, args: Sequence[str]
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.target = target
        self.args = tuple(args)
        self.tmpdir = tmpdir
        self.stdout_path = tmpdir / "stdout.log"
        self.stderr_path = tmpdir / "stderr.log"
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

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful), wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.returncode = self.proc.returncode
        procs.live.discard(self)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
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
    tmpdir = Path(tempfile.mkdtemp(prefix="nemo_gym_grpc_bridge_"))
    ready = tmpdir / "ready"
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    command = [sys.executable, "-m", "nemo_gym_grpc.bridge", "serve", "--listen", listen]
    command += ["--ready-file", str(ready), *args]
    with open(tmpdir / "stdout.log", "wb") as out, open(tmpdir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=full_env
        )
    bridge = BridgeProcess(proc, "", tmpdir, args)
    procs.live.add(bridge)
    deadline = time.monotonic() + timeout
    while True:
        text = ready.read_text() if ready.exists() else ""
        if text.endswith("\n") and text.strip():
            bridge.target = text.strip()
            return bridge
        if proc.poll() is not None:
            stderr = bridge.stderr_tail()
            bridge.stop()
            raise NemoGymError(
                f"the bridge exited with {proc.returncode} before it was ready "
                f"({' '.join(command)}); stderr tail:\n{stderr}"
            )
        if time.monotonic() > deadline:
            stderr = bridge.stderr_tail()
            bridge.stop()
            raise NemoGymError(
                f"the bridge wrote no ready file within {timeout:.0f} s ({' '.join(command)}); "
                f"stderr tail:\n{stderr}"
            )
        time.sleep(0.05)
