"""What one resources server replica supports, learned once per replica and cached.

NeMo Gym 0.4 serves `/seed_session` (legacy body: the row) and `/verify`. 0.7 adds
`/close_session`, `GET /reverify_mode` (is re-running `/verify` safe: "stateless",
"unsupported" or "unknown"), the typed `ResourcesSeedSessionRequest` (some servers take only
that) and the rollout prefix `/ng-rollout/<id>/<route>`. Both versions serve FastAPI's
`GET /openapi.json`, which lists the routes and the `/seed_session` body schema. 0.7's
step-wise servers (`GymnasiumServer`: blackjack, wordle, ...) serve `/reset` and `/step` instead
of `/seed_session` and `/verify`.

Learning is two or three GETs: `/openapi.json`; when it lists `/reverify_mode`, that route
behind the rollout prefix (200 = the prefix works, and the mode), else without it. Any failure
means `LEGACY` (the 0.4 behaviour), never an item error; a transport failure is retried after
`RELEARN_AFTER` seconds, an answer (even a 404) is kept for the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from nemo_gym_grpc.bridge.nemo_gym.correlation import ROLLOUT_PREFIX
from nemo_gym_grpc.bridge.nemo_gym.sessions import CLOSE_PATH, RESET_PATH, SEED_PATH, STEP_PATH
from nemo_gym_grpc.bridge.nemo_gym.tool_schemas import dig, function_tool, refs

log = logging.getLogger(__name__)

OPENAPI_PATH = "/openapi.json"
REVERIFY_PATH = "/reverify_mode"
PROBE_ID = "nemo-gym-grpc-probe"
# Seconds an item waits for its replica's capabilities (then it goes on as on 0.4).
LEARN_TIMEOUT = 2.0
# Seconds one replica's learning may take in all, in the background past LEARN_TIMEOUT (and what
# a listing waits): a cold NeMo Gym 0.7 server builds its `/openapi.json` on the first request,
# which took over 10 s on this 2-core machine for servers that had just started together.
ASK_TIMEOUT = 30.0
# Seconds after a transport failure before a replica's capabilities are asked for again.
RELEARN_AFTER = 30.0

TYPED_SEED = "ResourcesSeedSessionRequest"
# The routes every NeMo Gym resources server has (not tools).
NEMO_GYM_ROUTES = frozenset(
    {
        "/verify",
        SEED_PATH,
        CLOSE_PATH,
        REVERIFY_PATH,
        RESET_PATH,
        STEP_PATH,
        "/aggregate_metrics",
        "/mcp",
        "/",
    }
)
DEFAULT_SEEDS = frozenset({"BaseSeedSessionRequest", TYPED_SEED})


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one replica supports.

    Attributes:
        typed_seed_only: `/seed_session` takes only the typed `ResourcesSeedSessionRequest`.
        custom_seed: `/seed_session` takes a body of the server's own (it keeps per-session
            state, e.g. example_session_state_mgmt): its items need a session to score.
        close_session: it serves `POST /close_session`.
        correlation: it strips the `/ng-rollout/<id>` prefix (0.7's RolloutContextMiddleware).
        reverify_mode: its `GET /reverify_mode` answer ("stateless", "unsupported",
            "unknown"), or "" when it has no such route (0.4) or it was not learned.
        learned: True when these come from the server's answers, False for `LEGACY`.
        typed_seed: `/seed_session` takes the typed `ResourcesSeedSessionRequest`.
        tools: its `POST /<name>` routes that are not NeMo Gym's own (`NEMO_GYM_ROUTES`) nor a
            catch-all (`/{path}`), sorted: the tools a session can call by their own route.
        step_wise: it serves `/reset` and `/step` and no `/verify` (a gymnasium-style server):
            an item is scored as a one-step episode.
        function_tools: each of `tools` as an OpenAI Responses function tool, JSON text
            (tool_schemas.function_tool), in the same order.
    """

    typed_seed_only: bool = False
    custom_seed: bool = False
    close_session: bool = False
    correlation: bool = False
    reverify_mode: str = ""
    learned: bool = False
    typed_seed: bool = False
    tools: tuple[str, ...] = ()
    step_wise: bool = False
    function_tools: tuple[str, ...] = ()


LEGACY = Capabilities()


