"""Fixtures of the Prometheus tier: a real Prometheus scraping the proxy and a
simulated engine under mixed load.

Everything runs as child processes on loopback ports: ``whoseturn sim`` (time-scaled),
``whoseturn serve`` in front of it, and Debian's ``prometheus`` (``apt-get install
prometheus``, which brings ``promtool`` too) with a configuration made from
``deploy/prometheus/prometheus.yml`` — its job names and rule file, with the test's
targets and 1-second intervals. A missing binary fails the tests; it never skips
them. Logs go to ``artifacts/prometheus/``.

The proxy has the Batch API on, and a Batch API job (``BATCH_JOB_LINES`` short
lines, half of them asking for JSON output) runs through the load and after it, so
the batch panels (jobs, records, valid ratio, the estimate) have series to show.

The engine reports the prompt tokens its prefix cache held (``usage``'s
``prompt_tokens_details.cached_tokens``, as vLLM does with
``--enable-prompt-tokens-details``), and the long batch prompts open with one shared
document (``DOCUMENT_WORDS`` words) before their own text, so the prefix-cache panels
show hits, both those the proxy's index expected and those the engine reported.

The engine shares a card with a second simulated engine (model ``SECOND_MODEL``, in
sleep mode; the two do not fit awake together): after the load one chat for the
second model swaps the card to it and the batch job's lines swap it back, so the
card panels (the model awake, swaps, their steps, the wait for a wake) have series.
Each load worker sends a bearer key of its own; with no ``api_keys`` each distinct
key is a tenant, so the tenant panels have several tenants and the batch senders,
held by the prefill budget beside each other, have a fairness index.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import MODEL
from tests.support.processes import (
    Child,
    free_port,
    logged_child,
    loopback_url,
    serve_command,
    sim_command,
)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "prometheus"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
EXAMPLE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "dashboards" / "whoseturn.json"
RULES_TEST = ROOT / "tests" / "prometheus" / "rules_test.yml"

ENGINE = "engine-a"
SECOND_ENGINE, SECOND_MODEL = "engine-b", "tiny-b"  # on the card beside ENGINE
TIME_SCALE = 20.0
LOAD_S = 6.0
BATCH_JOB_LINES = 20_000  # outlasts the test: the estimate exists while a job runs
DOCUMENT_WORDS = 1000  # the batch prompts' shared opening: prefix-cache hits
INTERVAL = "1s"


def tool(name: str) -> str:
    """The path of Debian's ``prometheus`` or ``promtool``; fails the test if absent."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not installed: apt-get install prometheus "
            "(Debian's package brings prometheus and promtool)",
            pytrace=False,
        )
    return path


def wait_until(what: str, ready: Callable[[], bool], timeout: float, *children: Child) -> None:
    """Poll ``ready()`` every 50 ms; a dead child or the deadline fails with its log."""
    deadline = time.monotonic() + timeout
    while True:
        for c in children:
            c.check_alive()
        try:
            if ready():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            logs = "\n".join(c.tail() for c in children)
            raise AssertionError(f"{what} not within {timeout} s\n{logs}")
        time.sleep(0.05)


def answers(url: str, path: str) -> bool:
    return httpx.get(url + path, timeout=1).status_code == 200


# -- the servers --------------------------------------------------------------------


@contextmanager
def run_sim(model: str = MODEL) -> Iterator[str]:
    port = free_port()
    command = sim_command(
        "--port", str(port), "--time-scale", str(TIME_SCALE), "--enable-prompt-tokens-details",
        "--served-model-name", model,
    )  # fmt: skip
    with logged_child(f"sim-{model}", command, ARTIFACTS, cwd=ROOT) as sim:
        url = loopback_url(port)
        wait_until("whoseturn sim answering /health", lambda: answers(url, "/health"), 30, sim)
        yield url


@contextmanager
def run_proxy(engine_url: str, second_url: str, workdir: Path) -> Iterator[str]:
    """``whoseturn serve`` with a small prefill budget, so batch is held at times; its
    engine on a card with the second engine, swapped at once when asked."""
    port = free_port()
    budget = {"initial_tokens": 2048, "min_tokens": 512, "max_tokens": 4096}
    activation = {"sleep_level": 1, "wake_s": 0.1}  # the simulated wake: 50 ms
    on_card = {"card": "card0", "footprint_gib": 6, "activation": activation}
    engine = {"url": engine_url, "name": ENGINE, "models": [MODEL], "budget": budget, **on_card}
    second = {"url": second_url, "name": SECOND_ENGINE, "models": [SECOND_MODEL], **on_card}
    card = {"name": "card0", "memory_gib": 10, "min_awake_s": 0, "chat_quiet_s": 0}
    intervals = {"health_interval_s": 0.2, "scrape_interval_s": 0.2}
    store = str(workdir / "batch.db")
    command = serve_command(
        workdir / "whoseturn.yaml", port=port, engines=[engine, second], cards=[card],
        batch_store_path=store, **intervals,
    )  # fmt: skip
    with logged_child("proxy", command, ARTIFACTS, cwd=ROOT) as proxy:
        url = loopback_url(port)
        wait_until("whoseturn serve answering /readyz", lambda: answers(url, "/readyz"), 30, proxy)
        yield url


