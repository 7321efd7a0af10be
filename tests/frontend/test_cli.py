"""``tidal serve`` flags of the serving path: API server count (and its default), stream
interval; bad values are refused with a message naming the flag."""

from __future__ import annotations

import pytest

from tidal.engine_core.config import EngineArgs
from tidal.frontend.cli import _api_server_count, _server_settings, build_parser
from tidal.frontend.server.api_servers import MAX_DEFAULT_API_SERVERS, default_api_server_count


def _serve(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_serving_flags_reach_the_settings():
    ns = _serve("--stream-interval", "4", "--api-server-count", "3")
    assert _server_settings(ns).stream_interval == 4
    assert _api_server_count(ns, EngineArgs()) == 3
    assert _server_settings(_serve()).stream_interval == 1


@pytest.mark.parametrize("flags, match", [
    (("--stream-interval", "0"), "--stream-interval must be >= 1"),
    (("--api-server-count", "0"), "--api-server-count must be >= 1"),
])
def test_bad_values_are_refused(flags, match):
    ns = _serve(*flags)
    with pytest.raises(SystemExit, match=match):
        _server_settings(ns)
        _api_server_count(ns, EngineArgs())


def test_default_api_server_count_follows_the_cores():
    assert default_api_server_count(1, cpus=2) == 1  # CI-sized machines: one process
    assert default_api_server_count(1, cpus=6) == 1
    assert default_api_server_count(1, cpus=16) == 6  # one H100 host
    assert default_api_server_count(2, cpus=16) == 6
    assert default_api_server_count(4, cpus=16) == 5
    assert default_api_server_count(1, cpus=128) == MAX_DEFAULT_API_SERVERS
