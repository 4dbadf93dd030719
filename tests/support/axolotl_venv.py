"""Real axolotl 0.21.0 for the tests (trainer_venv.py: a cached base venv and a per-checkout
overlay with this package): tests/locks/axolotl-0.21.0.txt, overlay build/axolotl-venv.

    python = ensure_axolotl()   # Path of <checkout>/build/axolotl-venv/bin/python
"""

from __future__ import annotations

from pathlib import Path

from tests.support.trainer_venv import Trainer, ensure

AXOLOTL = Trainer(
    name="axolotl",
    version="0.21.0",
    build_cost="about 7 minutes and 6.2 GB of disk on a 2-core machine (measured 2026-12)",
    imports=("torch", "trl", "axolotl.cli.train", "axolotl.integrations.nemo_gym"),
    ours="nemo_gym_grpc.rewards.axolotl",
    python_env="AXOLOTL_PYTHON",
)
AXOLOTL_VERSION = AXOLOTL.version
OVERLAY = AXOLOTL.overlay


def ensure_axolotl(timeout: float = 3600.0) -> Path:
    """The overlay's interpreter: axolotl 0.21.0 with this checkout's package."""
    return ensure(AXOLOTL, timeout)
