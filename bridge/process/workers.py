"""`serve --workers N`: N bridge processes sharing one port (SO_REUSEPORT).

The supervisor forks the workers before any gRPC object exists (gRPC supports fork only
then), forwards SIGTERM/SIGINT to them, and exits with the worst exit status. The kernel
spreads new connections across the workers; each connection (and so each stream) stays with
one worker. Each worker keeps its own metrics: with `metrics_port` P, worker i serves them on
port P+i (scrape every one; sum across them in PromQL).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from pathlib import Path

from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.bridge.rpc.server import check_free, run
from nemo_gym_grpc.shared.child import read_ready_file, write_ready_file

log = logging.getLogger(__name__)


def _resolve_port(listen: str) -> str:
    """`listen` with port 0 replaced by a free port (all workers must bind the same one)."""
    host, port = listen.rsplit(":", 1)
    if port != "0":
        return listen
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host.strip("[]"), 0))
        return f"{host}:{probe.getsockname()[1]}"


def _worker(config: BridgeConfig) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        run(config)
    except (RuntimeError, ValueError, OSError) as exc:  # what `serve` raises: said in a line
        log.error("worker %d: %s", os.getpid(), exc)
        return 1
    except Exception:
        log.exception("worker %d failed", os.getpid())
        return 1
    return 0


def run_workers(config: BridgeConfig, workers: int) -> int:
    """Run `workers` bridge processes on one port until they exit. Returns the exit status.

    `config.ready_file`, if set, is written once every worker serves (worker i writes
    `<ready_file>.i`, removed again at exit).

    Raises:
        OSError: no free port can be found for a `listen` with port 0, or the fork fails.
        RuntimeError: another socket listens on `listen` (`server.check_free`).
    """
    listen = _resolve_port(config.listen)
    check_free(listen, reuse_port=True)  # one line here rather than one per worker
    ready_files: list[Path] = []  # one per worker, if `config.ready_file` is set
    children: dict[int, int] = {}
    for index in range(workers):
        ready: Path | None = None
        if config.ready_file:
            ready = config.ready_file.with_name(f"{config.ready_file.name}.{index}")
            ready_files.append(ready)
        metrics_port = config.metrics_port
        if metrics_port:  # None = no metrics, 0 = a free port for each worker
            metrics_port += index
        child_config = dataclasses.replace(
            config,
            listen=listen,
            reuse_port=True,
            ready_file=ready,
            exit_with_parent=True,
            metrics_port=metrics_port,
            share_factor=workers,  # each worker has its limits
        )
        pid = os.fork()
        if pid == 0:
            os._exit(_worker(child_config))
        children[pid] = index
    log.info("started %d workers on %s: pids %s", workers, listen, sorted(children))
    try:
        return _supervise(config, children, listen, ready_files)
    finally:
        for ready in ready_files:
            ready.unlink(missing_ok=True)


def _supervise(
    config: BridgeConfig, children: dict[int, int], listen: str, ready_files: list[Path]
) -> int:
    """Forward SIGTERM/SIGINT to `children` (pid -> worker index) and wait for them all to
    exit; write the ready file once every worker's is there. Returns the worst exit status
    (0 or 1)."""

    def forward(signum: int, _frame: object) -> None:
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    parent = os.getppid()
    status = 0
    announced = config.ready_file is None
    while children:
        pid, code = os.waitpid(-1, os.WNOHANG)
        if pid:
            children.pop(pid, None)
            status = max(status, os.waitstatus_to_exitcode(code) and 1)
            if children and code:
                log.error("worker %d exited with %d: stopping the others", pid, code)
                forward(signal.SIGTERM, None)
            continue
        if config.ready_file and not announced and all(map(read_ready_file, ready_files)):
            write_ready_file(config.ready_file, listen)
            announced = True
        if config.exit_with_parent and os.getppid() != parent:
            log.warning("parent process %d exited: stopping workers", parent)
            forward(signal.SIGTERM, None)
            parent = os.getppid()
        time.sleep(0.1)
    return status
