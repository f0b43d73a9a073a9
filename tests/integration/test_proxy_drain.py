"""Graceful drain of a real ``whoseturn serve`` process: on SIGTERM, queued batch
requests get 503 with ``Retry-After``, new connections are refused, streams in
flight finish, one that outlasts the drain timeout is aborted upstream with a
logged reason, and the process exits with status 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml

from loadtests.engine_io import labelled_samples
from tests.support import MODEL
from tests.support.http import data_lines
from tests.support.processes import free_port

from .simserver import SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration

DRAIN_S = 4
SHORT_TOKENS = 300  # about 1.5 s at real time on the cpu-tiny profile
LONG_TOKENS = 1900  # about 10 s: outlasts the drain


def chat(n: int, tokens: int) -> dict[str, object]:
    messages = [{"role": "user", "content": f"drain {n}"}]
    return {"model": MODEL, "messages": messages, "max_tokens": tokens, "stream": True}


def batch(n: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": f"record {n}", "max_tokens": SHORT_TOKENS}


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with run_server(sim_settings(time_scale=1.0)) as server:
        yield server


def start_proxy(sim: SimServer, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    config = tmp_path / "whoseturn.yaml"
    engine = {"url": sim.base_url, "name": "a", "models": [MODEL], "batch_max_inflight": 1}
    config.write_text(yaml.safe_dump({"engines": [engine], "drain_timeout_s": DRAIN_S}))
    port, log = free_port(), tmp_path / "proxy.log"
    command = [sys.executable, "-m", "proxy", "--log-level", "warning", "serve"]
    command += ["--config", str(config), "--port", str(port)]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process, port, log
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise AssertionError("the proxy never became ready")


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def queued_batch(client: httpx.Client) -> float:
    metrics = labelled_samples(client.get("/metrics").text)
    key = ("whoseturn_queue_depth", frozenset({("class", "batch")}))
    return metrics.get(key, 0.0)


@pytest.mark.timeout(60)
def test_sigterm_drains(sim: SimServer, tmp_path: Path) -> None:
    process, port, log = start_proxy(sim, tmp_path)
    try:
        with ExitStack() as stack, ThreadPoolExecutor(3) as pool:
            client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}"))
            streams = []
            for n, tokens in enumerate([SHORT_TOKENS] * 3 + [LONG_TOKENS]):
                response = stack.enter_context(
                    client.stream("POST", "/v1/chat/completions", json=chat(n, tokens), timeout=30)
                )
                events = data_lines(response)
                next(events)
                streams.append(events)
            batches = [
                pool.submit(client.post, "/batch/v1/completions", json=batch(n), timeout=30)
                for n in range(3)
            ]
            deadline = time.monotonic() + 10
            while queued_batch(client) < 2:
                assert time.monotonic() < deadline, "batch work never queued"
                time.sleep(0.02)

            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            answers = sorted(f.result(timeout=30).status_code for f in batches)
            assert answers == [200, 503, 503]
            for f in batches:
                if (r := f.result()).status_code == 503:
                    assert int(r.headers["retry-after"]) >= 1
                    assert "shutting down" in r.json()["error"]["message"]
            assert refused(port)
            for events in streams[:3]:
                *rest, done = list(events)
                assert done == "[DONE]"
                assert all("error" not in json.loads(line) for line in rest)
            *_, error, done = list(streams[3])  # cut off when the drain ran out
            assert done == "[DONE]"
            assert "shutting down" in json.loads(error)["error"]["message"]
        assert process.wait(DRAIN_S + 10) == 0
        drained_s = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
    sim.wait_for(lambda: sim.metric("vllm:num_requests_running") == 0)
    text = log.read_text()
    assert "draining: 2 queued requests answered 503" in text
    assert "aborted upstream on a: the drain timeout passed" in text
    assert "Traceback" not in text
    print(f"exit 0 {drained_s:.2f} s after SIGTERM (drain timeout {DRAIN_S} s)")
    assert drained_s < DRAIN_S + 3
