"""Several models on one card, through the proxy: two simulated engines that do not fit
awake together, woken and put to sleep by the proxy (vLLM's sleep mode, or start and
stop commands), by the rule of :mod:`proxy.scheduler.residency`.

- the proxy keeps one model awake at start; a model asleep still lists, and a model
  that exists nowhere is a 404 naming both;
- chat for the sleeping model drains the awake one (a stream in flight there runs to
  its end), swaps, and is answered with its wait for the wake as its own phase
  (``X-Whoseturn-Activation-Ms``), seen in ``/turn``, ``/turn/log`` and the metrics;
- batch for the sleeping model waits for the awake model's chat to be quiet;
- with commands, the engine processes are started and stopped (and stopped with
  the proxy).
"""

from __future__ import annotations

import dataclasses
import shlex
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from loadtests.sim.profile import Activation
from tests.integration.proxyserver import ProxyServer, run_proxy
from tests.integration.simserver import SimServer, run_server, sim_settings
from tests.support.processes import free_port, loopback_url, sim_command

pytestmark = pytest.mark.integration

SCALE = 20.0
WAKE_MODEL_S = 10.0  # the sleep mode's wake (level 1), in model seconds: 0.5 s here
A, B = "tiny-a", "tiny-b"


def chat(model: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello " * 20}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


@contextmanager
def sim(model: str, scale: float = SCALE) -> Iterator[SimServer]:
    settings = sim_settings(time_scale=scale)
    activation = Activation(sleep_level1_s=2.0, wake_level1_s=WAKE_MODEL_S)
    profile = dataclasses.replace(settings.profile, activation=activation)
    settings = dataclasses.replace(settings, profile=profile, served_model_name=model)
    with run_server(settings) as server:
        yield server


def card_engine(url: str, model: str, **activation: Any) -> dict[str, Any]:
    return {
        "url": url,
        "name": f"engine-{model}",
        "models": [model],
        "card": "c0",
        "footprint_gib": 6,
        "activation": activation or {"sleep_level": 1, "wake_s": 1},
    }


def card(**rules: float) -> list[dict[str, Any]]:
    return [{"name": "c0", "memory_gib": 10, "min_awake_s": 0, "chat_quiet_s": 0.5, **rules}]


@contextmanager
def sleeping_pair(
    scale: float = SCALE, **rules: float
) -> Iterator[tuple[ProxyServer, SimServer, SimServer]]:
    with sim(A, scale) as a, sim(B, scale) as b:
        engines = [card_engine(a.base_url, A), card_engine(b.base_url, B)]
        with run_proxy(engines, cards=card(**rules), health_interval_s=0.1) as proxy:
            yield proxy, a, b


def sleeping(server: SimServer) -> bool:
    answer: bool = server.http.get("/is_sleeping").json()["is_sleeping"]
    return answer


def test_chat_for_the_sleeping_model_drains_the_awake_one_then_swaps() -> None:
    with sleeping_pair() as (proxy, a, b):
        assert not sleeping(a) and sleeping(b), "the proxy keeps the first model awake"
        listed = {m["id"] for m in proxy.http.get("/v1/models").json()["data"]}
        assert listed == {A, B}, "a model asleep still lists"
        missing = proxy.http.post("/v1/chat/completions", json=chat("nope"))
        assert missing.status_code == 404
        assert A in missing.json()["error"]["message"] and B in missing.json()["error"]["message"]

        streamed: dict[str, Any] = {}

        def long_stream() -> None:
            with httpx.Client(base_url=proxy.base_url, timeout=60) as http:
                answer = http.post("/v1/chat/completions", json=chat(A, 1500))
                streamed["usage"] = answer.json()["usage"]
                streamed["done_at"] = time.monotonic()

        worker = threading.Thread(target=long_stream)
        worker.start()
        a.wait_for(lambda: a.requests_running() == 1, timeout=5)
        answer = proxy.http.post("/v1/chat/completions", json=chat(B), timeout=60)
        answered_at = time.monotonic()
        worker.join()
        assert answer.status_code == 200, answer.text
        assert streamed["usage"]["completion_tokens"] == 1500, "the swap cut the awake model's work"
        assert answered_at > streamed["done_at"], "B was woken before A's stream ended"
        activation_ms = float(answer.headers["x-whoseturn-activation-ms"])
        queue_ms = float(answer.headers["x-whoseturn-queue-ms"])
        assert activation_ms == queue_ms  # it arrived while its model slept: all of its wait
        assert activation_ms >= WAKE_MODEL_S / SCALE * 1000 * 0.8
        assert sleeping(a) and not sleeping(b)

        turn = proxy.http.get("/turn").json()
        (c0,) = turn["cards"]
        assert c0["awake"] == [B] and c0["models"][A]["state"] == "asleep"
        residency = {e["engine"]: e["residency"] for e in turn["engines"]}
        assert residency == {f"engine-{A}": "asleep", f"engine-{B}": "awake"}
        events = proxy.http.get("/turn/log").json()["cards"]
        assert [e["action"] for e in events] == ["drain", "swap"], events
        swap = events[-1]
        assert (swap["model"], swap["asleep"], swap["why"]) == (B, A, "chat")
        assert swap["wake_s"] >= WAKE_MODEL_S / SCALE * 0.8 and swap["reason"]

        assert proxy.metric("whoseturn_model_swaps_total", card="c0", model=B, why="chat") == 1
        assert proxy.metric("whoseturn_model_awake", model=B) == 1
        assert proxy.metric("whoseturn_model_awake", model=A) == 0
        waits = proxy.metric("whoseturn_activation_wait_seconds_count", model=B)
        assert waits == 1
        assert proxy.metric("whoseturn_model_swap_seconds_count", model=B, step="wake") == 1
        assert proxy.metric("whoseturn_activation_wait_seconds_count", model=A) == 0


def test_a_drain_for_a_chat_that_left_opens_the_awake_model_again() -> None:
    with sleeping_pair(scale=2.0) as (proxy, a, b):  # A's stream lasts seconds
        done: dict[str, Any] = {}

        def long_stream() -> None:
            with httpx.Client(base_url=proxy.base_url, timeout=60) as http:
                answer = http.post("/v1/chat/completions", json=chat(A, 1500))
                done["at"] = time.monotonic()
                done["tokens"] = answer.json()["usage"]["completion_tokens"]

        worker = threading.Thread(target=long_stream)
        worker.start()
        a.wait_for(lambda: a.requests_running() == 1, timeout=5)
        with pytest.raises(httpx.ReadTimeout):  # B's client hangs up while A drains
            proxy.http.post("/v1/chat/completions", json=chat(B), timeout=0.3)
        proxy.wait_for(lambda: [e["action"] for e in log(proxy)] == ["drain", "open"])
        answer = proxy.http.post("/v1/chat/completions", json=chat(A), timeout=10)
        answered_at = time.monotonic()
        worker.join()
        assert answer.status_code == 200 and "x-whoseturn-activation-ms" not in answer.headers
        assert answered_at < done["at"], "A took no new work until its stream ended"
        assert done["tokens"] == 1500 and sleeping(b) and not sleeping(a)


def log(proxy: ProxyServer) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = proxy.http.get("/turn/log").json()["cards"]
    return events


def test_batch_for_the_sleeping_model_waits_for_the_awake_models_chat_to_be_quiet() -> None:
    quiet_s = 1.0
    with sleeping_pair(chat_quiet_s=quiet_s) as (proxy, _, b):
        answered: dict[str, Any] = {}

        def batch_line() -> None:
            with httpx.Client(base_url=proxy.base_url, timeout=60) as http:
                answered["response"] = http.post("/batch/v1/chat/completions", json=chat(B))
                answered["at"] = time.monotonic()

        worker = threading.Thread(target=batch_line)
        chats_until = time.monotonic() + 2.0
        worker.start()
        last_chat = 0.0
        while time.monotonic() < chats_until:  # a chat every 0.2 s: never quiet for 1 s
            assert proxy.http.post("/v1/chat/completions", json=chat(A)).status_code == 200
            last_chat = time.monotonic()
            assert sleeping(b), "batch woke its model while the awake model's chat was live"
            time.sleep(0.2)
        worker.join()
        response = answered["response"]
        assert response.status_code == 200, response.text
        assert answered["at"] - last_chat >= quiet_s * 0.8, "batch took the card inside the quiet"
        assert float(response.headers["x-whoseturn-activation-ms"]) >= 2000 * 0.8
        (swap,) = [e for e in proxy.http.get("/turn/log").json()["cards"] if e["action"] == "swap"]
        assert (swap["model"], swap["why"]) == (B, "batch_window")


def port_open(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_command_activation_starts_and_stops_engine_processes() -> None:
    ports = {A: free_port(), B: free_port()}
    urls = {m: loopback_url(p) for m, p in ports.items()}
    engines = []
    for model, port in ports.items():
        flags = ("--time-scale", str(SCALE), "--served-model-name", model, "--port", str(port))
        start = shlex.join(sim_command(*flags))
        engines.append(card_engine(urls[model], model, start=start, wake_s=5))
    with ExitStack() as stack:
        proxy = stack.enter_context(
            run_proxy(engines, cards=card(), health_interval_s=0.1, first_byte_timeout_s=60)
        )
        assert not port_open(urls[A]) and not port_open(urls[B]), "nothing started yet"
        turn = proxy.http.get("/turn").json()
        assert turn["cards"][0]["awake"] == []
        first = proxy.http.post("/v1/chat/completions", json=chat(A), timeout=120)
        assert first.status_code == 200, first.text
        assert float(first.headers["x-whoseturn-activation-ms"]) > 0
        assert port_open(urls[A])
        second = proxy.http.post("/v1/chat/completions", json=chat(B), timeout=120)
        assert second.status_code == 200, second.text
        assert port_open(urls[B]) and not port_open(urls[A]), "A's process still serves"
        events = proxy.http.get("/turn/log").json()["cards"]
        swaps = [e for e in events if e["action"] == "swap"]
        assert [(s["model"], s["asleep"]) for s in swaps] == [(A, None), (B, A)]
        assert swaps[0]["why"] == "nothing_awake" and swaps[1]["why"] == "chat"
    assert not port_open(urls[B]), "the proxy left the engine process it started running"


def test_a_model_that_cannot_be_woken_fails_its_waiting_requests_with_503() -> None:
    """B's start command exits at once: the swap fails (A was put to sleep first), is
    counted and logged with its reason, and the chat waiting for B is answered 503
    naming why, instead of waiting for ever; A's chat then wakes A again."""
    with sim(A) as a:
        engines = [
            card_engine(a.base_url, A),
            card_engine(loopback_url(free_port()), B, start="exit 3"),
        ]
        with run_proxy(engines, cards=card(), health_interval_s=0.1) as proxy:
            refused = proxy.http.post("/v1/chat/completions", json=chat(B), timeout=30)
            assert refused.status_code == 503, refused.text
            message = refused.json()["error"]["message"]
            assert f"`{B}` could not be woken" in message and "exited 3" in message
            assert refused.headers["retry-after"] == "10"
            (failed,) = [e for e in log(proxy) if e["action"] == "swap_failed"]
            assert (failed["model"], failed["asleep"]) == (B, A)
            assert proxy.metric("whoseturn_model_swap_failures_total", model=B) == 1
            again = proxy.http.post("/v1/chat/completions", json=chat(A), timeout=30)
            assert again.status_code == 200, again.text
            assert not sleeping(a)


def test_a_card_where_every_model_fits_wakes_them_all_at_start_and_never_swaps() -> None:
    with sim(A) as a, sim(B) as b:
        assert b.http.post("/sleep", params={"level": 1}).status_code == 200
        engines = [card_engine(a.base_url, A), card_engine(b.base_url, B)]
        roomy = card(memory_gib=20)  # 6 + 6 fit
        with run_proxy(engines, cards=roomy, health_interval_s=0.1) as proxy:
            assert not sleeping(a) and not sleeping(b), "the proxy left a model asleep"
            (c0,) = proxy.http.get("/turn").json()["cards"]
            assert (c0["swaps"], c0["awake"]) == (False, [A, B])
            for model in (A, B):
                answer = proxy.http.post("/v1/chat/completions", json=chat(model))
                assert answer.status_code == 200
                assert "x-whoseturn-activation-ms" not in answer.headers
            assert log(proxy) == []
