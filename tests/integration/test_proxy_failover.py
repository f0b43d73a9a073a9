"""Two engines behind one proxy; one is killed (``SIGKILL``) in the middle of the work.

Streams that were running on the dead engine end with an SSE error event; work that
had not reached a client yet (queued, or a whole answer still being read) finishes
on the survivor; the dead engine is ejected and new work goes to the survivor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from tests.support.http import data_lines

from .proxyserver import Process, ProxyServer, engine, run_proxy, spawn_sim
from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration

TIME_SCALE = 2.0  # slow enough that the work is still running at the kill
STREAMS = 4
BATCHES = 4
BATCH_TOKENS = 150


def chat(n: int, **extra: object) -> dict[str, object]:
    """A chat request of its own conversation (no engine affinity between them)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": f"story {n}"}], **extra}


def engine_of(response: httpx.Response) -> str:
    return response.headers["x-whoseturn-engine"]


def batch_request(proxy: ProxyServer, n: int) -> tuple[httpx.Response, float]:
    """A whole batch answer, and when it came (monotonic)."""
    body = {"model": MODEL, "prompt": f"summarise record {n}", "max_tokens": BATCH_TOKENS}
    response = proxy.http.post("/batch/v1/completions", json=body, timeout=20)
    return response, time.monotonic()


@pytest.fixture
def doomed() -> Iterator[Process]:
    with spawn_sim(time_scale=TIME_SCALE) as sim:
        yield sim


@pytest.fixture
def survivor() -> Iterator[SimServer]:
    with run_server(sim_settings(time_scale=TIME_SCALE)) as sim:
        yield sim


def test_killing_an_engine_mid_run(doomed: Process, survivor: SimServer) -> None:
    engines = [
        engine(doomed.base_url, "a", batch_max_inflight=1),
        engine(survivor.base_url, "b", batch_max_inflight=1),
    ]
    with (
        run_proxy(engines, health_interval_s=0.1, unhealthy_after=1) as proxy,
        ExitStack() as stack,
        ThreadPoolExecutor(BATCHES) as pool,
    ):
        client = stack.enter_context(httpx.Client(base_url=proxy.base_url, timeout=10))
        # Streams, one at a time, so that each sees the others in decode: they spread.
        streams: list[tuple[str, Iterator[str]]] = []
        for n in range(STREAMS):
            request = chat(n, max_tokens=1500, stream=True)
            response = stack.enter_context(
                client.stream("POST", "/v1/chat/completions", json=request)
            )
            events = data_lines(response)
            next(events)
            streams.append((engine_of(response), events))
        on_a = [events for name, events in streams if name == "a"]
        assert 0 < len(on_a) < STREAMS, "the streams did not spread over both engines"

        # Batch work: one running on each engine (cap 1), the rest queued in the proxy.
        batches: list[Future[tuple[httpx.Response, float]]] = [
            pool.submit(batch_request, proxy, n) for n in range(BATCHES)
        ]
        proxy.wait_for(lambda: proxy.metric("whoseturn_queue_depth", **{"class": "batch"}) == 2)
        # The doomed engine has its streams and a batch request of its own.
        doomed.wait_for(lambda: doomed.metric("vllm:num_requests_running") == len(on_a) + 1)

        doomed.kill()
        killed_at = time.monotonic()

        # Streams on the dead engine end with an error event and [DONE], at once.
        for events in on_a:
            *_, error, done = list(events)
            assert done == "[DONE]"
            assert set(json.loads(error)["error"]) == {"message", "type", "param", "code"}
        assert time.monotonic() - killed_at < 1.0
        # Streams on the survivor go on.
        for name, events in streams:
            if name == "b":
                for _ in range(10):
                    assert "error" not in json.loads(next(events))

        # The whole answers, queued or cut off mid-read, finish on the survivor (on a
        # busy machine one may have finished on the doomed engine before the kill).
        after_kill = 0
        for future in batches:
            response, answered_at = future.result(timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == BATCH_TOKENS
            if answered_at > killed_at:
                assert engine_of(response) == "b"
                after_kill += 1
        # at least the one cut off on the doomed engine and one queued at the kill
        assert after_kill >= 2

        proxy.wait_for(lambda: proxy.metric("whoseturn_engine_up", engine="a") == 0, timeout=1)
        assert proxy.metric("whoseturn_engine_up", engine="b") == 1
        errors = proxy.metric("whoseturn_requests_total", engine="a", outcome="engine_error")
        assert errors == len(on_a)
        assert proxy.http.get("/readyz").json()["engines_up"] == ["b"]

        # New work goes to the survivor.
        for n in range(3):
            reply = proxy.http.post("/v1/chat/completions", json=chat(100 + n, max_tokens=2))
            assert reply.status_code == 200
            assert engine_of(reply) == "b"


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_connect_is_retried_on_the_other_engine(
    doomed: Process, survivor: SimServer, stream: bool
) -> None:
    """The engine is dead but not yet ejected (its health is checked rarely): the
    request tries it, cannot connect, and is served by the other one."""
    engines = [engine(doomed.base_url, "a"), engine(survivor.base_url, "b")]
    with run_proxy(engines, health_interval_s=60) as proxy:
        proxy.wait_for(lambda: proxy.metric("whoseturn_engine_up", engine="a") == 1)
        doomed.kill()
        assert proxy.metric("whoseturn_engine_up", engine="a") == 1
        request = chat(1, max_tokens=3, stream=stream)
        with proxy.http.stream("POST", "/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            assert engine_of(response) == "b"
            body = response.read()
        if stream:
            assert body.endswith(b"data: [DONE]\n\n")
            assert b'"error"' not in body
        else:
            assert json.loads(body)["usage"]["completion_tokens"] == 3
        # Only the failed connect can have ejected it, with health checks a minute apart.
        assert proxy.metric("whoseturn_engine_up", engine="a") == 0
        assert proxy.metric("whoseturn_requests_total", engine="b", outcome="ok") == 1
        assert survivor.metric("vllm:request_success_total", finished_reason="length") == 1
