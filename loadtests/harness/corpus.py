"""Real text for the load tests: Python's own documentation, sliced into prompts, and
the files of ``loadtests/corpus/`` (licences, RFCs, a public-domain book, Python's
documentation pages, and the awkward cases: a document of ten pages or more, one-line
questions, multi-turn conversations, batch extraction prompts asking for JSON with a
schema). Every file there is listed with its source, licence and hash in
``loadtests/corpus/manifest.yaml`` (:func:`manifest_problems` checks it); a workload
file's ``prompt.source`` names one of :data:`SETS`, and :func:`messages` makes a
request's messages from it.

The passages are the topic texts that ship with Python (``pydoc_data.topics``, the
same text the small model's tokenizer was trained on), read in a fixed order, so
every run on every machine sends the same prompts. A prompt is sized in the engine's
own tokens with ``POST /tokenize``.

vLLM caches prompt prefixes by whole blocks, each block's hash chained to the one
before: two prompts that differ in their first tokens share no block. Every prompt
here starts with its own header line, so no prompt's prefill is ever skipped, even
when the same passage is sent again in a later repetition.

These are text prompts of real prose, sized to within 0.5% by bisection, because
the harness sends what users send. The measuring tools (probe, calibration) want
token-id prompts of an exact length instead: :class:`loadtests.engine_io.PromptMaker`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import yaml

CORPUS_DIR = Path(__file__).parents[1] / "corpus"
MANIFEST = CORPUS_DIR / "manifest.yaml"
MAX_CORPUS_BYTES = 2_000_000

SETS: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (kind, files under loadtests/corpus/, glob patterns)
    "python-docs": ("topics", ()),  # pydoc_data.topics, which ships with Python
    "python-pages": ("documents", ("python-docs/*.rst.txt",)),
    "licences": ("documents", ("licences/*.txt",)),
    "rfc": ("documents", ("rfc/*.txt",)),
    "book": ("documents", ("book/*.txt",)),
    "long-document": ("documents", ("rfc/rfc2616-pages-1-16.txt",)),
    "questions": ("questions", ("awkward/questions.txt",)),
    "conversations": ("conversations", ("awkward/conversations.yaml",)),
    "extraction": ("extraction", ("awkward/extraction.yaml",)),
}
"""The prompt sources a workload file can name. ``topics`` and ``documents`` with
``chars`` give a passage of that many characters; ``documents`` without ``chars``
give whole documents in turn; ``questions`` one line each; ``conversations`` a whole
message history; ``extraction`` an instruction, a JSON schema and its document."""

NEEDS_CHARS = frozenset({"python-docs"})

Message = dict[str, str]


@cache
def corpus() -> str:
    """All of Python's topic texts, in key order, as one string."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # as the engine counts them (completions ``prompt``, or chat ``messages``)


class Tokenizer:
    """The engine's ``/tokenize``, for sizing prompts."""

    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http = http
        self.model = model

    def count_prompt(self, text: str) -> int:
        return self._count({"prompt": text})

    def count_messages(self, messages: list[dict[str, str]]) -> int:
        return self._count({"messages": messages})

    def _count(self, body: dict[str, object]) -> int:
        response = self.http.post("/tokenize", json={"model": self.model, **body})
        response.raise_for_status()
        return int(response.json()["count"])


def passage(start: int, chars: int) -> str:
    """``chars`` characters of the corpus from ``start``, wrapping around its end."""
    return _slice(corpus(), start, chars)


def sized_prompt(tokenizer: Tokenizer, header: str, start: int, tokens: int) -> Prompt:
    """``header`` then a passage from ``start``, cut so that the whole prompt has
    ``tokens`` tokens or just under (within 0.5%), by bisection on its length."""
    lo, hi = 0, tokens * 8  # characters; a token is at least one character
    best: Prompt | None = None
    for _ in range(40):
        chars = (lo + hi) // 2
        text = f"{header}\n\n{passage(start, chars)}"
        count = tokenizer.count_prompt(text)
        if count <= tokens:
            best = Prompt(text, count)
            if count >= tokens * 0.995:
                return best
            lo = chars + 1
        else:
            hi = chars - 1
        if lo > hi:
            break
    raise RuntimeError(f"could not size a prompt to {tokens} tokens (best {best})")


def set_files(name: str) -> list[Path]:
    """The files of source ``name``, sorted (none for ``python-docs``)."""
    _kind, patterns = SETS[name]
    return sorted(p for pattern in patterns for p in CORPUS_DIR.glob(pattern))


