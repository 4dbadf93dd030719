"""axolotl integration: `NemoGymPlugin`, a drop-in for axolotl's own NeMo Gym plugin.

    plugins:
      - nemo_gym_grpc.rewards.axolotl.NemoGymPlugin   # was axolotl.integrations.nemo_gym...

Same `nemo_gym_*` keys, same dataset loader and server handling (axolotl's, inherited);
scoring (single-turn) and rollouts (multi-turn, axolotl's data producer) go through the
bridge, failures are NaN and masked, never 0.0. docs/axolotl.md has both YAML configs.
Modules: `plugin` (the plugin), `producer` (the data producer), `batch` (rollouts -> the
trainer's batch), `wiring` (one NeMo Gym reward function per trainer). Needs axolotl 0.21
(Python >= 3.12), imported when `NemoGymPlugin` is first looked up (the other modules
import no axolotl).
"""

from typing import Any

__all__ = ["NemoGymPlugin"]


def __getattr__(name: str) -> Any:
    if name == "NemoGymPlugin":
        from nemo_gym_grpc.rewards.axolotl.plugin import NemoGymPlugin

        return NemoGymPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
