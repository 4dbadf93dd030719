"""The scripted policy model: a tiny deterministic OpenAI-compatible (vLLM-like) HTTP upstream.

Why a stand-in: no LLM can run on this machine, and a rollout needs a policy. This is the only
scripted part of the agent stack. It sits *behind* NeMo Gym's own `vllm_model` model server
(`return_token_id_information: true`), so what the agent returns (output items with
`prompt_token_ids` / `generation_token_ids` / `generation_log_probs`) is built by real NeMo Gym
code from what a vLLM server sends: per-token logprobs whose tokens read `token_id:<id>`
(`return_tokens_as_token_ids`) and the prompt's ids from `POST /tokenize` (what vllm_model 0.4.0
and 0.7.0 call when the reply has no inline ids); a request with `return_token_ids: true` (0.7's
`request_prompt_and_generation_token_ids`) also gets vLLM's inline `prompt_token_ids` and
`choices[0].token_ids`. Ids, template and logprobs: tests/support/toy_chat.py.

    with ScriptedPolicy() as policy:        # aiohttp.web in a thread, loopback
        policy.base_url                      # http://127.0.0.1:PORT/v1, vllm_model's base_url
        policy.knobs = Knobs(delay=0.2)      # faults, read on every call
        policy.calls                         # the request log (CallRecord)

Routes: `POST /v1/chat/completions`, `POST /tokenize`, `GET /v1/models` (with `max_model_len`),
`GET /health`, and `/judge/...` (every method), which always answers 503 (`judge_base_url`: a
judge model's upstream that is down, for masked rollouts). And what TRL 1.16's async GRPO
`VLLMClient` asks of the vLLM server it keeps in sync (`url` is its `vllm_server_base_url`):
`GET /get_world_size` (1), `POST /pause` (chat completions wait until `POST /resume`, as vLLM's
`mode=keep` freezes requests in flight), `POST /init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update` (acknowledged; no weights
move) and `GET /server_info` (dtype float32).

Replies, chosen from the conversation (Chat Completions `messages`):
- the request offers the `knobs.tool_name` tool (by default `get_weather`:
  example_single_tool_call, example_mcp_weather) and the conversation has fewer than
  `knobs.tool_turns` tool messages: a call of it with `knobs.tool_arguments` (by default
  `{"city": "sf"}`; id `call_<k>`, k = tool messages so far), finish_reason `tool_calls`;
- the last message is a tool output: FORECAST_PREFIX + the tool's `weather_description` (or
  `weather`);
- otherwise the first entry of `answers` (substring of the last user message -> text) that
  matches; by default a math prompt (asks for `\\boxed{}`) gets WRONG_MATH_ANSWER; else
  DEFAULT_ANSWER.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support import toy_chat, vllm_reply

WEATHER_TOOL = "get_weather"
WEATHER_ARGUMENTS = json.dumps({"city": "sf"})
FORECAST_PREFIX = "Here is the forecast:"
WRONG_MATH_ANSWER = "The answer is \\boxed{-1}."
DEFAULT_ANSWER = "I cannot help with that."
MODEL_NAME = "scripted-policy"
# vLLM's weight-update routes (VLLM_SERVER_DEV_MODE=1) that TRL's async GRPO client posts to.
WEIGHT_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


@dataclass
class Knobs:
    """Faults and script settings, read on every chat completion (set them from a test).

    Attributes:
        delay: seconds to wait before answering (an agent slow past its deadline).
        hold: do not answer; wait until the client closes the connection (recorded as
            CallRecord.closed_by_client) or ScriptedPolicy.release() is called (then answer
            normally), at most `hold_limit` s (then answer 503).
        hold_limit: bound of a hold, seconds.
        status: answer this HTTP status (e.g. 503) instead of a completion.
        status_times: apply `status` to this many calls, then stop (None: every call). Note:
            vllm_model retries 5xx itself, so one upstream 503 may not fail the rollout.
        match: apply delay/hold/status only to calls whose request body (JSON text) contains
            this substring (None: every call).
        tool_turns: how many get_weather calls to make before the final answer.
        tool_name: the tool those calls call, when the request offers it (get_weather).
        tool_arguments: the arguments of those calls (JSON text).
        tool_call_rate: the chance that a conversation offered get_weather calls it at all
            (else the first turn answers DEFAULT_ANSWER, which example_single_tool_call scores
            0.0): a stand-in for sampling, so that the rollouts of one prompt differ. Drawn
            per conversation from a generator seeded with `seed` when these knobs were set.
            1.0: always.
        seed: the seed of that generator.
    """

    delay: float = 0.0
    hold: bool = False
    hold_limit: float = 300.0
    status: int | None = None
    status_times: int | None = None
    match: str | None = None
    tool_turns: int = 1
    tool_name: str = WEATHER_TOOL
    tool_arguments: str = WEATHER_ARGUMENTS
    tool_call_rate: float = 1.0
    seed: int = 0


@dataclass
class CallRecord:
    """One request the policy received.

    Attributes:
        path: the URL path.
        body: the parsed JSON body ({} for none / not JSON).
        status: the HTTP status answered (None while in flight, or if the client left first).
        reply: the JSON body answered (None until answered).
        closed_by_client: the client closed the connection before the answer.
        started / finished: time.monotonic() of arrival and of the answer or close.
    """

    path: str
    body: dict[str, Any]
    status: int | None = None
    reply: dict[str, Any] | None = None
    closed_by_client: bool = False
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None


class ScriptedPolicy:
    """The scripted policy upstream on a free loopback port, served by aiohttp.web in a daemon
    thread of this process (`pid`, `port` recorded). start()/stop() or a context manager."""

    def __init__(self, answers: list[tuple[str, str]] | None = None) -> None:
        self.answers: list[tuple[str, str]] = list(answers or [("\\boxed{}", WRONG_MATH_ANSWER)])
        self._answers = list(self.answers)  # what reset() restores
        self.knobs = Knobs()
        self.calls: list[CallRecord] = []
        self.pid = os.getpid()
        self.port = 0
        self.max_model_len = 4096
        self._sampling = (self.knobs, random.Random(self.knobs.seed))
        self._resumed: asyncio.Event | None = None  # cleared while paused (made on the loop)
        self._status_used = 0
        self._release: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="scripted-policy", daemon=True
        )
        self._runner: web.AppRunner | None = None

    # lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> ScriptedPolicy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (root)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL for vllm_model's `base_url` (…/v1)."""
        return f"{self.url}/v1"

    @property
    def judge_base_url(self) -> str:
        """An OpenAI base URL (for openai_model's `openai_base_url`) that always answers 503."""
        return f"{self.url}/judge/v1"

    def start(self) -> ScriptedPolicy:
        """Listen on a free loopback port and serve in the background thread."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/judge/{tail:.*}", self._judge)
        app.router.add_get("/get_world_size", self._world_size)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        for route in WEIGHT_ROUTES:
            app.router.add_post(route, self._acknowledge)
        # handler_cancellation: a client that closes its connection cancels the handler
        # (so a held call sees the close at once).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = int(self._runner.addresses[0][1])
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and end the thread (10 s bound each). Idempotent."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def reset(self) -> None:
        """Default knobs and the answers it was made with, held calls released, not paused, an
        empty request log."""
        self.knobs = Knobs()
        self.answers = list(self._answers)
        self.release()
        self._loop.call_soon_threadsafe(self._unpause)
        self._status_used = 0
        self.calls.clear()

    def release(self) -> None:
        """Let every held call answer now (as if `hold` were off); later calls are held again
        while `knobs.hold` is set."""
        self._loop.call_soon_threadsafe(self._release_in_loop)

    def _unpause(self) -> None:
        if self._resumed is not None:
            self._resumed.set()

    def _release_in_loop(self) -> None:
        if self._release is not None:
            self._release.set()
            self._release = None

    def in_flight(self) -> list[CallRecord]:
        """Logged calls not answered and not closed by their client yet."""
        return [c for c in self.calls if c.finished is None]

    def chat_calls(self) -> list[CallRecord]:
        """The logged `/v1/chat/completions` calls, oldest first."""
        return [c for c in self.calls if c.path == "/v1/chat/completions"]

    @property
    def judge_hits(self) -> int:
        """How many requests reached the `/judge/...` routes."""
        return sum(c.path.startswith("/judge/") for c in self.calls)

    # the script ------------------------------------------------------------------------------
    def decide(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The assistant message (role, content, tool_calls) to reply to this conversation."""
        tool_messages = [m for m in messages if m.get("role") == "tool"]
        last = messages[-1] if messages else {}
        offers_weather = self.knobs.tool_name in toy_chat.tool_names(tools)
        if offers_weather and not tool_messages and self.knobs.tool_call_rate < 1.0:
            offers_weather = self._draw() < self.knobs.tool_call_rate
        if offers_weather and len(tool_messages) < self.knobs.tool_turns:
            call = {
                "id": f"call_{len(tool_messages)}",
                "type": "function",
                "function": {"name": self.knobs.tool_name, "arguments": self.knobs.tool_arguments},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        if last.get("role") == "tool":
            output = toy_chat.content_text(last.get("content"))
            with contextlib.suppress(ValueError, AttributeError):
                parsed = json.loads(output)
                output = str(parsed.get("weather_description", parsed.get("weather", output)))
            return {"role": "assistant", "content": f"{FORECAST_PREFIX} {output}"}
        users = [m for m in messages if m.get("role") == "user"]
        question = toy_chat.content_text(users[-1].get("content")) if users else ""
        text = next((t for s, t in self.answers if s in question), DEFAULT_ANSWER)
        return {"role": "assistant", "content": text}

    def _draw(self) -> float:
        """The next draw of the knobs' seeded generator (a new one when the knobs changed)."""
        if self._sampling[0] is not self.knobs:
            self._sampling = (self.knobs, random.Random(self.knobs.seed))
        return self._sampling[1].random()

    # handlers --------------------------------------------------------------------------------
    async def _record(self, request: web.Request) -> CallRecord:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        record = CallRecord(path=request.path, body=body if isinstance(body, dict) else {})
        self.calls.append(record)
        return record

    @staticmethod
    def _answer(record: CallRecord, reply: dict[str, Any], status: int = 200) -> web.Response:
        record.status, record.reply, record.finished = status, reply, time.monotonic()
        return web.json_response(reply, status=status)

    async def _chat_completions(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        try:
            fault = await self._apply_faults(record)
        except asyncio.CancelledError:
            record.closed_by_client, record.finished = True, time.monotonic()
            raise
        if fault is not None:
            return fault
        body = record.body
        message = self.decide(list(body.get("messages") or []), list(body.get("tools") or []))
        reply = vllm_reply.chat_completion(body, message, f"chatcmpl-{len(self.calls)}", MODEL_NAME)
        return self._answer(record, reply)

    async def _apply_faults(self, record: CallRecord) -> web.Response | None:
        if self._resumed is not None and not self._resumed.is_set():
            try:  # paused (POST /pause): wait for /resume, within the hold bound
                await asyncio.wait_for(self._resumed.wait(), self.knobs.hold_limit)
            except TimeoutError:
                error = {"error": {"message": "paused past the hold limit", "code": 503}}
                return self._answer(record, error, 503)
        knobs = self.knobs
        if knobs.match is not None and knobs.match not in json.dumps(record.body):
            return None
        if knobs.delay > 0:
            await asyncio.sleep(knobs.delay)
        if knobs.hold:
            if self._release is None:
                self._release = asyncio.Event()
            try:  # cancelled when the client closes (handler_cancellation)
                await asyncio.wait_for(self._release.wait(), knobs.hold_limit)
            except TimeoutError:
                error = {"error": {"message": "hold limit reached", "code": 503}}
                return self._answer(record, error, 503)
        if knobs.status is not None and (
            knobs.status_times is None or self._status_used < knobs.status_times
        ):
            self._status_used += 1
            error = {"error": {"message": f"scripted HTTP {knobs.status}", "code": knobs.status}}
            return self._answer(record, error, knobs.status)
        return None

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's chat form of /tokenize: {messages, tools, ...} -> {tokens, count, ...}."""
        record = await self._record(request)
        body = record.body
        ids = toy_chat.prompt_token_ids(body.get("messages") or [], body.get("tools") or [])
        reply = {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
        return self._answer(record, reply)

    async def _models(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        model = {"id": MODEL_NAME, "object": "model", "max_model_len": self.max_model_len}
        return self._answer(record, {"object": "list", "data": [model]})

    async def _world_size(self, request: web.Request) -> web.Response:
        return self._answer(await self._record(request), {"world_size": 1})

    async def _server_info(self, request: web.Request) -> web.Response:
        reply = {"vllm_config": {"model_config": {"dtype": "torch.float32"}}}
        return self._answer(await self._record(request), reply)

    async def _pause(self, request: web.Request) -> web.Response:
        if self._resumed is None:
            self._resumed = asyncio.Event()
        self._resumed.clear()
        return self._answer(await self._record(request), {})

    async def _resume(self, request: web.Request) -> web.Response:
        self._unpause()
        return self._answer(await self._record(request), {})

    async def _acknowledge(self, request: web.Request) -> web.Response:
        return self._answer(await self._record(request), {})

    async def _health(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        return self._answer(record, {})

    async def _judge(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        return self._answer(record, {"error": {"message": "judge overloaded"}}, 503)
