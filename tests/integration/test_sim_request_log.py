"""The simulated engine's request log (``--request-log``): every generation request
that reached it, with the ids a client gave it, its status and how it ended."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import httpx
import pytest

from loadtests import cli as bench
from loadtests.sim.server.requestlog import RequestLogReader

from .simserver import MODEL, run_server, sim_settings

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"


def ask(user: str, **extra: object) -> dict[str, object]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": user}
    return {**body, "max_tokens": 3, **extra}


def test_each_request_is_logged_when_it_starts_and_when_it_ends(tmp_path: Path) -> None:
    path = tmp_path / "engine.jsonl"
    settings = dataclasses.replace(sim_settings(time_scale=1.0), request_log=path)
    log = RequestLogReader(path)
    with run_server(settings) as sim:
        before = time.time()
        whole = sim.http.post(CHAT, json=ask("whole"), headers={"X-Request-Id": "r-1"})
        assert whole.status_code == 200, whole.text
        with sim.http.stream("POST", CHAT, json=ask("streamed", stream=True)) as streamed:
            assert streamed.status_code == 200
            streamed.read()
        text = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": "r-2"}
        assert sim.http.post("/v1/completions", json=text).status_code == 200
        refused = sim.http.post(CHAT, json=ask("refused", max_tokens=-1))
        assert refused.status_code == 400
        with httpx.Client(base_url=sim.base_url, timeout=10) as other:
            long = ask("left", stream=True, max_tokens=1500)
            with other.stream("POST", CHAT, json=long) as leaving:
                next(leaving.iter_lines())
        assert sim.http.get("/v1/models").status_code == 200  # not a generation: not logged

        def all_ended() -> bool:
            log.read()
            return len(log.requests) == 5 and not log.running()

        sim.wait_for(all_ended)
    seen = [(r.path, r.user, r.request_id, r.model, r.status, r.outcome) for r in log.requests]
    assert seen == [
        (CHAT, "whole", "r-1", MODEL, 200, "finished"),
        (CHAT, "streamed", None, MODEL, 200, "finished"),
        ("/v1/completions", None, "r-2", MODEL, 200, "finished"),
        (CHAT, "refused", None, MODEL, 400, "finished"),
        (CHAT, "left", None, MODEL, 200, "aborted"),
    ]
    assert [r.seq for r in log.requests] == [1, 2, 3, 4, 5]
    starts = [r.started for r in log.requests]
    assert before <= starts[0] and starts == sorted(starts)  # in the order sent
    # each ends after it starts (the end of one may be logged just after the client,
    # which has its last byte, sent the next)
    assert all(r.ended is not None and r.ended >= r.started for r in log.requests)


def test_the_flag_sets_the_log_and_none_is_the_default(tmp_path: Path) -> None:
    given = bench.sim_settings(bench.parse("sim", ["--request-log", str(tmp_path / "x")]))
    assert given.request_log == tmp_path / "x"
    assert bench.sim_settings(bench.parse("sim", [])).request_log is None
