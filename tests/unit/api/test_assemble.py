"""A non-streaming body assembled from the chunks vLLM streams."""

from __future__ import annotations

from typing import Any

from proxy.api.assemble import Assembler
from proxy.api.sse import SSEReader

from .helpers import (
    USAGE,
    chat_chunk,
    chat_events,
    completion_chunk,
    completion_events,
    delta,
    text,
)

Json = dict[str, Any]


def assemble(chunks: list[Json], chat: bool = True) -> Json:
    asm = Assembler(chat=chat)
    for chunk in chunks:
        asm.add(chunk)
    return asm.body()


def parsed(events: list[bytes]) -> list[Json]:
    return [e.data for e in SSEReader().feed(b"".join(events)) if e.data is not None]


def message_choice(index: int, content: str, finish: str = "stop", **extra: Any) -> Json:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content, "tool_calls": [], **extra},
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


def test_chat_body_from_a_vllm_stream() -> None:
    body = assemble(parsed(chat_events(model="tiny")))
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 17,
        "model": "tiny",
        "choices": [message_choice(0, "Hello world!")],
        "usage": USAGE,
        "prompt_logprobs": None,
    }


def test_completion_body_from_a_vllm_stream() -> None:
    body = assemble(parsed(completion_events()), chat=False)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 17,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "Hello world!",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": USAGE,
    }


def test_two_choices_interleaved_come_out_in_index_order() -> None:
    chunks = [
        chat_chunk(delta(1, role="assistant", content="")),
        chat_chunk(delta(0, role="assistant", content="")),
        chat_chunk(delta(1, content="B1")),
        chat_chunk(delta(0, content="A1")),
        chat_chunk(delta(0, content=" A2")),
        chat_chunk(delta(1, content=" B2")),
        chat_chunk(delta(1, content="", finish="length")),
        chat_chunk(delta(0, content="", finish="stop")),
        chat_chunk(usage=USAGE),
    ]
    body = assemble(chunks)
    assert body["choices"] == [
        message_choice(0, "A1 A2", "stop"),
        message_choice(1, "B1 B2", "length"),
    ]


def test_completion_choices_interleaved() -> None:
    chunks = [
        completion_chunk(text("b", index=1)),
        completion_chunk(text("a", index=0)),
        completion_chunk(text("bb", index=1, finish="stop")),
        completion_chunk(text("aa", index=0, finish="length")),
    ]
    choices = assemble(chunks, chat=False)["choices"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "aaa", "length"),
        (1, "bbb", "stop"),
    ]


def tool(index: int, **fields: Any) -> Json:
    return {"index": index, **fields}


def test_tool_call_deltas_are_merged() -> None:
    chunks = [
        chat_chunk(delta(role="assistant", content="")),
        chat_chunk(
            delta(
                tool_calls=[tool(0, id="call-a", type="function", function={"name": "get_weather"})]
            )
        ),
        chat_chunk(delta(tool_calls=[tool(0, function={"arguments": '{"city": '})])),
        chat_chunk(delta(tool_calls=[tool(0, function={"arguments": '"Paris"}'})])),
        chat_chunk(
            delta(tool_calls=[tool(1, id="call-b", type="function", function={"name": "now"})])
        ),
        chat_chunk(delta(tool_calls=[tool(1, function={"arguments": "{}"})])),
        chat_chunk(delta(content="", finish="tool_calls")),
    ]
    (choice,) = assemble(chunks)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call-a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call-b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]


def test_reasoning_content_is_kept_apart() -> None:
    chunks = [
        chat_chunk(delta(role="assistant", reasoning_content="Think")),
        chat_chunk(delta(reasoning_content="ing.")),
        chat_chunk(delta(content="Answer", finish="stop")),
    ]
    (choice,) = assemble(chunks)["choices"]
    assert choice["message"]["content"] == "Answer"
    assert choice["message"]["reasoning_content"] == "Thinking."


