"""OpenRLHF: `reward_func` and the remote reward HTTP contract, scoring with NeMo Gym `/verify`.

OpenRLHF takes `--reward.remote_url` (`--remote_rm_url` before 0.10) either as a `.py` file
defining `reward_func(queries, prompts, labels, **kwargs)` or as an HTTP URL it POSTs
`{"query": [...], "prompts": [...], "labels": [...]}` to, reading `{"rewards": [...],
"scores": [...], "extra_logs": {...}}` back. OpenRLHF 0.11.2's caller
(`openrlhf/utils/agent.py`, `SingleTurnAgentExecutor`) sends one sample per call, many at
once (the file's function in a thread each); it retries a failed HTTP request 5 times, 1 s
apart, and when the call still fails it logs that at INFO and leaves the sample's reward None.
Both forms are served here:

- a file: `reward_func.py` holding `from nemo_gym_grpc.rewards.openrlhf import reward_func`,
  then `--reward.remote_url /path/to/reward_func.py --data.label_key label`;
- HTTP: `nemo-gym-grpc openrlhf-rm --port 5000` (`app`), then
  `--reward.remote_url http://127.0.0.1:5000/get_reward --data.label_key label`; concurrent
  requests' items go to the bridge together (`stacks.score_one`).

Data mapping (`nemo-gym-grpc export --format openrlhf`): each label is JSON text
`{"resources_server": ..., "nemo_gym_row": {...}}` (OpenRLHF passes labels as strings); the
completion is the query after its prompt (queries are prompt + response). Failure policy:
`stacks.py`; a failed item is counted in `extra_logs["scoring_failed"]` (1.0 per failed item).
Over HTTP a call that raises answers 500 `{"error": ...}` (OpenRLHF retries, then raises)
and a malformed request 400.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from nemo_gym_grpc.rewards import stacks
from nemo_gym_grpc.rewards.client.outcomes import Outcome
from nemo_gym_grpc.rewards.client.policy import ScoringError

log = logging.getLogger("nemo_gym_grpc.rewards")

# The path OpenRLHF's docs and `openrlhf.cli.serve_rm` use; "/" is served too.
PATH = "/get_reward"


def completion_of(query: str, prompt: str, index: int) -> str:
    """The response part of OpenRLHF's `query` (prompt + response): the text after `prompt`.

    Raises:
        ValueError: `query` does not contain `prompt` (the prompt text differs from what the
            query was decoded from); the message names the item's `index`.
    """
    if query.startswith(prompt):
        return query[len(prompt) :]
    at = query.find(prompt) if prompt else -1
    if at < 0:
        raise ValueError(
            f"query {index} does not contain its prompt (OpenRLHF passes prompt + response "
            f"as the query): prompt {prompt[:80]!r}, query {query[:80]!r}"
        )
    return query[at + len(prompt) :]


def openrlhf_items(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]
) -> list[stacks.StackItem]:
    """The `StackItem`s of one OpenRLHF call (data mapping in the module docstring).

    Raises:
        ValueError: the lists differ in length, a query does not contain its prompt, or a
            label is text that is not a JSON object.
    """
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(
            f"{len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels: one each "
            "per item"
        )
    items = []
    for index, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
        server, row = stacks.nemo_gym_fields(label, f"labels[{index}]")
        text = completion_of(str(query), str(prompt), index)
        items.append(stacks.StackItem(server=server, completion=text, row=row, prompt=prompt))
    return items


def openrlhf_result(outcomes: Sequence[Outcome], *, where: str) -> dict[str, Any]:
    """OpenRLHF's reply (lists of floats): `rewards`, `scores` (the same values, for its
    dynamic filtering) and `extra_logs` {"scoring_failed": [1.0 per failed item, else 0.0]}.

    Raises:
        ScoringError: as `stacks.stack_rewards`.
    """
    rewards = stacks.stack_rewards(outcomes, where=where)
    failed = [float(bool(stacks.failure_cause(o))) for o in outcomes]
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": {"scoring_failed": failed}}


def reward_func(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any
) -> dict[str, Any]:
    """OpenRLHF's custom reward function: every item of the call in one `VerifyStream`.

    Args:
        queries: prompt + response text, one per item.
        prompts: the prompt text, one per item.
        labels: the `--data.label_key` column, one JSON label per item (module docstring).
        **kwargs: OpenRLHF's other arguments, ignored.

    Returns:
        `openrlhf_result`'s dict with torch tensors (float32) in place of its lists.

    Raises:
        ScoringError: an item failed and `NEMO_GYM_GRPC_ON_ERROR` is unset or `raise`, or more
            than `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION` of the items failed.
        ValueError: as `openrlhf_items`.
    """
    import torch  # OpenRLHF's reward path has torch; the HTTP sidecar does not need it

    outcomes = stacks.score_items(openrlhf_items(queries, prompts, labels))
    result = openrlhf_result(outcomes, where=f"OpenRLHF reward_func, {len(outcomes)} items")

    def as_tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)

    return {
        "rewards": as_tensor(result["rewards"]),
        "scores": as_tensor(result["scores"]),
        "extra_logs": {k: as_tensor(v) for k, v in result["extra_logs"].items()},
    }


async def _get_reward(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        queries, prompts = body.get("query"), body.get("prompts")
        labels = body.get("labels")
        if not isinstance(queries, list) or not isinstance(prompts, list):
            raise ValueError('"query" and "prompts" must be lists (one per item)')
        if not isinstance(labels, list):
            raise ValueError(
                '"labels" must be a list of JSON labels (start OpenRLHF with --data.label_key)'
            )
        items = openrlhf_items(queries, prompts, labels)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError too
        return web.json_response({"error": str(exc)}, status=400)
    try:
        # OpenRLHF sends one sample per request, many at once: those go to the bridge together
        outcomes = list(await asyncio.gather(*(stacks.score_one(item) for item in items)))
        result = openrlhf_result(outcomes, where=f"openrlhf-rm, {len(items)} items")
    except (ScoringError, ValueError, TypeError, RuntimeError) as exc:
        log.error("openrlhf-rm: %s", exc)
        return web.json_response({"error": str(exc)}, status=500)
    return web.json_response(result)


def app() -> web.Application:
    """The OpenRLHF remote reward HTTP app: `POST /get_reward` (and `POST /`) with
    `{"query", "prompts", "labels"}` -> `openrlhf_result`'s JSON (NaN written as `NaN`, which
    Python's json, and so OpenRLHF's `requests`, reads); 400 for a malformed request, 500
    `{"error": ...}` when the call raises. Settings: `NEMO_GYM_GRPC_*` (`client/settings.py`)."""
    application = web.Application(client_max_size=256 * 1024 * 1024)
    application.router.add_post(PATH, _get_reward)
    application.router.add_post("/", _get_reward)
    return application


def serve(host: str, port: int) -> int:
    """Run `app()` on host:port until interrupted (SIGINT/SIGTERM); logs
    "nemo-gym-grpc openrlhf-rm listening on http://HOST:PORT/get_reward" once it accepts
    requests. Returns the exit status: 0 after SIGINT/SIGTERM; 1, with one line on stderr,
    when it cannot listen there (e.g. the port is taken)."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}{PATH}"
    listening = False

    def ready(_aiohttp_banner: str) -> None:
        nonlocal listening
        listening = True
        log.info("nemo-gym-grpc openrlhf-rm listening on %s", url)

    try:
        web.run_app(app(), host=host, port=port, print=ready)
    except OSError as exc:
        if listening:
            raise
        print(f"nemo-gym-grpc openrlhf-rm: cannot listen on {url}: {exc}", file=sys.stderr)
        return 1
    return 0
