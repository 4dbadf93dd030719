"""TRL/axolotl reward functions scoring with NeMo Gym through the gRPC bridge.

Same names and call shapes as axolotl's `axolotl.integrations.nemo_gym.rewards`, which these
replace. A reward function gets `completions`, `prompts` and every dataset column as keyword
arguments (one value per completion) and returns one value per completion, in input order:
the reward (float), or None for an item that could not be scored (TRL reads None as NaN and
leaves it out of the mean). A failure is never a reward of 0.0.

One call = one `VerifyStream` RPC carrying the whole batch; each failing batch logs one
warning on the `nemo_gym_grpc.rewards` logger counting failures by cause.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nemo_gym_grpc.rewards import client, convert, embedded, settings

log = logging.getLogger("nemo_gym_grpc.rewards")

# The `model` the seed's reward_nemo_gym_verify wrote into its Responses object.
SEED_MODEL = "axolotl"


def reward_env(completions, prompts=None, **kwargs):
    """Passthrough of a reward computed elsewhere (NeMo Gym agent `/run`, multi-turn).

    Reads the `env_reward` keyword argument (injected per sample by axolotl's NeMo Gym data
    producer): a list or tuple gives `[float(r) for r in env_reward]`; a scalar is repeated
    once per completion; missing (or None) gives 0.0 per completion. Identical to axolotl's
    `reward_env`; no I/O.

    Returns:
        list[float].
    """
    env_rewards = kwargs.get("env_reward")
    if env_rewards is not None:
        if isinstance(env_rewards, (list, tuple)):
            return [float(r) for r in env_rewards]
        return [float(env_rewards) for _ in completions]
    return [0.0 for _ in completions]


def reward_nemo_gym_verify(completions, prompts=None, **kwargs):
    """Score each completion with its NeMo Gym resources server's `/verify` (single-turn).

    Load it by dotted path (`nemo_gym_grpc.rewards.reward_nemo_gym_verify`, e.g. in axolotl's
    `trl.reward_funcs`) or pass it to `GRPOTrainer(reward_funcs=[...])`.

    Args:
        completions: one per item: plain text, or a conversational list of message dicts
            (the assistant messages' contents, joined with newlines, are the answer).
        prompts: one per item (conversational list or plain string), or None. Used by the
            bridge only for a row without its own `responses_create_params`.
        resources_server_ref: keyword, required: one `{"name": <resources server>}` per item
            (axolotl's NeMo Gym dataset loader column). A missing or empty name makes that
            item fail (INVALID_ARGUMENT), not the batch.
        verify_extra: keyword, optional: one dataset row dict per item (axolotl's loader
            column: the whole NeMo Gym row, None-filled by Arrow; None values are dropped and
            the row's own `responses_create_params` is used).
        **kwargs: other dataset columns and TRL arguments, ignored.

    Bridge: `NEMO_GYM_GRPC_TARGET` ("host:port") if set; otherwise an embedded bridge started
    on first use that discovers resources servers from the NeMo Gym head server at
    `NEMO_GYM_HEAD_URL` (default http://127.0.0.1:11000). Per-item `/verify` timeout: the
    bridge's default (30 s unless the bridge sets another). Whole-batch deadline:
    `NEMO_GYM_GRPC_BATCH_TIMEOUT` (default 600 s). The Responses object carries model
    "axolotl", as in the seed.

    Returns:
        list[float | None], one per completion, in input order.

    Raises:
        ValueError: `resources_server_ref` missing, a column's length differs from the number
            of completions, or an env var holds an invalid number.
        TypeError: a completion, prompt or row has an unusable shape.
        RuntimeError: the embedded bridge could not be started.
        client.ProtocolError: the bridge's results do not match the items sent.
    """
    return _score(
        completions,
        prompts,
        kwargs,
        model=SEED_MODEL,
        timeout_seconds=0.0,
        target=settings.target(),
        spec=lambda: embedded.BridgeSpec(head_url=settings.head_url()),
        batch_timeout=None,
    )


def _base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/verify")] if url.endswith("/verify") else url


def create_nemo_gym_reward_fn(
    global_config: Mapping[str, Any] | None,
    verify_endpoints: Mapping[str, str],
    model_name: str = "axolotl-model",
    verify_timeout: float = 30,
    *,
    target: str | None = None,
    batch_timeout: float | None = None,
) -> Callable[..., list[float | None]]:
    """A reward function bound to explicit `/verify` endpoints (axolotl's plugin uses this).

    Args:
        global_config: NeMo Gym's global config dict; accepted for signature compatibility
            with axolotl and not read (routing comes from `verify_endpoints`).
        verify_endpoints: {resources server name: "http://host:port/verify"}. The base URL
            (the endpoint without its trailing "/verify") is what the bridge calls.
        model_name: `model` written into the Responses object built from each completion.
        verify_timeout: seconds per upstream `/verify` call (sent with every item, and the
            embedded bridge's default).
        target: keyword-only: "host:port" of a running bridge. Default: the
            `NEMO_GYM_GRPC_TARGET` env var at call time; if that is unset too, an embedded
            bridge routing exactly `verify_endpoints` (`--server NAME=BASE_URL` each, no head
            server discovery) is started on first use. A running bridge routes by its own
            table; `verify_endpoints` then only serve the embedded case.
        batch_timeout: keyword-only: gRPC deadline in seconds for one call's batch; default
            `NEMO_GYM_GRPC_BATCH_TIMEOUT` at call time (600 s).

    Returns:
        A function `nemo_gym(completions, prompts=None, **kwargs) -> list[float | None]`
        taking the same arguments as `reward_nemo_gym_verify`, with the same errors.
    """
    spec = embedded.BridgeSpec(
        head_url=None,
        servers=tuple(sorted((name, _base_url(url)) for name, url in verify_endpoints.items())),
        verify_timeout=float(verify_timeout),
    )

    def nemo_gym(completions, prompts=None, **kwargs):
        """NeMo Gym `/verify` rewards for the bound endpoints; see `create_nemo_gym_reward_fn`
        and `reward_nemo_gym_verify`. Returns list[float | None] in input order."""
        return _score(
            completions,
            prompts,
            kwargs,
            model=model_name,
            timeout_seconds=float(verify_timeout),
            target=target or settings.target(),
            spec=lambda: spec,
            batch_timeout=batch_timeout,
        )

    return nemo_gym


def _score(
    completions: Sequence[Any],
    prompts: Sequence[Any] | None,
    kwargs: Mapping[str, Any],
    *,
    model: str,
    timeout_seconds: float,
    target: str | None,
    spec: Callable[[], embedded.BridgeSpec],
    batch_timeout: float | None,
) -> list[float | None]:
    """Build the batch, send it over one VerifyStream, return rewards in input order."""
    batch_id = uuid.uuid4().hex[:16]
    batch = convert.build_batch(
        completions,
        prompts,
        kwargs.get("resources_server_ref"),
        kwargs.get("verify_extra"),
        model=model,
        timeout_seconds=timeout_seconds,
        batch_id=batch_id,
    )
    if not batch.requests:
        return []
    if batch.repaired:
        log.warning(
            "%d of %d items had text that is not valid Unicode (lone surrogates); "
            "replaced with U+FFFD before scoring (first: item %d)",
            len(batch.repaired),
            len(batch.requests),
            batch.repaired[0],
        )
    deadline = batch_timeout if batch_timeout is not None else settings.batch_timeout()
    connect = settings.connect_timeout()
    bridge = target or embedded.ensure_bridge(spec())
    outcomes = client.verify_batch(
        bridge, batch.requests, timeout=deadline, connect_timeout=connect
    )

    rewards: list[float | None] = []
    causes: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for outcome in outcomes:
        if isinstance(outcome, client.Failure):
            rewards.append(None)
            causes[outcome.cause] += 1
            examples.setdefault(outcome.cause, outcome.message)
        else:
            rewards.append(outcome.reward)
    if causes:
        summary = ", ".join(f"{cause} x{n}" for cause, n in causes.most_common())
        detail = "; ".join(f"{cause}: {message[:300]}" for cause, message in examples.items())
        log.warning(
            "%d of %d items failed (reward None; bridge %s, batch %s): %s. First of each: %s",
            sum(causes.values()),
            len(rewards),
            bridge,
            batch_id,
            summary,
            detail,
        )
    return rewards
