"""`create_nemo_gym_rollout_func`: TRL's `GRPOTrainer(rollout_func=...)` running each prompt as
a NeMo Gym rollout through the bridge (agent `/run` or environment server episode).

What TRL 1.16 does around it (`trl/trainer/grpo_trainer.py`, `_generate`): it calls
`rollout_func(prompts, trainer)` with this process's slice of the batch. Its sampler
(`RepeatSampler`, `mini_repeat_count=num_generations`) has already repeated every dataset row
`num_generations` times, consecutively, so `prompts` holds each prompt `num_generations` times
(or its share of them on this process) and the function runs exactly one rollout per entry:
`num_generations` rollouts per dataset row in all, none duplicated. It must return, one entry
per prompt, `prompt_ids`, `completion_ids` and `logprobs`, and may return `env_mask` (1 =
trained on); TRL forwards every other key to the reward functions as a keyword argument, one
value per completion. This function returns `env_mask`, `env_reward` (the rollout's reward,
NaN for a failed rollout), `num_turns` and `rollout_error` (None, or the failure's cause, e.g.
"UNAVAILABLE (AGENT_UNAVAILABLE)"), so `reward_funcs=[reward_env]` trains on the agent's
rewards. Tokens are stitched across turns as `stitch.py` says.

From prompt to dataset row: TRL passes only the prompts, so each prompt is looked up among the
dataset rows by its `prompt` value (equal JSON, see `RowIndex`): the trainer's own
`train_dataset` and `eval_dataset` by default, or the `rows` given. The NeMo Gym row sent to the
agent is the dataset row's `row_column` (default `verify_extra`, the whole NeMo Gym row as
axolotl's NeMo Gym dataset loader stores it, as a dict or as JSON text), or, for a dataset
without that column, the dataset row without its `prompt`. Its agent is its
`agent_ref.name`, else `agent`. Rows whose prompts are equal must be equal too (else the
lookup raises: it could not tell them apart).

A failed rollout (any `Failure`, a masked sample, tokens that cannot be stitched) becomes
`stitch.failed_sample`: a one-token EOS completion with `env_mask` 0 and reward NaN. It never
trains, and TRL leaves it out of the group baseline (its advantage is 0). When more than
`max_failure_fraction` of one call's rollouts failed, the call raises `ScoringError` instead:
that is an outage, not a training signal.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nemo_gym_grpc.rewards import policy, rollouts, settings
from nemo_gym_grpc.rewards.outcomes import Failure, RunOutcome
from nemo_gym_grpc.rewards.stitch import Sample, StitchError, failed_sample, stitch

log = logging.getLogger("nemo_gym_grpc.rewards")

RolloutFunc = Callable[[list[Any], Any], dict[str, list[Any]]]


def prompt_key(prompt: Any) -> str:
    """The lookup key of a TRL prompt (text, or a list of message dicts): its JSON with sorted
    keys, so equal prompts have equal keys however their dicts were built."""
    return json.dumps(prompt, sort_keys=True, default=repr)


class RowIndex:
    """Dataset rows by their `prompt`: the one way from TRL's prompts back to the rows.

    Args:
        dataset_rows: dicts each with a `prompt` (a `datasets.Dataset`, a list, ...).

    Raises:
        ValueError: a row has no `prompt`.
    """

    def __init__(self, dataset_rows: Iterable[Mapping[str, Any]]) -> None:
        self._rows: dict[str, list[Mapping[str, Any]]] = {}
        for index, row in enumerate(dataset_rows):
            if "prompt" not in row:
                raise ValueError(f"dataset row {index} has no `prompt` column")
            same = self._rows.setdefault(prompt_key(row["prompt"]), [])
            if row not in same:
                same.append(row)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, prompt: Any) -> Mapping[str, Any]:
        """The dataset row whose `prompt` equals `prompt`.

        Raises:
            KeyError: no row has this prompt.
            ValueError: rows that differ have this prompt.
        """
        rows = self._rows.get(prompt_key(prompt))
        if not rows:
            raise KeyError(f"no dataset row has the prompt {prompt!r:.200}")
        if len(rows) > 1:
            raise ValueError(
                f"{len(rows)} different dataset rows have the prompt {prompt!r:.200}; a "
                "rollout_func gets only the prompt, so rows must differ in their prompts"
            )
        return rows[0]


def nemo_gym_row(dataset_row: Mapping[str, Any], row_column: str) -> dict[str, Any]:
    """The NeMo Gym row of a dataset row: its `row_column` when that is a dict or the JSON
    text of one (text keeps Arrow from filling other rows' keys in with None), else the
    dataset row without `prompt`.

    Raises:
        ValueError: `row_column` holds text that is not a JSON object.
    """
    inner = dataset_row.get(row_column)
    if isinstance(inner, str):
        try:
            inner = json.loads(inner)
        except ValueError:
            inner = None
        if not isinstance(inner, Mapping):
            raise ValueError(f"the {row_column!r} column holds text that is not a JSON object")
    if isinstance(inner, Mapping):
        return dict(inner)
    return {key: value for key, value in dataset_row.items() if key != "prompt"}


def _datasets(trainer: Any) -> list[Any]:
    found = [getattr(trainer, "train_dataset", None)]
    evaluation = getattr(trainer, "eval_dataset", None)
    found += list(evaluation.values()) if isinstance(evaluation, Mapping) else [evaluation]
    for dataset in found:
        if dataset is not None and not hasattr(dataset, "__len__"):
            raise TypeError(
                "the trainer's dataset is iterable only (no length); pass its rows to "
                "create_nemo_gym_rollout_func(rows=...)"
            )
    return [dataset for dataset in found if dataset is not None]


def eos_token_id(trainer: Any) -> int:
    """The EOS token id of the trainer's tokenizer (`processing_class`, or its `tokenizer`).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ValueError("the trainer's tokenizer has no eos_token_id (a failed rollout needs one)")
    return eos


def sample_of(outcome: RunOutcome) -> Sample | Failure:
    """The training sample of a rollout's outcome, or why there is none (a `Failure`, its
    own or INTERNAL with the `StitchError`'s reason)."""
    if isinstance(outcome, Failure):
        return outcome
    try:
        return stitch(outcome.rollout.turns)
    except StitchError as exc:
        return Failure("INTERNAL", exc.reason, str(exc))


def rollout_output(
    outcomes: Sequence[RunOutcome], eos: int, failures: dict[int, Failure] | None = None
) -> dict[str, list[Any]]:
    """TRL's `rollout_func` return value for `outcomes` (one per prompt, in prompt order);
    `failures`, if given, receives index -> `Failure` of each failed rollout.

    Returns:
        {"prompt_ids", "completion_ids", "logprobs", "env_mask": lists per sample;
        "env_reward": float per sample (NaN for a failure); "num_turns": int per sample;
        "rollout_error": None or the failure's cause per sample}.
    """
    output: dict[str, list[Any]] = {
        key: []
        for key in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            "env_reward",
            "num_turns",
            "rollout_error",
        )
    }
    for index, outcome in enumerate(outcomes):
        sample = sample_of(outcome)
        if isinstance(sample, Failure):
            if failures is not None:
                failures[index] = sample
            error: str | None = sample.cause
            reward = math.nan
            sample = failed_sample(eos)
        else:
            error = None
            reward = outcome.rollout.reward  # type: ignore[union-attr]
        output["prompt_ids"].append(sample.prompt_ids)
        output["completion_ids"].append(sample.completion_ids)
        output["logprobs"].append(sample.logprobs)
        output["env_mask"].append(sample.env_mask)
        output["env_reward"].append(reward)
        output["num_turns"].append(sample.num_turns)
        output["rollout_error"].append(error)
    return output