def prometheus_config(proxy_url: str, engine_url: str) -> dict[str, Any]:
    """The example configuration, pointed at the test's servers, scraping every second."""
    config: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["global"].update(
        scrape_interval=INTERVAL, scrape_timeout=INTERVAL, evaluation_interval=INTERVAL
    )
    config["rule_files"] = [str(RULES)]
    targets = {"whoseturn": proxy_url, "vllm": engine_url}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), f"example scrape jobs changed: {sorted(jobs)}"
    for name, job in jobs.items():
        job.update(scrape_interval=INTERVAL, scrape_timeout=INTERVAL)
        job["static_configs"] = [{"targets": [targets[name].removeprefix("http://")]}]
    return config


@dataclass
class Prometheus:
    url: str
    http: httpx.Client

    def query(self, expr: str) -> dict[str, Any]:
        """``/api/v1/query`` at now; the whole answer (``status``, ``data``, ``error``)."""
        response = self.http.get("/api/v1/query", params={"query": expr})
        body: dict[str, Any] = response.json()
        return body

    def result(self, expr: str) -> list[dict[str, Any]]:
        body = self.query(expr)
        assert body["status"] == "success", f"{expr!r}: {body.get('error')}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def label_values(self, metric: str, label: str) -> list[str]:
        """What Grafana's ``label_values(metric, label)`` offers."""
        response = self.http.get(f"/api/v1/label/{label}/values", params={"match[]": metric})
        body = response.json()
        assert body["status"] == "success", body
        values: list[str] = body["data"]
        return values

    def rule_errors(self) -> dict[str, str]:
        """Rules whose last evaluation failed, with Prometheus's error."""
        groups = self.http.get("/api/v1/rules").json()["data"]["groups"]
        return {
            rule["name"]: rule.get("lastError", "")
            for group in groups
            for rule in group["rules"]
            if rule["health"] != "ok"
        }

    def wait_for_records(self, names: list[str], timeout: float) -> None:
        """Until every recorded series in ``names`` has a sample at now."""
        deadline = time.monotonic() + timeout
        while missing := [name for name in names if not self.result(name)]:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"recorded series still empty after {timeout} s: {missing}; "
                    f"rules failing: {self.rule_errors()}"
                )
            time.sleep(0.2)

    def targets_up(self) -> bool:
        active = self.http.get("/api/v1/targets").json()["data"]["activeTargets"]
        return len(active) == 2 and all(t["health"] == "up" for t in active)


