"""A batch line is read as strictly as an interactive body: every bad body the
interactive routes refuse is a :class:`LineError` naming the line and the field,
a line over ``max_body_bytes`` too, and reading one costs no more memory than
that limit."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import pytest

from proxy.batch.lines import check_file, check_line, read_lines
from proxy.batch.runner import BatchRunner, RunnerLimits
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import LineError, NewBatch
from proxy.metrics import BatchMetrics
from tests.unit.api.test_hardening import BAD_BODIES, applies, bad_raw
from tests.unit.batch.test_runner import Engine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# Beyond the interactive cases: what a batch file gets wrong as often.
MORE_BAD: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("messages missing", {"messages": None}, "messages"),
    ("messages empty", {"messages": []}, "messages"),
    ("prompt missing", {"prompt": None}, "prompt"),
    ("temperature out of range", {"temperature": 3}, "temperature"),
    ("max_tokens beyond int64", {"max_tokens": 2**64}, "max_tokens"),
    ("n zero", {"n": 0}, "n"),
    ("top_p a string", {"top_p": "0.9"}, "top_p"),
]
# The field each raw case names, where the interactive table leaves it open.
RAW_PARAMS = {
    "NaN": "temperature",
    "Infinity": "top_p",
    "1e400": "max_tokens",
    "surrogate in text": "user",
    "surrogate in model": "model",
    "stream_options without stream": "stream_options",
    "include_usage as a string": "stream_options.include_usage",
}


def line_bytes(body: bytes, endpoint: str = CHAT, custom_id: str = "a") -> bytes:
    head = json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint})
    return head[:-1].encode() + b', "body": ' + body + b"}"


def good_line(custom_id: str = "a") -> bytes:
    return line_bytes(json.dumps(GOOD).encode(), custom_id=custom_id)


CASES = [
    pytest.param(endpoint, name, bad, param, id=f"{name} on {endpoint}")
    for endpoint in (CHAT, COMPLETIONS)
    for name, bad, param in [*BAD_BODIES, *MORE_BAD]
    if applies(endpoint, bad)
]


@pytest.mark.parametrize(("endpoint", "name", "bad", "param"), CASES)
def test_each_bad_body_is_a_line_error_naming_the_line_and_field(
    endpoint: str, name: str, bad: bytes | dict[str, Any], param: str | None
) -> None:
    raw = line_bytes(bad_raw(endpoint, bad), endpoint)
    with pytest.raises(LineError) as caught:
        check_line(raw, 7, endpoint)
    assert caught.value.line == 7
    assert str(caught.value).startswith("Line 7: ")
    field = param or RAW_PARAMS.get(name)
    if field is not None:
        assert f"`body.{field}`" in str(caught.value), str(caught.value)
    else:  # deeper than the parser goes: no field to name
        assert "nested deeper" in str(caught.value)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_good_body_passes_on_its_endpoint_only(endpoint: str) -> None:
    body = {"model": "m", "temperature": 2, "max_tokens": 2**63 - 1, "top_k": 5}
    body |= {"messages": GOOD["messages"]} if endpoint == CHAT else {"prompt": [1, 2]}
    spec = check_line(line_bytes(json.dumps(body).encode(), endpoint), 1, endpoint)
    assert json.loads(spec.body) == body  # the fields the proxy does not read pass too
    other = COMPLETIONS if endpoint == CHAT else CHAT
    with pytest.raises(LineError, match=r"`body\.(messages|prompt)` is required"):
        check_line(line_bytes(json.dumps(body).encode(), other), 1, other)


def test_a_body_that_is_not_an_object_is_named() -> None:
    with pytest.raises(LineError, match=r"^Line 2: `body`: The request body must be a JSON"):
        check_line(line_bytes(b"[1]"), 2, CHAT)


def test_a_non_finite_number_outside_the_body_is_refused_too() -> None:
    raw = b'{"custom_id": NaN, "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    with pytest.raises(LineError, match="Line 1: `custom_id`: NaN"):
        check_line(raw, 1, CHAT)


# -- the line's size --------------------------------------------------------------------


def padded(size: int, custom_id: str = "a") -> bytes:
    """A good line of exactly ``size`` bytes (no newline)."""
    line = good_line(custom_id)
    return line[:-1] + b" " * (size - len(line)) + b"}"


@pytest.mark.parametrize("newline", [b"\n", b""])
def test_a_line_at_the_limit_is_read_and_one_byte_more_is_refused(newline: bytes) -> None:
    limit = 1024
    taken = list(read_lines(io.BytesIO(padded(limit) + newline), CHAT, 10, max_line_bytes=limit))
    assert [spec.custom_id for spec in taken] == ["a"]
    data = good_line("x") + b"\n" + padded(limit + 1) + newline
    with pytest.raises(LineError) as caught:
        list(read_lines(io.BytesIO(data), CHAT, 10, max_line_bytes=limit))
    assert caught.value.line == 2
    assert str(caught.value) == "Line 2: longer than the limit of 1024 bytes."


class CountingFile(io.BytesIO):
    """A file that keeps the size of every piece read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.pieces: list[int] = []

    def readline(self, size: int | None = -1, /) -> bytes:
        piece = super().readline(size)
        self.pieces.append(len(piece))
        return piece


