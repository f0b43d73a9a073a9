"""Nothing invalid in a batch file reaches an engine: the proxy in front of the
simulated engine is given input files carrying each kind of bad body the
interactive routes refuse (tests/unit/api/test_hardening.py), and more (empty
messages, numbers out of range, a line over ``max_body_bytes``).

Both places a line is checked are driven: ``POST /v1/batches`` (a 400 naming the
line and the field; no job stored), and the runner's validation of a job stored
``validating`` without that check (here: written to the store before the proxy
starts, as a job left by a proxy with a larger limit), which fails the job with
OpenAI's ``errors``. The engine's request log (every generation request that
arrived, refused or not) counts 0 of them, and a good job in the same test shows
the count is live: each of its lines arrives once. The engine's
``vllm:request_success_total`` agrees."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from loadtests.sim.server.requestlog import RequestLogReader
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import NewBatch
from tests.unit.api.test_hardening import BAD_BODIES, applies, bad_raw
from tests.unit.batch.test_line_validation import MORE_BAD, RAW_PARAMS, line_bytes

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY_BYTES = 16 * 1024


def body_for(endpoint: str, custom_id: str) -> dict[str, Any]:
    """A good body; ``user`` carries the line's id to the engine's request log."""
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "user": custom_id}
    if endpoint == CHAT:
        return {**asked, "messages": [{"role": "user", "content": "hi"}]}
    return {**asked, "prompt": "hi"}


def good_line(endpoint: str, custom_id: str) -> bytes:
    return line_bytes(json.dumps(body_for(endpoint, custom_id)).encode(), endpoint, custom_id)


def too_long_line(endpoint: str) -> bytes:
    """A good line, padded past ``max_body_bytes``."""
    line = good_line(endpoint, "too-long")
    return line[:-1] + b" " * (MAX_BODY_BYTES + 1 - len(line)) + b"}"


def bad_cases() -> list[tuple[str, str, bytes, str | None]]:
    """(name, endpoint, the bad line, the field its error names: None for none)."""
    cases: list[tuple[str, str, bytes, str | None]] = []
    for endpoint in (CHAT, COMPLETIONS):
        for name, bad, param in [*BAD_BODIES, *MORE_BAD]:
            if not applies(endpoint, bad):
                continue
            raw = bad_raw(endpoint, bad).replace(b'"model": "m"', f'"model": "{MODEL}"'.encode())
            field = param or RAW_PARAMS.get(name)
            named = f"`body.{field}`" if field else "nested deeper"
            cases.append((name, endpoint, line_bytes(raw, endpoint, "bad"), named))
        cases.append(("over max_body_bytes", endpoint, too_long_line(endpoint), "longer than"))
    return cases


def input_file(endpoint: str, bad: bytes) -> bytes:
    """A good line 1, then the bad line 2."""
    return good_line(endpoint, "good-before") + b"\n" + bad + b"\n"


@contextmanager
def engine_and_proxy(tmp_path: Path) -> Iterator[tuple[SimServer, ProxyServer, RequestLogReader]]:
    log = tmp_path / "requests.jsonl"
    settings = dataclasses.replace(sim_settings(), request_log=log)
    with (
        run_server(settings) as sim,
        run_proxy(
            [engine(sim.base_url, "sim-0")],
            batch_store_path=str(tmp_path / "batch.db"),
            max_body_bytes=MAX_BODY_BYTES,
        ) as proxy,
    ):
        yield sim, proxy, RequestLogReader(log)


def upload(proxy: ProxyServer, data: bytes) -> str:
    files = {"file": ("in.jsonl", data)}
    answer = proxy.http.post("/v1/files", files=files, data={"purpose": "batch"})
    assert answer.status_code == 200, answer.text
    file_id: str = answer.json()["id"]
    return file_id


def create(proxy: ProxyServer, file_id: str, endpoint: str) -> Any:
    asked = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
    return proxy.http.post("/v1/batches", json=asked)


def wait_for_status(proxy: ProxyServer, batch_id: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        batch: dict[str, Any] = proxy.http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"{batch_id} still {batch['status']}"
        time.sleep(0.05)


def run_good_job(proxy: ProxyServer, lines: int) -> set[str]:
    """A good job through the routes, to its end; the ``custom_id`` of its lines."""
    ids = {f"good-{i}" for i in range(lines)}
    data = b"".join(good_line(CHAT, custom_id) + b"\n" for custom_id in sorted(ids))
    created = create(proxy, upload(proxy, data), CHAT)
    assert created.status_code == 200, created.text
    done = wait_for_status(proxy, created.json()["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == lines
    return ids


def successes(sim: SimServer) -> float:
    try:
        return sim.metric("vllm:request_success_total")
    except KeyError:  # no request has finished yet
        return 0.0


def test_every_bad_line_is_a_400_at_create_and_none_reaches_the_engine(tmp_path: Path) -> None:
    cases = bad_cases()
    with engine_and_proxy(tmp_path) as (sim, proxy, log):
        for name, endpoint, bad, named in cases:
            answer = create(proxy, upload(proxy, input_file(endpoint, bad)), endpoint)
            assert answer.status_code == 400, f"{name} on {endpoint}: {answer.text}"
            error = answer.json()["error"]
            assert error["param"] == "input_file_id", name
            assert error["message"].startswith("Line 2: "), f"{name}: {error['message']}"
            assert named in error["message"], f"{name}: {error['message']}"
        assert proxy.http.get("/v1/batches").json()["data"] == []  # no job was stored
        assert log.read() == [] and successes(sim) == 0  # 0 reached the engine
        # The count is live: a good job's lines arrive, each once.
        good = run_good_job(proxy, 3)
        arrived, success = log.read(), successes(sim)
    assert sorted(r.user or "" for r in arrived) == sorted(good)
    assert success == len(good)
    print(f"{len(cases)} bad lines refused at create; engine saw {len(arrived)} (the good ones)")


def seed(store_path: Path, cases: list[tuple[str, str, bytes, str | None]]) -> None:
    """Each bad file as a job ``validating``, written to the store the proxy will open
    (no route checked it), and a good job last."""

    async def write() -> None:
        store = SQLiteStore(store_path, time.time)
        await store.open()
        files = [(endpoint, input_file(endpoint, bad)) for _, endpoint, bad, _ in cases]
        files.append((CHAT, good_line(CHAT, "seeded-0") + b"\n" + good_line(CHAT, "seeded-1")))
        for i, (endpoint, data) in enumerate(files):
            spool = store.spool_path()
            spool.write_bytes(data)
            stored = await store.add_file("batch", "in.jsonl", spool)
            await store.add_batch(
                NewBatch(f"batch_{i:03d}", endpoint, stored.id, "24h", 86400, None)
            )
        await store.close()

    anyio.run(write)


def test_every_bad_line_fails_its_job_at_validation_and_none_reaches_the_engine(
    tmp_path: Path,
) -> None:
    cases = bad_cases()
    seed(tmp_path / "batch.db", cases)
    with engine_and_proxy(tmp_path) as (sim, proxy, log):
        ended = [wait_for_status(proxy, f"batch_{i:03d}") for i in range(len(cases) + 1)]
        arrived = log.read()
        success = successes(sim)
    for (name, endpoint, _, named), batch in zip(cases, ended, strict=False):
        assert batch["status"] == "failed", f"{name} on {endpoint}: {batch['status']}"
        [error] = batch["errors"]["data"]
        assert (error["code"], error["line"], error["param"]) == (
            "invalid_line", 2, "input_file_id"
        ), name  # fmt: skip
        assert named in error["message"], f"{name}: {error['message']}"
        assert batch["request_counts"]["total"] == 0  # none of its lines was kept
    good = ended[-1]
    assert good["status"] == "completed" and good["request_counts"]["completed"] == 2
    # The engine saw the good job's two lines, and nothing of the bad files.
    assert sorted(r.user or "" for r in arrived) == ["seeded-0", "seeded-1"]
    assert success == 2
    print(f"{len(cases)} bad jobs failed at validation; engine saw {len(arrived)} (the good ones)")
