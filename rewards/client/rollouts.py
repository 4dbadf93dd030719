"""Dataset rows -> NeMo Gym rollouts over one gRPC `RunStream`: `run_rollouts` (sync, grpcio)
and `arun_rollouts` (asyncio, grpc.aio), one outcome per row, in row order.

A row is a NeMo Gym dataset row (a JSONL line of a NeMo Gym dataset): a dict with
`responses_create_params` and the fields its resources server reads, and usually `agent_ref`
(`{"type": "responses_api_agents", "name": <agent>}`), which names the agent server that runs
it. The bridge posts it to that agent's `/run` (or runs it as an episode of an environment
server), see `RunRequest` in `rollout.proto`.

Settings not given as keywords come from `settings.py` (target, TLS, token, head server,
`NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT`, `NEMO_GYM_GRPC_RUN_TIMEOUT`, connect timeout), read at
each call; the call goes where its `stream.Route` says (with no target at all, an embedded bridge
routing the head server's agents).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_gym_grpc.rewards.client import convert, settings, stream
from nemo_gym_grpc.rewards.client.outcomes import RunOutcome
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.v1 import rollout_pb2

RolloutBatch = convert.Batch[rollout_pb2.RunRequest, rollout_pb2.RunResponse]


def agent_of(row: Mapping[str, Any], default: str | None) -> str:
    """The agent that runs `row`: its `agent_ref.name` when it has one, else `default`, else
    "" (no agent: `build_requests` fails that row)."""
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, Mapping) else None
    if isinstance(name, str) and name:
        return name
    return default or ""


def _params(
    row: Mapping[str, Any], prompt: Any, overrides: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The row's `responses_create_params` (else one built from `prompt`, as the bridge would)
    with `overrides` applied; None when there are no overrides (the bridge builds them)."""
    if not overrides:
        return None
    own = row.get("responses_create_params")
    if isinstance(own, Mapping):
        params = dict(own)
    else:
        messages = convert.prompt_messages(prompt)
        params = {"input": [{"role": role, "content": text} for role, text in messages]}
    params.update(overrides)
    return params


def build_requests(
    rows: Sequence[Mapping[str, Any]],
    *,
    agent: str | None,
    batch_id: str,
    prompts: Sequence[Any] | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
    run_timeout: float = 0.0,
    include_reply: bool = False,
) -> RolloutBatch:
    """One `RunRequest` per row, in row order; request ids f"{batch_id}-{index}".

    Args:
        rows: NeMo Gym dataset rows (dicts).
        agent: the agent for rows without `agent_ref.name`; None = such rows fail.
        batch_id: prefix of the request ids; unique per call.
        prompts: one TRL prompt (text or messages) per row, or None: sent as the typed
            `prompt`, which the bridge uses for a row without `responses_create_params`.
        responses_create_params: keys set in every row's `responses_create_params` (e.g.
            `temperature`); None = the rows' own.
        run_timeout: seconds for each rollout's `/run` (0 = the bridge's default).
        include_reply: ask for each reply's other fields (`Rollout.reply_json`).

    Returns:
        The batch: requests to send, and the rows failed here (INVALID_ARGUMENT /
        INVALID_ITEM, not sent): no agent, or text that is not valid Unicode.

    Raises:
        ValueError: `prompts` has another length than `rows`.
        TypeError: a row is not a dict, holds a value JSON cannot represent, or a prompt
            has an unusable shape.
    """
    if prompts is not None and len(prompts) != len(rows):
        raise ValueError(f"prompts has {len(prompts)} entries for {len(rows)} rows")
    batch = RolloutBatch(size=len(rows), batch_id=batch_id)
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"row {index} must be a dict, got {row!r:.100}")
        name = agent_of(row, agent)
        if not name:
            missing = f"row {index} has no agent_ref {{'name': <agent>}} and no agent was given"
            batch.reject(index, missing)
            continue
        prompt = prompts[index] if prompts is not None else None
        params = _params(row, prompt, responses_create_params)
        request = rollout_pb2.RunRequest(
            request_id=batch.request_id(index),
            row_json=_json(row, index),
            responses_create_params_json="" if params is None else _json(params, index),
            timeout_seconds=run_timeout,
            include_reply=include_reply,
        )
        try:
            request.agent = convert.proto_text(name, "agent name")
            request.prompt.extend(convert.proto_messages(convert.prompt_messages(prompt)))
        except convert.InvalidText as exc:
            batch.reject(index, str(exc))
            continue
        batch.requests.append(request)
    return batch


