"""Everything the bridge knows about NeMo Gym's HTTP API, and the only package that does. Its
modules are imported by name; this package re-exports nothing.

Routes the bridge calls: `POST /verify` (`verify.py`), `POST /seed_session` and
`POST /close_session` (`sessions.py`) on a resources server, each under 0.7's
`/ng-rollout/<id>` prefix (`correlation.py`, with rollout ids and the `EpisodeId`) where the
server has it; `POST /run` on an agent server (`run.py`) and on an environment server
(`episodes.py`), plain (neither has a prefixed route); `GET /openapi.json` and
`/reverify_mode` to learn what a server supports (`capabilities.py`); `GET /` as its liveness
probe (`http.py`, with the POST itself and its error mapping), and the head server's
`GET /global_config_dict_yaml` (`head.py`). What the verify and run bodies and replies share:
the row with its `responses_create_params` (`rows.py`) and the score in a reply (`scores.py`).
`codec.py` is the JSON codec of the bodies;
`reports.py` the failure report a later NeMo Gym may send (a reply header, an episode field),
passed on opaque and bounded. `plain_http.py` is the bridge's own HTTP/1.1 client;
`framing.py` the reply-header limits it shares with the aiohttp session, and `destinations.py`
the addresses either may dial.
"""
