"""Sending pieces upstream: a long batch prompt prefilled as requests over growing
prefixes (the I/O of piecing).

The arithmetic, the choice and the per-engine facts are pure
(:mod:`proxy.scheduler.pieces`); this module does what needs the network, for
:class:`proxy.api.forward.Forwarder`:

- :meth:`PieceSender.discover`: each engine's ``vllm:cache_config_info`` (prefix caching
  on or off, the block size) decides whether it may piece at all, and is logged
  for the operator.
- :meth:`PieceSender.pieceable`: a batch request whose prompt is longer than one piece,
  counted exactly, for a model whose up engines may piece.
- :meth:`PieceSender.choose`: whether a prompt sent to an engine now goes in pieces:
  decided ahead, while chat is live or expected there (the scheduler's
  :class:`~proxy.scheduler.pieces.ChatSigns`), not after chat missed its aim. The
  edge asks again once the scheduler names the engine, so chat that arrives while a
  prompt waits in the proxy turns piecing on for it, and a prompt whose first piece
  lands on an engine that chunks itself goes whole.
- :meth:`PieceSender.prefill`: the prompt is tokenized to its ids by the engine
  (``/tokenize``; with ``messages`` through the chat template, so the client's own
  request later finds the same tokens in the cache); each piece is sent as token
  ids to ``/v1/completions`` with ``max_tokens: 1`` (the answer is discarded) and
  its cache check made; then the job goes back to the scheduler as its next piece
  (pinned to the engine), which admits it like any batch work: within the budget,
  after any chat in prefill. It returns what the client's real request is to be
  admitted as.

The first piece on an engine runs alone and tells whether the engine cuts a long
prefill into small steps itself (``--long-prefill-token-threshold``): a chat stream's
widest gap while it ran, against the piece's time
(:func:`~proxy.scheduler.pieces.judge_chunking`). One that does gets whole prompts.

A piece that finds fewer cached tokens than its earlier pieces put there turns
piecing off on that engine and the prompt goes whole from there on. The piece's
``usage`` tells where the engine reports ``cached_tokens``; elsewhere the
engine's ``vllm:prefix_cache_hits`` counter, read before the piece is sent and
after it is answered, must have risen by at least as many (an engine that
reports neither cannot be checked and is not pieced); a piece that fails on the engine sends the
prompt whole too. Neither loses the request or answers it twice: pieces produce
no answer, and the real request is sent exactly once per admission.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import InitVar, dataclass, field
from typing import Any

import anyio
import httpx

from proxy.admission import Admission, Admitted
from proxy.api.sse import SSEReader
from proxy.api.ticket import Ticket
from proxy.clock import Clock
from proxy.config import EngineConfig
from proxy.engines import EngineClient, EnginePool, UpstreamError, raw_chunks
from proxy.metrics import PieceMetrics
from proxy.openai.answers import cached_tokens
from proxy.scheduler import Job, TrafficClass
from proxy.scheduler.pieces import (
    PIECE_DEPTH,
    Choice,
    EnginePieces,
    Piece,
    PiecingMode,
    cache_held,
    hits_check_due,
    hits_held,
    judge_chunking,
    next_piece,
    pace_s,
)
from proxy.scheduler.prefix import chain

logger = logging.getLogger(__name__)
PIECE_TIMEOUT_S = 120.0
PIECE_OUTPUT_TOKENS = 1  # a piece asks for one token (its answer is discarded)
CHOICES_KEPT = 200  # whole-or-pieces choices kept for /turn/log


@dataclass(frozen=True)
class PieceChoice:
    """A long batch prompt went whole or in pieces to ``engine`` at ``time`` (the
    proxy's clock), and why."""

    time: float
    request_id: str
    engine: str
    choice: Choice


@dataclass
class Pieced:
    """A prompt to be sent in pieces: its token ids, and its first piece."""

    ids: list[int]
    piece: Piece


@dataclass(frozen=True)
class Final:
    """The client's own request after its pieces: its ``tokens`` to prefill, the
    ``engine`` it is pinned to (None: anywhere, sent whole) and its piece number."""

    tokens: int
    engine: str | None
    piece: int


@dataclass(eq=False)
class PieceSender:
    """The edge's side of piecing (the module docstring): one per proxy, the request
    path's (:class:`~proxy.api.forward.Forwarder`), told of engines joining and
    leaving."""

    engines: InitVar[list[EngineConfig]]  # the configured ones; DNS adds the others
    pool: EnginePool
    admission: Admission
    clock: Clock
    metrics: PieceMetrics
    target_s: float
    idle_target_s: float
    board: dict[str, EnginePieces] = field(default_factory=dict, init=False)
    _discovered: set[str] = field(default_factory=set, init=False)
    _choices: deque[PieceChoice] = field(
        default_factory=lambda: deque(maxlen=CHOICES_KEPT), init=False
    )

    def __post_init__(self, engines: list[EngineConfig]) -> None:
        for config in engines:
            if not config.by_dns:
                self.add(config)

    def add(self, config: EngineConfig) -> None:
        """Keep piecing facts for engine ``config`` (configured, or joined by DNS
        with its group's settings)."""
        self.board[config.name] = EnginePieces(
            mode=PiecingMode(config.piecing),
            initial_tokens=config.piece_tokens,
            target_s=self.target_s,
            idle_target_s=self.idle_target_s,
        )
        self._discovered.discard(config.name)
        self.metrics.add(config.name)

    def remove(self, name: str) -> None:
        """Forget engine ``name`` (it left and was drained)."""
        self.board.pop(name, None)
        self._discovered.discard(name)

    @property
    def active(self) -> bool:
        return any(p.mode is not PiecingMode.OFF for p in self.board.values())

    # -- discovery -------------------------------------------------------------

    async def discover(self) -> None:
        """Ask every engine that may piece what its cache config is (once each)."""
        for name, facts in self.board.items():
            if facts.mode is PiecingMode.OFF:
                facts.discovered(None, None)
            elif name not in self._discovered:
                await self._discover(name, facts)

    async def _discover(self, name: str, facts: EnginePieces) -> None:
        try:
            found = await self.pool.client_for(name).cache_facts()
        except UpstreamError as exc:
            facts.reason = f"not discovered yet: {exc}"
            return
        self._discovered.add(name)
        facts.discovered(found.prefix_caching, found.block_size)
        self.admission.set_piece_depth(name, facts.depth)
        when = (
            "while chat is live or expected there; its own chunking is judged by the "
            "first piece beside a chat stream"
            if facts.enabled and facts.mode is PiecingMode.AUTO
            else "always"
            if facts.enabled
            else "never"
        )
        logger.info(
            "engine %s: pieces long batch prompts %s (%s); block %d, first piece %d tokens",
            name, when, facts.reason, facts.block_size, facts.piece_tokens,
        )  # fmt: skip

    def aborted(self, engine: str) -> None:
        """A batch request was aborted in prefill on ``engine``, to be requeued."""
        self.metrics.aborts.labels(engine).inc()
        if engine in self.board:
            self.board[engine].aborts += 1

    def requeued(self, engine: str) -> None:
        """An aborted batch request was sent again, to ``engine``."""
        self.metrics.requeues.labels(engine).inc()
        if engine in self.board:
            self.board[engine].requeues += 1

    def cost(self, engine: str | None) -> float | None:
        """Engine ``engine``'s measured seconds per new prompt token (None: unknown)."""
        facts = self.board.get(engine) if engine is not None else None
        return None if facts is None else facts.seconds_per_token

    def report(self) -> dict[str, dict[str, object]]:
        """Each engine's piecing facts, for ``/turn``; ``piecing_now``: whether a
        long batch prompt sent there now would go in pieces, and ``why``."""
        out: dict[str, dict[str, object]] = {}
        for name, facts in self.board.items():
            choice = self.choose(name)
            out[name] = {**facts.report(), "piecing_now": choice.pieces, "why": choice.why}
        return out

    def choices(self, limit: int) -> list[PieceChoice]:
        """The ``limit`` most recent choices of whole or pieces, oldest first."""
        return list(self._choices)[-limit:] if limit > 0 else []

    def choose(self, engine: str) -> Choice:
        """Whether a long batch prompt sent to ``engine`` now goes in pieces (a read)."""
        facts = self.board.get(engine)
        if facts is None:
            return Choice(False, "not an engine the piece sender knows")
        return facts.choose(self.clock.now(), self.admission.chat_signs(engine))

    def _chose(self, ticket: Ticket, engine: str, choice: Choice) -> None:
        """Keep a choice for ``/turn/log``."""
        self._choices.append(PieceChoice(self.clock.now(), ticket.id, engine, choice))

    # -- the request path ------------------------------------------------------

    async def pieceable(self, ticket: Ticket) -> list[str] | None:
        """The up engines ``ticket``'s prompt may be pieced on (discovered first if
        they were not yet), if it may be at all; None otherwise."""
        up = self._engines_for(ticket)
        if up is None:
            return None
        for name in up:
            if name not in self._discovered and self.board[name].mode is not PiecingMode.OFF:
                await self._discover(name, self.board[name])
        enabled = [name for name in up if self.board[name].enabled]
        if not enabled:
            return None
        first = self._first_size(enabled)
        if ticket.count.tokens <= first:
            return None
        count = ticket.count
        if self.admission.least_uncached(ticket.req.model, count.tokens, count.blocks) <= first:
            return None  # an engine holds (or is computing) all but a piece of it
        return up

    def wanted(self, ticket: Ticket, up: list[str]) -> bool:
        """Whether ``ticket`` is to start in pieces: some engine it may go to pieces
        now (the engine the scheduler picks decides again, :meth:`prefill`)."""
        return any(self.choose(name).pieces for name in up)

    def keep_whole(self, ticket: Ticket, engine: str) -> bool:
        """Whether ``ticket``, admitted whole on ``engine``, is sent whole: False if
        chat came there while it waited, so it goes in pieces instead."""
        choice = self.choose(engine)
        if choice.pieces:
            self._chose(ticket, engine, choice)
            logger.info("%s: pieces instead of whole on %s: %s", ticket.id, engine, choice.why)
        return not choice.pieces

    def _engines_for(self, ticket: Ticket) -> list[str] | None:
        """The up engines ``ticket``'s prompt would go to, if it may be pieced at all:
        a batch request whose tokens were counted exactly, on engines all known to
        the piece sender (not one that left, or not yet told to it); None otherwise."""
        req = ticket.req
        if not self.active or req.cls is not TrafficClass.BATCH or ticket.count.estimated:
            return None
        up = self.admission.engines_up_for(req.model)
        if not up or not all(name in self.board for name in up):
            return None
        return up

    def _first_size(self, up: list[str]) -> int:
        return min(self.board[name].piece_tokens for name in up)

    def _first_block(self, up: list[str]) -> int:
        """A block every engine in ``up`` ends its blocks on: the first piece is not
        pinned, and must end on a block boundary wherever it goes."""
        return math.lcm(*(self.board[name].block_size for name in up))

    async def _token_ids(self, client: EngineClient, ticket: Ticket) -> list[int] | None:
        req = ticket.req
        try:
            if req.messages is not None:
                return await client.token_ids(req.model, messages=req.messages)
            if isinstance(req.prompt, str):
                return await client.token_ids(req.model, prompt=req.prompt)
        except (UpstreamError, ValueError) as exc:
            logger.debug("%s: no token ids from %s, sent whole: %s", ticket.id, client.name, exc)
            return None
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        return None  # a list of prompts is several requests' worth: sent whole

    async def prefill(self, ticket: Ticket, up: list[str]) -> Final:
        """Send every piece but the final, each on its own admission, at most the
        engine's depth in flight (piece ``k+1`` once piece ``k`` is in the engine);
        when all are answered, or piecing stops, what the client's own request is to
        be admitted as. A piece's job leaves the scheduler when its answer is read,
        or when the caller is cancelled."""
        whole = Final(ticket.count.tokens, None, 0)
        ids = await self._token_ids(self.pool.client_for(up[0]), ticket)
        size = self._first_size(up)
        if ids is None or len(ids) <= size:
            return whole
        piece = next_piece(len(ids), 0, size, self._first_block(up))
        run = _Run(ticket, Pieced(ids, piece), anyio.Semaphore(PIECE_DEPTH))
        async with anyio.create_task_group() as group:
            while not piece.final and run.failed is None:
                await run.room.acquire()
                if run.failed is not None or not self._may_go_on(run):
                    run.room.release()
                    break
                admitted = await self.admission.admit(self._job(run, piece))
                if run.engine is None and not self._first_goes(run, admitted):
                    return whole
                run.engine = admitted.engine
                await self._pace(admitted.engine, piece)
                started, done = anyio.Event(), anyio.Event()
                group.start_soon(self._piece, run, admitted, piece, started, done)
                await started.wait()
                facts = self.board[admitted.engine]
                if facts.seconds_per_token is None or facts.chunks_itself is None:
                    await done.wait()  # measured, and the engine's chunking judged, first
                piece = self._after(run, piece)
        return self._final(run, piece)

    async def _pace(self, engine: str, piece: Piece) -> None:
        """Hold an admitted piece so that the engine gets its pieces one a step
        (:func:`~proxy.scheduler.pieces.pace_s`)."""
        facts = self.board[engine]
        cost = facts.seconds_per_token
        others = self.admission.pieces_in_prefill(engine) - 1
        piece_s = None if cost is None else cost * piece.new_tokens
        wait = pace_s(self.clock.now(), facts.last_sent, others, piece_s)
        if wait > 0:
            await anyio.sleep(wait)
        facts.last_sent = self.clock.now()

    def _first_goes(self, run: _Run, admitted: Admitted) -> bool:
        """Whether the first piece, admitted on its engine, is sent: the engine pieces
        now (else the turn is given back and the prompt goes whole)."""
        choice = self.choose(admitted.engine)
        self._chose(run.ticket, admitted.engine, choice)
        if choice.pieces:
            return True
        self.admission.finished(admitted.job_id)
        run.room.release()
        logger.debug("%s: whole on %s: %s", run.ticket.id, admitted.engine, choice.why)
        return False

    def _may_go_on(self, run: _Run) -> bool:
        return run.engine is None or self.choose(run.engine).pieces

    def _job(self, run: _Run, piece: Piece) -> Job:
        req = run.ticket.req
        size = self.admission.block_size_for(req.model)
        blocks = chain(run.pieced.ids[: piece.end], size) if size else ()
        return Job(
            id=f"{run.ticket.id}#{piece.index}", cls=req.cls, model=req.model,
            prompt_tokens=piece.new_tokens, arrival=run.ticket.arrival, pinned=run.engine,
            piece=piece.index, blocks=blocks, prefix_tokens=piece.cached,
            tenant=req.tenant.name, flow=req.flow, weight=req.tenant.weight, tier=req.tier,
            expected_output=PIECE_OUTPUT_TOKENS,
        )  # fmt: skip

    def _after(self, run: _Run, piece: Piece) -> Piece:
        assert run.engine is not None
        facts = self.board[run.engine]
        streams = self.admission.interactive_streams(run.engine) > 0
        size, block = facts.piece_tokens_for(streams=streams), facts.block_size
        return next_piece(len(run.pieced.ids), piece.end, size, block, piece.index + 1)

    def _final(self, run: _Run, piece: Piece) -> Final:
        """The client's request: the last piece pinned where the others are; the rest
        of the prompt there if piecing stopped being wanted after some pieces were
        answered; or the whole prompt anywhere if a piece failed, the cache did not
        hold, or that engine went down."""
        total = len(run.pieced.ids)
        up = run.engine in self.admission.engines_up_for(run.ticket.req.model)
        if run.failed is not None or not up or run.engine is None:
            if run.failed is not None and run.engine is not None:
                self.metrics.fallbacks.labels(run.engine, run.failed).inc()
            return Final(total, None, piece.index)
        self.board[run.engine].pieced_prompts += 1
        self.metrics.prompts.labels(run.engine).inc()
        if not piece.final:  # chat left, or the engine was found to chunk itself
            return Final(total - run.answered, run.engine, piece.index)
        return Final(piece.new_tokens, run.engine, piece.index)

    async def _piece(
        self, run: _Run, admitted: Admitted, piece: Piece, started: anyio.Event, done: anyio.Event
    ) -> None:
        """Send one piece and check what it found cached: at least the pieces
        answered before it was sent (fewer: the cache did not hold); ``started`` is
        set once the engine has begun to answer, ``done`` when it is all over."""
        try:
            await self._checked(run, admitted, piece, run.answered, started)
        finally:
            done.set()

    async def _checked(
        self, run: _Run, admitted: Admitted, piece: Piece, answered: int, started: anyio.Event
    ) -> None:
        engine, facts = admitted.engine, self.board[admitted.engine]
        client = self.pool.client_for(engine)
        probe = _Probe(piece.new_tokens) if facts.chunks_itself is None else None
        try:
            before = Hits()
            by_hits = answered and facts.cache_check != CACHED_TOKENS
            if by_hits and hits_check_due(piece.index, facts.hit_checks):
                facts.hit_checks += 1
                before = await Hits.read_from(client)
            if probe is not None:
                self._probe_start(probe, engine)
            ids = run.pieced.ids[: piece.end]
            cached, sent = await self._send(run.ticket, admitted, ids, started)
            if probe is not None:
                await self._probe_end(probe, engine, facts, reports_cached=cached is not None)
        except (UpstreamError, httpx.HTTPError, TimeoutError) as exc:
            logger.warning("%s: piece %d failed on %s: %s", run.ticket.id, piece.index, engine, exc)
            run.failed = run.failed or "piece_failed"
            return
        finally:
            started.set()
            self.admission.finished(admitted.job_id)
            run.room.release()
        self.metrics.pieces.labels(engine).inc()
        now = self.clock.now()
        miss = await self._miss(client, facts, piece, answered, cached, before)
        if miss is not None:
            run.failed = "cache_miss"
            if facts.enabled:
                facts.disable(miss)
                logger.warning("engine %s: piecing turned off: %s", engine, facts.reason)
            return
        facts.answered(piece.new_tokens, sent, now)
        run.answered = max(run.answered, piece.end)

    def _probe_start(self, probe: _Probe, engine: str) -> None:
        """Before a piece that is to judge the engine's chunking: whether it is the
        engine's only prefill work, and when it was sent."""
        probe.alone = self.admission.prefill_tokens(engine) == probe.tokens
        probe.sent = self.clock.now()

    async def _probe_end(
        self, probe: _Probe, engine: str, facts: EnginePieces, *, reports_cached: bool
    ) -> None:
        """After it: judge by the widest gap of a chat stream there meanwhile, if the
        piece stayed alone (else it tells nothing). The line that says the verdict
        advises an engine flag only where the engine does not show it:
        ``--long-prefill-token-threshold`` where the piece ran in one step, with the
        piece's size, since a threshold at or above it runs it in one step too (the
        engine's flags are not visible from outside: its ``/metrics`` says its cache
        config, not its scheduler's); ``--enable-prompt-tokens-details`` only where
        the piece's answer (``reports_cached``: it had ``cached_tokens``) lacks it."""
        answered = self.clock.now()
        alone = probe.alone and self.admission.prefill_tokens(engine) == probe.tokens
        if alone and self.admission.interactive_streams(engine) == 0:
            return  # no stream to stall: the next piece asks again
        verdict = None
        if alone:
            await anyio.sleep(GAP_SETTLE_S)  # the stream's token of the piece's last step
            widest = self.admission.widest_gap(engine, probe.sent, self.clock.now())
            verdict = judge_chunking(probe.tokens, answered - probe.sent, widest)
        known = facts.chunks_itself is not None
        facts.judged(verdict)
        if facts.chunks_itself is None or known:
            return
        self.admission.set_piece_depth(engine, facts.depth)
        advice = ""
        if not facts.chunks_itself:
            n = probe.tokens
            advice = (
                f" So vLLM runs without --long-prefill-token-threshold, or with one of {n} "
                f"or more; one below {n} (say {max(n // 2, 1)}) would let it interleave long "
                f"prefills with decode by itself, and the proxy would send prompts whole "
                f"(no extra requests)."
            )
            if not reports_cached:
                advice += (
                    " --enable-prompt-tokens-details would let the proxy check each piece's "
                    "cached tokens in its answer rather than by the prefix-cache hit counter."
                )
        logger.info(
            "engine %s: %s: %s%s", engine,
            "chunks long prefills itself, so prompts go whole unless chat misses its aim"
            if facts.chunks_itself else "pieces while chat is live", facts.chunking, advice,
        )  # fmt: skip

    async def _miss(
        self,
        client: EngineClient,
        facts: EnginePieces,
        piece: Piece,
        answered: int,
        cached: int | None,
        before: Hits,
    ) -> str | None:
        """Why the piece shows the cache did not hold (or cannot show it held);
        None if it held, or if there was nothing to check this time.

        The piece's own ``cached_tokens`` decides where the engine reports them;
        otherwise the engine's prefix-cache hit counter (:func:`_hits_check`)."""
        if cached is not None:
            facts.cache_check = CACHED_TOKENS
            return None if cache_held(answered, cached) else _miss(piece, answered, cached)
        if not answered:
            if facts.cache_check is None and (await Hits.read_from(client)).unexported:
                return NOT_CHECKABLE  # known after the first piece: no need for a second
            return None
        if not before.read:
            return None
        if before.unexported:
            return NOT_CHECKABLE
        facts.cache_check = PREFIX_CACHE_HITS
        return await _hits_check(client, piece, answered, before)

    async def _send(
        self, ticket: Ticket, admitted: Admitted, ids: list[int], started: anyio.Event
    ) -> tuple[int | None, float]:
        """One piece: its ``cached_tokens`` (None: not reported), and when it was
        sent; ``started`` is set once the engine has begun to answer."""
        client = self.pool.client_for(admitted.engine)
        body: dict[str, Any] = {
            "model": ticket.req.model,
            "prompt": ids,
            "max_tokens": PIECE_OUTPUT_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if client.config.scheduling_policy == "priority":
            body["priority"] = ticket.req.engine_priority
        sent = self.clock.now()
        usage: dict[str, Any] = {}
        with anyio.fail_after(PIECE_TIMEOUT_S):
            async with client.stream("/v1/completions", body) as response:
                started.set()
                reader = SSEReader()
                async for chunk in raw_chunks(response):
                    for event in reader.feed(chunk):
                        if event.data is not None and isinstance(event.data.get("usage"), dict):
                            usage = event.data["usage"]
        return cached_tokens(usage), sent


CACHED_TOKENS = "cached_tokens"
PREFIX_CACHE_HITS = "prefix_cache_hits"
HITS_SETTLE_S = 0.25
GAP_SETTLE_S = 0.05  # a stream's token of a piece's step comes a moment after it
NOT_CHECKABLE = (
    "the engine reports neither cached_tokens nor vllm:prefix_cache_hits, so pieces "
    "cannot be checked (start it with --enable-prompt-tokens-details)"
)


@dataclass(frozen=True)
class Hits:
    """One read of an engine's prefix-cache hit counter: ``read`` False if the read
    failed (or was not made), ``value`` None if the engine does not export it."""

    read: bool = False
    value: float | None = None

    @property
    def unexported(self) -> bool:
        return self.read and self.value is None

    @classmethod
    async def read_from(cls, client: EngineClient) -> Hits:
        try:
            return cls(True, await client.prefix_cache_hits())
        except UpstreamError as exc:
            logger.debug("engine %s: prefix-cache hits not read: %s", client.name, exc)
            return cls()


@dataclass
class _Probe:
    """A piece that judges the engine's own chunking: its new ``tokens``, whether it
    was the engine's only prefill work when sent, and when it was sent."""

    tokens: int
    alone: bool = False
    sent: float = 0.0


@dataclass
class _Run:
    """One prompt's pieces under way: the engine they are pinned to, the end of the
    pieces answered, the room for pieces in flight, and why piecing
    stopped (``cache_miss``, ``piece_failed``; None: it did not)."""

    ticket: Ticket
    pieced: Pieced
    room: anyio.Semaphore
    engine: str | None = None
    answered: int = 0
    failed: str | None = None


def _miss(piece: Piece, expected: int, cached: int) -> str:
    return (
        f"the cache did not hold: piece {piece.index} found {cached} of "
        f"{expected} tokens cached (evicted, or prefix caching off)"
    )


async def _hits_check(
    client: EngineClient, piece: Piece, answered: int, before: Hits
) -> str | None:
    """Why the hit counter shows the cache did not hold; None if it held, or if it
    judges nothing. It must have risen by the tokens answered before the piece was
    sent; vLLM counts a step's hits when it hands out that step's tokens, so a
    shortfall is read once more after :data:`HITS_SETTLE_S` before it counts. A
    ``/metrics`` read that failed, or a counter that went back (the engine
    restarted), judges nothing."""
    for attempt in range(2):
        if attempt:
            await anyio.sleep(HITS_SETTLE_S)
        after = await Hits.read_from(client)
        if not after.read:
            return None
        held = hits_held(answered, before.value, after.value)
        if held is None:
            return None if after.value is not None else NOT_CHECKABLE
        if held:
            return None
    assert after.value is not None and before.value is not None
    return _hits_miss(piece, answered, after.value - before.value)


def _hits_miss(piece: Piece, expected: int, rose: float) -> str:
    return (
        f"the cache did not hold: while piece {piece.index} ran, the engine's "
        f"vllm:prefix_cache_hits rose by {rose:.0f} tokens, fewer than the {expected} "
        "it should have found cached (evicted, or prefix caching off)"
    )
