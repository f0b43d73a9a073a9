"""The prefix index (proxy.scheduler.prefix) and what the scheduler does with it:
routing by expected prefill, and the budget charging uncached tokens."""

from __future__ import annotations

from proxy.scheduler import HeldReason, Job, Phase, Scheduler
from proxy.scheduler.prefix import Cleared, IndexMode, PrefixIndex, Removed, Stored, chain

from .helpers import B, I, check_accounting, engine, job, make, sent

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 1_000_003 + 7 * i) % 50_000 for i in range(n)]


def prompt_job(cls: object, ids: list[int], at: float = 0.0) -> Job:
    j = job(cls, len(ids), at=at)  # type: ignore[arg-type]
    j.blocks = chain(ids, BS)
    return j


def finish(s: Scheduler, j: Job) -> None:
    s.on_first_token(j.id)
    s.on_finished(j.id)


# -- the index ----------------------------------------------------------------------


def test_equal_prefixes_hash_alike_and_part_where_the_tokens_do() -> None:
    shared = tokens(1, 64)
    a, b = chain(shared + tokens(2, 40), BS), chain(shared + tokens(3, 40), BS)
    assert len(a) == len(b) == (64 + 40) // BS  # full blocks only
    assert a[:4] == b[:4] and a[4] != b[4]
    assert chain(tokens(9, 15), BS) == ()


def test_a_routed_index_holds_what_was_computed_and_ages_at_the_cache_size() -> None:
    index = PrefixIndex(BS, capacity=6)
    first, second = chain(tokens(1, 64), BS), chain(tokens(2, 64), BS)
    index.sent(first)
    assert index.match(first) == 0 and index.match(first, pending=True) == 4
    index.prefilled(first)
    assert index.match(first) == 4
    index.sent(second)
    index.prefilled(second)
    # six blocks fit: the oldest of the first prompt's went, so its prefix is gone
    assert len(index) == 6 and index.match(second) == 4 and index.match(first) == 0


def test_an_answer_with_fewer_cached_tokens_drops_blocks_and_ages_sooner() -> None:
    index = PrefixIndex(BS, capacity=100)
    blocks = chain(tokens(1, 160), BS)
    index.routed(blocks)
    index.answered(blocks, expected=10, reported=4)
    assert index.match(blocks) == 4 and index.limit == 90
    index.answered(blocks[:4], expected=4, reported=4)
    assert index.limit == 91  # grows back a block per answer that matched


def test_events_keep_the_index_exact_under_the_engines_own_names() -> None:
    index = PrefixIndex(BS, capacity=100)
    ids = tokens(1, 48)
    blocks = chain(ids, BS)
    index.apply([Stored([b"e1", b"e2"], None, ids[:32], BS)])
    assert index.mode is IndexMode.EVENTS and index.match(blocks) == 2
    index.apply([Stored([b"e3"], b"e2", ids[32:48], BS)])
    assert index.match(blocks) == 3
    index.apply([Removed([b"e2"])])
    assert index.match(blocks) == 1  # the chain breaks where the engine evicted
    index.apply([Stored([b"x"], b"never-seen", ids[:16], BS)])  # unknown parent: ignored
    assert len(index) == 2
    index.apply([Cleared()])
    assert len(index) == 0 and index.match(blocks) == 0
    index.routed(blocks)  # an index kept from events ignores what was routed
    assert len(index) == 0


# -- routing -------------------------------------------------------------------------


def test_a_prompt_goes_where_its_prefix_is_cached_with_a_receipt() -> None:
    s, _ = make(engine("a"), engine("b"))
    history = tokens(1, 800)
    first = prompt_job(I, history)
    s.submit(first)
    assert sent(s) == {first.id: "a"}  # nothing cached anywhere: least load, name order
    finish(s, first)
    follow = prompt_job(I, history + tokens(2, 40))
    s.submit(follow)
    assert sent(s) == {follow.id: "a"}
    route = s.log[-1].route
    assert route is not None and route.why == "prefix"
    assert dict(route.cached) == {"a": 800}
    assert follow.cached_tokens == 800 and follow.uncached_tokens == 40
    # another conversation, while a computes: b is now less loaded
    other = prompt_job(I, tokens(3, 400))
    s.submit(other)
    assert sent(s) == {other.id: "b"}
    assert s.log[-1].route is not None and s.log[-1].route.why == "load"
    check_accounting(s)


