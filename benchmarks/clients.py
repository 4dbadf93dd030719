"""The ways of scoring items that the benchmarks compare.

(a) `seed_loop`: the seed's pattern, one blocking `requests.post` per item, in order (a new
    connection each time, as module-level `requests.post` does);
(b) `fanout`: direct aiohttp `POST /verify` at concurrency C over one keep-alive pool;
(c) `reward_fn`: `reward_nemo_gym_verify` through a running bridge (one VerifyStream per call).

Plus the raw gRPC clients used where the reward function's all-at-once return hides what is
measured: `stream_run` (results as they arrive, over several connections) and the per-item
latency probes.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import grpc
import requests

from nemo_gym_grpc.bridge.nemo_gym.verify import completion_response
from nemo_gym_grpc.rewards.client import channels, convert, stream
from nemo_gym_grpc.rewards.trl.functions import SEED_MODEL, reward_nemo_gym_verify
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Item:
    """One completion to score, in the shapes TRL hands a reward function."""

    server: str
    prompt: str
    completion: str
    row: dict
    expected: float


def make_items(
    rows: Sequence[dict], count: int, server: str = "mcqa", scripted: bool = False
) -> list[Item]:
    """`count` mcqa-style items cycling over `rows`: even ones answer right (reward 1.0),
    odd ones wrong (0.0); every one expects 1.0 from a `scripted` upstream."""
    items = []
    for i in range(count):
        row = rows[i % len(rows)]
        answer = row["expected_answer"]
        wrong = "A" if answer != "A" else "C"
        prompt = row["responses_create_params"]["input"][0]["content"]
        right = i % 2 == 0
        text = f"The answer is \\boxed{{{answer if right else wrong}}}"
        items.append(Item(server, prompt, text, row, 1.0 if right or scripted else 0.0))
    return items


def reward_kwargs(items: Sequence[Item]) -> dict:
    """The keyword arguments TRL passes a reward function for `items` (axolotl's columns)."""
    return {
        "completions": [[{"role": "assistant", "content": it.completion}] for it in items],
        "prompts": [[{"role": "user", "content": it.prompt}] for it in items],
        "resources_server_ref": [{"name": it.server} for it in items],
        "verify_extra": [it.row for it in items],
    }


def grpc_requests(items: Sequence[Item], batch_id: str = "bench") -> list[verify_pb2.VerifyRequest]:
    """The VerifyRequests the reward function would send for `items` (built ahead of time)."""
    kwargs = reward_kwargs(items)
    batch = convert.build_batch(
        kwargs["completions"],
        kwargs["prompts"],
        kwargs["resources_server_ref"],
        kwargs["verify_extra"],
        model=SEED_MODEL,
        timeout_seconds=0.0,
        batch_id=batch_id,
    )
    return list(batch.requests)


def seed_body(item: Item) -> dict:
    """The `/verify` body the seed builds: the row without None values, a one-message
    `responses_create_params` from the prompt, and a Responses object for the completion."""
    body = {key: value for key, value in item.row.items() if value is not None}
    body["responses_create_params"] = {"input": [{"role": "user", "content": item.prompt}]}
    body["response"] = completion_response(item.completion, SEED_MODEL)
    return body


def seed_loop(verify_url: str, items: Sequence[Item]) -> list[float]:
    """(a) One blocking `requests.post` per item, in order; a failure counts as 0.0 (as in
    the seed)."""
    rewards = []
    for item in items:
        reply = requests.post(verify_url, json=seed_body(item), timeout=30)
        rewards.append(float(reply.json().get("reward", 0.0)) if reply.ok else 0.0)
    return rewards


def fanout(verify_url: str, items: Sequence[Item], concurrency: int) -> list[float]:
    """(b) Direct aiohttp POSTs, at most `concurrency` at once over one keep-alive pool."""

    async def run() -> list[float]:
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            gate = asyncio.Semaphore(concurrency)

            async def one(item: Item) -> float:
                async with gate:
                    data = json.dumps(seed_body(item))
                    async with session.post(verify_url, data=data, headers=JSON_HEADERS) as reply:
                        body = await reply.read()
                        return float(json.loads(body)["reward"]) if reply.status == 200 else 0.0

            return await asyncio.gather(*(one(item) for item in items))

    return asyncio.run(run())


def reward_fn(target: str, items: Sequence[Item]) -> list[float | None]:
    """(c) `reward_nemo_gym_verify` over the bridge at `target` (NEMO_GYM_GRPC_TARGET)."""
    os.environ["NEMO_GYM_GRPC_TARGET"] = target
    return reward_nemo_gym_verify(**reward_kwargs(items))


@dataclass
class StreamRun:
    """One `stream_run`: seconds to the first and the last result, failures, and the
    cumulative result count over time [(seconds, results so far), ...]."""

    wall: float
    first: float
    received: int
    failed: int
    timeline: list[tuple[float, int]] = field(default_factory=list)


def _channel(target: str) -> grpc.aio.Channel:
    # A local subchannel pool gives each channel its own TCP connection (else channels to one
    # target share one), so `serve --workers N` sees several connections.
    options = [*channels.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    return grpc.aio.insecure_channel(target, options=options)


def stream_run(
    target: str,
    requests_: Sequence[verify_pb2.VerifyRequest],
    streams: int = 1,
    per_message: int = 64,
    timeout: float = 300.0,
) -> StreamRun:
    """Send `requests_` over `streams` concurrent VerifyStreams (one connection each, items
    dealt round-robin, `per_message` items per message) and time the results as they arrive.
    Connections are made before the clock starts."""

    async def run() -> StreamRun:
        channels = [_channel(target) for _ in range(streams)]
        try:
            for ch in channels:
                await asyncio.wait_for(ch.channel_ready(), 30)
            shares = [requests_[i::streams] for i in range(streams)]
            messages = [
                [
                    verify_pb2.VerifyStreamRequest(items=share[i : i + per_message])
                    for i in range(0, len(share), per_message)
                ]
                for share in shares
            ]
            result = StreamRun(0.0, 0.0, 0, 0)
            started = time.perf_counter()

            async def one(ch: grpc.aio.Channel, batch: list) -> None:
                call = verify_pb2_grpc.VerifyServiceStub(ch).VerifyStream(
                    iter(batch), timeout=timeout
                )
                async for message in call:
                    now = time.perf_counter() - started
                    if not result.received:
                        result.first = now
                    result.received += len(message.results)
                    result.failed += sum(r.HasField("error") for r in message.results)
                    result.timeline.append((now, result.received))

            await asyncio.gather(*(one(ch, m) for ch, m in zip(channels, messages, strict=True)))
            result.wall = time.perf_counter() - started
            return result
        finally:
            for ch in channels:
                await ch.close()

    return asyncio.run(run())


def direct_latencies(verify_url: str, item: Item, count: int) -> list[float]:
    """Seconds per `POST /verify`, one at a time over a keep-alive aiohttp connection."""

    async def run() -> list[float]:
        data = json.dumps(seed_body(item))
        out = []
        async with aiohttp.ClientSession() as session:
            for _ in range(count):
                started = time.perf_counter()
                async with session.post(verify_url, data=data, headers=JSON_HEADERS) as reply:
                    await reply.read()
                out.append(time.perf_counter() - started)
        return out

    return asyncio.run(run())


def unary_latencies(target: str, request: verify_pb2.VerifyRequest, count: int) -> list[float]:
    """Seconds per unary `Verify` call, one at a time (sync gRPC client, one channel)."""
    out = []
    with grpc.insecure_channel(target, options=channels.CHANNEL_OPTIONS) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        stub.Verify(request, timeout=10)  # connect
        for _ in range(count):
            started = time.perf_counter()
            stub.Verify(request, timeout=10)
            out.append(time.perf_counter() - started)
    return out


def stream1_latencies(target: str, request: verify_pb2.VerifyRequest, count: int) -> list[float]:
    """Seconds per one-item VerifyStream call made by the reward functions' own client
    (`rewards.client.stream.send`, its shared channel), one at a time."""
    out = []
    stream.send(
        stream.Call(stream.VERIFY, target, [request], timeout=10, connect_timeout=10)
    )  # connect
    for _ in range(count):
        started = time.perf_counter()
        stream.send(stream.Call(stream.VERIFY, target, [request], timeout=10, connect_timeout=10))
        out.append(time.perf_counter() - started)
    return out
