"""verifiers 0.4 env servers for tests and benchmarks: `Served` (an env server process for a
taskset config, as prime-rl runs one per source) and `run_episodes` (its client's side).

    served = Served({"id": "nemo-gym-grpc-verifiers", "dataset": ..., "task": {...}})
    traces = asyncio.run(run_episodes(served.address, policy.base_url, served.data[:4]))
    served.stop()       # or served.kill(): SIGKILL by PID

The harness is tests/support/vf_harness.py's scripted chat loop; the model any
OpenAI-compatible base URL (the scripted policy's).
"""

from __future__ import annotations

import asyncio
import glob
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

from tests.support.venv import resources_server_dir

# verifiers (and vf_harness, built on it) are imported where used: 2 s that collecting the
# tests, the fast tier's included, need not spend.

TASKSET_ID = "nemo-gym-grpc-verifiers"
SPAWN = multiprocessing.get_context("spawn")
STARTUP_TIMEOUT = 120.0  # seconds for the env server process to report its address
# The port file verifiers 0.4 writes for every tool server it launches and never removes
# (verifiers/v1/mcp/launch.py, `serve_in_runtime`). Its path is verifiers' own literal, not
# the system temp folder: TMPDIR does not move it, so neither may this pattern.
PORT_FILES = "/tmp/vf-port-*"


class Served:
    """A verifiers env server process (`vf_harness.serve`) for the taskset config `taskset`
    (`{"id": ..., ...}` as in prime-rl's `[...env.taskset]`); `data` holds its tasks as the
    orchestrator ships them (dumped TaskData), `address` its ZMQ address."""

    def __init__(self, taskset: dict[str, Any]) -> None:
        from verifiers.v1.serve import env_config_data
        from verifiers.v1.utils.loaders import load_taskset, resolve_env_config

        from tests.support import vf_harness

        agent = {"harness": {"id": vf_harness.install()}, "runtime": {"type": "subprocess"}}
        config = resolve_env_config({"taskset": taskset, "agent": agent})
        self.data = [t.data.model_dump(mode="json") for t in load_taskset(config.taskset).load()]
        queue = SPAWN.Queue()
        self._port_files = set(glob.glob(PORT_FILES))  # the ones before this server's
        self.process = SPAWN.Process(target=vf_harness.serve, args=(env_config_data(config), queue))
        self.process.start()
        self.address: str = queue.get(timeout=STARTUP_TIMEOUT)

    def kill(self) -> None:
        """SIGKILL, by PID (a trainer's env server that dies); then the tool servers' port files
        written since it started are removed."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=30)
        for path in set(glob.glob(PORT_FILES)) - self._port_files:
            Path(path).unlink(missing_ok=True)

    def stop(self) -> None:
        """SIGTERM (verifiers' graceful teardown), then SIGKILL if it is still alive."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=30)
        self.kill()


def served_examples(target: str, server: str, venv: Path | None = None) -> Served:
    """A Served env server of our taskset (TASKSET_ID) over resources server `server`'s
    example rows (data/example.jsonl in the NeMo Gym `venv`), through the bridge at `target`."""
    rows = resources_server_dir(server, venv) / "data" / "example.jsonl"
    task = {"bridge": target, "resources_server": server}
    return Served({"id": TASKSET_ID, "dataset": str(rows), "task": task})


async def run_episodes(address: str, model_url: str, data: list[dict]) -> list[Any]:
    """One episode per task data dict, all at once through one EnvClient (model `model_url`);
    the episodes' traces (one each), in order."""
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.serve import EnvClient
    from verifiers.v1.types import SamplingConfig

    client = EnvClient(address)
    try:
        await client.wait_for_server_startup()
        model = EvalClientConfig(base_url=model_url, api_key_var="NO_KEY_NEEDED")
        runs = [client.run(model, "scripted", SamplingConfig(), row) for row in data]
        episodes = await asyncio.gather(*runs)
    finally:
        await client.close()
    return [trace for episode in episodes for trace in episode.traces]
