"""A client's request body (or a batch input line), read strictly: JSON that every
later step can handle, checked against typed models of the OpenAI request.

:func:`parse_json` refuses what Python's ``json`` module would let through but the
rest of the path cannot carry: non-finite numbers (``NaN``, ``Infinity``,
``1e400``), lone surrogates (``"\\ud800"``) and nesting deeper than
:data:`MAX_DEPTH`, naming the field that holds them. :func:`check_completion`
validates the fields the proxy reads or forwards (strictly: ``"stream": "false"`` is
not a boolean; numbers within the bounds OpenAI documents, integers within int64)
and lets every other field through for the engine to judge. :func:`check_batch` and
:func:`check_page` do the same for the Batch API's body and list queries. All raise
:class:`BodyError` with a message fit for the client.

The models here are the one place these rules live: the published OpenAPI schema
is made from them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from proxy.openai.errors import bad_request

MAX_DEPTH = 100
MAX_PARAM_CHARS = 200
"""A field's path in an error is cut to this length (keys can be long)."""


class BodyError(ValueError):
    """The body cannot be served; ``param`` names the field where one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def under(self, parent: str) -> BodyError:
        """The same error for a body that is the field ``parent`` of a larger object
        (a batch line's ``body``): its field named from there."""
        param = f"{parent}.{self.param}" if self.param else parent
        named = f"`{self.param}`" if self.param else None
        if named and self.message.startswith(named):
            return BodyError(f"`{param}`" + self.message.removeprefix(named), param)
        return BodyError(f"`{param}`: {self.message}", param)


class NotJSON(BodyError):
    """The body is not JSON at all; ``detail`` says where the parser stopped."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"The request body is not valid JSON: {detail}")
        self.detail = detail


class _NotFinite:
    """A number the body may not carry, held where it was parsed until
    :func:`_check_tree` names its field."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _no_constant(name: str) -> _NotFinite:
    return _NotFinite(f"{name} is not a JSON number.")


def _finite(text: str) -> float | _NotFinite:
    value = float(text)
    if not math.isfinite(value):
        return _NotFinite(f"The number {text[:32]} is out of range.")
    return value


def parse_json(raw: bytes) -> Any:
    """``raw`` as a JSON value, or :class:`BodyError` (naming the field to blame)."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise BodyError(f"JSON nested deeper than {MAX_DEPTH} levels.") from None
    except ValueError as exc:
        raise NotJSON(str(exc)) from None
    _check_tree(value)
    return value


def parse_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object: a 400 :class:`~proxy.openai.errors.APIError` for
    what :func:`parse_json` refuses, or for any other JSON value."""
    try:
        body = parse_json(raw)
    except BodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


# A node of the tree being checked: the value, its depth, and the node and key it
# hangs from (its path is built only for an error).
_Node = tuple[Any, int, "_Node | None", "str | int | None"]


def _check_tree(value: Any) -> None:
    """No non-finite numbers, no lone surrogates in any string or key, no nesting
    beyond :data:`MAX_DEPTH`. Iterative, so that depth costs no stack. Keys are
    checked before their values, so a path in an error is valid text."""
    stack: list[_Node] = [(value, 0, None, None)]
    while stack:
        node = stack.pop()
        item, depth = node[0], node[1]
        if isinstance(item, str):
            _check_text(item, node)
            continue
        if isinstance(item, _NotFinite):
            raise _at(node, item.why)
        if not isinstance(item, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise BodyError(f"JSON nested deeper than {MAX_DEPTH} levels.")
        if isinstance(item, dict):
            for key in item:
                _check_text(key, node)
            stack.extend((child, depth + 1, node, key) for key, child in item.items())
        else:
            stack.extend((child, depth + 1, node, i) for i, child in enumerate(item))


def _check_text(text: str, node: _Node) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _at(
            node, "A string in the body holds a lone surrogate (not valid Unicode)."
        ) from None


def _at(node: _Node, why: str) -> BodyError:
    """``why``, naming the field at ``node`` (dotted: ``messages.0.content``) if any."""
    parts: list[str] = []
    at: _Node | None = node
    while at is not None and at[2] is not None:
        parts.append(str(at[3]))
        at = at[2]
    if not parts:
        return BodyError(why)
    param = ".".join(reversed(parts))[:MAX_PARAM_CHARS]
    return BodyError(f"`{param}`: {why}", param=param)


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


INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


# OpenAI's bounds (its API reference); a float field takes an integer too, never NaN.
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
Choices = Annotated[int, Field(ge=1, le=128)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Logprobs = Annotated[int, Field(ge=0, le=5)]
BestOf = Annotated[int, Field(ge=0, le=20)]


class _Request(_Open):
    """The fields both completion routes read or forward, with OpenAI's bounds."""

    model_config = ConfigDict(json_schema_extra=_OPTIONS_NEED_STREAM)

    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    max_tokens: Count | None = None
    n: Choices | None = None
    temperature: Temperature | None = None
    top_p: Fraction | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Int64 | None = None
    logit_bias: dict[str, Bias] | None = None


class ContentPart(_Open):
    type: str | None = None


class Message(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions`` (and its ``/batch`` twin)."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None


TokenIds = Annotated[list[Count], Field(min_length=1)]
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
    logprobs: Logprobs | None = None
    best_of: BestOf | None = None


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
    loc = loc[:MAX_PARAM_CHARS]
    if first["type"] == "missing":
        return BodyError(f"`{loc}` is required.", param=loc)
    return BodyError(f"`{loc}`: {first['msg']}.", param=loc or None)


def _is_union_branch(part: Any) -> bool:
    """Pydantic names the union member it tried (``str``, ``list[int]``) in ``loc``."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "bool"})


# -- the Batch API ----------------------------------------------------------------------

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
WINDOW_UNIT_S = {"h": 3600, "m": 60, "s": 1}
MAX_WINDOW_S = 8760 * 3600
"""The longest ``completion_window``: ``8760h``, a year (OpenAI takes ``24h`` only)."""
WINDOW = re.compile(r"[1-9][0-9]{0,8}[hms]")
WINDOW_RULE = "`<n>h`, `<n>m` or `<n>s` from 1s to 8760h (a year), like `24h`"
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,256}$"
"""A file or batch id as a client may send it (the store's ids and OpenAI's fit)."""


def window_seconds(window: str) -> int | None:
    """The seconds of a completion window ``<n>h``, ``<n>m`` or ``<n>s`` within
    1 s ... :data:`MAX_WINDOW_S`; None for any other text."""
    if WINDOW.fullmatch(window) is None:
        return None
    seconds = int(window[:-1]) * WINDOW_UNIT_S[window[-1]]
    return seconds if seconds <= MAX_WINDOW_S else None


def _window(window: str) -> str:
    if window_seconds(window) is None:
        raise PydanticCustomError("completion_window", f"must be {WINDOW_RULE}")
    return window


Window = Annotated[
    str,
    AfterValidator(_window),
    Field(description=f"{WINDOW_RULE}.", json_schema_extra={"pattern": f"^{WINDOW.pattern}$"}),
]
FileId = Annotated[str, Field(pattern=ID_PATTERN)]
# OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class BatchRequest(_Open):
    """``POST /v1/batches``."""

    input_file_id: FileId
    endpoint: Endpoint
    completion_window: Window
    metadata: Metadata | None = None


def check_batch(body: Any) -> BatchRequest:
    """``body`` as a request to create a batch, else :class:`BodyError`."""
    if not isinstance(body, dict):
        raise BodyError("The request body must be a JSON object.")
    try:
        return BatchRequest.model_validate(body)
    except ValidationError as exc:
        raise _body_error(exc) from None


class PageQuery(BaseModel):
    """The query of ``GET /v1/files`` and ``GET /v1/batches`` (text, read as such)."""

    model_config = ConfigDict(extra="allow")

    after: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] = 20


def check_page(query: Mapping[str, str]) -> PageQuery:
    """``query`` read as a :class:`PageQuery`, else :class:`BodyError`."""
    try:
        return PageQuery.model_validate(dict(query))
    except ValidationError as exc:
        raise _body_error(exc) from None