def test_an_over_long_line_is_not_read_past_the_limit() -> None:
    limit = 4096
    f = CountingFile(good_line("x") + b"\n" + padded(1_000_000) + b"\n" + good_line("y") + b"\n")
    with pytest.raises(LineError, match="Line 2: longer than"):
        list(read_lines(f, CHAT, 10, max_line_bytes=limit))
    assert max(f.pieces) == limit + 1
    assert sum(f.pieces) < 2 * limit  # the line's other ~995 kB were never read


def test_reading_a_file_with_a_huge_line_costs_memory_of_the_limit_not_the_line(
    tmp_path: Path,
) -> None:
    """The promise of docs/security.md: a body's memory is bounded by max_body_bytes."""
    limit = 256 * 1024
    path = tmp_path / "in.jsonl"
    with path.open("wb") as f:
        f.write(good_line("x") + b"\n" + padded(32 * 1024 * 1024) + b"\n")
    tracemalloc.start()
    try:
        with pytest.raises(LineError, match="Line 2: longer than"):
            check_file(path, CHAT, 10, max_line_bytes=limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * limit, f"peak {peak} bytes reading a 32 MiB line"


def test_check_file_names_the_first_bad_line_with_its_field(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    bad = line_bytes(b'{"model": "m", "messages": [{"role": "user"}], "temperature": NaN}')
    path.write_bytes(good_line("a") + b"\n\n" + bad + b"\n" + good_line("c") + b"\n")
    with pytest.raises(LineError) as caught:
        check_file(path, CHAT, 10)
    assert str(caught.value) == "Line 3: `body.temperature`: NaN is not a JSON number."


# -- at the runner's validation ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (line_bytes(b'{"model": "m", "messages": [{"role": "user"}], "top_p": Infinity}'),
         "Line 2: `body.top_p`: Infinity is not a JSON number."),
        (padded(5000), "Line 2: longer than the limit of 4096 bytes."),
    ],
)  # fmt: skip
async def test_the_runner_fails_a_job_whose_line_is_bad_and_sends_nothing(
    tmp_path: Path, bad: bytes, message: str
) -> None:
    """A job stored ``validating`` without the route's check (as after a restart
    with a smaller limit) is failed by the runner with OpenAI's ``errors``."""
    store = SQLiteStore(tmp_path / "b.db", lambda: 0.0)
    await store.open()
    spool = store.spool_path()
    spool.write_bytes(good_line("a") + b"\n" + bad + b"\n")
    uploaded = await store.add_file("batch", "in.jsonl", spool)
    await store.add_batch(NewBatch("batch_1", CHAT, uploaded.id, "24h", 86400, None))
    engine = Engine({})
    metrics = BatchMetrics()
    limits = RunnerLimits(poll_s=0.01, max_line_bytes=4096)
    runner = BatchRunner(store, engine.complete, metrics, limits, lambda: 0, lambda: True)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            while True:
                batch = await store.get_batch("batch_1")
                if batch is None or batch.status != "validating":
                    break
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    await store.close()
    assert batch is not None and batch.status == "failed"
    assert batch.errors == [
        {"code": "invalid_line", "message": message, "param": "input_file_id", "line": 2}
    ]
    assert sum(engine.tries.values()) == 0
