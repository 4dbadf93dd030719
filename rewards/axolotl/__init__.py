"""axolotl integration: `NemoGymPlugin`, a drop-in for axolotl's own NeMo Gym plugin.

    plugins:
      - nemo_gym_grpc.rewards.axolotl.NemoGymPlugin   # was axolotl.integrations.nemo_gym...

Same `nemo_gym_*` keys, same dataset loader and server handling (axolotl's, inherited);
scoring (single-turn) and rollouts (multi-turn, axolotl's data producer) go through the
bridge, failures are NaN and masked, never 0.0. docs/axolotl.md has both YAML configs.
Modules: `plugin` (the plugin), `producer` (the data producer), `batch` (rollouts -> the
trainer's batch), `wiring` (one NeMo Gym reward function per trainer). Needs axolotl 0.21
(Python >= 3.12); importing this package imports axolotl.
"""

from nemo_gym_grpc.rewards.axolotl.plugin import NemoGymPlugin

__all__ = ["NemoGymPlugin"]
