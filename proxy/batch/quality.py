"""A batch line's answer judged: ``valid`` or ``invalid``, for the job's
``request_counts`` and the ``whoseturn_batch_records_total{status}`` counters.

Every answered line (an HTTP 2xx) is one or the other, so that ``valid + invalid``
is ``completed`` whatever the lines asked for. An answer is valid when it holds a
completion (a first choice with a ``text``, or a ``message``) and, where the line
asked for structured output, its text follows what was asked:

- OpenAI's ``response_format``: ``json_object`` (a JSON object) or ``json_schema``
  (JSON that validates against the schema, with ``jsonschema``);
- vLLM's own fields, which plain completions use most: ``guided_json`` (a schema),
  ``guided_choice`` (one of a list), ``guided_regex`` (the whole text matches), or
  the same under ``structured_outputs`` (``json``, ``choice``, ``regex``).

What cannot be checked here (a grammar, a regex Python does not read) only needs
a completion. Pure; the answer is the object already parsed for its line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema

Json = dict[str, Any]
Check = Callable[[str], bool]


def quality(asked: Json, answer: Json) -> str:
    """``valid``/``invalid`` for an answered line: ``asked`` is its request body,
    ``answer`` the engine's answer object."""
    text = answer_text(answer)
    if text is None:
        return "invalid"
    check = structure_check(asked)
    return "valid" if check is None or check(text) else "invalid"


def answer_text(answer: Json) -> str | None:
    """The first choice's text (a completion's ``text``, a chat ``message``'s
    ``content``, ``""`` for a message with none, such as tool calls); None where the
    answer holds no completion."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    first = choices[0]
    message = first.get("message")
    if isinstance(message, dict):
        content = message.get("content")
        return content if isinstance(content, str) else ""
    text = first.get("text")
    return text if isinstance(text, str) else None


def structure_check(asked: Json) -> Check | None:
    """What the line's answer text must satisfy, or None where it asked for no
    structure (or one that cannot be checked here)."""
    wanted = asked.get("response_format")
    kind = wanted.get("type") if isinstance(wanted, dict) else None
    if kind == "json_object":
        return _json_object
    if kind == "json_schema" and isinstance(wanted, dict):
        spec = wanted.get("json_schema")
        return _schema(spec.get("schema") if isinstance(spec, dict) else None)
    if (schema := _vllm(asked, "json")) is not None:
        return _schema(schema)
    if (choices := _vllm(asked, "choice")) is not None:
        return _choice(choices)
    if (pattern := _vllm(asked, "regex")) is not None:
        return _regex(pattern)
    if _vllm(asked, "json_object"):
        return _json_object
    return None


def _vllm(asked: Json, key: str) -> Any:
    """vLLM's ``structured_outputs.<key>``, else its older ``guided_<key>``."""
    outputs = asked.get("structured_outputs")
    value = outputs.get(key) if isinstance(outputs, dict) else None
    return value if value is not None else asked.get(f"guided_{key}")


def _parsed(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def _json_object(text: str) -> bool:
    ok, value = _parsed(text)
    return ok and isinstance(value, dict)


def _schema(schema: Any) -> Check:
    """JSON that validates against ``schema`` (a schema object, or its JSON text as
    vLLM takes it); any JSON where there is no schema to read."""
    if isinstance(schema, str):
        ok, schema = _parsed(schema)
        schema = schema if ok else None

    def fits(text: str) -> bool:
        ok, value = _parsed(text)
        if not ok:
            return False
        if not isinstance(schema, dict):
            return True
        try:
            jsonschema.validate(value, schema)
        except (jsonschema.ValidationError, jsonschema.SchemaError):
            return False
        return True

    return fits


def _choice(choices: Any) -> Check | None:
    if not isinstance(choices, list):
        return None
    allowed = {c for c in choices if isinstance(c, str)}
    return lambda text: text in allowed


def _regex(pattern: Any) -> Check | None:
    if not isinstance(pattern, str):
        return None
    try:
        compiled = re.compile(pattern)
    except re.error:
        return None
    return lambda text: compiled.fullmatch(text) is not None
