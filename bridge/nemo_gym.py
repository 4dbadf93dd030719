"""Everything the bridge knows about NeMo Gym's HTTP API (0.4.0), and the only module that does.

Routes the bridge calls:
- `POST /verify` on a resources server. Request body (`BaseVerifyRequest` plus the server's
  own row fields): the dataset row's fields with None values dropped,
  `responses_create_params` and `response`. Reply (`BaseVerifyResponse`): the request echoed
  back plus `reward`, optional `reward_components` and the server's own fields; judge
  failures are marked in a 200 reply (`_ng_failure_class`; newer releases `failure_kind` /
  `mask_sample`).
- `POST /seed_session` before an item's `/verify` when it runs as a session: NeMo Gym keeps
  per-rollout state behind a session cookie (Starlette's SessionMiddleware). It takes the row
  and answers with a `Set-Cookie`, which the item's `/verify` sends back. The bridge's HTTP
  session keeps no cookies (DummyCookieJar): an item sends exactly the cookies its own
  `/seed_session` reply set, and an item without a session sends none.
- `GET /global_config_dict_yaml` on the head server: the routing table (`parse_global_config`).
- `GET /` on a resources server: its liveness route (`answers`).

Every POST carries the item's `request_id` as an `X-Request-Id` header, so NeMo Gym's access
logs (and the tests' fault proxy) can tell items apart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.cookies import Morsel
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import yaml
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.v1 import verify_pb2

log = logging.getLogger(__name__)

VERIFY_PATH = "/verify"
SEED_PATH = "/seed_session"
GLOBAL_CONFIG_PATH = "/global_config_dict_yaml"
LIVENESS_PATH = "/"
REQUEST_ID_HEADER = "X-Request-Id"
DEFAULT_MODEL = "nemo-gym-grpc"

# Longest X-Request-Id value sent, characters (uvicorn refuses very large header blocks).
_MAX_REQUEST_ID_HEADER = 200
# Reply keys that VerifyResponse carries as typed fields or that only echo the request.
_TYPED_OR_ECHOED = frozenset({"reward", "reward_components", "responses_create_params", "response"})
# Hosts a server binds to that are not addresses to call.
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def completion_response(text: str, model: str, response_id: str = "resp") -> dict[str, Any]:
    """An OpenAI Responses object for a plain completion.

    Shape: a completed response with one assistant `message` output item holding one
    `output_text` part whose text is `text` (what NeMo Gym's simple agent gets from a policy
    that answered in text).
    """
    return {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "model": model,
        "status": "completed",
        "output": [
            {
                "id": "msg_0",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def build_verify_body(
    request: verify_pb2.VerifyRequest,
    *,
    row: dict[str, Any] | None,
    params: dict[str, Any] | None,
    response: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON body of `POST /verify` for one item.

    Args:
        request: the item (its prompt, completion, model and request_id are used when the
            JSON fields below do not say otherwise).
        row, params, response: the item's `row_json`, `responses_create_params_json` and
            `response_json` as parsed JSON objects; None when the field is empty.

    Order of precedence is documented on `VerifyRequest` in verify.proto. Keys whose value is
    null are dropped from the row and from `responses_create_params`: a row from an Arrow
    table (axolotl's loader, `datasets`) or a saved rollout has null for every parameter that
    another row sets or the rollout left unset, and NeMo Gym's request models reject some of
    them (HTTP 422 for `"parallel_tool_calls": null`) where the absent key gets the default.
    """
    body: dict[str, Any] = {}
    if row is not None:
        body = {key: value for key, value in row.items() if value is not None}
    if params is not None:
        body["responses_create_params"] = params
    elif "responses_create_params" not in body:
        body["responses_create_params"] = {
            "input": [{"role": m.role or "user", "content": m.content} for m in request.prompt]
        }
    found = body["responses_create_params"]
    if isinstance(found, dict):
        body["responses_create_params"] = {k: v for k, v in found.items() if v is not None}
    if response is not None:
        body["response"] = response
    else:
        body["response"] = completion_response(
            request.completion, request.model or DEFAULT_MODEL, f"resp_{request.request_id}"
        )
    return body


def seed_body(verify_body: Mapping[str, Any]) -> bytes:
    """The UTF-8 JSON body of `/seed_session` for an item: its `/verify` body without
    `response` (the row's fields and `responses_create_params`)."""
    row = {key: value for key, value in verify_body.items() if key != "response"}
    return json.dumps(row, ensure_ascii=False, allow_nan=False).encode("utf-8")


