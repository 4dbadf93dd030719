"""How far one item travels through our code: the walk of one `/verify` item (from
`reward_nemo_gym_verify` to the upstream and back) and of one rollout group (from the TRL
`rollout_worker` of `create_nemo_gym_rollout_worker` to `/run` and back to its
`rollout_buffer`), counted by a profiler, so that two versions of the code are counted the
same way.

    python -m benchmarks.walks                 # this checkout
    python -m benchmarks.walks --code OTHER    # another checkout (e.g. a `git worktree`)

The code is imported from a folder laid out as installed (`tests.support.layout`, from the
checkout's own pyproject.toml), with the editable install's finder taken out first. One
bridge runs in this process (its event loop in the main thread) in front of a stand-in NeMo
Gym server (aiohttp: `/verify` and an agent's `/run` with token ids; a stand-in because only
the path through our code is counted). `sys.setprofile` /
`threading.setprofile` record every function of ours entered ("call" events, a coroutine's
resumption included) while one warmed-up item is under way, in every thread. Per walk:

- stops: the distinct functions entered (file and qualified name);
- files: the distinct files they are in;
- returns: the distinct steps (from one file into another) that enter a file already left, in
  each thread's sequence of files (repeats in a row merged): a count of the code's shape, not
  of how often a polling loop ran during the walk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def use_checkout(code: Path) -> None:
    """Import `nemo_gym_grpc` from `code` laid out as installed, not from the editable install."""
    from tests.support.layout import laid_out_elsewhere

    root = laid_out_elsewhere(code)
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h)]
    sys.path_importer_cache.clear()
    sys.path.insert(0, str(root))


class Recorder:
    """The profiler: (thread, file, function) of every call into our code while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[int, str, str]] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        at = path.find("/nemo_gym_grpc/")
        if at < 0 or "_pb2" in path:
            return
        self.calls.append((threading.get_ident(), path[at + 15 :], frame.f_code.co_qualname))

    def install(self) -> None:
        """Profile this thread and every thread started from now on."""
        sys.setprofile(self)
        threading.setprofile(self)

    def walk(self, run: Callable[[], None]) -> dict[str, Any]:
        """Record while `run()` runs; its stops, files and returns (module docstring)."""
        self.calls = []
        self.on = True
        try:
            run()
        finally:
            self.on = False
        stops = sorted({(f, q) for _, f, q in self.calls})
        returns: set[tuple[str, str]] = set()
        for thread in {t for t, _, _ in self.calls}:
            seen: set[str] = set()
            last = ""
            for t, f, _ in self.calls:
                if t != thread or f == last:
                    continue
                if f in seen:
                    returns.add((last, f))
                seen.add(f)
                last = f
        return {
            "stops": len(stops),
            "files": len({f for f, _ in stops}),
            "returns": len(returns),
            "path": [f"{f}:{q}" for f, q in stops],
        }


async def stand_in() -> tuple[Any, str]:
    """A stand-in NeMo Gym server on loopback: `/verify` and an agent's `/run` (rewards 1, 0,
    1, ... so that a group has a spread); (its runner, its base URL)."""
    from aiohttp import web

    from tests.support.web_app import serve_app

    count = 0

    async def verify(request: web.Request) -> web.Response:
        return web.json_response({**(await request.json()), "reward": 1.0})

    async def run(request: web.Request) -> web.Response:
        nonlocal count
        count += 1
        turn = {"type": "message", "role": "assistant", "id": "m", "status": "completed"}
        turn |= {"content": [{"type": "output_text", "text": "x", "annotations": []}]}
        turn |= {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4]}
        turn |= {"generation_log_probs": [-0.5, -0.25]}
        return web.json_response({"reward": float(count % 2), "response": {"output": [turn]}})

    app = web.Application()
    app.add_routes([web.post("/verify", verify), web.post("/run", run)])
    return await serve_app(app)


def verify_walk(recorder: Recorder, target: str) -> dict[str, Any]:
    """One `/verify` item through `reward_nemo_gym_verify`, after one to warm up."""
    os.environ["NEMO_GYM_GRPC_TARGET"] = target
    from nemo_gym_grpc.rewards import reward_nemo_gym_verify

    def one() -> None:
        assert reward_nemo_gym_verify(["x"], resources_server_ref=[{"name": "gym"}]) == [1.0]

    one()
    return recorder.walk(one)


def rollout_walk(recorder: Recorder, target: str) -> dict[str, Any]:
    """One group of 2 rollouts through the rollout worker, after one group to warm up. The
    buffer takes one group (`queue_maxsize` 2), so the worker waits with the warm-up group in
    it, and the walked group is sent only once the window is open (else the worker sent it
    while the warm-up group was taken, and the window caught it half done)."""
    from types import SimpleNamespace

    from nemo_gym_grpc.rewards import create_nemo_gym_rollout_worker

    fields = {"num_generations": 2, "max_staleness": 4, "queue_maxsize": 2, "top_p": 1.0}
    fields |= {"max_inflight_tasks": 2, "temperature": 1.0, "per_device_train_batch_size": 2}
    row = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}
    args = SimpleNamespace(gradient_accumulation_steps=1, **fields)
    worker = create_nemo_gym_rollout_worker([row], args, "agent", target=target)
    worker.start()

    def filled() -> None:
        deadline = time.monotonic() + 60
        while worker.rollout_buffer.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker.rollout_buffer.qsize() == 2, f"no group in 60 s: {worker.counts}"

    def group() -> None:
        for _ in range(2):
            worker.rollout_buffer.get_nowait()  # the group before: the worker goes on
        filled()

    try:
        filled()
        return recorder.walk(group)
    finally:
        worker.stop()


async def main(recorder: Recorder) -> dict[str, Any]:
    """Both walks on one in-process bridge in front of the stand-in."""
    from nemo_gym_grpc.bridge import BridgeConfig, serve

    runner, url = await stand_in()
    folder = tempfile.TemporaryDirectory(prefix="nemo_gym_grpc_walks_")
    ready = Path(folder.name) / "ready"
    config = BridgeConfig(servers={"gym": [url]}, agents={"agent": [url]}, ready_file=ready)
    stop = asyncio.Event()
    bridge = asyncio.ensure_future(serve(config, stop))
    for _ in range(3000):  # at most 60 s
        if ready.exists() or bridge.done():
            break
        await asyncio.sleep(0.02)
    target = ready.read_text().strip()
    loop = asyncio.get_running_loop()
    try:
        walks = {"verify": await loop.run_in_executor(None, verify_walk, recorder, target)}
        walks["rollout"] = await loop.run_in_executor(None, rollout_walk, recorder, target)
    finally:
        stop.set()
        await bridge
        await runner.cleanup()
        folder.cleanup()
    return walks


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout to count")
    parser.add_argument("--path", action="store_true", help="also list every stop")
    options = parser.parse_args()
    use_checkout(options.code.resolve())
    recorder = Recorder()
    recorder.install()
    result = asyncio.run(main(recorder))
    for walk in result.values():
        if not options.path:
            del walk["path"]
    print(json.dumps(result, indent=1))
