"""The fleet benchmark's three workloads (:mod:`loadtests.bench.fleet`), made from a seed.

- ``conversations``: multi-turn chats, each turn resending the whole history so far
  (its earlier turns and a fixed reply to each), a pause between turns as a reader
  takes. What a prefix cache saves here is the history; a router that scatters one
  chat's turns over the fleet makes every engine hold every chat.
- ``system-prompt``: one long system prompt shared by every chat, then a short
  question of its own; one turn each, arriving at random (Poisson) times. Every
  router finds the shared prefix somewhere; the question is whether it piles the
  whole load on the engine that holds it.
- ``documents``: a batch job of documents, each asked :data:`QUESTIONS` questions,
  one line per question (prompt = document + question), the lines of a document
  one after the other as a pipeline writes them; beside it, short live chats.

Pure and deterministic: the same name, fleet size, duration and seed give the same
requests, byte for byte, in every arm and every run. Prompts are prose from Python's
own documentation (:func:`loadtests.harness.corpus.passage`); sizes are in
characters, about 4.5 to a token of the simulated engine's word-level tokenizer. A
chat's replies are part of the workload, not the engine's answers, so that every
arm resends the same history. Every chat's first message opens with its own id,
so two chats share no cache block unless the workload means them to (the system
prompt).

Load scales with the fleet and the run: the numbers below are per engine and per
second, so each engine of a 4- and a 16-engine fleet sees about the same work, and
a shorter run (``--duration-s``) sends less of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtests.harness.corpus import corpus, passage

WORKLOADS = ("conversations", "system-prompt", "documents")
QUESTIONS = (
    "In one sentence, what is the passage above about?",
    "Name one term the passage above defines.",
    "Which example in the passage above is the simplest?",
    "What would a beginner find hardest in the passage above?",
)
"""The questions asked of every document, one batch line each."""

Message = dict[str, str]


@dataclass(frozen=True)
class Chat:
    """One conversation: ``turns`` user messages sent one after the other, each with
    the history before it; ``start_s`` after the run starts, ``think_s[i]`` after
    turn ``i`` is answered."""

    id: str
    start_s: float
    turns: tuple[str, ...]
    replies: tuple[str, ...]
    think_s: tuple[float, ...]
    system: str = ""

    def messages(self, turn: int) -> list[Message]:
        """What turn ``turn`` (0-based) sends: the system prompt if any, every earlier
        turn with its reply, then this turn's message."""
        out: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn):
            out += [
                {"role": "user", "content": self.turns[i]},
                {"role": "assistant", "content": self.replies[i]},
            ]
        return [*out, {"role": "user", "content": self.turns[turn]}]


@dataclass(frozen=True)
class Line:
    """One batch line: its ``custom_id`` and the one user message it sends."""

    custom_id: str
    content: str


@dataclass(frozen=True)
class Workload:
    """A workload's requests: its chats and its batch lines (in file order)."""

    name: str
    chats: tuple[Chat, ...]
    lines: tuple[Line, ...] = ()
    chat_max_tokens: int = 16
    line_max_tokens: int = 8

    @property
    def chat_requests(self) -> int:
        return sum(len(c.turns) for c in self.chats)


@dataclass(frozen=True)
class Sizes:
    """How much work, per engine, and how large each prompt is (characters)."""

    conversations_per_engine_s: float = 0.2  # chats begun per engine per second of the run
    conversation_turns: int = 6
    conversation_opening_chars: int = 1600  # a pasted passage opens each chat
    turn_chars: int = 120
    reply_chars: int = 70
    think_s: tuple[float, float] = (1.0, 2.0)
    system_prompt_chars: int = 5400
    questions_per_engine_s: float = 1.5
    documents_per_engine_s: float = 0.6
    document_chars: int = 3600
    side_chats_per_engine_s: float = 0.15
    side_chat_turns: int = 3
    side_chat_opening_chars: int = 400


