"""Items/s of one 512-item training batch through each stack adapter vs the same items through
`reward_nemo_gym_verify`, on the session's real bridge and NeMo Gym mcqa server.

Prints a table (and writes build/stacks_throughput.json). Asserts only that every path gave
the right rewards; the times are measurements, not pass/fail conditions. Each path is warmed
up with a few items first (channels, the bridge's route learning), then timed once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web

from nemo_gym_grpc.rewards import (
    openrlhf,
    reward_nemo_gym_verify,
    reward_nemo_gym_verify_async,
    slime,
    verl,
)
from tests.stacks_common import ROOT, SlimeSample, answers, export_examples, run_verl
from tests.support import example_rows, free_ports

pd = pytest.importorskip("pandas")  # the test-trl group of `make dev` installs it

BATCH = 512
PROMPT = "<|user|>Q<|assistant|>"
# One way to score: run(n) -> the rewards of the first n items of the batch.
Scorer = Callable[[int], Awaitable[list[float]]]


@pytest.fixture(scope="module")
def batch(nemo_gym_venv) -> tuple[list[dict[str, Any]], list[str], list[float]]:
    """BATCH (mcqa example row, completion) items, right and wrong in turn; expected rewards."""
    rows = example_rows("mcqa", nemo_gym_venv)
    items = [rows[i % len(rows)] for i in range(BATCH)]
    texts = [answers("mcqa", row)[i % 2] for i, row in enumerate(items)]
    return items, texts, [float(1 - i % 2) for i in range(BATCH)]


async def _timed(run: Scorer, expected: list[float]) -> float:
    await run(4)  # warm-up
    started = time.perf_counter()
    got = await run(BATCH)
    seconds = time.perf_counter() - started
    assert got == expected[: len(got)] and len(got) == BATCH
    return seconds


def _reward_fn_paths(rows: list[dict], texts: list[str]) -> dict[str, Scorer]:
    """The TRL, verl and slime reward functions, each as run(n) -> rewards of the first n."""
    refs = [{"name": "mcqa"}] * BATCH

    async def trl_sync(n: int) -> list[float]:
        args = {"resources_server_ref": refs[:n], "verify_extra": rows[:n]}
        return await asyncio.to_thread(reward_nemo_gym_verify, texts[:n], None, **args)  # type: ignore[arg-type]

    async def trl_async(n: int) -> list[float]:
        args = {"resources_server_ref": refs[:n], "verify_extra": rows[:n]}
        return await reward_nemo_gym_verify_async(texts[:n], None, **args)  # type: ignore[return-value]

    async def verl_per_sample(n: int) -> list[float]:  # as verl's NaiveRewardManager calls it
        infos = [{"resources_server": "mcqa", "nemo_gym_row": json.dumps(r)} for r in rows[:n]]
        results = await asyncio.gather(
            *(verl.compute_score("mcqa", t, None, i) for t, i in zip(texts, infos, strict=False))
        )
        return [r["score"] for r in results]

    def samples(n: int) -> list[SlimeSample]:
        return [
            SlimeSample(
                prompt="Q", response=t, metadata={"resources_server": "mcqa", "nemo_gym_row": r}
            )  # fmt: skip
            for t, r in zip(texts[:n], rows[:n], strict=True)
        ]

    async def slime_group(n: int) -> list[float]:
        return await slime.group_reward(None, samples(n))

    async def slime_per_sample(n: int) -> list[float]:
        return list(await asyncio.gather(*(slime.reward(None, s) for s in samples(n))))

    return {
        "reward_nemo_gym_verify (TRL, sync; baseline)": trl_sync,
        "reward_nemo_gym_verify_async (TRL)": trl_async,
        "verl compute_score, one call per sample": verl_per_sample,
        "slime group_reward (--group-rm)": slime_group,
        "slime reward, one call per sample": slime_per_sample,
    }


def _openrlhf_paths(rows: list[dict], texts: list[str], port: int) -> dict[str, Scorer]:
    """OpenRLHF's reward_func in process, and its app over HTTP on `port` (already serving)."""
    labels = [json.dumps({"resources_server": "mcqa", "nemo_gym_row": r}) for r in rows]

    def queries(n: int) -> tuple[list[str], list[str], list[str]]:
        return [PROMPT + t for t in texts[:n]], [PROMPT] * n, labels[:n]

    async def openrlhf_func(n: int) -> list[float]:
        result = await asyncio.to_thread(openrlhf.reward_func, *queries(n))
        return [float(x) for x in result["rewards"].tolist()]

    async def openrlhf_http(n: int) -> list[float]:
        q, p, lab = queries(n)
        body = {"query": q, "prompts": p, "labels": lab}
        url = f"http://127.0.0.1:{port}{openrlhf.PATH}"
        reply = await asyncio.to_thread(requests.post, url, json=body, timeout=120)
        return [float(x) for x in reply.json()["rewards"]]

    return {
        "OpenRLHF reward_func": openrlhf_func,
        "OpenRLHF openrlhf-rm HTTP (requests)": openrlhf_http,
    }


