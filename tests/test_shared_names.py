"""Names the bridge and the trainer side both use, each declared on both sides (the bridge never
imports `nemo_gym_grpc.rewards`): the copies must stay equal."""

from __future__ import annotations

from nemo_gym_grpc.bridge import config, errors
from nemo_gym_grpc.rewards.client import channels, outcomes, settings


def test_the_token_variable_is_the_same_on_both_sides():
    assert settings.TOKEN_ENV == config.TOKEN_ENV


def test_the_message_limit_is_the_same_on_both_sides():
    assert channels.MAX_MESSAGE_BYTES == config.BridgeConfig().max_message_bytes


def test_the_client_reuses_the_bridge_reasons_it_sets_locally():
    assert outcomes.INVALID_ITEM == errors.INVALID_ITEM
    assert outcomes.ITEM_TOO_LARGE == errors.ITEM_TOO_LARGE


def test_client_only_reasons_do_not_collide_with_bridge_reasons():
    bridge_reasons = {
        value for name, value in vars(errors).items() if name.isupper() and isinstance(value, str)
    }
    assert errors.UPSTREAM_TIMEOUT in bridge_reasons  # the scan finds the reason constants
    assert {outcomes.INVALID_ROW, outcomes.NO_RESOURCES_SERVER}.isdisjoint(bridge_reasons)
