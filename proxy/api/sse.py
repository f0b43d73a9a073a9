"""Reading the engine's server-sent events without re-serialising them.

:class:`SSEReader` takes the raw byte chunks of an upstream stream as they come
and returns the complete events in them, each with its raw bytes (what is relayed
to the client, unchanged) and its parsed ``data`` (what the proxy looks at: did a
token arrive, is this the usage chunk, is it an error).
"""

from __future__ import annotations

import json
from typing import Any

Json = dict[str, Any]
# vLLM 0.32 streams reasoning text as ``reasoning``; older releases said ``reasoning_content``.
_TOKEN_KEYS = ("content", "tool_calls", "reasoning", "reasoning_content")


_UNREAD: Any = object()
"""An event's ``data`` not parsed yet."""

# What a token's chunk holds, as compact JSON writes it (vLLM's, pydantic's): a key
# and the first character of its value. In valid JSON ``"key":`` occurs only as a key:
# a quote inside a string is escaped (``\\"``), and a string cannot be followed by a
# colon unless it is one. The next character tells an empty value (``""``, ``[]``,
# ``null``) from one that is not.
_TOKEN_MARKS = (
    (b'"content":"', b'"'),
    (b'"text":"', b'"'),
    (b'"finish_reason":"', b'"'),
    (b'"token_ids":[', b"]"),
    (b'"tool_calls":[', b"]"),
    (b'"reasoning":"', b'"'),
    (b'"reasoning_content":"', b'"'),
)
# Where ``"usage"``, ``"error"`` or ``": `` is in a payload, it is parsed: the usage
# chunk, an error, and JSON written with spaces (the marks above would miss its keys).


class SSEEvent:
    """One complete event: ``raw``, its bytes as they came (what is relayed), ``done``
    (it is ``data: [DONE]``) and ``data`` (its JSON object, None if it has none).

    What the relay asks of every event (:attr:`has_token`, :attr:`usage`,
    :attr:`error`, :attr:`is_usage_only`) is read from the bytes where they are compact
    JSON with no usage and no error in them, as each token's chunk from vLLM is: no
    JSON parse per token (docs/overhead.md, "The hot path"); ``data`` is parsed when
    it is asked for. Anything else is parsed."""

    __slots__ = ("_data", "_payload", "_plain", "done", "raw")

    def __init__(
        self, raw: bytes, data: Json | None = None, done: bool = False, payload: bytes = b""
    ) -> None:
        self.raw = raw
        self.done = done
        self._payload = payload
        plain = (
            bool(payload)
            and b'"usage"' not in payload
            and b'"error"' not in payload
            and b'": ' not in payload
        )
        self._plain = plain
        self._data: Json | None = _UNREAD if plain else data
        if payload and not plain:
            self._data = _payload(payload)[0]

    @classmethod
    def of_payload(cls, raw: bytes, payload: bytes) -> SSEEvent:
        """The event ``raw`` whose one data line holds ``payload``."""
        if payload.startswith(b"{"):
            return cls(raw, payload=payload)
        data, done = _payload(payload)
        return cls(raw, data, done)

    @property
    def data(self) -> Json | None:
        data = self._data
        if data is _UNREAD:
            data = self._data = _payload(self._payload)[0]
        return data

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SSEEvent):
            return NotImplemented
        return (self.raw, self.done, self.data) == (other.raw, other.done, other.data)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SSEEvent(raw={self.raw!r}, done={self.done})"

    @property
    def has_token(self) -> bool:
        """Whether the event carries generated output (text, a tool call, or a finish,
        or token ids: vLLM's ``return_token_ids`` sends a chunk for every token, even
        one whose text is held back until a character is whole)."""
        if self._plain:
            payload = self._payload
            for mark, empty in _TOKEN_MARKS:
                at = payload.find(mark)
                while at >= 0:  # every choice's
                    at += len(mark)
                    if payload[at : at + 1] != empty:
                        return True
                    at = payload.find(mark, at)
            return False
        data = self.data
        if data is None:
            return False
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("text") or choice.get("finish_reason") or choice.get("token_ids"):
                return True
            if any(delta.get(key) for key in _TOKEN_KEYS):
                return True
        return False

    @property
    def usage(self) -> Json | None:
        """The usage the event reports, if any."""
        if self._plain:
            return None
        data = self.data
        usage = data.get("usage") if data is not None else None
        return usage if isinstance(usage, dict) and usage else None

    @property
    def is_usage_only(self) -> bool:
        """The closing chunk that ``stream_options.include_usage`` adds."""
        if self._plain:
            return False
        data = self.data
        return data is not None and not data.get("choices") and "usage" in data

    @property
    def error(self) -> Json | None:
        if self._plain:
            return None
        data = self.data
        if data is None:
            return None
        err = data.get("error")
        return err if isinstance(err, dict) else None


_DECODE = json.JSONDecoder().decode


def _parse(block: bytes) -> tuple[Json | None, bool]:
    if block.startswith(b"data:") and b"\n" not in block and b"\r" not in block:
        payload = block[5:].lstrip()  # one data line, the usual case
    else:
        lines = [ln[5:].lstrip() for ln in block.splitlines() if ln.startswith(b"data:")]
        if not lines:
            return None, False
        payload = b"\n".join(lines)
    return _payload(payload)


def _payload(payload: bytes) -> tuple[Json | None, bool]:
    """An event's ``data`` parsed, and whether it is ``[DONE]``. An object is decoded
    by the decoder itself: ``json.loads`` on bytes first guesses their encoding (a
    third of its time on a token's chunk), which for one starting with ``{`` is
    UTF-8, so the result is the same."""
    if payload.startswith(b"{"):
        try:
            data = _DECODE(payload.decode("utf-8", "surrogatepass"))
        except ValueError:  # UnicodeDecodeError too
            return None, False
        return (data if isinstance(data, dict) else None), False
    if payload.strip() == b"[DONE]":
        return None, True
    try:
        data = json.loads(payload)
    except ValueError:
        return None, False
    return (data if isinstance(data, dict) else None), False


class SSEReader:
    """Split a byte stream into events at blank lines (``\\n\\n`` or ``\\r\\n\\r\\n``)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if (
            not self._buffer
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        ):
            # One whole event of one data line, as each of vLLM's chunks is: no
            # buffer, no search for the boundary.
            return [SSEEvent.of_payload(chunk, chunk[5:-2].lstrip())]
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            cut, sep = self._boundary()
            if cut < 0:
                return events
            raw = self._buffer[: cut + sep]
            self._buffer = self._buffer[cut + sep :]
            data, done = _parse(raw[:cut])
            events.append(SSEEvent(raw, data, done))

    def _boundary(self) -> tuple[int, int]:
        if b"\r" not in self._buffer:
            i = self._buffer.find(b"\n\n")
            return (i, 2) if i >= 0 else (-1, 0)
        found = [(i, len(s)) for s in (b"\n\n", b"\r\n\r\n") if (i := self._buffer.find(s)) >= 0]
        return min(found) if found else (-1, 0)

    @property
    def pending(self) -> bytes:
        return self._buffer


def sse_error(message: str, err_type: str = "engine_error", code: str = "engine_failed") -> bytes:
    """An SSE event carrying an OpenAI-style error object: the end of a stream whose
    status (200) went out already, so only ``type`` and ``code`` can say what failed
    (``code`` a string, as in every error the proxy answers: :mod:`proxy.openai.errors`)."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
