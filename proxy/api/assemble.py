"""A non-streaming answer assembled from the engine's streamed chunks.

The proxy always streams from the engine (so it sees the first token); a client
that asked for a plain JSON answer gets one with the shape of the engine's own
non-streaming body: ``chat.completion`` with a ``message`` per choice, or
``text_completion`` with ``text`` per choice, and ``usage``.
"""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

_TOP_SKIP = {"choices", "usage", "object", "error"}
# The engine's name for reasoning text, kept in the assembled message: vLLM 0.32
# streams ``reasoning``, older releases ``reasoning_content``.
_REASONING_KEYS = ("reasoning", "reasoning_content")


def _merge_tool_calls(into: list[Json], deltas: list[Json]) -> None:
    for delta in deltas:
        index = delta.get("index", len(into))
        while len(into) <= index:
            into.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = into[index]
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        fn = delta.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


class _Choice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = _REASONING_KEYS[0]
        self.tool_calls: list[Json] = []
        self.logprobs: Json | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None

    def add(self, choice: Json) -> None:
        delta = choice.get("delta")
        if delta is not None:
            self.role = delta.get("role") or self.role
            self.text.append(delta.get("content") or "")
            for key in _REASONING_KEYS:
                if delta.get(key):
                    self.reasoning_key = key
                    self.reasoning.append(delta[key])
            _merge_tool_calls(self.tool_calls, delta.get("tool_calls") or [])
        else:
            self.text.append(choice.get("text") or "")
        self._add_logprobs(choice.get("logprobs"))
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.stop_reason = choice.get("stop_reason", self.stop_reason)

    def _add_logprobs(self, lp: Json | None) -> None:
        if not lp:
            return
        if self.logprobs is None:
            self.logprobs = {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
            return
        for key, value in lp.items():
            if isinstance(value, list) and isinstance(self.logprobs.get(key), list):
                self.logprobs[key].extend(value)

    def chat(self) -> Json:
        message: Json = {"role": self.role, "content": "".join(self.text)}
        message["tool_calls"] = self.tool_calls
        if any(self.reasoning):
            message[self.reasoning_key] = "".join(self.reasoning)
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }

    def completion(self) -> Json:
        return {
            "index": self.index,
            "text": "".join(self.text),
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "prompt_logprobs": None,
        }


class Assembler:
    """Feed it every parsed chunk; :meth:`body` gives the non-streaming answer."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._head: Json = {}
        self._choices: dict[int, _Choice] = {}
        self.usage: Json | None = None

    def add(self, chunk: Json) -> None:
        # The first chunk sets the head; later ones only add to it (vLLM sends
        # ``system_fingerprint`` in the closing usage chunk).
        for key, value in chunk.items():
            if key not in _TOP_SKIP:
                self._head.setdefault(key, value)
        for choice in chunk.get("choices") or ():
            index = int(choice.get("index", 0))
            self._choices.setdefault(index, _Choice(index)).add(choice)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def body(self) -> Json:
        choices = [self._choices[i] for i in sorted(self._choices)]
        head = {"id": self._head.get("id"), "object": "", **self._head}
        if self.chat:
            head["object"] = "chat.completion"
            body = {**head, "choices": [c.chat() for c in choices], "usage": self.usage}
            body.setdefault("prompt_logprobs", None)
            return body
        head["object"] = "text_completion"
        return {**head, "choices": [c.completion() for c in choices], "usage": self.usage}
