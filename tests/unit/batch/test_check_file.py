"""The whole-file check ``POST /v1/batches`` runs before a job exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.batch.lines import check_file
from proxy.batch.store import LineError

CHAT = "/v1/chat/completions"


def line(custom_id: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_good_file_counts_its_requests_and_skips_blank_lines(tmp_path: Path) -> None:
    assert check_file(write(tmp_path, line("a"), "", line("b")), CHAT, 10) == 2


@pytest.mark.parametrize(
    ("lines", "limit", "number", "why"),
    [
        ((line("a"), line("b"), line("a")), 10, 3, "duplicate custom_id `a`"),
        ((line("a"), "{oops"), 10, 2, "not valid JSON"),
        ((line("a"), line("b"), line("c")), 2, 3, "limit of 2"),
        (("",), 10, 0, "no requests"),
    ],
)
def test_the_first_bad_line_is_named(
    tmp_path: Path, lines: tuple[str, ...], limit: int, number: int, why: str
) -> None:
    with pytest.raises(LineError) as caught:
        check_file(write(tmp_path, *lines), CHAT, limit)
    assert caught.value.line == number and why in str(caught.value)
