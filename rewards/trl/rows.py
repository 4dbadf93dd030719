"""From TRL's prompts back to the dataset rows: a TRL `rollout_func` gets only the prompts, so
each prompt is looked up among the dataset rows by its `prompt` value (equal JSON, `RowIndex`).

The NeMo Gym row of a dataset row (`nemo_gym_row`) is its `row_column` (axolotl's NeMo Gym
dataset loader stores the whole NeMo Gym row in `verify_extra`, as a dict or as JSON text), or,
for a dataset without that column, the dataset row without its `prompt`. Rows whose prompts are
equal must be equal too (else the lookup raises: it could not tell them apart).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from nemo_gym_grpc.rewards.client.convert import json_object


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
        inner = json_object(inner, f"the {row_column!r} column")
    if isinstance(inner, Mapping):
        return dict(inner)
    return {key: value for key, value in dataset_row.items() if key != "prompt"}


def trainer_datasets(trainer: Any) -> list[Any]:
    """The trainer's `train_dataset` and `eval_dataset` (each of a dict of them), those set.

    Raises:
        TypeError: a dataset is iterable only (no length).
    """
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
