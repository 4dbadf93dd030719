"""Everything the bridge knows about NeMo Gym's HTTP API, and the only package that does.

Routes the bridge calls: `POST /verify` (`verify.py`) and `POST /seed_session` (`sessions.py`)
on a resources server, `GET /` as its liveness probe (`http.py`, with the POST itself and its
error mapping), and the head server's `GET /global_config_dict_yaml` (`head.py`).
"""

from nemo_gym_grpc.bridge.nemo_gym.head import (
    GLOBAL_CONFIG_PATH,
    global_config,
    parse_global_config,
)
from nemo_gym_grpc.bridge.nemo_gym.http import (
    LIVENESS_PATH,
    REQUEST_ID_HEADER,
    Refused,
    Reply,
    answers,
    post,
    request_id_header,
)
from nemo_gym_grpc.bridge.nemo_gym.sessions import SEED_PATH, cookie_header, seed_body
from nemo_gym_grpc.bridge.nemo_gym.verify import (
    DEFAULT_MODEL,
    MAX_FAILURE_KIND,
    MAX_FAILURE_REASON,
    VERIFY_PATH,
    Scored,
    build_verify_body,
    completion_response,
    read_verify_reply,
)

__all__ = [
    "DEFAULT_MODEL",
    "GLOBAL_CONFIG_PATH",
    "LIVENESS_PATH",
    "MAX_FAILURE_KIND",
    "MAX_FAILURE_REASON",
    "REQUEST_ID_HEADER",
    "SEED_PATH",
    "VERIFY_PATH",
    "Refused",
    "Reply",
    "Scored",
    "answers",
    "build_verify_body",
    "completion_response",
    "cookie_header",
    "global_config",
    "parse_global_config",
    "post",
    "read_verify_reply",
    "request_id_header",
    "seed_body",
]
