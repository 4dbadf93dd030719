"""`python -m nemo_gym_grpc.rewards.tools COMMAND ...`: the `nemo-gym-grpc` console script."""

import sys

from nemo_gym_grpc.rewards.tools.cli import main

sys.exit(main())