def _json(value: Mapping[str, Any], index: int) -> str:
    """`value` as JSON text. Raises TypeError naming row `index`."""
    try:
        return json.dumps(dict(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"row {index} is not JSON serializable: {exc}") from None


def _prepare(
    rows: Sequence[Mapping[str, Any]],
    agent: str | None,
    target: str | None,
    batch_timeout: float | None,
    run_timeout: float | None,
    options: Mapping[str, Any],
) -> tuple[Route, RolloutBatch]:
    """The route and the batch of one `run_rollouts` call (`options`: `build_requests`'s
    prompts, responses_create_params, include_reply)."""
    timeout = settings.optional(settings.check_seconds, batch_timeout, "batch_timeout")
    route = Route.resolve(
        target=target, timeout=settings.resolve(timeout, settings.rollout_batch_timeout)
    )
    each = settings.optional(settings.check_seconds, run_timeout, "run_timeout")
    batch = build_requests(
        rows,
        agent=agent,
        batch_id=uuid.uuid4().hex[:16],
        run_timeout=settings.resolve(each, settings.run_timeout),
        **options,
    )
    return route, batch


def run_rollouts(
    rows: Sequence[Mapping[str, Any]],
    *,
    agent: str | None = None,
    target: str | None = None,
    batch_timeout: float | None = None,
    run_timeout: float | None = None,
    prompts: Sequence[Any] | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
    include_reply: bool = False,
) -> list[RunOutcome]:
    """Run each row as one NeMo Gym rollout, all over one `RunStream` call.

    Args:
        rows: NeMo Gym dataset rows (see the module docstring).
        agent: keyword: agent (or environment server) name for rows without
            `agent_ref.name`.
        target: keyword: the bridge's gRPC target; default `NEMO_GYM_GRPC_TARGET`, and if
            that is unset an embedded bridge over the head server (`NEMO_GYM_HEAD_URL`).
        batch_timeout: keyword: gRPC deadline of the whole call, seconds (default
            `NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT`). Rollouts unfinished by then fail with
            DEADLINE_EXCEEDED (`whole_call`); nothing waits longer.
        run_timeout: keyword: seconds per rollout's `/run` (default
            `NEMO_GYM_GRPC_RUN_TIMEOUT`, else the bridge's `--run-timeout`).
        prompts, responses_create_params, include_reply: keyword: as `build_requests`.

    Returns:
        One outcome per row, in row order: the `RunResponse` (its `rollout`: `reward`,
        `reward_components`, `output_json`, `turns`, ...; and `latency_seconds`), or a
        `Failure` (code and reason as `RunResponse.error` documents; `metadata` with
        `failureKind`, `stage`, `terminal` when known; `whole_call` when the call failed).

    Raises:
        ValueError: a keyword or env var holds an invalid value; `prompts` of another length.
        TypeError: a row or prompt has an unusable shape.
        RuntimeError: the embedded bridge could not be started.
        outcomes.ProtocolError: the bridge's results do not match the rollouts sent.
    """
    options = dict(
        prompts=prompts,
        responses_create_params=responses_create_params,
        include_reply=include_reply,
    )
    route, batch = _prepare(rows, agent, target, batch_timeout, run_timeout, options)
    return batch.outcomes(route.send(stream.RUN, batch.requests))


async def arun_rollouts(
    rows: Sequence[Mapping[str, Any]],
    *,
    agent: str | None = None,
    target: str | None = None,
    batch_timeout: float | None = None,
    run_timeout: float | None = None,
    prompts: Sequence[Any] | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
    include_reply: bool = False,
) -> list[RunOutcome]:
    """`run_rollouts` as a coroutine (grpc.aio on a channel of its own; an embedded bridge
    is started in a worker thread). Cancelling it cancels the `RunStream`, and the bridge
    closes the agents' `/run` requests. Arguments, outcomes and errors: as `run_rollouts`."""
    options = dict(
        prompts=prompts,
        responses_create_params=responses_create_params,
        include_reply=include_reply,
    )
    route, batch = _prepare(rows, agent, target, batch_timeout, run_timeout, options)
    return batch.outcomes(await route.asend(stream.RUN, batch.requests))
