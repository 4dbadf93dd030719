"""The network rule, checked: the test's processes use loopback only (in the machine's own
network namespace); what runs inside namespaces the test made (tests/support/hosts.py) may use
their addresses.

    stray_sockets()        -> [] when the rule holds, else the offending sockets

It reads iproute2's `ss -Htanup` (every TCP and UDP socket with its owning processes) in the
machine's namespace, and keeps the sockets of "our" processes (this process's descendants and
every member of their sessions and process groups, so daemons that left their parent count
too) whose local address is not loopback: a listener on `0.0.0.0`, `*`, `[::]` or the
machine's external address, or a connection that left loopback. Sockets inside other network
namespaces are not listed by `ss` run here at all.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass

from tests.support.procs import list_processes


@dataclass(frozen=True)
class Socket:
    """One socket as `ss` shows it: protocol, state, local and peer address, owning pids."""

    proto: str
    state: str
    local: str
    peer: str
    pids: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.proto} {self.state} {self.local} -> {self.peer} pids {list(self.pids)}"


def _pids(users: str) -> tuple[int, ...]:
    """The pids in ss's `users:(("name",pid=1,fd=3),...)` column."""
    return tuple(int(part.split(",")[0]) for part in users.split("pid=")[1:])


def sockets() -> list[Socket]:
    """Every TCP and UDP socket of the machine's namespace (`ss -Htanup`)."""
    out = subprocess.run(
        ["ss", "-Htanup"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        users = fields[6] if len(fields) > 6 else ""
        found.append(Socket(fields[0], fields[1], fields[4], fields[5], _pids(users)))
    return found


def host_of(address: str) -> str:
    """The host part of ss's "host:port" ("[::1]:80" -> "::1", "127.0.0.1%lo:80" -> ...)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.split("%", 1)[0]


def is_loopback(address: str) -> bool:
    """Whether ss's local "host:port" is a loopback address, also IPv4-mapped
    ([::ffff:127.0.0.1]); "*" and 0.0.0.0 are not."""
    try:
        ip = ipaddress.ip_address(host_of(address))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # gRPC's IPv6 socket for 127.0.0.1
    return (mapped or ip).is_loopback


def our_processes(root: int | None = None) -> set[int]:
    """`root` (default: this process) and its descendants, plus every process sharing a session
    or process group with one of those descendants (not with `root` itself, whose session may
    hold the user's shell and other programs)."""
    root = os.getpid() if root is None else root
    table = list_processes()
    children: dict[int, list[int]] = {}
    for proc in table:
        children.setdefault(_ppid(proc.pid), []).append(proc.pid)
    ours, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in ours:
                ours.add(child)
                todo.append(child)
    by_pid = {p.pid: p for p in table}
    base = by_pid.get(root)
    own = {base.sid, base.pgid} if base else set()
    members = [by_pid[pid] for pid in ours - {root} if pid in by_pid]
    groups = {p.sid for p in members} | {p.pgid for p in members}
    groups -= own
    return ours | {p.pid for p in table if p.sid in groups or p.pgid in groups}


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def stray_sockets(pids: set[int] | None = None) -> list[Socket]:
    """Sockets of `pids` (default: `our_processes()`) in the machine's namespace whose local
    address is not loopback."""
    pids = our_processes() if pids is None else pids
    return [s for s in sockets() if set(s.pids) & pids and not is_loopback(s.local)]
