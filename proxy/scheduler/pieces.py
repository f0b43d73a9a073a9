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
    hold); ``auto`` where the engine's ``/metrics`` reports prefix caching on, and
    only while chat needs it there (:meth:`EnginePieces.wanted`)."""

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


def plan(total: int, size: int, block: int) -> list[Piece]:
    """Every piece of a ``total``-token prompt at a fixed ``size`` (the final last)."""
    pieces = [next_piece(total, 0, size, block)]
    while not pieces[-1].final:
        last = pieces[-1]
        pieces.append(next_piece(total, last.end, size, block, last.index + 1))
    return pieces


PIECE_DEPTH = 2
"""Pieces in prefill at once on one engine: the next piece waits in the engine while
one runs, so the engine never idles for the proxy's round trip between pieces."""

NEED_S = 120.0
"""How long ``auto`` keeps piecing after chat's last miss on the engine."""


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


def piece_size(seconds_per_token: float, target_s: float, block: int, lo: int, hi: int) -> int:
    """The piece that keeps the engine busy for about ``target_s`` at
    ``seconds_per_token``, in whole blocks, within ``[lo, hi]``."""
    if seconds_per_token <= 0:
        return aligned(hi, block)
    fit = int(target_s / seconds_per_token)
    return aligned(min(hi, max(lo, fit)), block)


@dataclass(kw_only=True)
class EnginePieces:
    """Piecing on one engine: whether it is on and why, and what was learned.

    ``piece_tokens`` starts at ``initial_tokens`` and follows the measured cost per
    prompt token (:meth:`answered`). A new chat waits for the :data:`PIECE_DEPTH`
    pieces in the engine, then its own short prefill: together they should take
    about ``idle_target_s`` (the TTFT aim). While chat streams decode there, one
    piece should also take no more than ``target_s`` (the gap aim). The engine may
    run both pieces it holds in one step (a piece sent while the one before it
    waits for a step goes with it), a gap of two pieces then; sizing each to half
    the gap aim made a third more pieces on the simulated engine and its batch
    1.15-1.26x slower than direct for no gain on real vLLM, whose pieces sit at
    ``min_tokens`` anyway.
    ``block_size`` comes from the engine's ``vllm:cache_config_info`` where it says.

    The cost is the engine's, not the request's round trip: a piece's time starts
    when it was sent or when the engine answered its previous piece, whichever is
    later (until then the engine was busy with that one), and ends with its
    answer. So the times of pieces that follow each other add up to the time the
    engine spent on them however it grouped them into steps, and however late each
    answer was read (a piece answered in its predecessor's step, or read late, has
    little time of its own, and the next one less). The cost is the sum of the last
    ``window`` pieces' times over the sum of their new tokens: robust to how the
    time falls between pieces, where the least of each piece's own ratio is not
    (one piece read just after another looks free). It counts what the pieces
    waited for besides (a chat's prefill, decode steps), so it errs high: smaller
    pieces, never larger.
    """

    mode: PiecingMode
    initial_tokens: int = 512
    min_tokens: int = 256
    max_tokens: int = 2048
    target_s: float = 0.08
    idle_target_s: float = 0.24
    block_size: int = 16
    enabled: bool = False
    reason: str = "not discovered yet"
    seconds_per_token: float | None = None
    pieces: int = 0
    pieced_prompts: int = 0
    fallbacks: int = 0
    aborts: int = 0  # final requests aborted in prefill for a chat (aborts.py)
    requeues: int = 0  # and sent again after an abort
    window: int = 16
    need_s: float = NEED_S
    """``auto`` pieces for this long after chat beside batch prefill missed its aim."""
    history: list[str] = field(default_factory=list)
    cache_check: str | None = None
    """How pieces are checked: ``cached_tokens`` (in ``usage``) or
    ``prefix_cache_hits`` (the engine's counter); None until a piece told."""
    _costs: deque[tuple[int, float]] = field(default_factory=deque)  # (tokens, seconds)
    _last_answer: float | None = None

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

    def wanted(self, now: float, missed_at: float | None) -> bool:
        """Whether a long prompt arriving at ``now`` is to be pieced: piecing is on
        here, and with ``auto`` the engine's budget loop judged chat beside batch
        prefill over its aim (at ``missed_at``) within the last :attr:`need_s`.

        An engine that interleaves prefill with decode by itself keeps chat within
        its aims, so ``auto`` never pieces there and batch pays nothing; one that
        runs a long prefill to the end before a chat misses, and the prompts after
        the miss are pieced. A read."""
        if not self.enabled:
            return False
        if self.mode is PiecingMode.ON:
            return True
        return missed_at is not None and now - missed_at <= self.need_s

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
            "block_size": self.block_size,
            "piece_tokens": self.piece_tokens,
            "prompt_token_cost_ms": None if cost is None else round(cost * 1000, 4),
            "pieces": self.pieces,
            "pieced_prompts": self.pieced_prompts,
            "fallbacks": self.fallbacks,
            "aborts": self.aborts,
            "requeues": self.requeues,
            "cache_check": self.cache_check,
            "advice": ADVICE,
        }


ADVICE = (
    "Piecing works around an engine that runs a long prefill to the end before a new "
    "chat; starting vLLM with --long-prefill-token-threshold (e.g. 512) lets the engine "
    "interleave by itself, and makes the job cheaper (no extra requests); "
    "--enable-prompt-tokens-details lets the proxy check each piece's cached tokens "
    "in its answer rather than by the engine's prefix-cache hit counter."
)
