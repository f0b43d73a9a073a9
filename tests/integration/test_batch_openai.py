"""The official ``openai`` client runs the Files and Batch API against the proxy in
front of a simulated engine (real time, so long lines are still running when a job
is cancelled or expires): upload, create, poll to the end, read the output and
error files, list, cancel, expire; every validation case answers its 4xx. Every
test runs on both stores: SQLite, and a real PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
from openai.types import Batch

from tests.support.postgres import fresh_database

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"
MAX_FILE_BYTES = 50_000
MAX_LINES = 40


def chat_line(custom_id: str, model: str = MODEL, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SimServer, ProxyServer]]:
    if request.param == "sqlite":
        store = {"batch_store_path": str(tmp_path_factory.mktemp("batch") / "batch.db")}
    else:
        dsn = fresh_database(request.getfixturevalue("postgres_dsn"))
        store = {"batch_store": "postgres", "batch_dsn": dsn}
    # Real time: a long line is still running when a test cancels or expires its job.
    with (
        run_server(sim_settings(time_scale=1.0)) as sim,
        run_proxy(
            [engine(sim.base_url, "sim-0")],
            **store,
            batch_max_file_bytes=MAX_FILE_BYTES,
            batch_max_lines=MAX_LINES,
            batch_retry_backoff_s=0.01,
        ) as proxy,
    ):
        yield sim, proxy


@pytest.fixture
def proxy(pair: tuple[SimServer, ProxyServer]) -> ProxyServer:
    return pair[1]


@pytest.fixture
def client(proxy: ProxyServer) -> Iterator[openai.OpenAI]:
    with proxy.openai() as c:
        yield c


def submit(client: openai.OpenAI, lines: list[Any], window: str = "24h") -> Batch:
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=CHAT,
        completion_window=window,  # type: ignore[arg-type]
        metadata={"team": "tests"},
    )


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 20) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.05)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_whole_cycle(client: openai.OpenAI, proxy: ProxyServer) -> None:
    schema = {"type": "object", "required": ["answer"]}
    lines = [chat_line(f"q-{i}", max_tokens=4) for i in range(12)]
    lines.append(chat_line("json", max_tokens=4, response_format={"type": "json_object"}))
    lines.append(
        chat_line(
            "schema",
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"schema": schema}},
        )
    )
    lines.append(chat_line("lost", model="no-such-model"))
    created = submit(client, lines)
    assert created.status == "validating" and created.metadata == {"team": "tests"}
    done = wait_done(client, created.id)
    assert done.status == "completed", done
    assert done.in_progress_at is not None and done.in_progress_at >= created.created_at
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (15, 14)
    assert done.request_counts.failed == 1
    out = read_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines[:-1])
    first = out[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["object"] == "chat.completion"
    errors = read_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in errors] == ["lost"]
    assert errors[0]["response"]["status_code"] == 404
    # The simulated engine's text is not JSON: both structured answers are invalid.
    assert proxy.metric("whoseturn_batch_records_total", status="invalid") >= 2
    assert proxy.metric("whoseturn_batch_records_total", status="failed") >= 1
    assert proxy.metric("whoseturn_batch_jobs", status="completed") >= 1 or proxy.wait_for(
        lambda: proxy.metric("whoseturn_batch_jobs", status="completed") >= 1
    )
    listed = client.batches.list(limit=100)
    assert created.id in [b.id for b in listed.data]
    assert done.output_file_id is not None
    with pytest.raises(openai.BadRequestError, match="purpose `batch_output`"):
        client.batches.create(
            input_file_id=done.output_file_id, endpoint=CHAT, completion_window="24h"
        )


def test_list_pages_with_after(client: openai.OpenAI) -> None:
    ids = [submit(client, [chat_line("a", max_tokens=1)]).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == ids[0]
    for batch_id in ids:
        wait_done(client, batch_id)


def test_cancel_stops_the_job(client: openai.OpenAI, pair: tuple[SimServer, ProxyServer]) -> None:
    sim = pair[0]
    lines = [chat_line(f"c-{i}", max_tokens=400, min_tokens=400) for i in range(MAX_LINES)]
    created = submit(client, lines)
    sim.wait_for(lambda: sim.requests_running() > 0, timeout=10)
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(client, created.id, timeout_s=10)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts is not None and done.request_counts.completed < MAX_LINES
    assert len(read_lines(client, done.output_file_id)) == done.request_counts.completed
    sim.wait_for(lambda: sim.requests_running() == 0, timeout=5)


def test_expiry_keeps_partial_output(client: openai.OpenAI) -> None:
    lines = [chat_line(f"e-{i}", max_tokens=400, min_tokens=400) for i in range(MAX_LINES)]
    created = submit(client, lines, window="1s")
    done = wait_done(client, created.id, timeout_s=10)
    assert done.status == "expired" and done.expired_at is not None
    counts = done.request_counts
    assert counts is not None and counts.completed < MAX_LINES
    assert counts.completed + counts.failed == counts.total == MAX_LINES
    out, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert len(out) == counts.completed and len(errors) == counts.failed
    assert sorted(x["custom_id"] for x in out + errors) == sorted(x["custom_id"] for x in lines)
    expired = [x for x in errors if x["error"] and x["error"]["code"] == "batch_expired"]
    assert len(expired) == counts.failed and all(x["response"] is None for x in expired)


def test_file_routes(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("x.jsonl", jsonl([chat_line("a")])), purpose="batch")
    assert (uploaded.purpose, uploaded.filename) == ("batch", "x.jsonl")
    assert client.files.retrieve(uploaded.id).bytes == uploaded.bytes
    assert json.loads(client.files.content(uploaded.id).text)["custom_id"] == "a"
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.BadRequestError, match="No input file"):
        client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")


def test_upload_over_the_limit_is_413(client: openai.OpenAI) -> None:
    big = jsonl([chat_line("x" * 2000 + str(i)) for i in range(40)])
    assert len(big) > MAX_FILE_BYTES
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert caught.value.status_code == 413


def test_upload_needs_purpose_batch(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in chat_line("a").items() if k != key}


BAD_LINES: list[tuple[list[Any], str]] = [
    ([], "no requests"),
    ([chat_line("a"), "{not json"], "Line 2: not valid JSON"),
    ([chat_line("a"), "[1, 2]"], "Line 2: expected a JSON object"),
    (
        [without("custom_id")],
        "Line 1: missing `custom_id`",
    ),
    ([without("method")], "Line 1: missing `method`"),
    ([without("url")], "Line 1: missing `url`"),
    ([without("body")], "Line 1: missing `body`"),
    ([{**chat_line("a"), "url": "/v1/completions"}], "Line 1: `url`"),
    ([chat_line("a"), chat_line("b"), chat_line("a")], "Line 3: duplicate custom_id `a`"),
    ([chat_line(str(i)) for i in range(MAX_LINES + 1)], f"limit of {MAX_LINES}"),
]


@pytest.mark.parametrize(("lines", "message"), BAD_LINES)
def test_bad_lines_are_400_naming_the_line(
    client: openai.OpenAI, lines: list[Any], message: str
) -> None:
    """Every line is checked when the job is created: a bad one is a 400 that names
    it, through the official client, and no job is stored."""
    uploaded = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    before = len(client.batches.list(limit=100).data)
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert caught.value.status_code == 400 and message in caught.value.message
    assert len(client.batches.list(limit=100).data) == before


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ({"endpoint": CHAT, "completion_window": "soon"}, "completion_window"),
        ({"endpoint": CHAT, "completion_window": "24h", "input_file_id": "file-x"}, "No input"),
    ],
)
def test_bad_batch_requests_are_400(
    proxy: ProxyServer, client: openai.OpenAI, body: dict[str, Any], message: str
) -> None:
    uploaded = client.files.create(file=("ok.jsonl", jsonl([chat_line("a")])), purpose="batch")
    answer = proxy.http.post("/v1/batches", json={"input_file_id": uploaded.id, **body})
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]


def test_unknown_ids_are_404(proxy: ProxyServer) -> None:
    for path in ("/v1/batches/batch_x", "/v1/files/file-x", "/v1/files/file-x/content"):
        assert proxy.http.get(path).status_code == 404
    assert proxy.http.post("/v1/batches/batch_x/cancel").status_code == 404


def test_ids_no_file_could_have_are_404_not_500(proxy: ProxyServer) -> None:
    """A NUL byte in a path id or an upload's name never reaches the database
    (PostgreSQL refuses NUL in text: that was a 500)."""
    for ident in ("a%00b", "%00", "x" * 300, "%C3%A9"):
        for path in (f"/v1/batches/{ident}", f"/v1/files/{ident}", f"/v1/files/{ident}/content"):
            got = proxy.http.get(path)
            assert got.status_code == 404, (path, got.text)
        assert proxy.http.delete(f"/v1/files/{ident}").status_code == 404
        assert proxy.http.post(f"/v1/batches/{ident}/cancel").status_code == 404
    form = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="in\x00put.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n{}\n\r\n--b--\r\n"
    )
    headers = {"content-type": "multipart/form-data; boundary=b"}
    up = proxy.http.post("/v1/files", content=form, headers=headers)
    assert up.status_code == 200, up.text
    assert up.json()["filename"] == "input.jsonl"


def test_store_holds_the_files(proxy: ProxyServer, client: openai.OpenAI) -> None:
    """SQLite: a database file and a folder beside it; PostgreSQL: the bytes in the
    database (any replica serves them)."""
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    if proxy.settings.batch.store == "sqlite":
        path = Path(proxy.settings.batch.store_path)
        assert path.exists() and Path(f"{path}.files/{uploaded.id}").is_file()
        return
    with psycopg.connect(proxy.settings.batch.dsn) as conn:
        sql = "SELECT string_agg(data, '' ORDER BY n) FROM file_chunks WHERE file_id = %s"
        row = conn.execute(sql, (uploaded.id,)).fetchone()
    assert row is not None and row[0] == jsonl([chat_line("a")])


def test_the_proxys_api_keys_guard_the_batch_routes(tmp_path: Path, shared_sim: SimServer) -> None:
    with run_proxy(
        [engine(shared_sim.base_url, "sim-0")],
        api_keys=["secret"],
        batch_store_path=str(tmp_path / "b.db"),
    ) as guarded:
        guarded_routes = [
            ("GET", "/v1/files"),
            ("GET", "/v1/batches"),
            ("POST", "/v1/batches"),
            ("GET", "/v1/files/file-x/content"),
        ]
        for method, path in guarded_routes:
            assert guarded.http.request(method, path).status_code == 401, path
        keyed = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="secret", max_retries=0)
        with keyed as client:
            uploaded = client.files.create(
                file=("k.jsonl", jsonl([chat_line("a")])), purpose="batch"
            )
            assert client.files.retrieve(uploaded.id).id == uploaded.id


def test_a_running_job_is_seen_on_status_metrics_and_the_decision_log(
    client: openai.OpenAI, pair: tuple[SimServer, ProxyServer]
) -> None:
    """A short job runs first, so the model has a measured rate: the long job that
    follows carries an estimate from its first moments, on ``/v1/batches``,
    ``/status/batches`` and ``/metrics``; the decision log names each line's job."""
    sim, proxy = pair
    short = wait_done(
        client, submit(client, [chat_line(f"s-{i}", max_tokens=4) for i in range(12)]).id
    )
    assert short.status == "completed"
    log = proxy.http.get("/turn/log", params={"limit": 1000}).json()["decisions"]
    named = {d["batch"]["custom_id"] for d in log if (d["batch"] or {}).get("id") == short.id}
    assert named == {f"s-{i}" for i in range(12)}
    assert all(d["batch"] is None for d in log if not d["request_id"].startswith("batch_"))
    assert proxy.metric("whoseturn_batch_tokens_total", kind="completion") >= 12 * 4
    assert proxy.metric("whoseturn_batch_records_total", status="completed") >= 12

    lines = [chat_line(f"l-{i}", max_tokens=400, min_tokens=400) for i in range(MAX_LINES)]
    long = submit(client, lines)

    def row() -> dict[str, Any] | None:
        jobs = proxy.http.get("/status/batches").json()["jobs"]
        found = [j for j in jobs if j["id"] == long.id and j["estimated_completion_at"]]
        return found[0] if found else None

    proxy.wait_for(lambda: row() is not None, timeout=10)
    seen = row()
    assert seen is not None and seen["status"] == "in_progress" and seen["total"] == MAX_LINES
    assert seen["records_per_hour"] > 0 and seen["window_reachable"] is True
    assert seen["estimated_completion_at"] <= seen["expires_at"]
    retrieved = client.batches.retrieve(long.id).model_dump()
    assert retrieved["whoseturn"]["records_per_hour"] > 0
    assert retrieved["whoseturn"]["window_reachable"] is True
    eta = "whoseturn_batch_estimated_completion_timestamp_seconds"
    assert proxy.metric(eta, batch=long.id) >= long.created_at
    proxy.wait_for(lambda: proxy.metric("whoseturn_batch_jobs", status="in_progress") >= 1)
    client.batches.cancel(long.id)
    wait_done(client, long.id, timeout_s=10)
    assert client.batches.retrieve(long.id).model_dump()["whoseturn"] is None
    assert not [j for j in proxy.http.get("/status/batches").json()["jobs"] if j["id"] == long.id]
    sim.wait_for(lambda: sim.requests_running() == 0, timeout=5)