def make(
    name: str, engines: int, duration_s: float, seed: int, sizes: Sizes | None = None
) -> Workload:
    """Workload ``name`` (one of :data:`WORKLOADS`) for a fleet of ``engines`` over
    about ``duration_s`` seconds (``sizes``: :class:`Sizes`' defaults if None)."""
    sizes = sizes or Sizes()
    rng = random.Random(f"{name}:{engines}:{duration_s}:{seed}")
    if name == "conversations":
        return Workload(name, _conversations(rng, engines, duration_s, sizes))
    if name == "system-prompt":
        return Workload(name, _system_prompt(rng, engines, duration_s, sizes))
    if name == "documents":
        side = _chats(
            rng,
            "side",
            count=_count(sizes.side_chats_per_engine_s, engines, duration_s),
            turns=sizes.side_chat_turns,
            opening_chars=sizes.side_chat_opening_chars,
            spread_s=duration_s,
            sizes=sizes,
        )
        documents = _count(sizes.documents_per_engine_s, engines, duration_s)
        return Workload(name, side, _documents(rng, documents, sizes))
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def _conversations(
    rng: random.Random, engines: int, duration_s: float, sizes: Sizes
) -> tuple[Chat, ...]:
    """Chats that start over the first part of the run, so that the last of them
    ends near ``duration_s`` (each takes its turns' pauses and answers)."""
    length_s = sizes.conversation_turns * sum(sizes.think_s) / 2
    return _chats(
        rng,
        "chat",
        count=_count(sizes.conversations_per_engine_s, engines, duration_s),
        turns=sizes.conversation_turns,
        opening_chars=sizes.conversation_opening_chars,
        spread_s=max(1.0, duration_s - length_s),
        sizes=sizes,
    )


def _chats(
    rng: random.Random,
    prefix: str,
    *,
    count: int,
    turns: int,
    opening_chars: int,
    spread_s: float,
    sizes: Sizes,
) -> tuple[Chat, ...]:
    chats = []
    for n in range(count):
        chat_id = f"{prefix}-{n}"
        opening = f"{chat_id}: read this, then answer my questions.\n\n" + _text(rng, opening_chars)
        asks = [opening] + [f"{chat_id}: {_text(rng, sizes.turn_chars)}?" for _ in range(turns - 1)]
        chats.append(
            Chat(
                id=chat_id,
                start_s=round(rng.uniform(0, spread_s), 3),
                turns=tuple(asks),
                replies=tuple(_text(rng, sizes.reply_chars) for _ in range(turns)),
                think_s=tuple(round(rng.uniform(*sizes.think_s), 3) for _ in range(turns)),
            )
        )
    return tuple(sorted(chats, key=lambda c: c.start_s))


def _system_prompt(
    rng: random.Random, engines: int, duration_s: float, sizes: Sizes
) -> tuple[Chat, ...]:
    """One-turn chats at Poisson times, all behind the same long system prompt."""
    system = "You answer questions about Python. Its documentation follows.\n\n"
    system += _text(rng, sizes.system_prompt_chars)
    rate = sizes.questions_per_engine_s * engines
    chats: list[Chat] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        n = len(chats)
        question = f"Question {n}: {_text(rng, sizes.turn_chars)}?"
        chats.append(Chat(f"ask-{n}", round(at, 3), (question,), ("",), (0.0,), system))
        at += rng.expovariate(rate)
    return tuple(chats)


def _documents(rng: random.Random, count: int, sizes: Sizes) -> tuple[Line, ...]:
    """Each document's questions, one line each, a document's lines together."""
    lines = []
    for d in range(count):
        document = f"Document {d}.\n\n" + _text(rng, sizes.document_chars)
        for q, question in enumerate(QUESTIONS):
            lines.append(Line(f"doc-{d}-q{q}", f"{document}\n\n{question}"))
    return tuple(lines)


def _count(per_engine_s: float, engines: int, duration_s: float) -> int:
    """How many of a thing a fleet of ``engines`` gets over ``duration_s`` (at least one)."""
    return max(1, round(per_engine_s * engines * duration_s))


def _text(rng: random.Random, chars: int) -> str:
    return passage(rng.randrange(len(corpus())), chars).strip()
