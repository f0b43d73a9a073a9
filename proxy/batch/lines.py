"""Batch lines, pure: an input line checked, a request built from it, and the
output or error line written for its answer (OpenAI's line shapes).

A line is read as strictly as an interactive body (:mod:`proxy.openai.bodies`): the same
JSON rules, its ``body`` the same model of the endpoint's request, and no longer
than ``max_body_bytes``; a line that fails is a :class:`LineError` naming it and
the field to blame.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from proxy.batch.quality import quality
from proxy.batch.store import Json, LineError, LineResult, LineSpec
from proxy.config import ANONYMOUS, Tenant
from proxy.openai.answers import Answer
from proxy.openai.bodies import BodyError, NotJSON, check_completion, parse_json
from proxy.openai.request import ChatRequest, describe
from proxy.scheduler import TrafficClass

USAGE = ("prompt_tokens", "completion_tokens")
MAX_LINE_BYTES = 8 * 1024 * 1024
"""A line's limit where none is given: the default ``max_body_bytes``."""


def check_line(raw: bytes, number: int, endpoint: str) -> LineSpec:
    """One input line, or :class:`LineError` naming it (``number`` counts from 1)
    and the field to blame. The line is parsed once."""
    try:
        line = parse_json(raw)
    except NotJSON as exc:
        raise LineError(number, f"not valid JSON: {exc.detail}") from None
    except BodyError as exc:
        raise LineError(number, exc.message) from None
    if not isinstance(line, dict):
        raise LineError(number, "expected a JSON object.")
    for key in ("custom_id", "method", "url", "body"):
        if key not in line:
            raise LineError(number, f"missing `{key}`.")
    if not isinstance(line["custom_id"], str) or not line["custom_id"]:
        raise LineError(number, "`custom_id` must be a non-empty string.")
    if line["method"] != "POST":
        raise LineError(number, "`method` must be POST.")
    if line["url"] != endpoint:
        raise LineError(number, f"`url` {line['url']!r} differs from the batch's {endpoint!r}.")
    try:
        body = check_completion(line["body"], chat=endpoint.endswith("/chat/completions"))
    except BodyError as exc:
        raise LineError(number, exc.under("body").message) from None
    return LineSpec(number, line["custom_id"], json.dumps(body))


def read_lines(
    f: IO[bytes], endpoint: str, max_lines: int, *, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[LineSpec]:
    """The file's lines checked one by one, as a stream (blank lines skipped). No
    more than ``max_line_bytes`` (and its newline) of a line is read: a longer line
    is a :class:`LineError`, the rest of it unread."""
    count, number = 0, 0
    while raw := f.readline(max_line_bytes + 1):
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            raise LineError(number, f"longer than the limit of {max_line_bytes} bytes.")
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            raise LineError(number, f"more than the limit of {max_lines} requests.")
        yield check_line(raw, number, endpoint)


def check_file(
    path: Path, endpoint: str, max_lines: int, *, max_line_bytes: int = MAX_LINE_BYTES
) -> int:
    """Read a whole input file as :func:`read_lines` does, and also find a repeated
    ``custom_id`` or an empty file (what the store would refuse); the number of
    requests. Raises :class:`LineError`. Keeps a 16-byte digest per line, not the ids."""
    seen: set[bytes] = set()
    count = 0
    with path.open("rb") as f:
        for spec in read_lines(f, endpoint, max_lines, max_line_bytes=max_line_bytes):
            digest = hashlib.blake2b(spec.custom_id.encode(), digest_size=16).digest()
            if digest in seen:
                raise LineError(spec.idx, f"duplicate custom_id `{spec.custom_id}`")
            seen.add(digest)
            count += 1
    if not count:
        raise LineError(0, "The input file has no requests.")
    return count


def line_request(
    body: Json, endpoint: str, *, tenant: Tenant = ANONYMOUS, flow: str = ""
) -> ChatRequest:
    """The request a line makes, as the batch routes would read it (batch class, one
    whole answer), for its job's ``tenant``, sharing that tenant's part with the
    job's other lines (``flow``: the job's id)."""
    plain = {**body, "stream": False}
    plain.pop("stream_options", None)
    return describe(body, endpoint, TrafficClass.BATCH, plain, tenant=tenant, flow=flow)


def _request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def answered(custom_id: str, answer: Answer, asked: Json) -> LineResult:
    """The line for an answer the engine (or the proxy) gave: OpenAI's shape, written
    around the answer's bytes (:func:`_ascii`); the usage and the quality
    (:func:`proxy.batch.quality.quality`: every answered line is ``valid`` or
    ``invalid``) are read from its object, which is never parsed again."""
    status, body = answer.status, answer.body
    ok = 200 <= status < 300
    head = json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id})
    line = (
        f'{head[:-1]}, "response": {{"status_code": {status}, "request_id": '
        f'"{_request_id()}", "body": {_ascii(answer)}}}, "error": null}}'
    )
    usage = body.get("usage") if ok else None
    tokens = [usage.get(k) if isinstance(usage, dict) else 0 for k in USAGE]
    prompt, completion = (t if isinstance(t, int) else 0 for t in tokens)
    return LineResult(ok, line, quality(asked, body) if ok else "", prompt, completion)


def _ascii(answer: Answer) -> str:
    """The answer's JSON text for its line, ASCII as ever: its bytes as they came
    where they are ASCII (most answers), else its object written once (escaping is
    what ``json.dumps`` does fastest)."""
    if answer.raw.isascii():
        return answer.raw.decode("ascii")
    return json.dumps(answer.body)


def failed(custom_id: str, code: str, message: str) -> LineResult:
    """The error-file line for a line that got no answer."""
    line = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return LineResult(False, json.dumps(line))
