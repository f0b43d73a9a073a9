"""Prefilling a long batch prompt in pieces: the arithmetic, the piece size, what the
proxy knows per engine. Pure: no I/O, no clock (the edge passes times in).

Without ``--long-prefill-token-threshold`` vLLM runs a prompt already in prefill
before a chat that arrives after it, in steps of up to ``max_num_batched_tokens``,
so a chat admitted beside a long batch prompt still waits for all of it. With
prefix caching on (the V1 default) the proxy can instead send the prompt as a
sequence of requests over growing prefixes of its token ids, each asking for one
token (the answer is discarded), then the real request: each piece costs the
engine only its new tokens, and between pieces a chat goes first.

The plan (:func:`next_piece`): piece ``k`` of a prompt of ``total`` tokens ends at
the ``k``-th multiple of the piece size ``size`` (itself a multiple of the
engine's KV block, so every piece ends on a block boundary and its blocks are
cached whole), as long as that end is below ``total``; then the final request,
the whole prompt, which has between 1 and ``size`` new tokens (an engine always
computes at least a prompt's last token, so the final cannot be all cached). A
prompt no longer than one piece is sent whole.

The cache must hold: piece ``k+1`` should find the ``k`` earlier pieces' tokens
cached. The engine says so in the piece's ``usage`` when it reports
``cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``;
:func:`cache_held`); otherwise its ``vllm:prefix_cache_hits`` counter must have
risen by at least that many tokens while the piece ran (:func:`hits_held`).
Other requests' hits only add to the counter, so a shortfall is a miss for sure;
a miss that other hits cover goes unseen. When the cache did not hold (evicted,
prefix caching off) or cannot be checked (neither is reported), the engine's
:class:`EnginePieces` turns piecing off there and says why.

Each piece is a batch job of its own new tokens, which the scheduler admits
within the budget and after any chat in prefill, at most :data:`PIECE_DEPTH` in
prefill per engine (:func:`pieces_in_prefill`); a prompt's later pieces and its
final request are pinned to the engine of its first (``Job.pinned``). Piece
``k+1`` is sent once piece ``k`` is in the engine, so it finds ``k`` cached if
the engine runs them in order; it must find at least the pieces already
answered.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from proxy.scheduler.types import Job, Phase


class PiecingMode(enum.StrEnum):
    """``engines[].piecing``: ``off`` never; ``on`` always (until the cache fails to
    hold); ``auto`` where the engine's ``/metrics`` reports prefix caching on, while
    chat is live or expected there and the engine does not chunk long prefills
    itself (:meth:`EnginePieces.choose`)."""

    OFF = "off"
    ON = "on"
    AUTO = "auto"


@dataclass(frozen=True)
class Piece:
    """One request of a pieced prompt: number ``index`` (from 1), over the prompt's
    first ``end`` tokens, of which ``cached`` should be in the engine's cache and
    ``new_tokens`` are computed; ``final`` is the whole prompt (the real request)."""

    index: int
    end: int
    cached: int
    final: bool

    @property
    def new_tokens(self) -> int:
        return self.end - self.cached


def aligned(tokens: int, block: int) -> int:
    """``tokens`` rounded down to a whole number of blocks, at least one block."""
    if block < 1:
        raise ValueError(f"block size must be at least 1, got {block}")
    return max(block, tokens // block * block)


def next_piece(total: int, done: int, size: int, block: int, index: int = 1) -> Piece:
    """The piece after the first ``done`` tokens (a block-aligned end of an earlier
    piece; 0 at the start) of a ``total``-token prompt, with pieces of ``size``
    tokens rounded down to whole blocks of ``block``."""
    if total < 1 or not 0 <= done < total:
        raise ValueError(f"need 0 <= done < total, got done={done}, total={total}")
    end = done + aligned(size, block)
    if end >= total:
        return Piece(index, total, done, final=True)
    return Piece(index, end, done, final=False)


PIECE_DEPTH = 2
"""Pieces in prefill at once on one engine: the next piece waits in the engine while
one runs, so the engine never idles for the proxy's round trip between pieces. While
the engine's own chunking is not known yet, one (:attr:`EnginePieces.depth`): the
piece that tells it must run alone."""

NEED_S = 120.0
"""How long chat seen on an engine (sent there, or missing its aim there) keeps
``auto`` piecing there."""

MIN_PIECE_TOKENS = 64
"""The smallest piece is the fewest whole KV blocks of the engine that hold this
many tokens (one block of 128 on vLLM's CPU build, four of 16 on a GPU's default):
below that, a piece's request costs the engine more in its step's fixed part than
it spares a chat."""

CHUNK_PROBES = 3
"""Pieces that may leave the engine's own chunking unjudged (other work in the same
steps, no step histogram) before pieces go two at a time anyway."""


@dataclass(frozen=True)
class ChatSigns:
    """What the scheduler knows of chat on one engine, for the piecing choice: its
    interactive ``streams`` in decode, ``in_prefill`` chats dispatched there and not
    answered yet, ``queued`` chats the engine may take, when a chat was last
    dispatched there (``last_at``) and when its budget loop last judged chat beside
    batch prefill over its aim (``missed_at``); None: never."""

    streams: int = 0
    in_prefill: int = 0
    queued: int = 0
    last_at: float | None = None
    missed_at: float | None = None


@dataclass(frozen=True)
class Choice:
    """Whether a long batch prompt goes in pieces on an engine, and why."""

    pieces: bool
    why: str


def pieces_in_prefill(inflight: Iterable[Job]) -> int:
    """The pieces in prefill among ``inflight``: a chat that arrives waits for every
    piece in the engine, so there are at most :data:`PIECE_DEPTH`."""
    return sum(1 for j in inflight if j.piece and j.phase is Phase.PREFILL)


def cache_held(expected: int, reported: int | None) -> bool:
    """Whether the engine found the earlier pieces in its cache: it reported at least
    ``expected`` cached prompt tokens (None: it does not report them)."""
    return reported is not None and reported >= expected


def hits_held(expected: int, before: float | None, after: float | None) -> bool | None:
    """Whether a piece that should find ``expected`` tokens cached did, judged by
    the engine's prefix-cache hit counter read ``before`` it was sent and ``after``
    it was answered: True if it rose by at least ``expected``, False if not; None
    if that cannot be told (no counter, or it went back: the engine restarted)."""
    if before is None or after is None or after < before:
        return None
    return after - before >= expected


HITS_CHECK_EVERY = 8
"""Where only the engine's prefix-cache hit counter can check the pieces, the pieces
of a prompt it checks: its second (the first with a piece before it), then every
eighth, besides every piece until an engine had :data:`HITS_CHECKS_FIRST` checks.
Each check reads the engine's ``/metrics`` twice, which on vLLM costs its API server
more than a small piece's own request; a miss the unchecked pieces hide shows at the
next check, and costs only compute (the client's request is answered whole)."""
HITS_CHECKS_FIRST = 3


def hits_check_due(index: int, checks: int) -> bool:
    """Whether piece ``index`` (from 1) of a prompt is checked by the hit counter,
    after ``checks`` checks on its engine so far."""
    if index < 2:
        return False
    return checks < HITS_CHECKS_FIRST or index == 2 or index % HITS_CHECK_EVERY == 0


def pace_s(now: float, last_sent: float | None, others: int, piece_s: float | None) -> float:
    """How long to hold a piece before sending it so that the engine computes its
    pieces one a step: none if no other piece of the engine is in flight (or nothing
    is known); else until half a piece's time (``piece_s``) after the last one was
    sent. vLLM puts every prompt waiting in its queue into its next step, so two
    pieces sent together share a step (a gap of two pieces for a chat stream) and
    the engine then waits for the proxy's round trip; paced, the next piece arrives
    while the one before it runs, and waits for a step of its own."""
    if not others or last_sent is None or piece_s is None:
        return 0.0
    return max(0.0, last_sent + piece_s / 2 - now)


def piece_size(seconds_per_token: float, target_s: float, block: int, lo: int, hi: int) -> int:
    """The piece that keeps the engine busy for about ``target_s`` at
    ``seconds_per_token``, in whole blocks, within ``[lo, hi]``."""
    if seconds_per_token <= 0:
        return aligned(hi, block)
    fit = int(target_s / seconds_per_token)
    return aligned(min(hi, max(lo, fit)), block)


@dataclass(kw_only=True)
class EnginePieces:
    """Piecing on one engine: whether it may piece, when it does, and what was learned.

    **When** (:meth:`choose`, ``auto``): while chat is live or expected there, decided
    ahead from what the scheduler knows (:class:`ChatSigns`) rather than after chat
    missed its aim: a chat stream in decode, a chat in prefill or queued, a chat sent
    there within :attr:`need_s`, or a miss of the budget loop within it. An engine that
    serves only batch gets whole prompts. An engine that chunks long prefills itself
    (:meth:`judged`) gets whole prompts too, misses or not: its steps are already no
    larger than two pieces would make them, and the budget loop answers its misses.

    **Size**: ``piece_tokens`` starts at ``initial_tokens`` and follows the measured
    cost per prompt token (:meth:`answered`). A new chat waits for the
    :data:`PIECE_DEPTH` pieces in the engine, then its own short prefill: together
    they should take about ``idle_target_s`` (the TTFT aim). While chat streams
    decode there, one piece should also take no more than ``target_s`` (the gap aim).
    The floor is :data:`MIN_PIECE_TOKENS` in whole KV blocks of the engine (from its
    ``vllm:cache_config_info``), so a slow engine gets pieces that fit the aims.

    The cost is the engine's, not the request's round trip: a piece's time starts
    when it was sent or when the engine answered its previous piece, whichever is
    later (until then the engine was busy with that one), and ends with its
    answer. So the times of pieces that follow each other add up to the time the
    engine spent on them however it grouped them into steps, and however late each
    answer was read. The cost is the sum of the last ``window`` pieces' times over
    the sum of their new tokens. It counts what the pieces waited for besides (a
    chat's prefill, decode steps), so it errs high: smaller pieces, never larger.
    """

    mode: PiecingMode
    initial_tokens: int = 512
    max_tokens: int = 2048
    target_s: float = 0.08
    idle_target_s: float = 0.24
    block_size: int = 16
    enabled: bool = False
    reason: str = "not discovered yet"
    seconds_per_token: float | None = None
    chunks_itself: bool | None = None
    """Whether the engine cuts a long prefill into steps smaller than a piece by
    itself (``--long-prefill-token-threshold``); None: not judged yet."""
    chunking: str = "not judged yet: the first piece beside a chat stream tells"
    probes: int = 0
    hit_checks: int = 0
    pieces: int = 0
    pieced_prompts: int = 0
    fallbacks: int = 0
    aborts: int = 0  # final requests aborted in prefill for a chat (aborts.py)
    requeues: int = 0  # and sent again after an abort
    window: int = 16
    need_s: float = NEED_S
    """``auto`` pieces for this long after chat was last seen or missed its aim."""
    history: list[str] = field(default_factory=list)
    cache_check: str | None = None
    """How pieces are checked: ``cached_tokens`` (in ``usage``) or
    ``prefix_cache_hits`` (the engine's counter); None until a piece told."""
    _costs: deque[tuple[int, float]] = field(default_factory=deque)  # (tokens, seconds)
    _last_answer: float | None = None
    last_sent: float | None = None
    """When the engine's last piece was sent (:func:`pace_s`)."""

    @property
    def min_tokens(self) -> int:
        return -(-MIN_PIECE_TOKENS // self.block_size) * self.block_size

    @property
    def depth(self) -> int:
        """Pieces in prefill at once here: one while the engine's chunking is being
        judged, so the piece that tells runs alone."""
        return PIECE_DEPTH if self.chunks_itself is not None else 1

    @property
    def piece_tokens(self) -> int:
        """The next piece's size while chat streams decode on the engine."""
        return self.piece_tokens_for(streams=True)

    def piece_tokens_for(self, *, streams: bool) -> int:
        """The next piece's size, with chat streams decoding on the engine or not."""
        if self.seconds_per_token is None:
            return aligned(self.initial_tokens, self.block_size)
        wait = self.idle_target_s / PIECE_DEPTH  # a new chat waits for every piece
        target = min(self.target_s, wait) if streams else wait
        return piece_size(
            self.seconds_per_token, target, self.block_size, self.min_tokens, self.max_tokens
        )

    def discovered(self, prefix_caching: bool | None, block_size: int | None) -> None:
        """What the engine's ``/metrics`` said (None: it did not say)."""
        if block_size:
            self.block_size = block_size
        if self.mode is PiecingMode.OFF:
            self.enabled, self.reason = False, "piecing: off in the configuration"
        elif prefix_caching is False:
            self.enabled, self.reason = False, "the engine reports prefix caching off"
        elif self.mode is PiecingMode.ON:
            self.enabled, self.reason = True, "piecing: on in the configuration"
        elif prefix_caching:
            self.enabled, self.reason = True, "auto: the engine reports prefix caching on"
        else:
            self.enabled, self.reason = False, "auto: the engine does not say it caches prefixes"

    def choose(self, now: float, chat: ChatSigns) -> Choice:
        """Whether a long batch prompt sent to this engine at ``now`` goes in pieces,
        and why. A read."""
        if not self.enabled:
            return Choice(False, self.reason)
        if self.mode is PiecingMode.ON:
            return Choice(True, "piecing: on in the configuration")
        if self.chunks_itself:
            return Choice(False, f"the engine chunks itself: {self.chunking}")
        missed = chat.missed_at is not None and now - chat.missed_at <= self.need_s
        live = _chat_live(now, chat, self.need_s)
        if live is not None:
            return Choice(True, live)
        if missed:
            assert chat.missed_at is not None
            ago = now - chat.missed_at
            return Choice(True, f"chat missed its aim beside batch prefill {ago:.1f} s ago")
        if chat.last_at is None:
            return Choice(False, "batch only: no chat here yet")
        return Choice(False, f"batch only: no chat here for {now - chat.last_at:.0f} s")

    def judged(self, verdict: Chunking | None) -> None:
        """What a piece that ran alone showed of the engine's own chunking (None: it
        could not tell; after :data:`CHUNK_PROBES` such pieces, pieces go two at a
        time unjudged)."""
        if self.chunks_itself is not None:
            return
        self.probes += 1
        if verdict is not None:
            self.chunks_itself, self.chunking = verdict.chunks, verdict.why
        elif self.probes >= CHUNK_PROBES:
            self.chunks_itself = False
            self.chunking = f"unknown after {self.probes} pieces: taken as not chunking"

    def answered(self, new_tokens: int, sent: float, now: float) -> None:
        """A piece of ``new_tokens`` sent at ``sent`` was answered at ``now``."""
        self.pieces += 1
        last, self._last_answer = self._last_answer, max(now, self._last_answer or now)
        if new_tokens < 1:
            return
        start = sent if last is None else max(sent, last)
        self._costs.append((new_tokens, max(0.0, now - start)))
        while len(self._costs) > self.window:
            self._costs.popleft()
        seconds = sum(s for _, s in self._costs)
        if seconds > 0:
            self.seconds_per_token = seconds / sum(t for t, _ in self._costs)

    def disable(self, reason: str) -> None:
        """The cache did not hold (or cannot be checked): piecing stops here."""
        self.fallbacks += 1
        self.enabled = False
        self.reason = reason
        self.history.append(reason)
        del self.history[:-10]

    def report(self) -> dict[str, object]:
        """For ``/turn``: whether the engine pieces, why, and what it costs."""
        cost = self.seconds_per_token
        return {
            "mode": self.mode.value,
            "enabled": self.enabled,
            "reason": self.reason,
            "chunks_itself": self.chunks_itself,
            "chunking": self.chunking,
            "block_size": self.block_size,
            "piece_tokens": self.piece_tokens,
            "prompt_token_cost_ms": None if cost is None else round(cost * 1000, 4),
            "pieces": self.pieces,
            "pieced_prompts": self.pieced_prompts,
            "fallbacks": self.fallbacks,
            "aborts": self.aborts,
            "requeues": self.requeues,
            "cache_check": self.cache_check,
        }


def _chat_live(now: float, chat: ChatSigns, recent_s: float) -> str | None:
    """Why chat is live or expected on the engine; None if it is not."""
    if chat.streams:
        return f"chat live: {chat.streams} stream(s) in decode"
    if chat.in_prefill:
        return f"chat live: {chat.in_prefill} chat(s) in prefill"
    if chat.queued:
        return f"chat live: {chat.queued} chat(s) queued"
    if chat.last_at is not None and now - chat.last_at <= recent_s:
        return f"chat expected: a chat was sent here {now - chat.last_at:.1f} s ago"
    return None


@dataclass(frozen=True)
class Chunking:
    """The engine's own chunking as one piece showed it: ``chunks`` if it cut the
    piece into smaller steps, and what was seen."""

    chunks: bool
    why: str


ONE_STEP_SHARE = 0.75
"""A chat stream's widest gap while a piece ran, as a share of the piece's time, at
or above which the engine ran the piece in one step."""
CUT_SHARE = 0.6
"""At or below which the engine cut the piece into smaller steps itself."""
MIN_JUDGED_S = 0.02
"""A piece quicker than this tells nothing beside the decode steps' own time."""


def judge_chunking(tokens: int, piece_s: float, widest_gap_s: float | None) -> Chunking | None:
    """What a piece of ``tokens`` new tokens that was the engine's only prefill work,
    and took ``piece_s`` from its send to its answer, tells of the engine's own
    chunking, given the widest gap of a chat stream decoding there meanwhile: run
    in one step, the piece stalls the stream for about its whole time; cut into
    steps, for a share of it (half, for two). None if it cannot tell: no stream
    decoded, the piece was too quick, or the share falls between the two bounds."""
    if widest_gap_s is None or piece_s < MIN_JUDGED_S:
        return None
    share = widest_gap_s / piece_s
    seen = (
        f"a {tokens}-token piece of {piece_s * 1000:.0f} ms stalled a chat stream for at "
        f"most {widest_gap_s * 1000:.0f} ms"
    )
    if share >= ONE_STEP_SHARE:
        return Chunking(False, f"{seen}: one step")
    if share <= CUT_SHARE:
        return Chunking(True, f"{seen}: the engine cut it into smaller steps")
    return None


ADVICE = (
    "Starting vLLM with --long-prefill-token-threshold (e.g. 256) lets it interleave "
    "long prefills with decode by itself; the proxy then sees that and sends prompts "
    "whole (no extra requests). --enable-prompt-tokens-details lets it check each "
    "piece's cached tokens in its answer rather than by the prefix-cache hit counter."
)
"""Said once per engine, where the first piece showed the engine does not chunk."""
