"""TRL/axolotl reward functions scoring with NeMo Gym through the gRPC bridge.

Same names and call shapes as axolotl's `axolotl.integrations.nemo_gym.rewards`, which these
replace. A reward function gets `completions`, `prompts` and every dataset column as keyword
arguments (one value per completion) and returns one value per completion, in input order:
the reward (float), or for an item that could not be scored what the failure policy says
(`client/policy.py`: None by default, or 0.0, or `ScoringError`).

One call = one `VerifyStream` RPC carrying the whole batch. The `*_async` forms do the same
over `grpc.aio` for TRL's async reward path. When TRL passes `log_metric` / `log_extra`, the
per-item extras (failures, reward components, numeric reply fields) go to them
(`logs.py`). Settings not given as keywords come from environment variables, read at
each call: see `client/settings.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_grpc.rewards.client import convert, embedded, policy, settings, stream
from nemo_gym_grpc.rewards.client.outcomes import Outcome
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.rewards.trl import logs
from nemo_gym_grpc.shared.contract import VERIFY_TIMEOUT
from nemo_gym_grpc.v1 import verify_pb2

# The `model` the seed's reward_nemo_gym_verify wrote into its Responses object.
SEED_MODEL = "axolotl"


def reward_env(
    completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Passthrough of a reward computed elsewhere (NeMo Gym agent `/run`, multi-turn).

    Reads the `env_reward` keyword argument, one per completion: the rollout's reward, which
    `create_nemo_gym_rollout_func` returns and TRL forwards (NaN for a failed rollout, which
    stays NaN), or axolotl's NeMo Gym data producer injects. A list or tuple gives
    `[float(r) for r in env_reward]`; a scalar is repeated once per completion. As axolotl's
    `reward_env`, except that a list entry of None (a rollout without a reward) stays None
    (TRL reads it as NaN), and that a missing `env_reward` or a list of another length than
    `completions` is an error, where axolotl gave 0.0 to every completion (a training run
    whose rollouts never reached this function would otherwise learn from zeros); no I/O.

    When TRL passes `log_extra` and the `rollout_error` column has one entry per completion,
    it is logged as the completions table's `reward_env/rollout_error` column.

    Returns:
        list[float | None], one per completion.

    Raises:
        ValueError: `env_reward` is missing or None (no rollout_func or data producer fills
            it), or is a list or tuple whose length differs from `completions`'.
    """
    env_rewards = kwargs.get("env_reward")
    errors, log_extra = kwargs.get("rollout_error"), kwargs.get("log_extra")
    if callable(log_extra) and isinstance(errors, (list, tuple)):
        if len(errors) == len(completions):
            log_extra("reward_env/rollout_error", list(errors))
    if env_rewards is not None:
        if isinstance(env_rewards, (list, tuple)):
            if len(env_rewards) != len(completions):
                raise ValueError(
                    f"env_reward has {len(env_rewards)} entries for {len(completions)} completions"
                )
            return [None if r is None else float(r) for r in env_rewards]
        return [float(env_rewards) for _ in completions]
    raise ValueError(
        "reward_env needs the env_reward column (one reward per completion), which "
        "create_nemo_gym_rollout_func returns or axolotl's NeMo Gym data producer adds; "
        "it is missing, so the rollouts' rewards never reached this function"
    )


