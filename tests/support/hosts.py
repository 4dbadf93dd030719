"""Network namespaces as "hosts" for multi-host tests (Linux, as root: CI runs as root).

    with Hosts(3) as hosts:
        hosts[0].address                                  # "10.213.7.1"
        proc = hosts.spawn(hosts[0], ["python", "x.py"], log=path)   # runs inside hosts[0]
        hosts.run(hosts[1], ["ip", "-br", "addr"]).stdout

Layout: a "switch" namespace holding a Linux bridge device, and one namespace per host with a
veth to it; host i has the address <subnet>.(i+1)/24, the subnet picked at random in 10/8 (only
for readable logs: each namespace is private, so it cannot clash with the machine's networks).
The root namespace gets no address on this network: what runs on a host reaches the other
hosts and its own loopback, never the machine's interfaces, and nothing outside reaches it.
Each host's default route is its link (on-link, no gateway), so a program that finds its own
address by the route to an outside address (Ray's `ray.init()` does, towards 8.8.8.8) finds
the host's; packets for outside addresses go nowhere beyond the switch.
Each host's processes bind whatever they like inside it (Ray binds all of its addresses).

Names: namespaces `ngg<pid>h<i>` and `ngg<pid>sw` (<pid>: this process), so two test runs
never share one. `stop()` (also at interpreter exit) SIGTERMs the process groups `spawn`
started and every process inside the namespaces (`ip netns pids`: processes that left their
group, such as Ray's daemons, too), then SIGKILLs whatever is still there, and deletes the
namespaces; their veths and the bridge device go with them. `start()` first removes, the same
way, what a killed test run left: namespaces of that naming whose <pid> no longer runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.support import procs
from tests.support.errors import NemoGymError
from tests.support.missing import missing

_OURS = re.compile(r"^ngg(\d+)(?:h\d+|sw)$")  # the namespaces Hosts names


class HostsUnavailable(NemoGymError):
    """Network namespaces cannot be made here (not root, or no `ip`)."""


@dataclass(frozen=True)
class Host:
    """One namespace: its name (for `ip netns exec`), index and address on the test link."""

    name: str
    index: int
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespace_pids(name: str) -> list[int]:
    """The pids of every process inside network namespace `name` ([] if it is gone)."""
    out = _ip("netns", "pids", name, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def namespace_inode(name: str) -> int | None:
    """The inode of namespace `name` (/run/netns/<name>), what /proc/<pid>/ns/net points to."""
    with contextlib.suppress(OSError):
        return os.stat(f"/run/netns/{name}").st_ino
    return None


def remove_leftovers() -> list[str]:
    """Delete the namespaces of test runs that are gone (module docstring), SIGKILLing what
    still runs inside them. Returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    gone = [n for n in names if (m := _OURS.match(n)) and not os.path.exists(f"/proc/{m[1]}")]
    for name in gone:
        for pid in namespace_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _ip("netns", "del", name, check=False)
    return gone


class Hosts:
    """`count` hosts on one test link (module docstring). Raises HostsUnavailable when
    namespaces cannot be made here, NemoGymError when a step of building them fails."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("need at least one host")
        self.prefix = f"ngg{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        self.hosts = [Host(f"{self.prefix}h{i}", i, f"{subnet}.{i + 1}") for i in range(count)]
        self.made: list[str] = []
        self._groups: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def start(self) -> Hosts:
        """Make the switch and the hosts (about 50 ms per host)."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise HostsUnavailable("network namespaces need root and iproute2's `ip`")
        remove_leftovers()
        procs.live.add(self)
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                self._add(host.name)
                port = f"p{host.index}"
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                    "eth0", "netns", host.name)  # fmt: skip
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.name, "link", "set", "eth0", "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
                _ip("-n", host.name, "route", "add", "default", "dev", "eth0")
        except subprocess.CalledProcessError as exc:
            self.stop()
            raise NemoGymError(f"building the test hosts failed: {exc.cmd}: {exc.stderr}") from None
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def names(self) -> list[str]:
        """Every namespace made (switch first)."""
        return list(self.made)

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host` (`ip netns exec` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", host.name, *argv]

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host` in a new session (its pid leads the group `stop` ends),
        stdout and stderr to `log`."""
        out: IO[bytes]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.command(host, argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        self._groups.append(proc)
        return proc

    def run(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside `host` to the end (at most `timeout` s); output captured."""
        return subprocess.run(
            self.command(host, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            check=False,
        )

    def pids(self) -> list[int]:
        """Every process inside the hosts' namespaces now."""
        return [pid for name in self.made for pid in namespace_pids(name)]

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the groups `spawn` started and every process in the namespaces, wait up to
        `grace` s, SIGKILL every process left in them, delete them. Idempotent."""
        for proc in self._groups:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(3):
            left = self.pids()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for proc in self._groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()
        self._groups.clear()
        procs.live.discard(self)


def hosts_for_test(count: int) -> Hosts:
    """`Hosts(count)`, started, for a test: where namespaces cannot be made, the test fails
    when env CI is set (CI runs as root) and is skipped otherwise."""

    try:
        return Hosts(count).start()
    except HostsUnavailable as exc:
        problem = f"multi-host test cannot run: {exc}"
    missing(problem)
