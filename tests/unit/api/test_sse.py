"""SSEReader splits raw upstream bytes into events without changing a byte."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from proxy.api.sse import SSEEvent, SSEReader, sse_error

from .helpers import DONE, USAGE, chat_chunk, chat_events, completion_chunk, delta, sse, text

STREAM = b"".join(chat_events())


def feed_all(chunks: list[bytes]) -> tuple[list[SSEEvent], SSEReader]:
    reader = SSEReader()
    events = [e for chunk in chunks for e in reader.feed(chunk)]
    return events, reader


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


def event(data: dict[str, object]) -> SSEEvent:
    (only,) = SSEReader().feed(sse(data))
    return only


def test_one_event_per_blank_line() -> None:
    events, reader = feed_all([STREAM])
    assert [e.raw for e in events] == chat_events()
    assert events[-1].done and events[-1].data is None
    assert not any(e.done for e in events[:-1])
    assert events[1].data == chat_chunk(delta(content="Hello"))
    assert reader.pending == b""


def test_incomplete_event_waits_for_its_blank_line() -> None:
    reader = SSEReader()
    assert reader.feed(b'data: {"a": 1}\n') == []
    assert reader.pending == b'data: {"a": 1}\n'
    (e,) = reader.feed(b"\n")
    assert e.data == {"a": 1}
    assert e.raw == b'data: {"a": 1}\n\n'


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    events, reader = feed_all(split_at(STREAM, cuts))
    whole, _ = feed_all([STREAM])
    assert events == whole
    assert b"".join(e.raw for e in events) == STREAM
    assert reader.pending == b""


CRLF_STREAM = (
    b'data: {"n": 1}\r\n\r\n: keep-alive\r\n\r\ndata: {"n": 2}\r\n\r\ndata: [DONE]\r\n\r\n'
)


@given(st.lists(st.integers(min_value=0, max_value=len(CRLF_STREAM)), max_size=20))
def test_crlf_separators_under_any_split(cuts: list[int]) -> None:
    events, reader = feed_all(split_at(CRLF_STREAM, cuts))
    assert [e.data for e in events] == [{"n": 1}, None, {"n": 2}, None]
    assert [e.done for e in events] == [False, False, False, True]
    assert b"".join(e.raw for e in events) == CRLF_STREAM
    assert reader.pending == b""


payloads = st.one_of(
    st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=3).map(
        lambda d: b"data: " + json.dumps(d).encode()
    ),
    st.just(b"data: [DONE]"),
    st.just(b": comment"),
    st.text(alphabet="abc:{} ", max_size=12).map(lambda t: b"data: " + t.encode()),
)
streams = st.lists(st.tuples(payloads, st.sampled_from([b"\n\n", b"\r\n\r\n"])), max_size=8)


@given(streams, st.data())
def test_any_stream_any_split(parts: list[tuple[bytes, bytes]], data: st.DataObject) -> None:
    stream = b"".join(p + sep for p, sep in parts)
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=20))
    events, reader = feed_all(split_at(stream, cuts))
    assert [e.raw for e in events] == [p + sep for p, sep in parts]
    assert reader.pending == b""


def test_data_spread_over_several_lines_is_joined() -> None:
    (e,) = SSEReader().feed(b'event: x\nid: 3\ndata: {"a":\ndata: 1}\n\n')
    assert e.data == {"a": 1}


def test_comment_and_non_json_data_relayed_but_not_parsed() -> None:
    raw = [b": ping\n\n", b"data: not json\n\n", b"data: [1, 2]\n\n", b"data:\n\n"]
    events, _ = feed_all([b"".join(raw)])
    assert [e.raw for e in events] == raw
    assert all(e.data is None and not e.done for e in events)
    assert not any(e.has_token or e.is_usage_only or e.error for e in events)


def test_done_without_space() -> None:
    (e,) = SSEReader().feed(b"data:[DONE]\n\n")
    assert e.done


def test_has_token() -> None:
    assert not event(chat_chunk(delta(role="assistant", content=""))).has_token
    assert event(chat_chunk(delta(content="Hi"))).has_token
    assert event(chat_chunk(delta(content="", finish="stop"))).has_token
    # vLLM's return_token_ids: a token whose text is held back still comes as a chunk
    assert event(chat_chunk({**delta(), "token_ids": [1871]})).has_token
    assert not event(chat_chunk({**delta(), "token_ids": []})).has_token
    assert event(completion_chunk({**text(""), "token_ids": [7]})).has_token
    assert event(chat_chunk(delta(reasoning_content="hmm"))).has_token
    assert event(chat_chunk(delta(reasoning="hmm", content=None))).has_token  # vLLM 0.32
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}
    assert event(chat_chunk(delta(tool_calls=[call]))).has_token
    assert event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}).has_token
    assert not event({"choices": [{"index": 0, "text": "", "finish_reason": None}]}).has_token
    assert not event(chat_chunk(usage=USAGE)).has_token
    assert not SSEReader().feed(DONE)[0].has_token


def test_has_token_in_any_choice() -> None:
    e = event(chat_chunk(delta(0, content=""), delta(1, content="b")))
    assert e.has_token


def test_is_usage_only() -> None:
    assert event(chat_chunk(usage=USAGE)).is_usage_only
    # continuous_usage_stats puts usage on every chunk: those are not usage-only
    assert not event(chat_chunk(delta(content="Hi"), usage=USAGE)).is_usage_only
    assert not event(chat_chunk(delta(content="Hi"))).is_usage_only
    assert not SSEReader().feed(DONE)[0].is_usage_only


def test_error_event() -> None:
    err = {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    assert event({"error": err}).error == err
    assert event({"error": "plain"}).error is None
    assert event(chat_chunk(delta(content="x"))).error is None


def test_sse_error_is_one_openai_error_event() -> None:
    raw = sse_error("engine went away")
    (e,) = SSEReader().feed(raw)
    assert e.raw == raw
    assert e.error == {
        "message": "engine went away",
        "type": "engine_error",
        "param": None,
        "code": "engine_failed",
    }
    assert json.loads(raw[len(b"data: ") :]) == {"error": e.error}


def parsed(raw: bytes) -> SSEEvent:
    """The event as its parsed JSON says (the spaced form is never read from bytes)."""
    data = json.loads(raw[5:])
    (only,) = SSEReader().feed(b"data: " + json.dumps(data).encode() + b"\n\n")
    return only


_TEXT = st.text(alphabet=st.sampled_from(["a", '"', "\\", ":", "{", "[", "]", " ", "é", "\n"]))
_WORDS = st.sampled_from(
    ['"content":"x"', '"text":"', '"finish_reason":"stop"', '"usage"', '"error"', "token_ids"]
)
_STRINGS = st.one_of(_TEXT, _WORDS, st.just(""), st.none())
_CHOICE = st.fixed_dictionaries(
    {"index": st.integers(0, 3)},
    optional={
        "delta": st.fixed_dictionaries(
            {},
            optional={
                "role": st.just("assistant"),
                "content": _STRINGS,
                "reasoning": _STRINGS,
                "tool_calls": st.one_of(st.just([]), st.just([{"index": 0, "id": "c"}])),
            },
        ),
        "text": _STRINGS,
        "finish_reason": st.one_of(st.none(), st.sampled_from(["stop", "length", ""])),
        "token_ids": st.lists(st.integers(0, 9), max_size=2),
        "logprobs": st.one_of(st.none(), st.just({"content": [{"token": "a"}]})),
    },
)


@given(st.lists(_CHOICE, max_size=3), _STRINGS)
def test_a_compact_chunk_read_from_its_bytes_says_what_its_json_says(
    choices: list[dict[str, object]], note: str | None
) -> None:
    """A token's chunk is read from its bytes (no parse); whatever its strings hold,
    it says what the parsed JSON says."""
    raw = sse({"id": "c1", "object": "chat.completion.chunk", "choices": choices, "n": note})
    (fast,) = SSEReader().feed(raw)
    slow = parsed(raw)
    assert fast.has_token == slow.has_token
    assert fast.usage == slow.usage
    assert fast.error == slow.error
    assert fast.is_usage_only == slow.is_usage_only
    assert fast.data == slow.data
