"""Head-server discovery: the double-encoded /global_config_dict_yaml reply."""

from __future__ import annotations

import json

import pytest
import requests
import yaml

from nemo_gym_grpc.bridge.nemo_gym import parse_global_config


def test_real_head_server_reply_is_yaml_inside_a_json_string(nemo_gym):
    reply = requests.get(f"{nemo_gym.head_url}/global_config_dict_yaml", timeout=10)
    assert reply.headers["content-type"].startswith("application/json")
    assert isinstance(json.loads(reply.content), str)  # the first decode gives YAML text
    found = parse_global_config(reply.content, nemo_gym.head_url)
    assert {name: found[name] for name in nemo_gym.server_urls} == nemo_gym.server_urls


def _reply(config: dict) -> bytes:
    return json.dumps(yaml.safe_dump(config)).encode()


def test_wildcard_and_localhost_hosts_are_normalised_and_types_become_aliases():
    config = {
        "math": {"resources_servers": {"math_with_judge": {"host": "0.0.0.0", "port": 1234}}},
        "local": {"resources_servers": {"mcqa": {"host": "localhost", "port": 99}}},
        "v6": {"resources_servers": {"v6type": {"host": "::1", "port": 7}}},
        "a": {"resources_servers": {"shared": {"host": "127.0.0.1", "port": 1}}},
        "b": {"resources_servers": {"shared": {"host": "127.0.0.1", "port": 2}}},
        "policy": {"responses_api_models": {"m": {"host": "127.0.0.1", "port": 5}}},
        "head_server": {"host": "127.0.0.1", "port": 11000},
    }
    found = parse_global_config(_reply(config), "http://127.0.0.2:11000")
    assert found == {
        "math": "http://127.0.0.2:1234",
        "math_with_judge": "http://127.0.0.2:1234",
        "local": "http://127.0.0.1:99",
        "mcqa": "http://127.0.0.1:99",
        "v6": "http://[::1]:7",
        "v6type": "http://[::1]:7",
        "a": "http://127.0.0.1:1",
        "b": "http://127.0.0.1:2",
    }  # "shared" is ambiguous (two servers), so it is no alias; models are no upstreams


@pytest.mark.parametrize("body", [b'{"not": "a string"}', json.dumps("- a list").encode()])
def test_malformed_replies_raise_value_error(body):
    with pytest.raises(ValueError):
        parse_global_config(body, "http://127.0.0.1:11000")
