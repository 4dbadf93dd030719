"""The Ray actors of a bridge fleet: `BridgeActor` (one per node) and `Registry` (one).

`BridgeActor` runs `python -m nemo_gym_grpc.bridge serve` as a child process (a new process
group) on `<node address>:<port>`, with `--workers` = the CPUs the actor holds (at least 1),
`--exit-with-parent` and the caller's serve flags. A thread of the actor starts the child with
the parent-death signal SIGKILL (`Child`'s `die_with_parent`: tied to that thread, which lives
as long as the actor), waits on it and ends the actor process when the child exits, so
the actor and its bridge live and die together and Ray's `max_restarts` restarts both. The
child's output goes to the actor's stderr (Ray's worker log, rotated by Ray); a bridge that
does not start fails the actor's creation with its last lines. Before
it starts a child, an actor SIGKILLs the process group of the bridge an earlier incarnation
left on its node and port (its pid file is under the system temp folder; a `--workers` bridge's
workers outlive a SIGKILLed parent by up to a second), so the port is free again, and removes
the pid files there of bridges that no longer run (`sweep_pidfiles`).

`Registry` holds {node id: the bridge's entry} (`BridgeActor.entry`); every bridge writes its
entry when it serves and again every REREGISTER_SECONDS, so a restarted registry is whole
again within that time, and an entry not written again for STALE_SECONDS (a bridge that ended
for good, a node gone) is left out of the table. At those times an actor told to follow the
fleet's size also writes the number of the table's nodes into its bridge's
`--sharing-bridges-file` when it changed (`bridge.process.share`): bridges started before the
fleet grew or shrank then keep their new share of each server's queue.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import ray

from nemo_gym_grpc.shared.child import Child, NotReady, bridge_command

REREGISTER_SECONDS = 10.0
STALE_SECONDS = 3 * REREGISTER_SECONDS
OUTPUT_LINES = 40  # lines of the bridge's output kept for the message when it fails to start
# An actor's pid file in the system temp folder, by node id and port, and the suffix of its
# share file beside it.
PIDFILE = "nemo_gym_grpc-{node}-{port}.pid"
SHARE_SUFFIX = ".share"


class Registry:
    """{node id: entry} of the fleet's bridges (run as a named, detached Ray actor)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any]]] = {}  # (time.monotonic(), entry)

    def register(self, node_id: str, entry: dict[str, Any]) -> None:
        """Record (or replace) the bridge entry of `node_id`."""
        self.entries[node_id] = (time.monotonic(), entry)

    def forget(self, node_id: str) -> None:
        """Drop `node_id`'s entry (its bridge was stopped)."""
        self.entries.pop(node_id, None)

    def table(self) -> dict[str, dict[str, Any]]:
        """Every entry registered within STALE_SECONDS, by node id."""
        since = time.monotonic() - STALE_SECONDS
        return {node: entry for node, (at, entry) in self.entries.items() if at >= since}


def _is_bridge(pid: int) -> bool:
    try:
        return b"nemo_gym_grpc.bridge" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def sweep_pidfiles(folder: Path) -> None:
    """Remove the actors' pid files in `folder` (and their share files) whose process is no
    bridge any more. An actor ended with its cluster, not by `stop`, leaves its pair behind,
    one per node id and port, and no later cluster's node has that id; a file whose process is
    a bridge stays (another node's on this host, or the one `_take_over` kills)."""
    for pidfile in folder.glob(PIDFILE.format(node="*", port="*")):
        try:
            pid = int(pidfile.read_text())
        except (OSError, ValueError):
            continue  # gone, or being written
        if not _is_bridge(pid):
            for path in (pidfile, pidfile.with_suffix(SHARE_SUFFIX)):
                path.unlink(missing_ok=True)


