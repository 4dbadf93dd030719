"""Process and port helpers: /proc listings, process groups, free loopback ports, log tails,
and the registry of started stacks and bridges stopped at interpreter exit. Linux only."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tests.support.errors import NemoGymError


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc shows it: ids, state letter (R, S, Z, ...) and command line."""

    pid: int
    pgid: int
    sid: int
    state: str
    cmdline: str


def list_processes() -> list[ProcInfo]:
    """Every process visible in /proc (pid, process group, session, state, command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        found.append(ProcInfo(int(entry), int(fields[2]), int(fields[3]), fields[0], cmd or name))
    return found


def group_processes(leader_pid: int, include_zombies: bool = False) -> list[ProcInfo]:
    """Processes in the process group or session that `leader_pid` started (its descendants
    unless they left both), excluding zombies unless asked."""
    return [
        p
        for p in list_processes()
        if (p.pgid == leader_pid or p.sid == leader_pid) and (include_zombies or p.state != "Z")
    ]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def closed_port() -> int:
    """A loopback TCP port nothing listens on (bound once, then released): connecting to it
    is refused, like an upstream that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback TCP ports.

    Chosen outside the kernel's ephemeral range (outgoing connections of Ray and friends take
    ports from it while the servers start) and above Ray's default worker ports (10002-19999)
    and NeMo Gym's own port range (10001-20000), then checked by binding them. Raises
    NemoGymError if 2000 tries do not find them.
    """
    low, high = 20001, _ephemeral_range()[0] - 1
    if high - low < 1000:  # unusual ephemeral range: let the kernel choose
        low = high = 0
    ports: list[int] = []
    sockets = []
    try:
        for _ in range(2000):
            if len(ports) == count:
                return ports
            port = random.randint(low, high) if high else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            port = sock.getsockname()[1]
            if port in ports:
                sock.close()
                continue
            sockets.append(sock)
            ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    if len(ports) == count:
        return ports
    raise NemoGymError(f"could not find {count} free loopback ports")


# Sets SIGINT to its default action and unblocks it, then execs argv[1:] (both survive exec).
_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def with_default_sigint(command: list[str]) -> list[str]:
    """`command` run with the default SIGINT action, unblocked (a shell's `cmd &` ignores it, and
    Python keeps an inherited SIG_IGN, so ng_run would never see Ctrl-C). A launcher that execs
    `command`, not a `preexec_fn`: that makes `subprocess` fork (not vfork) and run Python in the
    child of a process with threads (gRPC's fork handlers among them; tests/test_descriptors.py)."""
    return [sys.executable, "-c", _DEFAULT_SIGINT, *command]


def tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of a text file, or a note that there is no such file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


class Stoppable(Protocol):
    """Anything in the exit registry: a NemoGymServers or a BridgeProcess."""

    def stop(self) -> object: ...


live: set[Stoppable] = set()  # started stacks and bridges, stopped at interpreter exit


@atexit.register
def _stop_everything_left() -> None:
    for item in list(live):
        with contextlib.suppress(Exception):
            item.stop()
