"""Real skyrl 0.4.0 (SkyRL's trainer package: its generator types) for the tests
(trainer_venv.py: a cached base venv and a per-checkout overlay with this package):
tests/locks/skyrl-0.4.0.txt, overlay build/skyrl-venv. skyrl 0.4.0 needs Python >= 3.12, and
on PyPI torch for cp312 is the CUDA build, whose nvidia-* libraries make most of the base's
size; it runs on the CPU.

    python = ensure_skyrl()   # Path of <checkout>/build/skyrl-venv/bin/python
"""

from __future__ import annotations

from pathlib import Path

from tests.support.trainer_venv import Trainer, ensure

SKYRL = Trainer(
    name="skyrl",
    version="0.4.0",
    build_cost="about 70 s with pip's cache warm and 5.3 GB of disk (measured 2026-12)",
    imports=("torch", "skyrl_gym", "skyrl.train.generators.skyrl_gym_generator"),
    ours="nemo_gym_grpc.rewards.skyrl.generator",
    python_env="SKYRL_PYTHON",
)


def ensure_skyrl(timeout: float = 3600.0) -> Path:
    """The overlay's interpreter: skyrl 0.4.0 with this checkout's package."""
    return ensure(SKYRL, timeout)
