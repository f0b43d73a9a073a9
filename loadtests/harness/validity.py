"""Whether an answer counts: whole, and, when its prompt carries a JSON schema (the
corpus's extraction prompts), an answer that follows it.

**Whole**: status 200, no error, and ended by length at exactly ``max_tokens``
tokens (the bench's prompts never let the model stop on its own). A prompt that asks
for JSON may end on its own: for one with a schema, an answer that ends with finish
reason ``stop`` within ``max_tokens`` is whole too.

**Schema-valid**: a whole answer's text, read as JSON by :func:`answer_json`,
validates against the schema with ``jsonschema`` (the validator the schema's
``$schema`` names, the latest draft when it names none). An answer that is not whole
is not checked: it is invalid already.

**Valid** = whole and, with a schema, schema-valid. Streamed records
(:class:`loadtests.harness.client.Record`) and Batch API output lines
(:func:`loadtests.harness.traffic.count_output`) are judged by the same :func:`assess`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.validators

FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL | re.IGNORECASE)


def answer_json(text: str) -> Any:
    """The JSON value of an answer's text, read narrowly, in this order: the whole
    text (surrounding whitespace stripped); else the inside of its first fenced block
    (```json or ```); else the span from its first ``{`` to its last ``}`` (one
    object with prose before or after it). Nothing is repaired: a cut, commented or
    single-quoted object stays invalid. Raises ValueError when none of the three
    parses."""
    stripped = text.strip()
    candidates = [stripped]
    fenced = FENCE.search(stripped)
    if fenced:
        candidates.append(fenced.group(1).strip())
    first, last = stripped.find("{"), stripped.rfind("}")
    if 0 <= first < last:
        candidates.append(stripped[first : last + 1])
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    raise ValueError("the answer holds no JSON value")


def follows(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` (:func:`answer_json`) validates against ``schema``; an
    unreadable answer or a schema that is not one does not."""
    try:
        value = answer_json(text)
    except ValueError:
        return False
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return bool(validator(schema).is_valid(value))


@dataclass(frozen=True)
class Assessment:
    """One answer judged: ``schema_valid`` is None when there was no schema to check
    or the answer was not whole (so not checked)."""

    whole: bool
    schema_valid: bool | None = None

    @property
    def valid(self) -> bool:
        return self.whole and self.schema_valid is not False

    def to_json(self) -> dict[str, bool | None]:
        return {"whole": self.whole, "schema_valid": self.schema_valid, "valid": self.valid}


def assess(
    *,
    status: int | None,
    error: str | None,
    finish_reason: str | None,
    completion_tokens: int | None,
    max_tokens: int,
    text: str,
    schema: dict[str, Any] | None,
) -> Assessment:
    """An answer judged as the module docstring says."""
    ok = status == 200 and error is None
    by_length = finish_reason == "length" and completion_tokens == max_tokens
    stopped = (
        schema is not None
        and finish_reason == "stop"
        and completion_tokens is not None
        and completion_tokens <= max_tokens
    )
    whole = ok and (by_length or stopped)
    if schema is None or not whole:
        return Assessment(whole)
    return Assessment(whole, follows(text, schema))
