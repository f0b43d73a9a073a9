"""The load-test client (loadtests.harness.client): what a record says about one request, the
parsing of vLLM-shaped stream chunks, and a whole streamed answer through
``httpx.MockTransport``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loadtests.harness.client import Record, _event, stream

Json = dict[str, Any]
URL = "http://engine/v1/chat/completions"


def record(**fields: Any) -> Record:
    base: Json = {
        "id": "r",
        "kind": "new",
        "url": URL,
        "prompt_tokens_sent": 0,
        "max_tokens": 4,
        "sent_at": 10.0,
    }
    return Record(**{**base, **fields})


def whole(**fields: Any) -> Record:
    """A record of a whole answer: every check of ``valid`` passes."""
    base: Json = {
        "status": 200,
        "finish_reason": "length",
        "completion_tokens": 4,
        "token_times": [10.5, 10.6, 10.7, 10.8],
        "finished_at": 11.0,
    }
    return record(**{**base, **fields})


# -- the record's derived times ---------------------------------------------------------


def test_ttft_is_the_first_token_after_sending_and_none_without_tokens() -> None:
    assert record().ttft is None
    assert record(token_times=[10.25, 10.5]).ttft == pytest.approx(0.25)


def test_done_is_the_end_after_sending_and_none_before_the_end() -> None:
    assert record().done is None
    assert record(finished_at=12.5).done == pytest.approx(2.5)


def test_worst_gap_is_the_longest_wait_between_two_tokens() -> None:
    assert record().worst_gap == 0.0
    assert record(token_times=[11.0]).worst_gap == 0.0
    gaps = record(token_times=[11.0, 11.1, 11.9, 12.0])
    assert gaps.worst_gap == pytest.approx(0.8)


def test_worst_gap_does_not_count_the_wait_for_the_first_token() -> None:
    assert record(sent_at=0.0, token_times=[5.0, 5.1]).worst_gap == pytest.approx(0.1)


# Times below are exact in binary, so that the sums and differences are exact too.
TIMES = [1.0, 1.25, 2.0, 2.25, 2.5]  # gaps 0.25, 0.75, 0.25, 0.25


def test_worst_gap_net_of_no_stops_is_the_worst_gap() -> None:
    assert record().worst_gap_net([]) == 0.0
    assert record(token_times=[11.0]).worst_gap_net([]) == 0.0
    gaps = record(token_times=[11.0, 11.1, 11.9, 12.0])
    assert gaps.worst_gap_net([]) == gaps.worst_gap == pytest.approx(0.8)
    assert record(token_times=TIMES).worst_gap_net([]) == 0.75


def test_no_tokens_or_one_token_have_no_gap_whatever_the_stops() -> None:
    assert record().worst_gap_net([(0.0, 100.0)]) == 0.0
    assert record(token_times=[11.0]).worst_gap_net([(10.5, 1.0)]) == 0.0


# One gap of 2 s, from 10.0 to 12.0: a record of two tokens has just that gap.
GAP = [10.0, 12.0]


@pytest.mark.parametrize(
    ("stop", "net"),
    [
        pytest.param((10.5, 0.5), 1.5, id="inside-the-gap"),
        pytest.param((11.0, 0.0625), 1.9375, id="a-short-stop-takes-off-only-its-length"),
        pytest.param((9.5, 1.0), 1.5, id="runs-into-it-counts-its-overlap"),
        pytest.param((11.75, 1.0), 1.75, id="runs-out-of-it-counts-its-overlap"),
        pytest.param((10.0, 2.0), 0.0, id="exactly-it"),
        pytest.param((9.0, 5.0), 0.0, id="covers-it-and-more"),
        pytest.param((9.0, 1.0), 2.0, id="ends-as-the-gap-opens"),
        pytest.param((12.0, 1.0), 2.0, id="starts-as-the-gap-closes"),
        pytest.param((5.0, 1.0), 2.0, id="well-before-it"),
        pytest.param((20.0, 1.0), 2.0, id="well-after-it"),
    ],
)
def test_a_gap_is_net_of_the_part_of_it_a_stop_covers(
    stop: tuple[float, float], net: float
) -> None:
    assert record(token_times=GAP).worst_gap_net([stop]) == net


@pytest.mark.parametrize(
    ("stops", "net"),
    [
        # 0.25 + 0.5 stopped: each takes off its own length
        pytest.param([(10.25, 0.25), (11.0, 0.5)], 1.25, id="two-apart"),
        # (10.5, 11.5) and (11.0, 12.0) cover (10.5, 12.0): 1.5, not 1.0 + 1.0
        pytest.param([(10.5, 1.0), (11.0, 1.0)], 0.5, id="overlapping-not-counted-twice"),
        pytest.param([(11.0, 1.0), (10.5, 1.0)], 0.5, id="overlapping-in-either-order"),
        # the second lies inside the first: 1.5 stopped, not 2.0
        pytest.param([(10.0, 1.5), (10.5, 0.5)], 0.5, id="one-inside-another"),
        pytest.param([(10.5, 0.5), (10.5, 0.5)], 1.5, id="the-same-stop-twice"),
        # end to end, they cover (10.5, 11.5) once
        pytest.param([(10.5, 0.5), (11.0, 0.5)], 1.0, id="touching-each-other"),
        # only the one inside the gap counts
        pytest.param([(5.0, 1.0), (10.5, 0.5), (20.0, 3.0)], 1.5, id="with-stops-outside"),
    ],
)
def test_several_stops_in_one_gap_take_off_the_time_they_cover_together(
    stops: list[tuple[float, float]], net: float
) -> None:
    assert record(token_times=GAP).worst_gap_net(stops) == net


def test_a_stop_over_the_worst_gap_can_leave_another_gap_the_worst() -> None:
    r = record(token_times=TIMES)
    # the 0.75 gap (1.25, 2.0) nets to 0.125: the 0.25 gaps are now the worst
    assert r.worst_gap_net([(1.25, 0.625)]) == 0.25
    # but a short stop leaves it the worst, less only that stop
    assert r.worst_gap_net([(1.5, 0.0625)]) == 0.6875


def test_a_stop_over_several_gaps_takes_off_from_each_only_its_own_part() -> None:
    r = record(token_times=TIMES)
    # (1.625, 2.125) covers 0.375 of the 0.75 gap and 0.125 of the next 0.25 one
    assert r.worst_gap_net([(1.625, 0.5)]) == 0.375
    # (1.125, 2.375) covers half of the first and of the last gap, all of the middle two
    assert r.worst_gap_net([(1.125, 1.25)]) == 0.125
    # covering every gap whole nets every gap to nothing
    assert r.worst_gap_net([(0.5, 3.0)]) == 0.0


def test_a_gap_net_of_stops_is_never_negative_nor_longer_than_the_gap() -> None:
    r = record(token_times=TIMES)
    starts = [0.5 + 0.125 * i for i in range(20)]
    lengths = [0.0, 0.0625, 0.25, 0.5, 1.0, 3.0]
    for at in starts:
        for length in lengths:
            net = r.worst_gap_net([(at, length)])
            assert 0.0 <= net <= r.worst_gap, (at, length)
            # and a second stop can only take more off
            assert r.worst_gap_net([(at, length), (1.5, 0.25)]) <= net, (at, length)


def test_the_wait_for_the_first_token_is_no_gap_even_net_of_stops() -> None:
    r = record(sent_at=0.0, token_times=[5.0, 5.1])
    assert r.worst_gap_net([]) == pytest.approx(0.1)
    # a stop while waiting for the first token changes nothing
    assert r.worst_gap_net([(1.0, 1.0)]) == pytest.approx(0.1)
    assert r.worst_gap_net([(0.0, 5.0)]) == pytest.approx(0.1)


# -- valid: a whole answer --------------------------------------------------------------


def test_a_whole_answer_is_valid() -> None:
    assert whole().valid


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param({"status": 503}, id="status-not-200"),
        pytest.param({"status": None}, id="no-status"),
        pytest.param({"error": '{"message": "boom"}'}, id="an-error"),
        pytest.param({"finish_reason": "stop"}, id="stopped-on-its-own"),
        pytest.param({"finish_reason": None}, id="no-finish-reason"),
        pytest.param({"completion_tokens": 3}, id="fewer-tokens"),
        pytest.param({"completion_tokens": 5}, id="more-tokens"),
        pytest.param({"completion_tokens": None}, id="no-usage"),
    ],
)
def test_each_way_an_answer_is_not_whole_makes_it_invalid(broken: Json) -> None:
    assert not whole(**broken).valid


def test_to_json_carries_the_fields_and_the_derived_values() -> None:
    row = whole(text="abcd").to_json()
    assert row["text"] == "abcd"
    assert row["token_times"] == [10.5, 10.6, 10.7, 10.8]
    assert row["ttft"] == pytest.approx(0.5)
    assert row["done"] == pytest.approx(1.0)
    assert row["worst_gap"] == pytest.approx(0.1)
    assert row["valid"] is True
    json.dumps(row)  # a records.jsonl row


# -- _event: one stream chunk -----------------------------------------------------------


def chat_chunk(*choices: Json, **top: Any) -> Json:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    return {**head, "choices": list(choices), **top}


def delta(finish: str | None = None, **fields: Any) -> Json:
    return {"index": 0, "delta": fields, "logprobs": None, "finish_reason": finish}


def text_chunk(text: str, finish: str | None = None) -> Json:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny"}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {**head, "choices": [choice]}


USAGE_CHUNK = chat_chunk(usage={"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4})


def test_a_chat_delta_with_content_is_a_token_at_its_arrival() -> None:
    r = record()
    _event(r, chat_chunk(delta(content="Hello")), 10.5)
    _event(r, chat_chunk(delta(content=" world")), 10.75)
    assert r.token_times == [10.5, 10.75]
    assert r.text == "Hello world"


def test_a_completions_text_piece_is_a_token() -> None:
    r = record()
    _event(r, text_chunk(" once"), 10.5)
    assert r.token_times == [10.5]
    assert r.text == " once"


@pytest.mark.parametrize(
    "chunk",
    [
        pytest.param(chat_chunk(delta(role="assistant", content="")), id="chat-role-only"),
        pytest.param(chat_chunk(delta()), id="chat-empty-delta"),
        pytest.param(chat_chunk(delta(content=None)), id="chat-null-content"),
        pytest.param(text_chunk(""), id="completions-empty-text"),
        pytest.param(chat_chunk({"index": 0, "delta": None}), id="chat-null-delta"),
    ],
)
def test_a_chunk_without_content_is_not_a_token(chunk: Json) -> None:
    r = record()
    _event(r, chunk, 10.5)
    assert r.token_times == []
    assert r.text == ""
    assert r.finish_reason is None


def test_the_usage_chunk_with_no_choices_fills_in_the_token_counts_only() -> None:
    r = record()
    _event(r, USAGE_CHUNK, 11.0)
    assert (r.prompt_tokens, r.completion_tokens) == (12, 4)
    assert r.token_times == []
    assert r.error is None


def test_a_null_usage_on_a_content_chunk_changes_no_count() -> None:
    r = record(prompt_tokens=7, completion_tokens=3)
    _event(r, chat_chunk(delta(content="x"), usage=None), 10.5)
    assert (r.prompt_tokens, r.completion_tokens) == (7, 3)


def test_the_finish_reason_is_kept_even_on_a_chunk_without_content() -> None:
    r = record()
    _event(r, chat_chunk(delta(finish="length", content="")), 10.9)
    assert r.finish_reason == "length"
    assert r.token_times == []
    r2 = record()
    _event(r2, text_chunk("end", finish="length"), 10.9)
    assert (r2.finish_reason, r2.text, r2.token_times) == ("length", "end", [10.9])


def test_an_error_payload_is_kept_as_json_cut_to_500_characters() -> None:
    r = record()
    error = {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    _event(r, {"error": error}, 10.5)
    assert r.error is not None and json.loads(r.error) == error
    long = record()
    _event(long, {"error": {"message": "x" * 1000}}, 10.5)
    assert long.error is not None and len(long.error) == 500


def test_an_error_after_tokens_makes_the_record_invalid() -> None:
    r = record(status=200, max_tokens=1)
    _event(r, chat_chunk(delta(content="a", finish="length")), 10.5)
    _event(r, chat_chunk(usage={"prompt_tokens": 3, "completion_tokens": 1}), 10.6)
    assert r.valid
    _event(r, {"error": {"message": "engine died"}}, 10.7)
    assert not r.valid


# -- stream: a whole answer over HTTP ---------------------------------------------------


def sse(data: Json) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


CHAT_EVENTS = [
    sse(chat_chunk(delta(role="assistant", content=""))),
    sse(chat_chunk(delta(content="Once"))),
    sse(chat_chunk(delta(content=" upon"))),
    sse(chat_chunk(delta(content=" a"))),
    sse(chat_chunk(delta(content=" time", finish="length"))),
    sse(USAGE_CHUNK),
    b"data: [DONE]\n\n",
]


def split_unevenly(events: list[bytes]) -> list[bytes]:
    """The events' bytes in pieces that cut lines and events apart, as a network may."""
    body = b"".join(events)
    return [body[i : i + 7] for i in range(0, len(body), 7)]