def test_reasoning_keeps_the_engines_key() -> None:
    # vLLM 0.32 streams ``reasoning`` (and answers with it); older ones ``reasoning_content``.
    chunks = [
        chat_chunk(delta(role="assistant", reasoning="Think", content="")),
        chat_chunk(delta(reasoning="ing.", content=None)),
        chat_chunk(delta(content="Answer", finish="stop")),
    ]
    (choice,) = assemble(chunks)["choices"]
    assert choice["message"]["content"] == "Answer"
    assert choice["message"]["reasoning"] == "Thinking."
    assert "reasoning_content" not in choice["message"]


def test_later_chunks_add_to_the_head() -> None:
    # vLLM sends system_fingerprint only in the closing usage chunk.
    chunks = [
        chat_chunk(delta(role="assistant", content="Hi", finish="stop")),
        chat_chunk(usage=USAGE, system_fingerprint="vllm-0.32.0", model="other"),
    ]
    body = assemble(chunks)
    assert body["system_fingerprint"] == "vllm-0.32.0"
    assert body["model"] == "m"


def test_no_reasoning_content_key_without_reasoning() -> None:
    (choice,) = assemble(parsed(chat_events()))["choices"]
    assert "reasoning_content" not in choice["message"]


def lp(token: str, value: float) -> Json:
    return {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}


def test_chat_logprobs_concatenated() -> None:
    chunks = [
        chat_chunk(delta(role="assistant", content="")),
        chat_chunk(delta(content="Hi", logprobs={"content": [lp("Hi", -0.5)]})),
        chat_chunk(delta(content=" you", logprobs={"content": [lp(" you", -1.0)]})),
        chat_chunk(delta(content="", finish="stop")),
    ]
    (choice,) = assemble(chunks)["choices"]
    assert choice["logprobs"] == {"content": [lp("Hi", -0.5), lp(" you", -1.0)]}


def test_completion_logprobs_concatenated() -> None:
    def lps(offset: int, token: str, value: float) -> Json:
        return {
            "text_offset": [offset],
            "token_logprobs": [value],
            "tokens": [token],
            "top_logprobs": [{token: value}],
        }

    chunks = [
        completion_chunk(text("Hi", logprobs=lps(0, "Hi", -0.5))),
        completion_chunk(text(" you", logprobs=lps(2, " you", -1.0), finish="stop")),
    ]
    (choice,) = assemble(chunks, chat=False)["choices"]
    assert choice["logprobs"] == {
        "text_offset": [0, 2],
        "token_logprobs": [-0.5, -1.0],
        "tokens": ["Hi", " you"],
        "top_logprobs": [{"Hi": -0.5}, {" you": -1.0}],
    }


def test_first_chunk_logprobs_not_aliased() -> None:
    first = {"content": [lp("a", -0.1)]}
    chunks = [
        chat_chunk(delta(content="a", logprobs=first)),
        chat_chunk(delta(content="b", logprobs={"content": [lp("b", -0.2)]})),
    ]
    assemble(chunks)
    assert first == {"content": [lp("a", -0.1)]}


def test_head_fields_kept_object_renamed() -> None:
    chunks = [
        chat_chunk(delta(role="assistant", content=""), system_fingerprint="fp", usage=None),
        chat_chunk(delta(content="x", finish="stop")),
    ]
    body = assemble(chunks)
    assert body["object"] == "chat.completion"
    assert body["system_fingerprint"] == "fp"
    assert body["usage"] is None


def test_usage_from_the_last_chunk_that_has_it() -> None:
    continuous = {"prompt_tokens": 12, "total_tokens": 13, "completion_tokens": 1}
    chunks = [
        chat_chunk(delta(content="x"), usage=continuous),
        chat_chunk(delta(content="y", finish="stop"), usage=None),
        chat_chunk(usage=USAGE),
    ]
    assert assemble(chunks)["usage"] == USAGE