def read_openapi(doc: Mapping[str, Any]) -> Capabilities:
    """The capabilities an OpenAPI document shows (routes and the `/seed_session` body),
    without `correlation` and `reverify_mode` (those need GETs). Any shape is accepted: what
    is not there is not supported."""
    paths = doc.get("paths")
    paths = paths if isinstance(paths, Mapping) else {}
    seeds = set(refs(dig(paths, SEED_PATH, "post", "requestBody", "content")))
    tools = sorted(
        ((str(path)[1:], methods["post"])
        for path, methods in paths.items()
        if isinstance(path, str) and path.count("/") == 1 and path not in NEMO_GYM_ROUTES
        and "{" not in path  # a catch-all route (`/{path}`), not one tool
        and isinstance(methods, Mapping) and isinstance(methods.get("post"), Mapping)),
        key=lambda tool: tool[0],
    )  # fmt: skip
    return Capabilities(
        typed_seed_only=seeds == {TYPED_SEED},
        custom_seed=bool(seeds - DEFAULT_SEEDS),
        close_session=CLOSE_PATH in paths,
        learned=True,
        typed_seed=TYPED_SEED in seeds,
        tools=tuple(name for name, _ in tools),
        function_tools=tuple(json.dumps(function_tool(n, post, doc)) for n, post in tools),
        step_wise=RESET_PATH in paths and STEP_PATH in paths and "/verify" not in paths,
    )


class Catalog:
    """The capabilities of every replica asked about, learned once each over `session`.

    Args:
        session: the bridge's aiohttp session.
        timeout: seconds one replica's learning may take (`ASK_TIMEOUT`).
    """

    def __init__(self, session: aiohttp.ClientSession, timeout: float = ASK_TIMEOUT) -> None:
        self._session = session
        self._timeout = timeout
        self._known: dict[str, tuple[Capabilities, float]] = {}  # url -> (caps, valid until)
        self._learning: dict[str, asyncio.Task[tuple[Capabilities, float]]] = {}

    async def of(self, url: str, wait: float) -> Capabilities:
        """The capabilities of replica `url` (base URL): cached, else learned, waiting at most
        `wait` seconds (the learning goes on for later items); `LEGACY` when not known."""
        known = self._known.get(url)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        task = self._learning.get(url)
        if task is None:
            task = self._learning[url] = asyncio.create_task(self._learn(url))
        if wait <= 0:
            return LEGACY
        try:
            return (await asyncio.wait_for(asyncio.shield(task), wait))[0]
        except TimeoutError:
            return LEGACY

    async def aclose(self) -> None:
        """Cancel learning still under way and wait for it to end."""
        tasks = list(self._learning.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _learn(self, url: str) -> tuple[Capabilities, float]:
        try:
            caps = await asyncio.wait_for(self._ask(url), self._timeout)
            until = float("inf")
        except Exception as exc:  # whatever goes wrong, the item goes on as on 0.4
            log.warning(
                "%s: cannot learn what it supports (%s: %s); legacy NeMo Gym calls only, "
                "asking again in %.0f s",
                url,
                type(exc).__name__,
                exc,
                RELEARN_AFTER,
            )
            caps, until = LEGACY, time.monotonic() + RELEARN_AFTER
        else:
            log.info("%s supports %s", url, caps)
        self._known[url] = (caps, until)
        del self._learning[url]
        return caps, until

    async def _ask(self, url: str) -> Capabilities:
        status, doc = await self._get(url + OPENAPI_PATH)
        if status != 200 or not isinstance(doc, Mapping):
            return Capabilities(learned=True)  # an answer, just not FastAPI's: legacy
        caps = read_openapi(doc)
        if REVERIFY_PATH not in doc.get("paths", {}):
            return caps
        status, mode = await self._get(url + ROLLOUT_PREFIX + PROBE_ID + REVERIFY_PATH)
        correlation = status == 200
        if not correlation:
            status, mode = await self._get(url + REVERIFY_PATH)
        mode = mode if status == 200 and isinstance(mode, str) else ""
        return dataclasses.replace(caps, correlation=correlation, reverify_mode=mode)

    async def _get(self, url: str) -> tuple[int, Any]:
        """(HTTP status, the JSON body or None). Raises aiohttp.ClientError."""
        async with self._session.get(url, allow_redirects=False) as reply:
            raw = await reply.read()
        try:
            return reply.status, json.loads(raw)
        except ValueError:
            return reply.status, None