def _guard(failures: Mapping[int, Failure], total: int, fraction: float, where: str) -> None:
    """Raise `ScoringError` above `fraction` of `total` failed; warn once about any failure."""
    if not failures:
        return
    head = f"{len(failures)} of {total} rollouts failed"
    if len(failures) / total > fraction:
        raise policy.ScoringError(
            f"{head}, more than max_failure_fraction={fraction:g} allows ({where}): "
            f"{policy.summary(failures)}",
            failures,
            total,
        )
    log.warning("%s (reward NaN, completion masked; %s): %s", head, where, policy.summary(failures))


def run_rows(
    rows: Sequence[Mapping[str, Any]],
    prompts: Sequence[Any],
    trainer: Any,
    *,
    agent: str | None = None,
    target: str | None = None,
    batch_timeout: float | None = None,
    run_timeout: float | None = None,
    trainer_sampling: bool = True,
    max_failure_fraction: float | None = None,
    where: str = "rollouts",
) -> dict[str, list[Any]]:
    """NeMo Gym rows (one per prompt, already looked up) run as rollouts for a GRPO trainer:
    the part `rollout_func` and axolotl's data producer (`nemo_gym_grpc.rewards.axolotl`)
    share. Keywords as `create_nemo_gym_rollout_func`'s (None = the env var, read now);
    `where` names the caller in the failure message.

    Returns:
        `rollout_output`'s dict, one entry per row (failed rollouts: NaN, masked).

    Raises:
        ScoringError: more than `max_failure_fraction` of the rollouts failed.
        What `rollouts.run_rollouts` raises.
    """
    sampling = (
        {"temperature": float(trainer.temperature), "top_p": float(trainer.top_p)}
        if trainer_sampling
        else None
    )
    outcomes = rollouts.run_rollouts(
        rows,
        agent=agent,
        target=target,
        batch_timeout=batch_timeout,
        run_timeout=run_timeout,
        prompts=prompts,
        responses_create_params=sampling,
    )
    failures: dict[int, Failure] = {}
    output = rollout_output(outcomes, eos_token_id(trainer), failures)
    fraction = settings.resolve(max_failure_fraction, settings.max_failure_fraction)
    _guard(failures, len(rows), fraction, where)
    return output


