"""The chaos side of the soak (tests/support/soak.py): the resources server processes it kills
and starts again (`Server`, `servers`, `kill_and_restart`, `report_up`), the bridge it
restarts, what it did (`Chaos`, `chaos_loop`), and the bridge's RSS and open descriptors
sampled every second (`sample`, `monitor_loop`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.support.bridge import BridgeProcess, start_bridge
from tests.support.soak_ledger import Ledger
from tests.support.stack import NemoGymServers


@dataclass
class Server:
    """One resources server process the chaos driver kills and starts again."""

    instance: str
    url: str
    pid: int
    argv: list[str]
    cwd: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None  # set once the soak started it itself


@dataclass
class Chaos:
    """The processes the chaos driver replaces, and what it did (elapsed s, event)."""

    bridge: BridgeProcess
    port: int
    bridge_args: tuple[str, ...]
    servers: list[Server]
    log: Path
    events: list[tuple[float, str]] = field(default_factory=list)
    bridge_starts: list[float] = field(default_factory=list)
    kills: int = 0

    def stop(self) -> None:
        """Stop the current bridge (SIGTERM) and SIGKILL the servers the soak started itself
        (ng_run stops the others)."""
        self.bridge.stop()
        for server in self.servers:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait(timeout=10)


def servers(gym: NemoGymServers) -> list[Server]:
    """The stack's resources server processes (`... app.py`), by instance name (ng_run gives
    each its instance in NEMO_GYM_CONFIG_PATH), with their command line, cwd and env."""
    found = []
    for proc in gym.processes():
        if not proc.cmdline.endswith("app.py"):
            continue
        raw_env = Path(f"/proc/{proc.pid}/environ").read_bytes().decode().split("\0")
        env = dict(entry.split("=", 1) for entry in raw_env if "=" in entry)
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")
        instance = env["NEMO_GYM_CONFIG_PATH"]
        cwd = os.readlink(f"/proc/{proc.pid}/cwd")
        found.append(Server(instance, gym.server_urls[instance], proc.pid, argv, cwd, env))
    return sorted(found, key=lambda server: server.instance)


def kill_and_restart(server: Server, log: Path) -> None:
    """SIGKILL the server and start it again as ng_run started it (without waiting)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.pid, signal.SIGKILL)
    if server.proc is not None:
        server.proc.wait(timeout=10)
    with open(log, "ab") as out:
        server.proc = subprocess.Popen(
            server.argv,
            cwd=server.cwd,
            env=server.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server.pid = server.proc.pid


def report_up(
    server: Server, proc: subprocess.Popen[bytes], chaos: Chaos, t0: float, halt: threading.Event
) -> None:
    """Record when a restarted server answers `/` again, or that it did not within 60 s (or
    exited); nothing if the soak ends first."""
    started = time.monotonic()
    while time.monotonic() - started < 60 and proc.poll() is None:
        if halt.is_set():
            return
        with contextlib.suppress(requests.RequestException):
            requests.get(server.url + "/", timeout=1)
            up = round(time.monotonic() - t0, 2)
            chaos.events.append((up, f"{server.instance} up after {up - started + t0:.1f} s"))
            return
        time.sleep(0.1)
    chaos.events.append((round(time.monotonic() - t0, 2), f"{server.instance} NOT up again"))


def chaos_loop(config: Any, chaos: Chaos, started: float, stop: threading.Event) -> None:
    """Every `config.kill_every` s SIGKILL the next server and start it again; at
    `config.bridge_restart_at` of `config.duration` SIGTERM the bridge and start a new one on
    its port (`config`: the soak's `SoakConfig`)."""
    next_kill = config.kill_every
    restart_at = config.duration * config.bridge_restart_at
    restarted = False
    while not stop.wait(0.1):
        now = time.monotonic() - started
        if now >= config.duration:
            return
        if now >= next_kill:
            server = chaos.servers[chaos.kills % len(chaos.servers)]
            chaos.kills += 1
            kill_and_restart(server, chaos.log)
            chaos.events.append((round(now, 2), f"SIGKILL {server.instance}, restarted"))
            assert server.proc is not None
            waiter = threading.Thread(
                target=report_up, args=(server, server.proc, chaos, started, stop)
            )
            waiter.daemon = True
            waiter.start()
            next_kill += config.kill_every
        if not restarted and now >= restart_at:
            restarted = True
            chaos.bridge.stop()  # SIGTERM: graceful drain, then exit
            chaos.events.append((round(time.monotonic() - started, 2), "bridge SIGTERM"))
            chaos.bridge = start_bridge(*chaos.bridge_args, listen=f"127.0.0.1:{chaos.port}")
            chaos.bridge_starts.append(time.monotonic() - started)
            chaos.events.append((round(time.monotonic() - started, 2), "bridge restarted"))


def sample(path: str) -> tuple[int, int] | None:
    """(RSS bytes, open fds) of a process, or None if it is gone or exiting (a zombie's status
    has no VmRSS line: the monitor thread must outlive a bridge restart)."""
    try:
        status = Path(f"{path}/status").read_text()
        fds = len(os.listdir(f"{path}/fd"))
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024, fds
    return None


def monitor_loop(ledger: Ledger, chaos: Chaos, started: float, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        measured = sample(f"/proc/{chaos.bridge.pid}")
        ledger.sample(time.monotonic() - started, chaos.bridge.pid, measured)
