"""vLLM's sleep mode on the simulated engine: ``/sleep``, ``/wake_up`` and
``/is_sleeping`` over HTTP, each taking the profile's time; asleep, a request is
refused with 503; a sleep with requests in the engine is refused with 409; the
prefix cache is empty after a wake."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtests.sim.profile import Activation
from tests.integration.simserver import SimServer, run_server, sim_settings
from tests.support import MODEL

pytestmark = pytest.mark.integration

SCALE = 20.0
ACTIVATION = Activation(
    sleep_level1_s=4.0, wake_level1_s=10.0, sleep_level2_s=2.0, wake_level2_s=20.0
)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4}


@pytest.fixture
def sim() -> Iterator[SimServer]:
    settings = sim_settings(time_scale=SCALE)
    profile = dataclasses.replace(settings.profile, activation=ACTIVATION)
    settings = dataclasses.replace(settings, profile=profile, enable_prompt_tokens_details=True)
    with run_server(settings) as server:
        yield server


def timed(http: httpx.Client, method: str, path: str) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = http.request(method, path)
    return response, time.monotonic() - began


def test_a_model_sleeps_and_wakes_in_its_profiles_time_and_serves_nothing_asleep(
    sim: SimServer,
) -> None:
    with httpx.Client(base_url=sim.base_url, timeout=30) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        warm = http.post("/v1/chat/completions", json=CHAT).json()["usage"]
        assert warm["prompt_tokens_details"]["cached_tokens"] > 0  # awake, the cache serves
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        slept, sleep_s = timed(http, "POST", "/sleep?level=1")
        assert slept.status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        refused = http.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
        woke, wake_s = timed(http, "POST", "/wake_up")
        assert woke.status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        again = http.post("/v1/chat/completions", json=CHAT)
        assert again.status_code == 200
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 0, "the KV cache survived the sleep"
    # model seconds over the time scale; wide margins, but a wake that took no time
    # (or the sleep's) would fail
    assert ACTIVATION.sleep_level1_s / SCALE * 0.8 <= sleep_s < 1.0
    assert ACTIVATION.wake_level1_s / SCALE * 0.8 <= wake_s < 2.0
    assert wake_s > sleep_s


def test_a_sleep_with_requests_in_the_engine_is_refused(sim: SimServer) -> None:
    long = {**CHAT, "max_tokens": 400}
    done: list[int] = []

    def chat() -> None:
        with httpx.Client(base_url=sim.base_url, timeout=60) as http:
            done.append(http.post("/v1/chat/completions", json=long).status_code)

    worker = threading.Thread(target=chat)
    worker.start()
    sim.wait_for(lambda: sim.requests_running() == 1, timeout=5)
    with httpx.Client(base_url=sim.base_url, timeout=30) as http:
        refused = http.post("/sleep", params={"level": 2})
        assert refused.status_code == 409, refused.text
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep", params={"level": 3}).status_code == 400
    worker.join()
    assert done == [200], "the request in the engine was cut"