def test_a_cached_engine_loses_when_its_queue_outweighs_what_it_holds() -> None:
    s, _ = make(engine("a"), engine("b"))
    history = tokens(1, 320)
    warm = prompt_job(I, history)
    s.submit(warm)
    sent(s)
    finish(s, warm)
    busy = job(I, 2000)
    busy.pinned = "a"
    s.submit(busy)
    assert sent(s) == {busy.id: "a"}  # 2,000 tokens in prefill on a now
    follow = prompt_job(I, history + tokens(2, 40))
    s.submit(follow)
    assert sent(s) == {follow.id: "b"}  # 360 on b beats 2,000 + 40 on a


def test_route_by_load_ignores_the_prefix() -> None:
    s, _ = make(engine("a"), engine("b"), route_by="load")
    history = tokens(1, 320)
    warm = prompt_job(I, history)
    s.submit(warm)
    sent(s)
    finish(s, warm)
    other = job(I, 100)
    other.pinned = "a"
    s.submit(other)
    sent(s)
    follow = prompt_job(I, history + tokens(2, 40))
    s.submit(follow)
    assert sent(s) == {follow.id: "b"} and s.log[-1].route is None


def test_batch_lines_of_one_document_follow_it() -> None:
    s, _ = make(engine("a"), engine("b"))
    doc = tokens(7, 960)
    lines = [prompt_job(B, doc + tokens(100 + q, 32)) for q in range(4)]
    s.submit(lines[0])
    first = sent(s)[lines[0].id]
    finish(s, lines[0])
    for line in lines[1:]:
        s.submit(line)
    placed = sent(s)
    assert set(placed.values()) == {first}, placed


# -- the budget charges uncached tokens ----------------------------------------------


def _admitted_at_once(cached: bool) -> tuple[int, list[HeldReason | None]]:
    """Four batch lines of 1,000 prompt tokens on one engine whose budget is 2,000:
    how many go at once, and why the others wait. ``cached``: they share a
    960-token prefix the engine holds (a line before them computed it)."""
    s, _ = make(engine("a", budget={"initial_tokens": 2000, "min_tokens": 512}))
    doc = tokens(7, 960)
    if cached:
        warm = prompt_job(B, doc + tokens(99, 40))
        s.submit(warm)
        sent(s)
        finish(s, warm)
    lines = [
        prompt_job(B, (doc if cached else tokens(50 + q, 960)) + tokens(q, 40)) for q in range(4)
    ]
    for line in lines:
        s.submit(line)
    went = sent(s)
    check_accounting(s)
    return len(went), [line.held for line in lines if line.phase is Phase.QUEUED]


def test_cached_prefix_lines_are_admitted_at_once_where_uncached_ones_are_held() -> None:
    assert _admitted_at_once(cached=True) == (4, [])
    n, held = _admitted_at_once(cached=False)
    assert n == 2 and len(held) == 2 and held[0] is HeldReason.PREFILL_BUDGET


def test_lines_whose_document_is_in_prefill_wait_for_it_then_go_for_their_own_part() -> None:
    """Blocks being computed are not cached yet: a line sent beside the one computing
    them would compute them again. It waits (holding no engine: a line of another
    document goes meanwhile), then goes charged only its own part."""
    s, _ = make(engine("a", budget={"initial_tokens": 4000, "min_tokens": 512}))
    doc = tokens(7, 960)
    lines = [prompt_job(B, doc + tokens(q, 40)) for q in range(3)]
    other = prompt_job(B, tokens(8, 500))
    for line in [*lines, other]:
        s.submit(line)
    assert sent(s) == {lines[0].id: "a", other.id: "a"}
    assert lines[0].cached_tokens == 0 and lines[1].held is None
    s.on_first_token(lines[0].id)  # its prefill is done: the document is cached
    assert sent(s) == {lines[1].id: "a", lines[2].id: "a"}
    assert [line.cached_tokens for line in lines[1:]] == [960, 960]
    check_accounting(s)


def test_route_by_load_does_not_wait_for_a_prefix() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 4000, "min_tokens": 512}), route_by="load")
    doc = tokens(7, 960)
    lines = [prompt_job(B, doc + tokens(q, 40)) for q in range(2)]
    for line in lines:
        s.submit(line)
    assert len(sent(s)) == 2
