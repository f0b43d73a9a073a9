"""A simple deterministic tokenizer, so that ``usage`` and ``/tokenize`` agree.

Text splits into words and single punctuation marks; each piece maps to a stable id
(CRC-32 of its bytes). Chat messages are rendered through a fixed template first.
Generated tokens are words from a fixed list, one token each, chosen from the
request's seed and position, so the same request always gets the same answer.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

_PIECE = re.compile(r"\w+|[^\w\s]")
NUM_SPECIAL = 16

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or "
    "are not but have has had were one all their there been if more when will would "
    "who so no out up into do than can only other time some could new these two may "
    "first then any like now over such our also most where after back"
).split()


class SimTokenizer:
    """Word-level tokenizer with ids in ``[NUM_SPECIAL, vocab_size)``."""

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size <= NUM_SPECIAL + len(_WORDS):
            raise ValueError("vocab_size too small")
        self.vocab_size = vocab_size
        self._word_ids = [self._piece_id(w) for w in _WORDS]
        self._id_words = dict(zip(self._word_ids, _WORDS, strict=True))

    def _piece_id(self, piece: str) -> int:
        return NUM_SPECIAL + zlib.crc32(piece.encode()) % (self.vocab_size - NUM_SPECIAL)

    def encode(self, text: str) -> list[int]:
        return [self._piece_id(p) for p in _PIECE.findall(text)]

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]]) -> str:
        """Render chat messages as one prompt, ending with the assistant's turn."""
        parts = [f"<|{m.get('role', 'user')}|>\n{message_text(m)}\n" for m in messages]
        parts.append("<|assistant|>\n")
        return "".join(parts)

    def sample(self, seed: int, index: int) -> int:
        """The token generated at output position ``index`` for ``seed``."""
        pick = zlib.crc32(f"{seed}:{index}".encode()) % len(self._word_ids)
        return self._word_ids[pick]

    def decode_token(self, token_id: int) -> str:
        """Text of a generated token (a leading space, then the word)."""
        word = self._id_words.get(token_id)
        return f" {word}" if word is not None else f" <{token_id}>"


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a chat message whose content is a string or a list of text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(t for t in texts if isinstance(t, str))
    raise TypeError("message content must be a string or a list of parts")


def prompt_seed(token_ids: list[int], seed: int | None = None) -> int:
    """A seed for generation derived from the prompt (and the request's ``seed``)."""
    data = ",".join(map(str, token_ids[-64:])).encode()
    return zlib.crc32(data) ^ (seed or 0)
