"""The client's request body, read strictly: JSON that every later step can handle,
checked against typed models of the OpenAI request.

:func:`parse_json` refuses what Python's ``json`` module would let through but the
rest of the path cannot carry: non-finite numbers (``NaN``, ``Infinity``,
``1e400``), lone surrogates (``"\\ud800"``) and nesting deeper than
:data:`MAX_DEPTH`. :func:`check_completion` validates the fields the proxy reads
(strictly: ``"stream": "false"`` is not a boolean) and lets every other field
through for the engine to judge. Both raise :class:`BodyError` with a message fit
for the client.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_DEPTH = 100


class BodyError(ValueError):
    """The body cannot be served; ``param`` names the field where one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _no_constant(name: str) -> Any:
    raise BodyError(f"{name} is not a JSON number.")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"The number {text[:32]} is out of range.")
    return value


def parse_json(raw: bytes) -> Any:
    """``raw`` as a JSON value, or :class:`BodyError`."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"JSON nested deeper than {MAX_DEPTH} levels.") from None
    except ValueError as exc:
        raise BodyError(f"The request body is not valid JSON: {exc}") from None
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """No lone surrogates in any string or key; no nesting beyond :data:`MAX_DEPTH`.
    Iterative, so that depth costs no stack."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise BodyError(f"JSON nested deeper than {MAX_DEPTH} levels.")
        children = list(item.values()) if isinstance(item, dict) else item
        if isinstance(item, dict):
            children += list(item)
        stack.extend((child, depth + 1) for child in children)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(
            "A string in the body holds a lone surrogate (not valid Unicode)."
        ) from None


# -- the fields the proxy reads ---------------------------------------------------------


class _Open(BaseModel):
    """Typed where the proxy reads a field; any other field passes through."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool | None = None


# As vLLM: non-empty ``stream_options`` only with ``stream: true`` (JSON Schema, so
# that the published schema says what :func:`check_completion` does).
_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {
        "required": ["stream_options"],
        "properties": {"stream_options": {"type": "object", "minProperties": 1}},
    },
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


class _Request(_Open):
    model_config = ConfigDict(json_schema_extra=_OPTIONS_NEED_STREAM)

    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class ContentPart(_Open):
    type: str | None = None


class Message(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions`` (and its ``/batch`` twin)."""

    messages: Annotated[list[Message], Field(min_length=1)]


TokenIds = Annotated[list[int], Field(min_length=1)]
# Text, token ids, or a batch of either; vLLM refuses empty lists, so do we.
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionRequest(_Request):
    """``POST /v1/completions`` (and its ``/batch`` twin)."""

    prompt: Prompt


def check_completion(body: Any, chat: bool) -> dict[str, Any]:
    """``body`` if it is a request the proxy can read, else :class:`BodyError`."""
    if not isinstance(body, dict):
        raise BodyError("The request body must be a JSON object.")
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        model.model_validate(body)
    except ValidationError as exc:
        raise _body_error(exc) from None
    if body.get("stream_options") and not body.get("stream"):
        # As vLLM answers it, so the two agree.
        raise BodyError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    return body


def _body_error(exc: ValidationError) -> BodyError:
    """The first problem, named by its field; the input itself is not repeated."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(part) for part in first["loc"] if not _is_union_branch(part))
    if first["type"] == "missing":
        return BodyError(f"`{loc}` is required.", param=loc)
    return BodyError(f"`{loc}`: {first['msg']}.", param=loc or None)


def _is_union_branch(part: Any) -> bool:
    """Pydantic names the union member it tried (``str``, ``list[int]``) in ``loc``."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "bool"})
