"""What `/verify` takes of a saved rollout: the row without the verdict its server gave it.

A NeMo Gym rollout row is the resources server's `/verify` answer: the request it was sent (the
dataset row and `response`) plus the fields the answer adds, its verdict (`reward`, and the
server's own: `equivalence_score`, `extracted_answer`, ...; 0.7 also `mask_sample`,
`failure_kind`, `failure_reason`). Sent back as they are, those fields reach the server's
`**body.model_dump(), reward=...` and every row fails with HTTP 500 ("got multiple values for
keyword argument 'reward'"). So `score` leaves out of each row the fields of its server's
`/verify` answer model that its request model does not have: the server's own FastAPI schema
(`GET <server>/openapi.json`; NeMo Gym's resources servers are FastAPI apps) says which, read
once per server at the start of a run, the servers' URLs from the bridge
(`ListResourcesServers`). A step-wise server (0.7's gymnasium-style servers: `/step`, no
`/verify`) has its `/step` models read instead (the verdict: `observation`, `reward`,
`terminated`, `truncated`, `info`). A server whose schema cannot be read (not reachable from
here, no schema) gets `BASE_VERDICT_FIELDS` left out, with a warning.

NeMo Gym's own reverification (`ng_reverify`, 0.7) pairs each rollout with its materialized
input row instead; a rollout file alone does not have it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import grpc

from nemo_gym_grpc.rewards.client import channels
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

# The answer fields of NeMo Gym's own answer models that its request models lack:
# BaseVerifyResponse (`reward`; 0.7: `mask_sample`, `failure_kind`, `failure_reason`) and
# BaseMultiRewardVerifyResponse (`reward_components`).
BASE_VERDICT_FIELDS = frozenset(
    {"reward", "reward_components", "mask_sample", "failure_kind", "failure_reason"}
)
# Seconds for ListResourcesServers and each server's /openapi.json: a server makes its schema
# on the first request, which took over 10 s here for servers that had just started.
SCHEMA_TIMEOUT = 60.0


class Verdicts:
    """The verdict fields of each resources server (`fields`), and the servers whose schema
    could not be read (`unread`: name -> why; they get `BASE_VERDICT_FIELDS`)."""

    def __init__(
        self, fields: Mapping[str, frozenset[str]], unread: Mapping[str, str] | None = None
    ) -> None:
        self.fields = dict(fields)
        self.unread = dict(unread or {})

    def of(self, server: str | None) -> frozenset[str]:
        """The fields to leave out of a row routed to `server`."""
        return self.fields.get(server or "", BASE_VERDICT_FIELDS)


def answer_only_fields(schema: Mapping[str, Any]) -> frozenset[str]:
    """The properties of `POST /verify`'s 200 answer model that its request model does not
    have (`POST /step`'s on a server without `/verify`), from a FastAPI OpenAPI document.

    Raises:
        KeyError, TypeError: the document has no such route or models (not a NeMo Gym
            resources server's schema).
    """
    paths = schema["paths"]
    post = paths["/verify" if "/verify" in paths else "/step"]["post"]
    request = post["requestBody"]["content"]["application/json"]["schema"]
    answer = post["responses"]["200"]["content"]["application/json"]["schema"]
    return frozenset(_properties(schema, answer) - _properties(schema, request))


def _properties(schema: Mapping[str, Any], model: Mapping[str, Any]) -> set[str]:
    ref = model.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        model = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return set(model["properties"])


async def _schema_fields(session: aiohttp.ClientSession, url: str) -> frozenset[str] | str:
    """The answer-only fields of the server at `url`, or why they could not be read."""
    try:
        async with session.get(f"{url}/openapi.json") as reply:
            if reply.status != 200:
                return f"GET {url}/openapi.json answered HTTP {reply.status}"
            return answer_only_fields(await reply.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return f"GET {url}/openapi.json failed: {exc!r:.200}"
    except (KeyError, TypeError):
        return f"{url}/openapi.json has no /verify (or /step) request and answer models"


async def read_verdicts(target: str, security: channels.Security) -> Verdicts:
    """The `Verdicts` of every resources server the bridge at `target` routes to (its
    `ListResourcesServers`, asking the head server again; then each server's schema, at
    once). Never raises: what cannot be read is in `unread` ("every server" when the bridge's
    list cannot be read)."""
    async with channels.aio_channel(target, security) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        try:
            listed = await stub.ListResourcesServers(
                verify_pb2.ListResourcesServersRequest(refresh=True),
                timeout=SCHEMA_TIMEOUT,
                metadata=security.metadata(),
            )
        except grpc.RpcError as exc:
            why = f"the bridge's ListResourcesServers failed: {exc.code().name}"
            return Verdicts({}, {"every server": why})
    urls = {s.name: s.upstream_urls[0] for s in listed.resources_servers if s.upstream_urls}
    timeout = aiohttp.ClientTimeout(total=SCHEMA_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        found = await asyncio.gather(*(_schema_fields(session, url) for url in urls.values()))
    fields = {
        name: got for name, got in zip(urls, found, strict=True) if isinstance(got, frozenset)
    }
    unread = {name: got for name, got in zip(urls, found, strict=True) if isinstance(got, str)}
    return Verdicts(fields, unread)
