"""`NemoGymPlugin`: axolotl's NeMo Gym plugin with its scoring and rollouts done by the bridge.

A subclass of `axolotl.integrations.nemo_gym.NemoGymPlugin` (axolotl 0.21), so everything
else is axolotl's own: config keys and their validation (`NemoGymArgs`), NeMo Gym server
auto-start and head-server discovery (`register`), the dataset loader (`load_datasets`), the
vLLM weight-sync transport choice (`pre_model_load`, `post_trainer_create`). It replaces the
two methods that wire NeMo Gym into the trainer:

- single-turn (`_wire_single_turn`): the reward function is `create_nemo_gym_reward_fn`'s,
  one `VerifyStream` per batch, `nemo_gym_verify_timeout` sent with every item,
  `nemo_gym_model_name` as the Responses object's `model`, a failed item None (NaN), never
  0.0 (`NEMO_GYM_GRPC_ON_ERROR`, `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION` apply);
- multi-turn (`_wire_multi_turn`): the trainer's data producer becomes `NemoGymDataProducer`
  (`producer.py`; wrapped in axolotl's `AsyncDataProducer` with `trl.async_prefetch`), whose
  rollouts run over `RunStream` with `nemo_gym_run_timeout` per rollout, and the reward
  function is `reward_env` (the rollouts' rewards, NaN for a failed one).
In both, that function is the trainer's only NeMo Gym reward function (`wiring.py`), and a
completion it gives no reward (NaN) is left out of its group's baseline with advantage 0
(`advantages.py`; a trainer where that cannot be done is refused).

The bridge: `NEMO_GYM_GRPC_TARGET` when set, else an embedded one discovering the head
server at 127.0.0.1:`nemo_gym_head_port` (where axolotl's plugin finds it too). Multi-turn
also sets `trl.use_data_producer: true` (axolotl chooses its async GRPO trainer from the
config before any plugin hook could), so the YAML needs nothing more than axolotl's keys.

No DataLoader forks worker processes (`get_training_args`), and the data producer stops when
training ends (`stop_production`): a run ends with exit 0 once its model is saved.
"""

from __future__ import annotations

import logging
from typing import Any

from axolotl.core.trainers.grpo.async_trainer import AsyncDataProducer
from axolotl.integrations.nemo_gym.plugin import NemoGymPlugin as AxolotlNemoGymPlugin
from transformers import TrainerCallback

from nemo_gym_grpc.rewards.axolotl import advantages
from nemo_gym_grpc.rewards.axolotl.producer import (
    NemoGymDataProducer,
    RolloutSettings,
    stop_production,
)
from nemo_gym_grpc.rewards.axolotl.wiring import install_reward
from nemo_gym_grpc.rewards.client import embedded, settings
from nemo_gym_grpc.rewards.trl.functions import create_nemo_gym_reward_fn, reward_env
from nemo_gym_grpc.shared.contract import DEFAULT_HEAD_PORT, DEFAULT_HEAD_URL

log = logging.getLogger("nemo_gym_grpc.rewards.axolotl")

DEFAULT_RUN_TIMEOUT = 300.0  # axolotl's nemo_gym_run_timeout default, seconds


