"""`python -m nemo_gym_grpc.cli COMMAND ...`: the `nemo-gym-grpc` console script."""

import sys

from nemo_gym_grpc.cli import main

sys.exit(main())