def cookie_header(cookies: Mapping[str, Morsel[str]]) -> str:
    """The `Cookie` request header that sends back the cookies a reply set.

    Args:
        cookies: a reply's cookies (aiohttp `ClientResponse.cookies`, parsed from its
            `Set-Cookie` headers).

    Returns:
        "name=value; name2=value2" with each value exactly as the server sent it (quoted if it
        was), or "" when the reply set none.
    """
    return "; ".join(f"{morsel.key}={morsel.coded_value}" for morsel in cookies.values())


def request_id_header(request_id: str) -> str:
    """The `X-Request-Id` value for `request_id`: itself when it is printable ASCII, else
    percent-encoded (UTF-8); cut to 200 characters either way."""
    if not (request_id.isascii() and request_id.isprintable()):
        request_id = quote(request_id, safe="", errors="replace")
    return request_id[:_MAX_REQUEST_ID_HEADER]


@dataclass(frozen=True, slots=True)
class Reply:
    """An upstream's answer to one POST: HTTP status, body, the cookies it set, and the
    seconds from sending the request to reading the whole body."""

    status: int
    body: bytes
    cookies: Mapping[str, Morsel[str]]
    seconds: float


class Refused(errors.ItemError):
    """UNAVAILABLE / UPSTREAM_UNAVAILABLE because the upstream refused the connection (the
    caller may pass that replica over for a while)."""


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    timeout: float,
    request_id: str,
    cookie: str = "",
    queued: float = 0.0,
) -> Reply:
    """One JSON POST to `url` (redirects are not followed: only configured URLs are called).

    Args:
        url: full URL, e.g. "http://127.0.0.1:18001/verify"; `body`: UTF-8 JSON.
        timeout: seconds for the whole exchange (> 0).
        request_id: the `X-Request-Id` header value (see `request_id_header`).
        cookie: the `Cookie` header, "" for none.
        queued: seconds the call waited for a slot before (reported on a timeout).

    Returns:
        The Reply, whatever its HTTP status.

    Raises:
        errors.ItemError: DEADLINE_EXCEEDED / UPSTREAM_TIMEOUT when `timeout` passed,
            UNAVAILABLE / UPSTREAM_UNAVAILABLE for a transport failure (`Refused` when the
            connection was refused); its `latency_seconds` is the time spent.
    """
    headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
    if cookie:
        headers["Cookie"] = cookie
    started = time.monotonic()
    try:
        async with session.post(
            url,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
        ) as reply:
            raw = await reply.read()
            seconds = time.monotonic() - started
            log.debug("%s: HTTP %d, %.3f s, request_id=%s", url, reply.status, seconds, request_id)
            return Reply(reply.status, raw, reply.cookies, seconds)
    except (asyncio.TimeoutError, TimeoutError):
        error = errors.ItemError(
            code_pb2.DEADLINE_EXCEEDED,
            errors.UPSTREAM_TIMEOUT,
            f"{url} did not answer within {timeout:.3f} s",
            upstreamUrl=url,
            timeoutSeconds=f"{timeout:.3f}",
            queuedSeconds=f"{queued:.3f}",
        )
    except aiohttp.ClientError as exc:
        kind = Refused if isinstance(exc, aiohttp.ClientConnectorError) else errors.ItemError
        error = kind(
            code_pb2.UNAVAILABLE,
            errors.UPSTREAM_UNAVAILABLE,
            f"{url} unreachable: {type(exc).__name__}: {exc}",
            upstreamUrl=url,
        )
    error.latency_seconds = time.monotonic() - started
    raise error


