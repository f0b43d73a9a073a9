"""``/openapi.json`` describes every answer: schemathesis runs every operation the
proxy publishes, in front of a simulated engine, with the Batch API on (SQLite) and
off, through all its phases (schema examples, coverage of each parameter's edges and
of the methods a path does not allow, random fuzzing, stateful sequences) and all its
checks: no 5xx, every status, content type, body and header as documented, ``Allow``
listing the path's methods, schema-invalid input refused and schema-valid input
taken. The few checks turned off for an operation, each with its reason, are in
``schemathesis.toml`` beside this file.

schemathesis runs as its own command against the proxy on a loopback socket (its
JUnit report read back), with a fixed seed and a bounded number of examples per
operation (about 20 s a run on two cores). A run against a route that answers a
status its schema does not name fails, as the last test shows."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.support.served import serve_app

from .proxyserver import engine, run_proxy
from .simserver import SimServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CONFIG = Path(__file__).with_name("schemathesis.toml")
EXAMPLES = 15
SEED = 26
METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def run_schemathesis(base_url: str, report: Path) -> tuple[str, dict[str, str | None]]:
    """schemathesis against ``base_url``'s ``/openapi.json``: its output, and each
    tested operation with its failure's text (None: it passed)."""
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG),
        "run", f"{base_url}/openapi.json",
        "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--workers", "1",
        "--request-timeout", "10", "--generation-database", "none", "--no-color",
        "--report", "junit", "--report-junit-path", str(report),
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=200, check=False, cwd=report.parent
    )
    output = done.stdout + done.stderr
    assert report.exists(), output[-4000:]
    results: dict[str, str | None] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        results[str(case.get("name"))] = None if bad is None else str(bad.text)
    return output, results


def published(document: dict[str, Any]) -> set[str]:
    """``METHOD /path`` of every operation the schema publishes."""
    return {
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
        if method in METHODS
    }


@pytest.mark.parametrize("batch_api", ["on", "off"])
def test_every_answer_is_documented(shared_sim: SimServer, tmp_path: Path, batch_api: str) -> None:
    # "off" is said outright: the Batch API is on by default, in the session's store
    store = (
        {"batch_store_path": str(tmp_path / "batch.db")}
        if batch_api == "on"
        else {"batch_store": "off"}
    )
    with run_proxy([engine(shared_sim.base_url, "sim-0")], **store) as proxy:
        operations = published(proxy.http.get("/openapi.json").json())
        output, results = run_schemathesis(proxy.base_url, tmp_path / "junit.xml")
    failed = {name: text for name, text in results.items() if text is not None}
    assert not failed, "\n\n".join(f"{name}:\n{text}" for name, text in failed.items())
    assert "POST /v1/batches" in operations and "GET /v1/files/{file_id}" in operations
    assert operations <= set(results), output[-4000:]  # every operation was run


def test_an_undocumented_status_fails_the_run(tmp_path: Path) -> None:
    """The same run, against a route that answers 418 where its schema says 200
    only, fails naming it (so a run that passes has checked the statuses)."""
    app = FastAPI()

    @app.get("/teapot", responses={200: {"description": "Tea."}})
    async def teapot() -> JSONResponse:
        return JSONResponse({"error": "I am a teapot"}, status_code=418)

    with serve_app(app, "the teapot") as (base_url, _):
        _, results = run_schemathesis(base_url, tmp_path / "junit.xml")
    failure = results["GET /teapot"]
    assert failure is not None and "Undocumented status code" in failure, results
