"""Processes the benchmarks start (scripted upstreams) and measure (CPU time, peak RSS).

Every process is started with its PID recorded and stopped by that PID (SIGTERM, then
SIGKILL after a timeout); nothing is ever signalled by name.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil

from nemo_gym_grpc.shared.child import Child, NotReady

HERE = Path(__file__).resolve().parent
PREFIX = "nemo_gym_grpc_bench_"


class _Script:
    """A running `benchmarks/<script>` that writes "host:port" to its --ready-file once it
    listens on a free loopback port (`address`): a `Child` of `nemo_gym_grpc.shared.child`."""

    def __init__(self, script: str, args: list[str], timeout: float = 15.0) -> None:
        self._child = Child([sys.executable, str(HERE / script), *args], prefix=PREFIX)
        self.proc = self._child.process
        self.pid = self._child.pid
        try:
            self.address = self._child.wait_ready(timeout)
        except NotReady as exc:
            raise RuntimeError(f"{script} {exc}") from None

    def __enter__(self) -> _Script:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM by PID, wait, SIGKILL if it is still there; remove its temporary folder."""
        self._child.stop(10.0)


class Upstream(_Script):
    """A running `benchmarks/upstream.py` (fixed-latency `/verify`) at `url`."""

    def __init__(self, latency: float, timeout: float = 15.0) -> None:
        self.latency = latency
        super().__init__("upstream.py", ["--latency", repr(latency)], timeout)
        self.url = f"http://{self.address}"

    def __enter__(self) -> Upstream:
        return self


class Floor(_Script):
    """A running `benchmarks/floor.py` (a no-op VerifyService) at gRPC target `address`."""

    def __init__(self, timeout: float = 15.0) -> None:
        super().__init__("floor.py", [], timeout)

    def __enter__(self) -> Floor:
        return self


@dataclass
class CpuMark:
    """CPU seconds (user + system) of a process tree at one moment."""

    seconds: float
    per_pid: dict[int, float]


def tree(pid: int) -> list[psutil.Process]:
    """The process and its live descendants (bridge workers are the supervisor's children)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_mark(pid: int) -> CpuMark:
    """User + system CPU seconds of `pid` and its descendants, in total and per process."""
    per_pid = {}
    for proc in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            per_pid[proc.pid] = times.user + times.system
    return CpuMark(sum(per_pid.values()), per_pid)


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) in MiB, summed over `pid` and its descendants."""
    total_kb = 0
    for proc in tree(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


@contextlib.contextmanager
def profiled(pid: int, out: Path, rate: int = 200) -> Iterator[None]:
    """Sample `pid` and its children with py-spy while the block runs, then write the
    hottest functions (self and inclusive share of samples) to `out`."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    raw = out.with_name(out.name + ".raw")
    command = [spy, "record", "-p", str(pid), "--subprocesses", "-r", str(rate), "-f", "raw"]
    proc = subprocess.Popen(
        [*command, "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT)  # py-spy writes its output on SIGINT
        proc.wait(timeout=60)
        if raw.exists():
            out.write_text(summarize_profile(raw.read_text()))
            raw.unlink()


def summarize_profile(collapsed: str, top: int = 30) -> str:
    """The `top` functions by self and by inclusive share of samples, from py-spy's raw
    (collapsed stacks) output; line numbers are dropped so a function counts once."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # [0]: the profiled process; a worker's own process frame keeps only its pid (its
        # command line holds temp paths that differ on every run).
        frames = [
            re.sub(r"^(process \d+):.*", r"\1", re.sub(r":\d+\)$", ")", f))
            for f in stack.split(";")[1:]
        ]
        total += int(count)
        if frames:
            own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    lines = [f"{total} samples"]
    plumbing = 0.9 * total  # frames under nearly every sample: the event loop, main()
    for title, counter in (("self", own), ("inclusive (below 90%)", inclusive)):
        lines.append(f"\n-- {title}")
        ranked = [(f, n) for f, n in counter.most_common() if n < plumbing][:top]
        lines += [f"{100 * n / max(total, 1):5.1f}%  {f}" for f, n in ranked]
    return "\n".join(lines) + "\n"


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    """Cores, CPU model, memory, kernel and limits that shape the numbers."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import resource

    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "somaxconn": int(Path("/proc/sys/net/core/somaxconn").read_text()),
    }


def versions(nemo_gym: str | None) -> dict:
    """Versions of Python and the packages on the measured paths."""
    found = {"python": platform.python_version()}
    for name in ("grpcio", "protobuf", "aiohttp", "requests", "nemo-gym-grpc"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    found["nemo-gym"] = nemo_gym

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()

    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        found["git_commit"] = git("rev-parse", "--short", "HEAD")
        if git("status", "--porcelain", "--", "../bridge", "../rewards"):
            found["git_commit"] += " (bridge/ or rewards/ modified)"
    return found