def reward_nemo_gym_verify(
    completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
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
        log_metric, log_extra: keyword, optional: TRL's callbacks; given, they receive the
            failed fraction, latency, `reward_components` and numeric reply fields
            (see `nemo_gym_grpc.rewards.trl.logs`).
        **kwargs: other dataset columns and TRL arguments, ignored.

    Settings: the environment variables of `nemo_gym_grpc.rewards.client.settings` (target, TLS,
    token, head server, timeouts, failure policy), read at each call. Per-item `/verify`
    timeout: the bridge's default. The Responses object carries model "axolotl", as in the
    seed.

    Returns:
        list[float | None], one per completion, in input order: the reward, or for a failed
        item None (on_error=none) or 0.0 (on_error=zero).

    Raises:
        ScoringError: on_error=raise and an item failed, or more than the allowed fraction of
            the items failed (the message counts failures by cause).
        ValueError: `resources_server_ref` missing, a column's length differs from the number
            of completions, or an env var holds an invalid value (e.g. an unreadable
            `NEMO_GYM_GRPC_CA` file).
        TypeError: a completion, prompt or row has an unusable shape.
        RuntimeError: the embedded bridge could not be started.
        outcomes.ProtocolError: the bridge's results do not match the items sent.
    """
    return _score(_VERIFY, completions, prompts, kwargs)


async def reward_nemo_gym_verify_async(
    completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """`reward_nemo_gym_verify` as a coroutine function, for TRL's async reward path.

    TRL (1.8 and newer) runs `async def` reward functions on its own event loop, alongside
    other async reward functions; load it by dotted path
    (`nemo_gym_grpc.rewards.reward_nemo_gym_verify_async`) or pass it in `reward_funcs`.
    Uses `grpc.aio` with a channel per call, so it may be awaited from any event loop in any
    thread (several loops in turn, or at once). Starting an embedded bridge, the only
    blocking step, runs in a worker thread.

    Arguments, settings, return value and errors: as `reward_nemo_gym_verify`.
    """
    return await _score_async(_VERIFY_ASYNC, completions, prompts, kwargs)


def _base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/verify")] if url.endswith("/verify") else url


def create_nemo_gym_reward_fn(
    global_config: Mapping[str, Any] | None,
    verify_endpoints: Mapping[str, str],
    model_name: str = "axolotl-model",
    verify_timeout: float = VERIFY_TIMEOUT,
    *,
    target: str | None = None,
    batch_timeout: float | None = None,
    on_error: str | None = None,
    max_failure_fraction: float | None = None,
    asynchronous: bool = False,
) -> Callable[..., list[float | None]] | Callable[..., Awaitable[list[float | None]]]:
    """A reward function bound to explicit `/verify` endpoints (axolotl's plugin uses this).

    Keyword-only settings left None take their environment variable (`client/settings.py`) at each
    call.

    Args:
        global_config: NeMo Gym's global config dict; accepted for signature compatibility
            with axolotl and not read (routing comes from `verify_endpoints`).
        verify_endpoints: {resources server name: "http://host:port/verify"}. The base URL
            (the endpoint without its trailing "/verify") is what the bridge calls.
        model_name: `model` written into the Responses object built from each completion.
        verify_timeout: seconds per upstream `/verify` call (sent with every item, and the
            embedded bridge's default).
        target: keyword-only: gRPC target of a running bridge (TLS and token from the
            environment). Default: `NEMO_GYM_GRPC_TARGET`; if that is unset too, an embedded
            bridge routing exactly `verify_endpoints` (`--server NAME=BASE_URL` each, no head
            server discovery) is started on first use. A running bridge routes by its own
            table; `verify_endpoints` then only serve the embedded case.
        batch_timeout: keyword-only: gRPC deadline in seconds for one call's batch
            (`NEMO_GYM_GRPC_BATCH_TIMEOUT`).
        on_error: keyword-only: "none", "zero" or "raise" (`client/policy.py`;
            `NEMO_GYM_GRPC_ON_ERROR`).
        max_failure_fraction: keyword-only: the call raises `ScoringError` when more than
            this fraction (0..1) of its items failed (`client/policy.py`;
            `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION`).
        asynchronous: keyword-only: return a coroutine function (grpc.aio; for TRL's async
            reward path, see `reward_nemo_gym_verify_async`) instead of a plain one.

    Returns:
        A function `nemo_gym(completions, prompts=None, **kwargs) -> list[float | None]`
        (an `async def` one if `asynchronous`) taking the same arguments as
        `reward_nemo_gym_verify`, with the same errors.

    Raises:
        ValueError: `on_error` or `max_failure_fraction` is out of range, or
            `verify_timeout` / `batch_timeout` is not a positive finite number of seconds.
    """
    scorer = _Scorer.for_endpoints(verify_endpoints, model_name, verify_timeout, target)
    scorer.batch_timeout = settings.optional(settings.check_seconds, batch_timeout, "batch_timeout")
    scorer.on_error = settings.optional(settings.check_on_error, on_error, "on_error")
    scorer.max_failure_fraction = settings.optional(
        settings.check_fraction, max_failure_fraction, "max_failure_fraction"
    )
    return _bound_async(scorer) if asynchronous else _bound(scorer)


def _bound(scorer: _Scorer) -> Callable[..., list[float | None]]:
    def nemo_gym(
        completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        """NeMo Gym `/verify` rewards for the bound endpoints; see `create_nemo_gym_reward_fn`
        and `reward_nemo_gym_verify`. Returns list[float | None] in input order."""
        return _score(scorer, completions, prompts, kwargs)

    return nemo_gym


def _bound_async(scorer: _Scorer) -> Callable[..., Awaitable[list[float | None]]]:
    async def nemo_gym(
        completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        """NeMo Gym `/verify` rewards for the bound endpoints (coroutine, grpc.aio); see
        `create_nemo_gym_reward_fn` and `reward_nemo_gym_verify`. Returns
        list[float | None] in input order."""
        return await _score_async(scorer, completions, prompts, kwargs)

    return nemo_gym


@dataclass
class _Scorer:
    """How one reward function scores: its fixed settings (None = read the env var at call
    time) and its extras log."""

    name: str
    model: str
    timeout_seconds: float
    spec: Callable[[], embedded.BridgeSpec]
    target: str | None = None
    batch_timeout: float | None = None
    on_error: str | None = None
    max_failure_fraction: float | None = None
    extras_log: logs.ExtrasLog = field(init=False)

    def __post_init__(self) -> None:
        self.extras_log = logs.ExtrasLog(self.name)

    @classmethod
    def for_endpoints(
        cls,
        verify_endpoints: Mapping[str, str],
        model_name: str,
        verify_timeout: float,
        target: str | None,
    ) -> _Scorer:
        """The scorer of `create_nemo_gym_reward_fn`: its embedded bridge routes exactly
        `verify_endpoints`. Raises ValueError for a bad `verify_timeout`."""
        verify_timeout = settings.check_seconds(verify_timeout, "verify_timeout")
        endpoints = sorted((name, _base_url(url)) for name, url in verify_endpoints.items())
        spec = embedded.BridgeSpec(servers=tuple(endpoints), verify_timeout=verify_timeout)
        return cls("nemo_gym", model_name, verify_timeout, lambda: spec, target)

    def prepare(self, completions: Sequence[Any], prompts: Any, kwargs: Mapping[str, Any]) -> _Job:
        """Validate the arguments and settings and build the batch (no I/O)."""
        batch = convert.build_batch(
            completions,
            prompts,
            kwargs.get("resources_server_ref"),
            kwargs.get("verify_extra"),
            model=self.model,
            timeout_seconds=self.timeout_seconds,
            batch_id=uuid.uuid4().hex[:16],
            include_reply=logs.wanted(kwargs),
        )
        return _Job(
            batch=batch,
            route=Route.resolve(
                target=self.target,
                timeout=settings.resolve(self.batch_timeout, settings.batch_timeout),
                spec=self.spec,
            ),
            on_error=settings.resolve(self.on_error, settings.on_error),
            max_failure_fraction=settings.resolve(
                self.max_failure_fraction, settings.max_failure_fraction
            ),
        )

    def finish(
        self, job: _Job, sent: Mapping[str, Outcome], kwargs: Mapping[str, Any]
    ) -> list[float | None]:
        """Rewards in input order under the failure policy; extras to TRL's callbacks."""
        outcomes = job.batch.outcomes(sent)
        rewards = policy.apply(
            outcomes,
            on_error=job.on_error,
            max_failure_fraction=job.max_failure_fraction,
            where=f"bridge {job.route.label}, batch {job.batch.batch_id}",
        )
        self.extras_log.emit(outcomes, kwargs)
        return rewards


@dataclass
class _Job:
    batch: convert.Batch[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse]
    route: Route
    on_error: str
    max_failure_fraction: float


# One per dotted-path function: the name keys its extras (TRL names metrics by `__name__`).
_VERIFY = _Scorer("reward_nemo_gym_verify", SEED_MODEL, 0.0, embedded.head_server_spec)
_VERIFY_ASYNC = _Scorer("reward_nemo_gym_verify_async", SEED_MODEL, 0.0, embedded.head_server_spec)


def _score(
    scorer: _Scorer, completions: Sequence[Any], prompts: Any, kwargs: Mapping[str, Any]
) -> list[float | None]:
    """One call of a sync reward function: build, send over one VerifyStream, apply policy."""
    job = scorer.prepare(completions, prompts, kwargs)
    sent = job.route.send(stream.VERIFY, job.batch.requests)
    return scorer.finish(job, sent, kwargs)


async def _score_async(
    scorer: _Scorer, completions: Sequence[Any], prompts: Any, kwargs: Mapping[str, Any]
) -> list[float | None]:
    """`_score` for the coroutine functions (grpc.aio; an embedded bridge starts in a thread)."""
    job = scorer.prepare(completions, prompts, kwargs)
    sent = await job.route.asend(stream.VERIFY, job.batch.requests)
    return scorer.finish(job, sent, kwargs)
