"""``whoseturn loadtest`` against servers that are not there: a second's check before
the run, one line that names the URL and what to do, exit status 1, no traceback; and
the same kind of line for a server that never starts or stops answering."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console

from loadtests import cli
from loadtests.harness.client import Record
from loadtests.harness.preflight import Server, Unreachable, check, failure_line, unanswered
from loadtests.harness.runs import ArmTarget, run_plan
from loadtests.harness.traffic import proxy_route
from loadtests.harness.workload_file import load_workload
from loadtests.support.processes import free_port, loopback_url
from tests.support.workloads import chat_class

pytestmark = pytest.mark.timeout(30)

WORKLOAD = {
    "name": "down",
    "model": "tiny",
    "plan": {"duration_s": 40, "warmup_s": 5},
    "classes": {
        "chat": chat_class({"process": "periodic", "rate": 2}, chars=200, max_tokens=4),
    },
}


def _workload(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({**WORKLOAD, **changes}))
    return path


def _nothing_there() -> str:
    return loopback_url(free_port())  # free a moment ago: nothing listens there


def test_a_target_that_is_down_is_said_in_one_line_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _nothing_there()
    out = tmp_path / "out"
    began = time.monotonic()
    status = cli.main("loadtest", [str(_workload(tmp_path)), "--target", url, "--out", str(out)])
    took = time.monotonic() - began
    assert status == 1
    assert took < 3.0  # not the workload's 40 s
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert url in err and "--target" in err and "whoseturn serve" in err
    assert not out.exists()  # nothing run, nothing written


def test_a_direct_engine_that_is_down_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    up, down = "http://proxy.test", "http://engine.test:8000"

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "engine.test":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"ready": True})
        return httpx.Response(200, json={"data": [{"id": "tiny"}]})

    servers = [Server(up, "--target"), Server(down, "--direct")]
    with pytest.raises(Unreachable) as caught:
        check(servers, "tiny", httpx.Client(transport=httpx.MockTransport(answer)))
    line = str(caught.value)
    assert line.startswith(f"nothing answers at {down} (--direct: [Errno 111] Connection refused)")
    assert "start it or give its base URL (without /v1) with --direct" in line


def _answers(routes: dict[str, httpx.Response]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        return routes.get(request.url.path, httpx.Response(404))

    return httpx.Client(transport=httpx.MockTransport(answer))


def _refusal(routes: dict[str, httpx.Response], flag: str = "--target") -> str:
    with pytest.raises(Unreachable) as caught:
        check([Server("http://s.test", flag)], "tiny", _answers(routes))
    return str(caught.value)


MODELS = {"/v1/models": httpx.Response(200, json={"data": [{"id": "tiny"}]})}
READY = {"/readyz": httpx.Response(200, json={"ready": True})}


def test_what_the_check_refuses_and_why() -> None:
    assert "give the proxy's base URL, without /v1, with --target" in _refusal({})
    other = {"/v1/models": httpx.Response(200, json={"data": [{"id": "llama"}]})}
    assert "serves llama, not the workload's model 'tiny'" in _refusal(other)
    failing = {"/v1/models": httpx.Response(500, text="boom")}
    assert "is up but failing (GET /v1/models: 500 boom)" in _refusal(failing)
    down = {**MODELS, "/readyz": httpx.Response(503, json={"ready": False, "engines_up": []})}
    assert "has no engine ready (GET /readyz: 503, engines up: [])" in _refusal(down)


def test_what_the_check_lets_through() -> None:
    check([Server("http://s.test", "--target")], "tiny", _answers({**MODELS, **READY}))
    keys = {"/v1/models": httpx.Response(401, json={"error": {}}), **READY}
    check([Server("http://s.test", "--target")], "tiny", _answers(keys))  # the workload's keys
    # an engine is not asked for /readyz (vLLM has none)
    check([Server("http://s.test", "--direct")], "tiny", _answers(MODELS))


def _record(status: int | None, error: str | None, closed: bool = False) -> Record:
    record = Record("chat-0", "chat", "http://s.test/v1/chat/completions", 0, 4, 0.0)
    record.status, record.error = status, error
    record.closed_at = 1.0 if closed else None
    return record


def test_a_run_without_any_answer_ends_the_command() -> None:
    refused = _record(None, "ConnectError: [Errno 111] Connection refused")
    with pytest.raises(Unreachable, match=r"no request of proxy \(warm 1/1\) got an answer"):
        unanswered([refused, refused], "proxy (warm 1/1)")
    unanswered([refused, _record(503, "no engine")], "run")  # a server answered
    unanswered([_record(None, None, closed=True)], "run")  # held, then closed by the client
    unanswered([], "run")


def test_a_server_that_stops_answering_ends_the_arm(tmp_path: Path) -> None:
    url = _nothing_there()
    chat = chat_class({"process": "periodic", "rate": 10}, chars=200, max_tokens=4)
    plan = {"duration_s": 0.5, "warmup_s": 0}
    workload = load_workload(_workload(tmp_path, plan=plan, classes={"chat": chat}))
    target = ArmTarget("proxy", proxy_route(url), url, {"proxy": url})
    console = Console(file=io.StringIO(), force_terminal=False)
    with pytest.raises(Unreachable) as caught:
        asyncio.run(run_plan(workload, target, out=tmp_path, console=console))
    assert f"to {url}/v1/chat/completions: ConnectError" in str(caught.value)


def test_a_lost_connection_is_one_line_naming_the_url() -> None:
    request = httpx.Request("GET", "http://s.test:8000/turn/log")
    line = failure_line(httpx.ReadError("connection reset", request=request))
    assert line == (
        "lost the connection to http://s.test:8000/turn/log (connection reset): "
        "is the server still running?"
    )


def test_an_engine_that_never_starts_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = {
        "count": 1,
        "command": "{python} -c 'raise SystemExit(3)' {port}",
        "ready_timeout_s": 20,
    }
    path = _workload(tmp_path, engines=engines, arms=["direct"])
    assert cli.main("loadtest", [str(path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "engine-0 (see " in err and "direct-engine-0.log) exited early (3)" in err