async def pieces(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class Engine:
    """A fake engine: answers every POST with a given response, keeping the bodies."""

    def __init__(self, status: int, chunks: list[bytes], headers: dict[str, str]) -> None:
        self.status = status
        self.chunks = chunks
        self.headers = headers
        self.bodies: list[Json] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(self.status, headers=self.headers, content=pieces(self.chunks))


async def stream_to(engine: Engine, r: Record, body: Json) -> Record:
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as http:
        return await stream(http, r, body)


@pytest.mark.anyio
async def test_stream_records_every_token_the_text_the_usage_and_the_headers() -> None:
    headers = {
        "content-type": "text/event-stream",
        "x-whoseturn-engine": "vllm-0",
        "x-whoseturn-queue-ms": "12.5",
    }
    engine = Engine(200, split_unevenly(CHAT_EVENTS), headers)
    r = record(sent_at=0.0)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out = await stream_to(engine, r, body)
    assert out is r
    assert r.status == 200
    assert r.error is None
    assert r.text == "Once upon a time"
    assert len(r.token_times) == 4
    assert r.token_times == sorted(r.token_times)
    assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (12, 4, "length")
    assert (r.engine, r.proxy_queue_ms) == ("vllm-0", 12.5)
    assert r.headers_at is not None and r.finished_at is not None
    assert r.sent_at > 0.0  # stamped when sent, not when the record was made
    assert r.sent_at <= r.headers_at <= r.token_times[0] <= r.finished_at
    assert r.valid
    assert engine.bodies == [{**body, "stream": True, "stream_options": {"include_usage": True}}]


@pytest.mark.anyio
async def test_stream_reads_a_completions_answer_without_the_proxys_headers() -> None:
    events = [
        sse(text_chunk(" a")),
        sse(text_chunk(" b", finish="length")),
        sse(
            {**text_chunk(""), "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
        ),
        b"data: [DONE]\n\n",
    ]
    engine = Engine(200, events, {"content-type": "text/event-stream"})
    r = record(kind="batch", url="http://engine/v1/completions", max_tokens=2)
    await stream_to(engine, r, {"model": "tiny", "prompt": "p", "max_tokens": 2})
    assert (r.text, len(r.token_times), r.completion_tokens) == (" a b", 2, 2)
    assert (r.engine, r.proxy_queue_ms, r.proxy_activation_ms) == (None, None, None)
    assert r.model == "tiny"
    assert r.valid


@pytest.mark.anyio
async def test_stream_records_the_wait_for_the_models_wake_beside_the_queue_wait() -> None:
    headers = {
        "content-type": "text/event-stream",
        "x-whoseturn-engine": "vllm-1",
        "x-whoseturn-queue-ms": "5400.0",
        "x-whoseturn-activation-ms": "5321.4",
    }
    engine = Engine(200, split_unevenly(CHAT_EVENTS), headers)
    r = record()
    await stream_to(engine, r, {"model": "small", "messages": [], "max_tokens": 4})
    assert (r.proxy_queue_ms, r.proxy_activation_ms, r.model) == (5400.0, 5321.4, "small")
    row = r.to_json()
    assert (row["proxy_activation_ms"], row["model"]) == (5321.4, "small")
    assert Record.from_json(row).proxy_activation_ms == 5321.4


@pytest.mark.anyio
async def test_stream_records_the_wake_of_a_request_the_woken_engine_failed() -> None:
    headers = {"x-whoseturn-queue-ms": "900.0", "x-whoseturn-activation-ms": "850.0"}
    engine = Engine(500, [b'{"error": {"message": "engine error"}}'], headers)
    r = record()
    await stream_to(engine, r, {"model": "small", "messages": [], "max_tokens": 4})
    assert (r.status, r.proxy_queue_ms, r.proxy_activation_ms) == (500, 900.0, 850.0)
    assert r.error is not None


@pytest.mark.anyio
async def test_stream_keeps_a_non_200_error_body_cut_to_500_characters() -> None:
    message = json.dumps({"error": {"message": "queue full " + "x" * 600}}).encode()
    engine = Engine(503, [message[:100], message[100:]], {"x-whoseturn-engine": "vllm-0"})
    r = record()
    await stream_to(engine, r, {"model": "tiny", "messages": [], "max_tokens": 4})
    assert r.status == 503
    assert r.error == message.decode()[:500]
    assert r.engine == "vllm-0"
    assert (r.token_times, r.text, r.completion_tokens) == ([], "", None)
    assert not r.valid


@pytest.mark.anyio
async def test_stream_turns_a_transport_failure_into_an_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    r = record()
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
        await stream(http, r, {"model": "tiny"})
    assert r.error == "ConnectError: connection refused"
    assert r.status is None
    assert r.finished_at is not None
    assert not r.valid