@contextmanager
def run_prometheus(proxy_url: str, engine_url: str, workdir: Path) -> Iterator[Prometheus]:
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(proxy_url, engine_url)))
    command = [
        tool("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    url = loopback_url(port)
    with (
        logged_child("prometheus", command, ARTIFACTS, cwd=ROOT) as prom,
        httpx.Client(base_url=url, timeout=5) as http,
    ):
        wait_until("prometheus ready", lambda: answers(url, "/-/ready"), 30, prom)
        server = Prometheus(url, http)
        wait_until("both scrape targets up", server.targets_up, 15, prom)
        yield server


# -- the load -------------------------------------------------------------------------


def until_stopped(
    url: str, stop: threading.Event, timeout: float, send: Callable[[httpx.Client, int], None]
) -> None:
    """``send(client, n)`` for n = 1, 2, ... until ``stop`` is set."""
    with httpx.Client(base_url=url, timeout=timeout) as http:
        for n in itertools.count(1):
            if stop.is_set():
                return
            send(http, n)


def tenant_key(kind: str, seed: int) -> dict[str, str]:
    """A bearer key of the worker's own: with no ``api_keys`` in the config each
    distinct key is a tenant, so the tenant panels and the fairness index have
    tenants to compare."""
    return {"authorization": f"Bearer {kind}-{seed}"}


def chat_worker(url: str, stop: threading.Event, seed: int) -> None:
    """Streaming chat requests on /v1, one after another, as tenant ``chat-SEED``."""

    def send(http: httpx.Client, n: int) -> None:
        words = " ".join(f"w{seed}x{n}x{i}" for i in range(40))
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": 24,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        key = tenant_key("chat", seed)
        with http.stream("POST", "/v1/chat/completions", json=body, headers=key) as response:
            assert response.status_code == 200, response.read()
            for _ in response.iter_lines():
                pass
        stop.wait(0.05)

    until_stopped(url, stop, 30, send)


def batch_worker(url: str, stop: threading.Event, seed: int) -> None:
    """Long-prompt batch requests on /batch/v1, completions and chat in turn, each
    a shared document and then its own 500 words, as tenant ``batch-SEED``: held
    by the prefill budget beside each other, so the batch fairness index is judged."""
    document = " ".join(f"doc{i}" for i in range(DOCUMENT_WORDS))

    def send(http: httpx.Client, n: int) -> None:
        text = document + " " + " ".join(f"b{seed}x{n}x{i}" for i in range(500))
        if n % 2:
            path = "/batch/v1/completions"
            body: dict[str, Any] = {"model": MODEL, "prompt": text, "max_tokens": 8}
        else:
            path = "/batch/v1/chat/completions"
            messages = [{"role": "user", "content": text}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
        response = http.post(path, json=body, headers=tenant_key("batch", seed))
        assert response.status_code == 200, response.text

    until_stopped(url, stop, 60, send)


def start_batch_job(url: str) -> str:
    """A Batch API job through the official routes; its id."""
    lines = []
    for i in range(BATCH_JOB_LINES):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]}
        body["max_tokens"] = 8
        if i % 2:
            body["response_format"] = {"type": "json_object"}
        line = {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps({**line, "body": body}) + "\n")
    with httpx.Client(base_url=url, timeout=30) as http:
        files = {"file": ("job.jsonl", "".join(lines).encode())}
        uploaded = http.post("/v1/files", files=files, data={"purpose": "batch"})
        assert uploaded.status_code == 200, uploaded.text
        ask = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
        made = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], **ask})
        assert made.status_code == 200, made.text
        batch_id: str = made.json()["id"]
        return batch_id


def drive_mixed_load(url: str, seconds: float) -> None:
    """Three chat streamers and three batch senders for ``seconds``, each a tenant
    of its own; re-raises the first error a worker met."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(work: Callable[[str, threading.Event, int], None], seed: int) -> None:
        try:
            work(url, stop, seed)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    workers = [threading.Thread(target=run, args=(chat_worker, i)) for i in range(3)]
    workers += [threading.Thread(target=run, args=(batch_worker, i)) for i in range(3)]
    for w in workers:
        w.start()
    stop.wait(seconds)
    stop.set()
    for w in workers:
        w.join(30)
    if errors:
        raise errors[0]


def swap_there_and_back(url: str) -> None:
    """A chat for the second model swaps the card to it (the batch job's lines on the
    first drained first); the job's lines waiting swap it back."""
    body = {"model": SECOND_MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}  # fmt: skip
    with httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert float(answer.headers["x-whoseturn-activation-ms"]) > 0

        def back() -> bool:
            card = http.get("/turn").json()["cards"][0]
            return bool(card["awake"] == [MODEL])

        wait_until("the card swapped back to the batch job's model", back, 30)


def record_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["record"] for group in groups for rule in group["rules"] if "record" in rule]


@dataclass
class Live:
    prometheus: Prometheus
    proxy_url: str
    engine_url: str
    checked: dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """Prometheus scraping a proxy and a simulated engine that have just served
    ``LOAD_S`` seconds of mixed chat and batch traffic."""
    tool("prometheus")  # before starting anything else
    workdir = tmp_path_factory.mktemp("prometheus")
    with ExitStack() as stack:
        engine_url = stack.enter_context(run_sim())
        second_url = stack.enter_context(run_sim(SECOND_MODEL))
        proxy_url = stack.enter_context(run_proxy(engine_url, second_url, workdir))
        prometheus = stack.enter_context(run_prometheus(proxy_url, engine_url, workdir))
        start_batch_job(proxy_url)
        drive_mixed_load(proxy_url, LOAD_S)
        swap_there_and_back(proxy_url)
        prometheus.wait_for_records(record_names(), timeout=20)
        found = Live(prometheus, proxy_url, engine_url, checked={})
        yield found
        # What each expression returned, for the CI log reader.
        (ARTIFACTS / "expressions.json").write_text(json.dumps(found.checked, indent=2))
