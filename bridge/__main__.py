"""`python -m nemo_gym_grpc.bridge serve ...`"""

import sys

from nemo_gym_grpc.bridge.process.cli import main

sys.exit(main())