@cache
def _documents(name: str) -> tuple[str, ...]:
    return tuple(p.read_text() for p in set_files(name))


@cache
def _joined(name: str) -> str:
    return "\n\n".join(_documents(name)) if SETS[name][0] != "topics" else corpus()


@cache
def _questions() -> tuple[str, ...]:
    (path,) = set_files("questions")
    return tuple(line.strip() for line in path.read_text().splitlines() if line.strip())


@cache
def _conversations() -> tuple[tuple[Message, ...], ...]:
    (path,) = set_files("conversations")
    data = yaml.safe_load(path.read_text())
    return tuple(tuple(dict(m) for m in data[k]) for k in sorted(data))


@cache
def _extractions() -> tuple[dict[str, Any], ...]:
    (path,) = set_files("extraction")
    return tuple(yaml.safe_load(path.read_text()))


def _slice(text: str, start: int, chars: int) -> str:
    start %= len(text)
    out = text[start : start + chars]
    while len(out) < chars:
        out += ("\n\n" + text)[: chars - len(out)]
    return out


def messages(source: str, index: int, start: int, chars: int | None) -> list[Message]:
    """Request ``index``'s chat messages from ``source`` (one of :data:`SETS`): the
    choice turns with ``index`` from a seeded ``start``; ``chars`` cuts a passage (or
    an extraction's document) to that length."""
    kind = SETS[source][0]
    if kind in ("topics", "documents"):
        if chars is not None:
            text = _slice(_joined(source), start, chars)
        else:
            docs = _documents(source)
            text = docs[(start + index) % len(docs)]
        return [{"role": "user", "content": text}]
    if kind == "questions":
        lines = _questions()
        return [{"role": "user", "content": lines[(start + index) % len(lines)]}]
    if kind == "conversations":
        convs = _conversations()
        return [dict(m) for m in convs[(start + index) % len(convs)]]
    item = _extraction(index, start)
    document = (CORPUS_DIR / item["document"]).read_text()
    if chars is not None:
        document = document[:chars]
    content = (
        f"{item['instruction']}\nAnswer with one JSON object only, valid against this "
        f"JSON schema:\n{json.dumps(item['schema'], sort_keys=True)}\n\n"
        f"Document ({item['document']}):\n\n{document}"
    )
    return [{"role": "user", "content": content}]


def _extraction(index: int, start: int) -> dict[str, Any]:
    items = _extractions()
    return items[(start + index) % len(items)]


def answer_schema(source: str, index: int, start: int) -> dict[str, Any] | None:
    """The JSON schema that request ``index``'s prompt from ``source`` (as
    :func:`messages` makes it) asks the answer to follow; None for a source whose
    prompts carry none (all but ``extraction``)."""
    if SETS[source][0] != "extraction":
        return None
    return dict(_extraction(index, start)["schema"])


def as_prompt(chat: list[Message]) -> str:
    """A completions ``prompt`` from chat messages: one ``role: content`` block each
    (a lone user message is its content alone)."""
    if len(chat) == 1 and chat[0]["role"] == "user":
        return chat[0]["content"]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in chat) + "\n\nassistant:"


def manifest_problems(root: Path = CORPUS_DIR) -> list[str]:
    """What is wrong with ``root``'s manifest: a file not listed, a listed file that
    is missing, a hash or size that differs, an entry without its source or licence,
    a corpus over :data:`MAX_CORPUS_BYTES`. Empty when all is well."""
    listed = yaml.safe_load((root / "manifest.yaml").read_text())["files"]
    present = {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name not in ("manifest.yaml", "SOURCES.md")
    }
    problems = [f"{name}: not in manifest.yaml" for name in sorted(present - set(listed))]
    problems += [f"{name}: listed but missing" for name in sorted(set(listed) - present)]
    total = 0
    for name in sorted(set(listed) & present):
        entry, data = listed[name], (root / name).read_bytes()
        total += len(data)
        for key in ("source", "licence"):
            if not entry.get(key):
                problems.append(f"{name}: no {key}")
        if (
            entry.get("bytes") != len(data)
            or entry.get("sha256") != hashlib.sha256(data).hexdigest()
        ):
            problems.append(f"{name}: differs from its manifest entry (size or sha256)")
    if total > MAX_CORPUS_BYTES:
        problems.append(f"the corpus is {total:,} bytes, over {MAX_CORPUS_BYTES:,}")
    return problems