async def _time_in_process(
    rows: list[dict], texts: list[str], expected: list[float]
) -> dict[str, float]:
    """Seconds per path of _reward_fn_paths and _openrlhf_paths (OpenRLHF's app served on a
    free loopback port meanwhile)."""
    runner = web.AppRunner(openrlhf.app())
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    paths = {**_reward_fn_paths(rows, texts), **_openrlhf_paths(rows, texts, port)}
    seconds: dict[str, float] = {}
    try:
        for name, run in paths.items():
            seconds[name] = await _timed(run, expected)
    finally:
        await runner.cleanup()
    return seconds


def _time_verl_reward_loop(
    nemo_gym_venv: Path,
    tmp_path: Path,
    rows: list[dict],
    expected: list[float],
    bridge_target: str,
) -> dict[str, float]:
    """Seconds of verl's own reward loop (RewardLoopWorker) in build/verl-venv, over exported
    mcqa rows, with each reward manager; the key names the number of calls."""
    seconds = {}
    (parquet,) = [p for s, p in export_examples(nemo_gym_venv, tmp_path, "verl").items()
                  if s == "mcqa"]  # fmt: skip
    frame = pd.read_parquet(parquet)
    items = [
        {"row": i % len(frame), "completion": answers("mcqa", rows[i % len(frame)])[i % 2]}
        for i in range(BATCH)
    ]
    for mode, name in (("naive", "verl RewardLoopWorker + compute_score (naive manager)"),
                       ("manager", "verl RewardLoopWorker + NemoGymRewardManager")):  # fmt: skip
        run_verl({"parquet": str(parquet), "mode": mode, "items": items[:4]}, bridge_target)
        result = run_verl({"parquet": str(parquet), "mode": mode, "items": items}, bridge_target)
        assert result["scores"] == expected
        seconds[f"{name} ({len(result['calls'])} calls)"] = result["seconds"]
    return seconds


def _report(seconds: dict[str, float], capsys) -> None:
    """Print the items/s table and write build/stacks_throughput.json."""
    base = seconds["reward_nemo_gym_verify (TRL, sync; baseline)"]
    lines = [f"{BATCH} mcqa items, one batch:", "| path | items/s | vs baseline |", "|---|---|---|"]
    lines += [f"| {k} | {BATCH / s:,.0f} | {base / s:.2f}x |" for k, s in seconds.items()]
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "stacks_throughput.json").write_text(json.dumps(seconds, indent=1))
    with capsys.disabled():
        print("\n" + "\n".join(lines))


async def test_512_items_through_each_adapter(batch, bridge_target, nemo_gym_venv, monkeypatch,
                                              tmp_path, capsys):  # fmt: skip
    monkeypatch.setenv("NEMO_GYM_GRPC_TARGET", bridge_target)
    monkeypatch.delenv("NEMO_GYM_GRPC_ON_ERROR", raising=False)
    rows, texts, expected = batch
    seconds = await _time_in_process(rows, texts, expected)
    seconds.update(_time_verl_reward_loop(nemo_gym_venv, tmp_path, rows, expected, bridge_target))
    _report(seconds, capsys)
