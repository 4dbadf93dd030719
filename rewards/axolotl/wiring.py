"""One NeMo Gym reward function per GRPO trainer: put the plugin's in, take every other out.

axolotl's NeMo Gym plugin always appends its own reward function to `trainer.reward_funcs`,
so a config that also lists one in `trl.reward_funcs` (which axolotl's own examples do) scores
every completion twice and logs the sum. Here the plugin's function takes the place of the
first NeMo Gym reward function the trainer already has (keeping the order of the reward
columns and `trl.reward_weights`), the others are removed, and one warning says so.
Without one, it is appended with weight 1.0. No axolotl import: works on any TRL
`GRPOTrainer` (its `reward_funcs`, `reward_func_names`, `reward_processing_classes`,
`reward_weights`, TRL 1.14 and newer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("nemo_gym_grpc.rewards.axolotl")

# The reward column's name in TRL's metrics (`rewards/nemo_gym/mean`), as axolotl's plugin.
NAME = "nemo_gym"
# Modules whose reward functions are NeMo Gym ones: this package's and axolotl's integration.
NEMO_GYM_MODULES = ("nemo_gym_grpc.rewards", "axolotl.integrations.nemo_gym")


def is_nemo_gym_reward(func: Any) -> bool:
    """Whether `func` is a NeMo Gym reward function (defined in one of NEMO_GYM_MODULES)."""
    module = getattr(func, "__module__", None) or ""
    return callable(func) and any(
        module == name or module.startswith(name + ".") for name in NEMO_GYM_MODULES
    )


def _qualified(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__name__', repr(func))}"


def install_reward(trainer: Any, func: Callable[..., Any], name: str = NAME) -> list[str]:
    """Make `func` (named `name`) the trainer's only NeMo Gym reward function.

    Returns:
        The qualified names of the NeMo Gym reward functions it replaced or removed
        (empty when `func` was appended, or was the only one listed).

    Raises:
        ValueError: the trainer's reward lists differ in length (not a TRL GRPOTrainer).
    """
    funcs = trainer.reward_funcs
    names = trainer.reward_func_names
    classes = trainer.reward_processing_classes
    weights = trainer.reward_weights
    if not len(funcs) == len(names) == len(classes) == len(weights):
        raise ValueError(
            f"the trainer's reward lists differ in length: {len(funcs)} reward_funcs, "
            f"{len(names)} names, {len(classes)} processing classes, {len(weights)} weights"
        )
    found = [index for index, existing in enumerate(funcs) if is_nemo_gym_reward(existing)]
    replaced = [_qualified(funcs[index]) for index in found]
    if not found:
        funcs.append(func)
        names.append(name)
        classes.append(None)
        trainer.reward_weights = torch.cat([weights, torch.ones(1, dtype=weights.dtype)])
        return replaced
    if len(found) == 1 and funcs[found[0]] is func:  # listed already: only its name changes
        names[found[0]], classes[found[0]] = name, None
        return []
    first, rest = found[0], set(found[1:])
    funcs[first], names[first], classes[first] = func, name, None
    keep = [index for index in range(len(funcs)) if index not in rest]
    funcs[:] = [funcs[index] for index in keep]
    names[:] = [names[index] for index in keep]
    classes[:] = [classes[index] for index in keep]
    trainer.reward_weights = weights[keep]
    log.warning(
        "NeMo Gym: the trainer had %s; the plugin's %r reward function (%s) takes the place "
        "of the first, so every completion is scored by NeMo Gym once",
        ", ".join(replaced),
        name,
        _qualified(func),
    )
    return replaced
