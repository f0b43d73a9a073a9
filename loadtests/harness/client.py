"""A streaming OpenAI client that times what a user sees: every request is streamed
(with ``include_usage``) and every content chunk's arrival is recorded.

Times are ``time.monotonic()`` seconds, the same clock in every process on the
machine, so they can be set against another process's (:mod:`loadtests.harness.stalls`).

The events are read with the bench's own SSE reader (:mod:`loadtests.engine_io`),
never with the proxy's relay code, on purpose: the load generator shares nothing
with the system under test, so a bug there cannot hide itself in the measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtests.engine_io import sse_events
from loadtests.harness.stalls import stopped_within
from loadtests.harness.validity import Assessment, assess


@dataclass
class Record:
    """One request's life as the client saw it, with its answer kept."""

    id: str
    kind: str  # "running", "new" (chat) or "batch"
    url: str
    prompt_tokens_sent: int
    max_tokens: int
    sent_at: float
    headers_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    # When the client closed the stream on purpose (:func:`close`), before its end.
    closed_at: float | None = None
    status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    proxy_queue_ms: float | None = None
    # The part of the queue wait spent waiting for the model to wake on its card
    # (``X-Whoseturn-Activation-Ms``); None when the request waited for no wake.
    proxy_activation_ms: float | None = None
    engine: str | None = None
    model: str | None = None  # the ``model`` the request asked for
    error: str | None = None
    text: str = ""
    # The JSON schema the prompt asks the answer to follow (extraction prompts), if any.
    schema: dict[str, Any] | None = None
    # The tenant that sent it (the workload file's name; "" for a request sent without a key).
    tenant: str = ""

    @property
    def tokens(self) -> int | None:
        """Prompt and completion tokens as the answer's usage counts them; None
        without usage (an error, or a stream closed before its end)."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def done(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.sent_at

    @property
    def worst_gap(self) -> float:
        times = self.token_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def ttft_net(self, stops: list[tuple[float, float]]) -> float | None:
        """Time to first token net of the time the machine was stopped meanwhile."""
        if not self.token_times:
            return None
        return (
            self.token_times[0]
            - self.sent_at
            - stopped_within(self.sent_at, self.token_times[0], stops)
        )

    def done_net(self, stops: list[tuple[float, float]]) -> float | None:
        """Completion time net of the time the machine was stopped meanwhile."""
        if self.finished_at is None:
            return None
        return (
            self.finished_at - self.sent_at - stopped_within(self.sent_at, self.finished_at, stops)
        )

    def worst_gap_net(self, stops: list[tuple[float, float]]) -> float:
        """The worst gap, each gap net of the time the machine was stopped within it
        (``stops``: start, length, from :mod:`loadtests.harness.stalls`)."""
        times = self.token_times
        return max(
            (b - a - stopped_within(a, b, stops) for a, b in itertools.pairwise(times)),
            default=0.0,
        )

    def assessment(self) -> Assessment:
        """The answer judged (:func:`loadtests.harness.validity.assess`). A stream the
        client closed on purpose is judged on what it streamed: whole (so valid) if it
        streamed tokens, without error, until then; its schema is not checked (a
        partial answer)."""
        if self.closed_at is not None:
            return Assessment(self.status == 200 and self.error is None and bool(self.token_times))
        return assess(
            status=self.status,
            error=self.error,
            finish_reason=self.finish_reason,
            completion_tokens=self.completion_tokens,
            max_tokens=self.max_tokens,
            text=self.text,
            schema=self.schema,
        )

    @property
    def whole(self) -> bool:
        """A whole answer (:mod:`loadtests.harness.validity`): status 200, no error, ended by
        length at exactly ``max_tokens`` tokens (or, asked for JSON with a schema, by
        stop within them); for a stream closed early, see :meth:`assessment`."""
        return self.assessment().whole

    @property
    def schema_valid(self) -> bool | None:
        """Whether a whole answer follows its prompt's schema; None without a schema,
        for an answer not whole, and for a stream closed early (a partial answer)."""
        return self.assessment().schema_valid

    @property
    def valid(self) -> bool:
        """Whole and, when the prompt carries a schema, schema-valid."""
        return self.assessment().valid

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Record:
        """A record from a row of ``to_json`` (other keys of the row are ignored)."""
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})

    def to_json(self) -> dict[str, Any]:
        """The fields, the times derived from them and the verdict (judged once)."""
        times = {"ttft": self.ttft, "done": self.done, "worst_gap": self.worst_gap}
        return {**asdict(self), **times, **self.assessment().to_json()}


async def stream(
    http: httpx.AsyncClient,
    record: Record,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Record:
    """POST ``body`` (streamed, with usage) to ``record.url`` with ``headers`` (a
    tenant's ``Authorization``) and fill in ``record``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    record.model = body.get("model")
    record.sent_at = time.monotonic()
    try:
        async with http.stream("POST", record.url, json=body, headers=headers) as response:
            record.headers_at = time.monotonic()
            record.status = response.status_code
            record.engine = response.headers.get("x-whoseturn-engine")
            queued = response.headers.get("x-whoseturn-queue-ms")
            record.proxy_queue_ms = float(queued) if queued is not None else None
            woke = response.headers.get("x-whoseturn-activation-ms")
            record.proxy_activation_ms = float(woke) if woke is not None else None
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:500]
                return record
            async for now, event in sse_events(response, time.monotonic):
                _event(record, event, now)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"
    record.finished_at = time.monotonic()
    return record


async def close(record: Record, task: asyncio.Task[Record]) -> None:
    """Close ``record``'s stream (``task`` runs :func:`stream`) if it is still open: the
    client hangs up, as a user who has read enough would."""
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    record.closed_at = record.finished_at = time.monotonic()


def _event(record: Record, data: dict[str, Any], now: float) -> None:
    if "error" in data:
        record.error = json.dumps(data["error"])[:500]
    usage = data.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    for choice in data.get("choices") or []:
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            # vLLM's return_token_ids: every token, even one whose text is held back
            # until a character is whole (this model's gibberish does that for
            # seconds); tokens that come together share a time.
            record.token_times.extend([now] * len(ids))
        elif piece:
            record.token_times.append(now)
        record.text += piece or ""
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
