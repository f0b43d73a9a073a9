"""Validity by JSON schema (loadtests.harness.validity): the corpus's own extraction schemas
against hand-written answers, the narrow reading of an answer as JSON, and the same
judgement on a streamed record and on a Batch API output line."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loadtests.harness.client import Record
from loadtests.harness.corpus import answer_schema, messages
from loadtests.harness.measures import summarize
from loadtests.harness.traffic import count_output
from loadtests.harness.validity import answer_json, assess, follows

from .records import record

MIT = {
    "licence": "MIT License",
    "copyright_holder": "A. Person",
    "year": 2024,
    "conditions": ["include the copyright notice"],
}
BSD = {"conditions": [{"number": 1, "text": "keep the notice"}], "warranty": False}


def _schema(text: str) -> dict[str, Any]:
    """The corpus's extraction schema whose prompt names ``text`` among its keys."""
    for k in range(5):
        schema = answer_schema("extraction", k, 0)
        assert schema is not None
        if text in schema["required"]:
            return schema
    raise AssertionError(text)


def test_every_extraction_prompt_carries_the_schema_it_shows() -> None:
    for k in range(5):
        schema = answer_schema("extraction", k, 0)
        (m,) = messages("extraction", k, 0, None)
        assert json.dumps(schema, sort_keys=True) in m["content"]
    assert answer_schema("questions", 0, 0) is None
    assert answer_schema("python-docs", 3, 7) is None


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        (json.dumps(MIT), True),
        (f"```json\n{json.dumps(MIT, indent=2)}\n```", True),
        (f"Here it is:\n```\n{json.dumps(MIT)}\n```\nDone.", True),
        (f"The licence, as JSON: {json.dumps(MIT)} (all fields).", True),
        (json.dumps({**MIT, "year": "2024"}), False),  # a string, not an integer
        (json.dumps({k: v for k, v in MIT.items() if k != "conditions"}), False),
        (json.dumps(MIT)[:-5], False),  # cut at max_tokens
        ("{'licence': 'MIT'}", False),  # not JSON
        ("the MIT licence, by A. Person, 2024", False),
        ("", False),
    ],
)
def test_answers_against_the_mit_extraction_schema(answer: str, ok: bool) -> None:
    assert follows(answer, _schema("copyright_holder")) is ok


def test_nested_items_are_checked_against_the_bsd_schema() -> None:
    schema = _schema("warranty")
    assert follows(json.dumps(BSD), schema)
    bad = {"conditions": [{"number": "one", "text": "keep the notice"}], "warranty": False}
    assert not follows(json.dumps(bad), schema)


def test_answer_json_reads_narrowly() -> None:
    assert answer_json(" [1, 2] \n") == [1, 2]
    assert answer_json('```json\n{"a": 1}\n```') == {"a": 1}
    with pytest.raises(ValueError, match="no JSON"):
        answer_json('{"a": 1,}')  # a trailing comma is not repaired


def test_an_answer_with_a_schema_may_stop_on_its_own_and_then_must_follow_it() -> None:
    schema = _schema("copyright_holder")
    base: dict[str, Any] = {"status": 200, "error": None, "max_tokens": 64, "schema": schema}
    stopped = assess(**base, finish_reason="stop", completion_tokens=40, text=json.dumps(MIT))
    assert (stopped.whole, stopped.schema_valid, stopped.valid) == (True, True, True)
    cut = assess(**base, finish_reason="length", completion_tokens=64, text=json.dumps(MIT)[:30])
    assert (cut.whole, cut.schema_valid, cut.valid) == (True, False, False)
    failed = assess(**{**base, "status": 500}, finish_reason="stop", completion_tokens=4, text="")
    assert (failed.whole, failed.schema_valid, failed.valid) == (False, None, False)
    plain = assess(**{**base, "schema": None}, finish_reason="stop", completion_tokens=4, text="")
    assert not plain.whole  # without a schema, an answer must run to max_tokens


def _streamed(i: int, text: str, schema: dict[str, Any] | None) -> Record:
    return record(
        i,
        max_tokens=64,
        sent_at=float(i),
        token_times=[i + 0.1, i + 0.2],
        finished_at=i + 0.3,
        status=200,
        finish_reason="stop",
        completion_tokens=2,
        text=text,
        schema=schema,
    )


def test_a_class_summary_counts_whole_checked_and_schema_valid_answers() -> None:
    schema = _schema("copyright_holder")
    records = [
        _streamed(0, json.dumps(MIT), schema),
        _streamed(1, "not json", schema),
        _streamed(2, json.dumps(MIT), None),  # no schema: stopped early, not whole
    ]
    assert [r.valid for r in records] == [True, False, False]
    s = summarize(records, 0.0, 3600.0)
    assert (s.requests, s.whole, s.schema_checked, s.schema_valid, s.valid) == (3, 2, 2, 1, 1)
    assert s.valid_per_hour == pytest.approx(1.0)
    row = records[1].to_json()
    assert (row["whole"], row["schema_valid"], row["valid"]) == (True, False, False)
    assert Record.from_json(row).schema == schema


def _output_line(custom_id: str, text: str, finish: str, tokens: int) -> str:
    body = {
        "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {"completion_tokens": tokens},
    }
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200, "body": body}})


def test_batch_output_lines_are_judged_as_streamed_answers_are() -> None:
    schema = _schema("copyright_holder")
    text = "\n".join(
        [
            _output_line("j-0", f"```json\n{json.dumps(MIT)}\n```", "stop", 50),
            _output_line("j-1", json.dumps(MIT)[:20], "length", 64),
            _output_line("j-2", "plain", "length", 64),
        ]
    )
    counted = count_output(text, 64, {"j-0": schema, "j-1": schema, "j-2": None})
    assert (counted.answered, counted.whole, counted.schema_checked) == (3, 3, 2)
    assert (counted.schema_valid, counted.valid) == (1, 2)