class NemoGymPlugin(AxolotlNemoGymPlugin):
    """axolotl plugin `nemo_gym_grpc.rewards.axolotl.NemoGymPlugin` (see the module
    docstring): `plugins: [nemo_gym_grpc.rewards.axolotl.NemoGymPlugin]` with axolotl's
    `nemo_gym_*` keys."""

    def __init__(self) -> None:
        super().__init__()
        self._head_url = DEFAULT_HEAD_URL
        self._target: str | None = None

    def register(self, cfg: Any) -> None:
        """axolotl's `register` (servers, discovery); then, for multi-turn, turn on
        `trl.use_data_producer` in the config before axolotl validates it."""
        super().register(cfg)
        if not cfg.get("nemo_gym_enabled"):
            return
        self._head_url = f"http://127.0.0.1:{cfg.get('nemo_gym_head_port') or DEFAULT_HEAD_PORT}"
        if cfg.get("nemo_gym_multi_turn"):
            trl = cfg.get("trl")
            if trl is None:
                cfg["trl"] = trl = {}
            if not trl.get("use_data_producer"):
                trl["use_data_producer"] = True
                log.info("NeMo Gym multi-turn: trl.use_data_producer set (axolotl's data producer)")

    def get_training_args(self, cfg: Any) -> dict[str, Any] | None:
        """axolotl's training arguments, plus `dataloader_num_workers: 0` (and no
        `dataloader_prefetch_factor`) when NeMo Gym is on.

        axolotl's plugin means that too (it sets `cfg.dataloader_num_workers = 0` here), but
        axolotl has read the value before this hook, so its default 1 stayed: DataLoader
        workers were forked while the prefetch thread was inside a gRPC call, and of ten runs
        one hung in gRPC's fork handler and one exited 1 (filelock refused the fork); others
        exited 1 after saving the model (docs/rewards.md, processes that fork).
        """
        args = dict(super().get_training_args(cfg) or {})
        if cfg.get("nemo_gym_enabled"):  # (a prefetch factor is refused without workers)
            args.update(dataloader_num_workers=0, dataloader_prefetch_factor=None)
        return args or None

    def bridge_target(self, verify_timeout: float) -> str:
        """The bridge's gRPC target: `NEMO_GYM_GRPC_TARGET`, else an embedded bridge over the
        head server (started on first use; `verify_timeout` is its default per `/verify`).

        Raises:
            RuntimeError: the embedded bridge could not be started.
        """
        if self._target is None:
            spec = embedded.BridgeSpec(head_url=self._head_url, verify_timeout=verify_timeout)
            self._target = settings.target() or embedded.ensure_bridge(spec)
            log.info("NeMo Gym: scoring and rollouts through the bridge at %s", self._target)
        return self._target

    def _wire_single_turn(self, trainer: Any, model_name: str, verify_timeout: float) -> None:
        """Single-turn: the bridge's `/verify` reward function, the trainer's only one."""
        reward = create_nemo_gym_reward_fn(
            self._global_config,
            self._verify_endpoints or {},
            model_name=model_name,
            verify_timeout=verify_timeout,
            target=self.bridge_target(verify_timeout),
        )
        install_reward(trainer, reward)
        advantages.install(trainer)

    def _wire_multi_turn(
        self, cfg: Any, trainer: Any, model_name: str, verify_timeout: float
    ) -> None:
        """Multi-turn: `NemoGymDataProducer` in place of the trainer's data producer (kept
        async when it was), and `reward_env` as the only NeMo Gym reward function.

        Raises:
            ValueError: the trainer has no data producer (not axolotl's async GRPO trainer).
        """
        current = getattr(trainer, "data_producer", None)
        if current is None:
            raise ValueError(
                "NeMo Gym multi-turn needs axolotl's async GRPO trainer (trl.use_data_producer: "
                "true, which this plugin sets in register); the trainer has no data producer"
            )
        inner = current._inner if isinstance(current, AsyncDataProducer) else current
        producer = NemoGymDataProducer(
            config=inner.config,
            prompt_dataset=inner._dataset,
            num_generations=inner._num_generations,
            generation_batch_size=inner._generation_batch_size,
            train_batch_size=inner._train_batch_size,
            steps_per_generation=inner._steps_per_generation,
            shuffle_dataset=inner._shuffle_dataset,
            seed=inner._seed,
            rollouts=RolloutSettings(
                target=self.bridge_target(verify_timeout),
                run_timeout=float(cfg.get("nemo_gym_run_timeout") or DEFAULT_RUN_TIMEOUT),
                max_output_tokens=getattr(trainer, "max_completion_length", None),
            ),
        )
        producer.set_trainer(trainer)
        if getattr(trainer.args, "async_prefetch", False):
            trainer.data_producer = AsyncDataProducer(
                producer, background_produce_kwargs={"skip_policy_logps": True}
            )
        else:
            trainer.data_producer = producer
        trainer.add_callback(_EndProduction(trainer))
        install_reward(trainer, reward_env)
        advantages.install(trainer)
        log.info(
            "NeMo Gym multi-turn: rollouts over RunStream (async_prefetch=%s)",
            bool(getattr(trainer.args, "async_prefetch", False)),
        )


class _EndProduction(TrainerCallback):
    """Stops the trainer's NeMo Gym data producer when training ends (`stop_production`)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stop_production(self._trainer.data_producer)