def create_nemo_gym_rollout_func(
    agent: str | None = None,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    row_column: str = "verify_extra",
    target: str | None = None,
    batch_timeout: float | None = None,
    run_timeout: float | None = None,
    trainer_sampling: bool = True,
    max_failure_fraction: float | None = None,
) -> RolloutFunc:
    """A TRL `rollout_func` that runs each prompt as one NeMo Gym rollout (see the module
    docstring for what TRL passes, the row lookup and the failure rules).

    Keyword settings left None take their environment variable (`settings.py`) at each call.

    Args:
        agent: the agent (or environment server) for rows without `agent_ref.name`.
        rows: keyword: dataset rows to look prompts up in (dicts with `prompt`); default the
            trainer's `train_dataset` and `eval_dataset`, read at the first call.
        row_column: keyword: the dataset column holding the NeMo Gym row.
        target: keyword: the bridge's gRPC target (`NEMO_GYM_GRPC_TARGET`; unset too = an
            embedded bridge over the head server).
        batch_timeout: keyword: gRPC deadline of one call's `RunStream`, seconds
            (`NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT`, 10800).
        run_timeout: keyword: seconds per rollout's `/run` (`NEMO_GYM_GRPC_RUN_TIMEOUT`).
        trainer_sampling: keyword: set `temperature` and `top_p` of every row's
            `responses_create_params` to the trainer's (`GRPOConfig.temperature`, `top_p`),
            so the agent's policy model samples as the trainer assumes. Default True.
        max_failure_fraction: keyword: raise `ScoringError` when more than this fraction of
            one call's rollouts failed (`NEMO_GYM_GRPC_MAX_FAILURE_FRACTION`, 0.5).

    Returns:
        `rollout_func(prompts, trainer) -> dict` for `GRPOTrainer(rollout_func=...)`.

    Raises:
        ValueError: a keyword is out of range (at creation); at a call: a prompt matches no
            row (KeyError) or several different rows, a setting's env var is invalid.
        ScoringError: at a call: too many rollouts failed.
    """
    if batch_timeout is not None:
        batch_timeout = settings.check_seconds(batch_timeout, "batch_timeout")
    if run_timeout is not None:
        run_timeout = settings.check_seconds(run_timeout, "run_timeout")
    if max_failure_fraction is not None:
        max_failure_fraction = settings.check_fraction(max_failure_fraction)
    given = RowIndex(rows) if rows is not None else None
    built: dict[int, tuple[Any, RowIndex]] = {}  # id(trainer) -> (trainer, its index)

    def index_for(trainer: Any) -> RowIndex:
        if given is not None:
            return given
        entry = built.get(id(trainer))
        if entry is None or entry[0] is not trainer:
            dataset_rows = [row for dataset in _datasets(trainer) for row in dataset]
            entry = built[id(trainer)] = (trainer, RowIndex(dataset_rows))
        return entry[1]

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """NeMo Gym rollouts for TRL's `prompts` (one per entry); see
        `create_nemo_gym_rollout_func`."""
        index = index_for(trainer)
        return run_rows(
            [nemo_gym_row(index.row(prompt), row_column) for prompt in prompts],
            prompts,
            trainer,
            agent=agent,
            target=target,
            batch_timeout=batch_timeout,
            run_timeout=run_timeout,
            trainer_sampling=trainer_sampling,
            max_failure_fraction=max_failure_fraction,
            where=f"rollout_func, {len(prompts)} prompts",
        )

    return rollout_func