class BridgeActor:
    """One node's bridge (module docstring). Raises RuntimeError from __init__ when the bridge
    does not serve within `startup_timeout` s or exits first (its output quoted).
    `follow_share`: keep the bridge's `--sharing-bridges-file` at the fleet's size."""

    def __init__(
        self,
        serve_args: list[str],
        port: int,
        workers: int,
        registry: str,
        namespace: str,
        startup_timeout: float = 120.0,
        follow_share: bool = False,
    ) -> None:
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.target = f"{self.address}:{port}"
        self.registry = (registry, namespace)
        self.restarted = context.was_current_actor_reconstructed
        self.pidfile = Path(tempfile.gettempdir()) / PIDFILE.format(
            node=self.node_id[:16], port=port
        )
        self.sharefile = self.pidfile.with_suffix(SHARE_SUFFIX) if follow_share else None
        self.share: int | None = None  # the number last written into it
        self._share_lock = threading.Lock()  # __init__ and the supervising thread write it
        own = ["--listen", self.target, "--workers", str(workers), "--exit-with-parent"]
        if self.sharefile:
            self.sharefile.unlink(missing_ok=True)  # an earlier incarnation's
            own += ["--sharing-bridges-file", str(self.sharefile)]
        self.command = bridge_command(*own, *serve_args)
        self.child: Child | None = None
        self.serving_since: float | None = None  # Unix time the bridge served
        self.output: deque[str] = deque(maxlen=OUTPUT_LINES)
        self.stopping = False
        self._started = threading.Event()
        self._decided = threading.Event()  # set once it served, or failed to
        self._take_over()
        sweep_pidfiles(self.pidfile.parent)
        threading.Thread(target=self._supervise, name="bridge-child", daemon=True).start()
        self._started.wait()
        if self.child is None:
            raise RuntimeError(f"could not start {' '.join(self.command)}: {self.output[-1]}")
        self._wait_ready(startup_timeout)
        self._register()
        with contextlib.suppress(Exception):  # else at the next re-registration
            self._write_share()

    def _take_over(self) -> None:
        """SIGKILL the process group of the bridge an earlier incarnation left here."""
        with contextlib.suppress(OSError, ValueError):
            old = int(self.pidfile.read_text())
            if _is_bridge(old):
                os.killpg(old, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while _is_bridge(old) and time.monotonic() < deadline:
                    time.sleep(0.05)

    def _supervise(self) -> None:
        """Start the child, then wait on it; when it exits (and no stop was asked), end the
        actor process so Ray restarts actor and bridge."""
        try:
            self.child = Child(
                self.command,
                pipe=True,
                own_session=True,
                die_with_parent=True,
                prefix="nemo_gym_grpc_bridge_actor_",
            )
        except OSError as exc:
            self.output.append(str(exc))
            return
        finally:
            self._started.set()
        self.pidfile.write_text(str(self.child.pid))
        threading.Thread(target=self._relay, name="bridge-output", daemon=True).start()
        while True:
            try:
                code = self.child.process.wait(timeout=REREGISTER_SECONDS)
                break
            except subprocess.TimeoutExpired:
                with contextlib.suppress(Exception):
                    self._register(wait=False)
                    self._write_share()
        self._decided.wait()  # whether it served (a child that never did: __init__ raises)
        if not self.stopping:
            print(f"nemo-gym-grpc bridge {self.child.pid} exited with {code}: actor exits")
            sys.stdout.flush()
            os._exit(1)

    def _relay(self) -> None:
        """The child's output, line by line, to this actor's stderr (Ray's worker log, which
        Ray rotates), its last OUTPUT_LINES lines kept for error messages."""
        assert self.child is not None and self.child.process.stdout is not None
        for raw in self.child.process.stdout:
            line = raw.decode(errors="replace")
            self.output.append(line.rstrip("\n"))
            sys.stderr.write(line)

    def _wait_ready(self, timeout: float) -> None:
        assert self.child is not None, "_supervise set it"
        try:
            self.child.wait_ready(timeout)
            self.serving_since = time.time()
        except NotReady as exc:
            self.stopping = True
            output = "\n".join(self.output)
            raise RuntimeError(f"bridge on {self.target} {exc}:\n{output}") from None
        finally:
            self._decided.set()

    def entry(self) -> dict[str, Any]:
        """{node_id, address, target ("host:port"), pid (the bridge's), actor_pid,
        restarted (this incarnation is a Ray restart), serving_since (Unix time, seconds)}."""
        return {
            "node_id": self.node_id,
            "address": self.address,
            "target": self.target,
            "pid": self.child.pid if self.child else None,
            "actor_pid": os.getpid(),
            "restarted": self.restarted,
            "serving_since": self.serving_since,
        }

    def _register(self, wait: bool = True) -> None:
        registry = ray.get_actor(self.registry[0], namespace=self.registry[1])
        ref: Any = registry.register.remote(self.node_id, self.entry())
        if wait:
            ray.get(ref, timeout=60)

    def _write_share(self) -> None:
        """Write the registry's node count (this node's included) into the bridge's
        `--sharing-bridges-file` when it changed (whole: written aside, then renamed)."""
        if self.sharefile is None:
            return
        registry = ray.get_actor(self.registry[0], namespace=self.registry[1])
        table: Any = ray.get(registry.table.remote(), timeout=REREGISTER_SECONDS)
        count = len(set(table) | {self.node_id})
        with self._share_lock:
            if count != self.share:
                aside = self.sharefile.with_suffix(".partial")
                aside.write_text(f"{count}\n")
                aside.replace(self.sharefile)
                self.share = count

    def stop(self, grace: float) -> int | None:
        """Drain the bridge (SIGTERM: NOT_SERVING, in-flight calls get its --grace), wait up to
        `grace` s, then SIGKILL its group. Returns its exit status."""
        self.stopping = True
        child = self.child
        if child is None:
            return None
        code = child.stop(grace)
        for path in (self.pidfile, self.sharefile):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
        return code
