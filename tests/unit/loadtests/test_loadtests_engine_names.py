"""``whoseturn loadtest --target P --direct E``: an engine has the name the proxy gives
it. The timeline plot's legend is the proxy's ``/turn``, in the proxy's names; the
report's tables name the servers watched, so those take the proxy's names too (read
from its ``whoseturn_engine_info{engine,url}``)."""

from __future__ import annotations

import httpx

from loadtests.harness.loadtest import direct_names
from loadtests.harness.preflight import engine_names

METRICS = """\
# HELP whoseturn_engine_info The engine's URL, to join with its own metrics
# TYPE whoseturn_engine_info gauge
whoseturn_engine_info{engine="sim-0",url="http://127.0.0.1:8001"} 1.0
whoseturn_engine_info{engine="sim-1",url="http://127.0.0.1:8002/"} 1.0
whoseturn_engine_up{engine="sim-0"} 1.0
"""


def _proxy(status: int, text: str) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        return httpx.Response(status, text=text)

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_the_proxys_names_by_url() -> None:
    known = engine_names("http://proxy.test", _proxy(200, METRICS))
    assert known == {"http://127.0.0.1:8001": "sim-0", "http://127.0.0.1:8002": "sim-1"}
    assert engine_names("http://proxy.test", _proxy(401, '{"error": {}}')) == {}


def test_direct_engines_take_the_proxys_names() -> None:
    known = {"http://127.0.0.1:8001": "sim-0", "http://127.0.0.1:8002": "sim-1"}
    urls = ["http://127.0.0.1:8002", "http://127.0.0.1:8001"]
    assert direct_names(urls, known) == {"sim-1": urls[0], "sim-0": urls[1]}
    # an engine the proxy does not serve keeps its place's name
    assert direct_names(["http://127.0.0.1:8001", "http://other:9"], known) == {
        "sim-0": "http://127.0.0.1:8001",
        "engine-1": "http://other:9",
    }
    assert direct_names(urls, {}) == {"engine-0": urls[0], "engine-1": urls[1]}


def test_names_stay_distinct() -> None:
    known = {"http://a:1": "engine-1"}
    assert direct_names(["http://a:1", "http://b:2"], known) == {
        "engine-0": "http://a:1",
        "engine-1": "http://b:2",
    }