@dataclass(frozen=True, slots=True)
class Scored:
    """What a 200 `/verify` reply says: the reward, its named components, and the reply's
    other fields as JSON text ("" unless asked for)."""

    reward: float
    components: dict[str, float]
    reply_json: str


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def read_verify_reply(raw: bytes, url: str, include_reply: bool) -> Scored:
    """The score in a 200 `/verify` body; `include_reply` keeps the reply's other fields.

    Raises:
        errors.ItemError: the body is not a JSON object, has no finite numeric `reward`,
            has non-numeric `reward_components`, or marks a failure
            (`_ng_failure_class`, `failure_kind`, `mask_sample`). None is retryable: a retry
            would repeat the same scoring (and, for judge failures, its judge calls).
    """

    def bad_reply(message: str) -> errors.ItemError:
        return errors.ItemError(
            code_pb2.INTERNAL, errors.UPSTREAM_BAD_REPLY, f"{url}: {message}", upstreamUrl=url
        )

    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_reply(f"reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(reply, dict):
        raise bad_reply(f"reply is not a JSON object: {raw[:200]!r}")

    failure_class = reply.get("_ng_failure_class")
    if failure_class:
        judge = failure_class == "judge_failed"
        detail = reply.get("_ng_failure_judge_error", "")
        raise errors.ItemError(
            code_pb2.UNAVAILABLE if judge else code_pb2.INTERNAL,
            errors.UPSTREAM_JUDGE_FAILED if judge else errors.UPSTREAM_REPORTED_FAILURE,
            f"{url} reported {failure_class}: {str(detail)[:200]}",
            retryable=False,  # a retry would repeat the judge calls (the caller may resubmit)
            upstreamUrl=url,
            failureClass=failure_class,
        )
    if reply.get("failure_kind") or reply.get("mask_sample") is True:
        raise errors.ItemError(
            code_pb2.INTERNAL,
            errors.UPSTREAM_REPORTED_FAILURE,
            f"{url} reported failure {reply.get('failure_kind')!r}: "
            f"{str(reply.get('failure_reason') or '')[:200]}",
            upstreamUrl=url,
            failureKind=reply.get("failure_kind"),
        )

    reward = _number(reply.get("reward"))
    if reward is None:
        raise bad_reply(f"reply has no finite numeric reward (got {reply.get('reward')!r})")
    found = reply.get("reward_components") or {}
    if not isinstance(found, dict):
        raise bad_reply("reward_components is not an object")
    components: dict[str, float] = {}
    for name, value in found.items():
        number = _number(value)
        if number is None:
            raise bad_reply(f"reward_components[{name!r}] is not a finite number")
        if errors.has_lone_surrogate(name):
            raise bad_reply(f"reward_components key {name!r} is not valid Unicode text")
        components[name] = number
    other = ""
    if include_reply:
        other = json.dumps({k: v for k, v in reply.items() if k not in _TYPED_OR_ECHOED})
    return Scored(reward, components, other)


def _base_url(host: str, port: int | str, head_host: str) -> str:
    host = str(host).strip("[]")
    if host in _WILDCARD_HOSTS:
        host = head_host
    if host == "localhost":
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"


def parse_global_config(body: bytes | str, head_url: str) -> dict[str, str]:
    """Resources servers in the head server's `/global_config_dict_yaml` reply.

    The reply is double encoded: a JSON string literal whose value is the YAML text of NeMo
    Gym's global config (`OmegaConf.to_yaml`). Resources servers sit at
    `<instance>.resources_servers.<type>.{host,port}`. Each is registered under its instance
    name (NeMo Gym's own routing key) and, when no other entry claims it, under `<type>` too
    (what axolotl's seed used). Wildcard hosts (0.0.0.0, ::) become the head server's host and
    `localhost` becomes 127.0.0.1.

    Returns:
        {name: base URL}, e.g. {"mcqa": "http://127.0.0.1:18001"}.

    Raises:
        ValueError: the body is not a JSON string or YAML mapping of that shape.
    """
    text = json.loads(body)
    if not isinstance(text, str):
        raise ValueError("global_config_dict_yaml reply is not a JSON string")
    config: Any = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ValueError("global config YAML is not a mapping")
    head_host = urlsplit(head_url).hostname or "127.0.0.1"
    by_instance: dict[str, str] = {}
    by_type: dict[str, set[str]] = {}
    for instance, block in config.items():
        servers = block.get("resources_servers") if isinstance(block, dict) else None
        if not isinstance(servers, dict):
            continue
        for server_type, server in servers.items():
            if isinstance(server, dict) and server.get("host") is not None and server.get("port"):
                url = _base_url(server["host"], server["port"], head_host)
                by_instance[str(instance)] = url
                by_type.setdefault(str(server_type), set()).add(url)
    found = dict(by_instance)
    for server_type, urls in by_type.items():
        if server_type not in found and len(urls) == 1:
            found[server_type] = next(iter(urls))
    return found


async def global_config(
    session: aiohttp.ClientSession, head_url: str, timeout: float
) -> dict[str, str]:
    """GET the head server's `/global_config_dict_yaml` and parse it (`parse_global_config`).

    Args:
        head_url: the head server's base URL, no trailing slash.
        timeout: seconds for the request.

    Raises:
        aiohttp.ClientError (a non-200 status included), TimeoutError, ValueError.
    """
    async with session.get(
        f"{head_url}{GLOBAL_CONFIG_PATH}", timeout=aiohttp.ClientTimeout(total=timeout)
    ) as reply:
        reply.raise_for_status()
        body = await reply.read()
    return parse_global_config(body, head_url)


async def answers(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    """True when the resources server at base URL `url` answers its liveness route `GET /`
    with 200 within `timeout` seconds."""
    try:
        timeout_ = aiohttp.ClientTimeout(total=timeout)
        async with session.get(f"{url}{LIVENESS_PATH}", timeout=timeout_) as reply:
            return reply.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
