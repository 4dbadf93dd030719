"""A Ray cluster with one node per test host (tests/support/hosts.py): a real multi-node Ray.

    with Hosts(3) as hosts, RayNodes(hosts, workdir) as cluster:
        cluster.address                         # "10.213.7.1:6390", the head's GCS
        cluster.driver(["script.py", ...])      # a Ray driver run on the head host

Every node is `ray start --block` inside its host, with that host's address as its node IP, its
own --temp-dir (the hosts share the file system; all under one short folder in /tmp, since
Ray's sockets need short paths), no dashboard, `--num-cpus` CPUs and a small object store; the
head on hosts[0]. Each node advertises and binds its host's addresses only, so the network rule
holds (tests/support/listeners.py). Token authentication is off for the test cluster (env
RAY_AUTH_MODE=disabled for every node and driver): Ray 2.60 turns it on when
~/.ray/auth_token exists, and a node without the token would be refused. `stop()` ends the
hosts (so everything inside them) and removes that folder.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.errors import NemoGymError
from tests.support.hosts import Host, Hosts
from tests.support.ng_run import offline_env
from tests.support.procs import tail

REPO = Path(__file__).resolve().parents[2]
GCS_PORT = 6390
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum is 75 MiB; the tests move little data
STARTED = b"Ray runtime started."  # what `ray start` prints once its node runs
# Prints the number of alive nodes of the cluster at RAY_ADDRESS.
_COUNT_NODES = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"


def ray_env(pythonpath: str = str(REPO)) -> dict[str, str]:
    """The environment of every node and driver: offline, no usage stats, no token auth,
    `pythonpath` (default the repository: drivers define callers in tests/ modules, which
    workers import)."""
    env = offline_env()
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=pythonpath, RAY_DEDUP_LOGS="0")
    return env


class RayNodes:
    """One Ray node per host of `hosts` (module docstring); `python` is the interpreter of
    every node (its venv's `ray` script starts them), `cpus` each node's CPUs, `pythonpath`
    their and the drivers' PYTHONPATH. `join`: the GCS address of a cluster already running on
    hosts[0] (NeMo Gym's own): then the other hosts' nodes join it and none is started there."""

    def __init__(
        self,
        hosts: Hosts,
        workdir: Path,
        *,
        python: str = sys.executable,
        cpus: int = 1,
        pythonpath: str = str(REPO),
        join: str | None = None,
    ) -> None:
        self.hosts = hosts
        self.workdir = Path(workdir)
        self.python = python
        self.cpus = cpus
        self.pythonpath = pythonpath
        self.join = join
        self.address = join or f"{hosts[0].address}:{GCS_PORT}"
        # Ray's session folders hold AF_UNIX sockets (paths of at most 107 bytes): a short root
        self.temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        self.started: list[Host] = []
        self.startup_seconds: float | None = None

    def __enter__(self) -> RayNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the hosts (and so every node), remove the nodes' session folders."""
        self.hosts.stop()
        shutil.rmtree(self.temp, ignore_errors=True)

    def _ray(self) -> str:
        return str(Path(self.python).parent / "ray")

    def log(self, host: Host) -> Path:
        """The `ray start` output of `host`'s node."""
        return self.workdir / f"ray-{host.name}.log"

    def start(self, timeout: float = 120.0) -> RayNodes:
        """Start the head, then the other nodes; wait until every node is alive."""
        began = time.monotonic()
        deadline = began + timeout
        head, *others = self.hosts.hosts
        if not self.join:
            self._wait_started([(head, self.start_node(head))], deadline)
        self._wait_started([(h, self.start_node(h)) for h in others], deadline)
        want = str(len(self.hosts))
        while True:
            left = max(5.0, deadline - time.monotonic())
            out = self.driver(["-c", _COUNT_NODES], timeout=min(60.0, left))
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [want]:
                break
            if time.monotonic() > deadline:
                raise NemoGymError(
                    f"Ray nodes not all alive: {out.stdout}{out.stderr}\n{self._logs()}"
                )
            time.sleep(1.0)
        self.startup_seconds = round(time.monotonic() - began, 2)
        return self

    def _logs(self) -> str:
        return "\n".join(f"{h.name}:\n{tail(self.log(h), 20)}" for h in self.started)

    def _wait_started(
        self, nodes: list[tuple[Host, subprocess.Popen[bytes]]], deadline: float
    ) -> None:
        """Until each node's `ray start` says it started (NemoGymError if one exits first or
        the deadline passes)."""
        for host, proc in nodes:
            while STARTED not in self.log(host).read_bytes():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise NemoGymError(f"Ray node on {host.name} did not start:\n{self._logs()}")
                time.sleep(0.2)

    def start_node(self, host: Host) -> subprocess.Popen[bytes]:
        """`ray start --block` inside `host`: the head on hosts[0], else a node joining it."""
        temp = self.temp / str(host.index)
        temp.mkdir(parents=True, exist_ok=True)
        argv = [self._ray(), "start", "--block", f"--node-ip-address={host.address}"]
        argv += [f"--temp-dir={temp}", f"--num-cpus={self.cpus}", "--disable-usage-stats"]
        argv += [f"--object-store-memory={OBJECT_STORE_BYTES}"]
        if host.index == 0 and not self.join:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        proc = self.hosts.spawn(host, argv, log=self.log(host), env=ray_env(self.pythonpath))
        self.started.append(host)
        return proc

    def driver(
        self,
        args: Sequence[str],
        *,
        host: Host | None = None,
        timeout: float = 600.0,
        env: Mapping[str, str] | None = None,
        python: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """`python ARGS` inside `host` (default the head's) with RAY_ADDRESS set to the cluster,
        run to the end; output captured. `python` defaults to the nodes' interpreter (another
        one needs the same Python and Ray versions: Ray's rule)."""
        full = ray_env(self.pythonpath)
        full.update(RAY_ADDRESS=self.address, **(env or {}))
        argv = [python or self.python, *args]
        return self.hosts.run(host or self.hosts[0], argv, timeout=timeout, env=full)
