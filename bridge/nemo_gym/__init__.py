"""Everything the bridge knows about NeMo Gym's HTTP API, and the only package that does.

Routes the bridge calls: `POST /verify` (`verify.py`), `POST /seed_session` and
`POST /close_session` (`sessions.py`) on a resources server, each under 0.7's
`/ng-rollout/<id>` prefix where the server has it; `POST /run` on an agent server (`run.py`)
and on an environment server (`episodes.py`), plain (neither has a prefixed route);
`GET /openapi.json` and `/reverify_mode` to learn what a server supports
(`capabilities.py`); `GET /` as its liveness probe (`http.py`,
with the POST itself and its error mapping), and the head server's
`GET /global_config_dict_yaml` (`head.py`).
"""

from nemo_gym_grpc.bridge.nemo_gym.capabilities import (
    LEGACY,
    Capabilities,
    Catalog,
    read_openapi,
    rollout_prefix,
)
from nemo_gym_grpc.bridge.nemo_gym.head import (
    AGENT_SERVERS,
    GLOBAL_CONFIG_PATH,
    RESOURCES_SERVERS,
    global_servers,
    parse_global_config,
    parse_servers,
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
from nemo_gym_grpc.bridge.nemo_gym.sessions import (
    CLOSE_PATH,
    CLOSE_TIMEOUT,
    SEED_PATH,
    Closer,
    Opened,
    close_body,
    cookie_header,
    episode_id,
    new_session_id,
    open_session,
    seed_body,
    typed_seed_body,
)
from nemo_gym_grpc.bridge.nemo_gym.verify import (
    DEFAULT_MODEL,
    MAX_FAILURE_KIND,
    MAX_FAILURE_REASON,
    VERIFY_PATH,
    Scored,
    bad_reply,
    build_row,
    build_verify_body,
    completion_response,
    parse_reply,
    read_verify_reply,
    score_reply,
)

__all__ = [
    "AGENT_SERVERS",
    "RESOURCES_SERVERS",
    "CLOSE_PATH",
    "CLOSE_TIMEOUT",
    "DEFAULT_MODEL",
    "GLOBAL_CONFIG_PATH",
    "LEGACY",
    "LIVENESS_PATH",
    "MAX_FAILURE_KIND",
    "MAX_FAILURE_REASON",
    "REQUEST_ID_HEADER",
    "SEED_PATH",
    "VERIFY_PATH",
    "Capabilities",
    "Catalog",
    "Closer",
    "Opened",
    "Refused",
    "Reply",
    "Scored",
    "answers",
    "bad_reply",
    "build_row",
    "build_verify_body",
    "close_body",
    "completion_response",
    "cookie_header",
    "episode_id",
    "global_servers",
    "new_session_id",
    "open_session",
    "parse_global_config",
    "parse_reply",
    "parse_servers",
    "post",
    "read_openapi",
    "read_verify_reply",
    "request_id_header",
    "rollout_prefix",
    "score_reply",
    "seed_body",
    "typed_seed_body",
]
