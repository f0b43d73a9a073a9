"""Two real vLLM models of different sizes on one card (the tiny model, 4 layers, and
its 2-layer sibling), woken by the proxy with start and stop commands: the way that
works on a CPU-only machine (sleep mode needs a GPU). Chat alternates between them;
each wake is an engine process started, the other stopped first.

Each answer carries its wait for the wake (``X-Whoseturn-Activation-Ms``): the
first start of each model (cold: nothing of that model started since the proxy
did, vLLM's compile cache as the session left it) and the second (warm) are
measured apart, listed in the terminal summary. The card's log names every swap
and its reason; the model put to sleep no longer answers; the engines the proxy
started stop with it.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.support.processes import free_port
from loadtests.support.vllm import (
    ENGINE_ENV,
    READY_TIMEOUT_S,
    REPO,
    cpu_dtype,
    model_dir,
    vllm_python,
)
from tests.integration.proxyserver import run_proxy

from .vllmserver import LOG_DIR, PROXY_OPTIONS, VllmFleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(4 * (READY_TIMEOUT_S + 120))]

A, B = "tiny", "tiny-2l"


def second_model() -> Path:
    path = Path(os.environ.get("WHOSETURN_E2E_MODEL_2L") or ".cache/tiny-model-2l")
    return path if path.is_absolute() else REPO / path


def start_command(model: str, directory: Path, port: int) -> str:
    """The engine as its card's ``start`` command: vLLM on ``directory``, its log in
    ``artifacts/e2e/``."""
    env = [f"{k}={v}" for k, v in ENGINE_ENV.items()]
    serve = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(directory), "--served-model-name", model, "--dtype", cpu_dtype(),
             "--max-model-len", "8192", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log = LOG_DIR / f"vllm-card-{model}.log"
    return f"exec env {shlex.join(env + serve)} >> {shlex.quote(str(log))} 2>&1"


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chat(model: str) -> dict[str, Any]:
    text = "Tell me about the card. " * 8
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


def test_two_real_models_take_turns_on_one_card_by_process_start_and_stop(
    vllm_fleet: VllmFleet, measured: Callable[[str], None]
) -> None:
    vllm_fleet.stop_all()  # two cores: only the card's engines run
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    ports = {A: free_port(), B: free_port()}
    urls = {m: f"http://127.0.0.1:{p}" for m, p in ports.items()}
    dirs = {A: model_dir(), B: second_model()}
    footprints = {A: 6, B: 5}  # they do not fit the card's 10 together
    engines = [
        {
            "url": urls[m],
            "name": f"vllm-{m}",
            "models": [m],
            "card": "cpu",
            "footprint_gib": footprints[m],
            "activation": {"start": start_command(m, dirs[m], ports[m]), "wake_s": 60},
        }
        for m in (A, B)
    ]
    card = [{"name": "cpu", "memory_gib": 10, "min_awake_s": 0, "chat_quiet_s": 0}]
    options = {**PROXY_OPTIONS, "first_byte_timeout_s": READY_TIMEOUT_S + 60}
    timeline: list[tuple[str, float, float]] = []
    with run_proxy(engines, cards=card, **options) as proxy:
        assert not answers(urls[A]) and not answers(urls[B])
        for model in (A, B, A, B):
            began = time.monotonic()
            answer = proxy.http.post(
                "/v1/chat/completions", json=chat(model), timeout=READY_TIMEOUT_S + 120
            )
            took = time.monotonic() - began
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 8
            activation_s = float(answer.headers["x-whoseturn-activation-ms"]) / 1000
            assert 0 < activation_s <= took
            timeline.append((model, activation_s, took))
            other = B if model == A else A
            assert answers(urls[model]) and not answers(urls[other]), "both engines run"
        events = proxy.http.get("/turn/log").json()["cards"]
        swaps = [e for e in events if e["action"] == "swap"]
        assert [(s["model"], s["asleep"]) for s in swaps] == [(A, None), (B, A), (A, B), (B, A)]
        assert [s["why"] for s in swaps] == ["nothing_awake", "chat", "chat", "chat"]
        waits = proxy.metric("whoseturn_activation_wait_seconds_count", model=A)
        assert waits == 2
    assert not answers(urls[B]), "the engine the proxy started outlived it"
    for i, (model, activation_s, took) in enumerate(timeline):
        kind = "cold" if i < 2 else "warm"
        measured(
            f"{model} ({kind} start by command): activation wait {activation_s:.1f} s, "
            f"answer after {took:.1f} s; wake {swaps[i]['wake_s']:.1f} s, "
            f"sleep of the other {swaps[i]['sleep_s'] or 0:.1f} s"
        )
