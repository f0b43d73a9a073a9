"""KVCacheManager and prefix caching, alone and through the scheduler and engine."""

from __future__ import annotations

import itertools

import pytest

from loadtests.sim.kv_cache import KVCacheManager, block_hashes
from loadtests.sim.profile import load_profile
from loadtests.sim.request import SimRequest

from .helpers import drain, make_engine, make_request, make_scheduler, step, unique_prompt

H100 = load_profile("h100-llama3-8b").step


def allocate(kv: KVCacheManager, request: SimRequest, num_tokens: int) -> bool:
    """Allocate as the scheduler does for a new request: prefix hits, then the rest."""
    hits, cached = kv.get_computed_blocks(request)
    return kv.allocate_slots(request, num_tokens - cached, hits)


# -- block hashes ---------------------------------------------------------------------


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(10)), 4, [])) == 2
    assert len(block_hashes(list(range(12)), 4, [])) == 3
    assert block_hashes(list(range(3)), 4, []) == []


def test_block_hashes_are_chained_through_the_prefix() -> None:
    a = list(range(100, 112))
    b = list(a)
    b[5] = 0
    ha, hb = block_hashes(a, 4, []), block_hashes(b, 4, [])
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]
    # Block 2 holds the same tokens in both, but follows a different prefix.
    assert ha[2] != hb[2]


def test_extending_known_hashes_matches_hashing_from_scratch() -> None:
    tokens = list(range(50, 90))
    start = block_hashes(tokens[:13], 4, [])
    assert block_hashes(tokens, 4, start) == block_hashes(tokens, 4, [])


# -- allocation -----------------------------------------------------------------------


def test_constructor_rejects_empty_cache() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError):
        KVCacheManager(8, 0)


def test_allocation_takes_whole_blocks_and_usage_follows() -> None:
    kv = KVCacheManager(8, 4)
    request = make_request("a", 10, 1)
    assert kv.allocate_slots(request, 10)
    assert len(kv.blocks_of("a")) == 3
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 2)  # 12 tokens still fit in 3 blocks
    assert len(kv.blocks_of("a")) == 3
    assert kv.allocate_slots(request, 3)  # 13..15 need a fourth
    assert len(kv.blocks_of("a")) == 4


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(8, 4)
    held = make_request("held", 12, 1)
    assert kv.allocate_slots(held, 12)
    big = make_request("big", 24, 1)
    assert not kv.allocate_slots(big, 24)
    assert kv.blocks_of("big") == []
    assert kv.num_free_blocks == 5
    assert kv.allocate_slots(big, 20)
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots(make_request("one", 1, 1), 1)


def test_free_returns_every_block() -> None:
    kv = KVCacheManager(8, 4)
    requests = [make_request(f"r{i}", 8, 1) for i in range(4)]
    for r in requests:
        assert kv.allocate_slots(r, 8)
    assert kv.usage == 1.0
    for r in requests:
        kv.free(r)
    assert kv.usage == 0.0
    assert all(kv.blocks_of(r.request_id) == [] for r in requests)


# -- prefix hits ----------------------------------------------------------------------


def test_freed_blocks_are_found_again_but_never_the_whole_prompt() -> None:
    kv = KVCacheManager(16, 4)
    prompt = unique_prompt(12)
    first = make_request("first", 12, 1, prompt=prompt)
    assert allocate(kv, first, 12)
    blocks = kv.blocks_of("first")
    kv.free(first)

    same = make_request("same", 12, 1, prompt=list(prompt))
    hits, cached = kv.get_computed_blocks(same)
    assert cached == 8  # the last block is recomputed so the step has logits
    assert hits == blocks[:2]

    longer = make_request("longer", 13, 1, prompt=[*prompt, 7])
    assert kv.get_computed_blocks(longer)[1] == 12

    other = make_request("other", 13, 1)
    assert kv.get_computed_blocks(other) == ([], 0)


def test_no_hits_with_prefix_caching_disabled() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    prompt = unique_prompt(12)
    first = make_request("first", 12, 1, prompt=prompt)
    assert kv.allocate_slots(first, 12)
    kv.free(first)
    assert kv.get_computed_blocks(make_request("again", 13, 1, prompt=[*prompt, 1])) == ([], 0)


def test_a_hit_on_blocks_held_by_a_running_request_shares_them() -> None:
    kv = KVCacheManager(8, 4)
    prompt = unique_prompt(12)
    a = make_request("a", 12, 1, prompt=prompt)
    assert allocate(kv, a, 12)
    b = make_request("b", 13, 1, prompt=[*prompt, 3])
    assert allocate(kv, b, 13)
    assert kv.blocks_of("b")[:3] == kv.blocks_of("a")
    assert kv.num_free_blocks == 8 - 4  # shared blocks count once
    kv.free(a)
    assert kv.num_free_blocks == 8 - 4  # still held by b
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_reclaimed_cached_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(4, 4)
    prompt = unique_prompt(12)
    a = make_request("a", 12, 1, prompt=prompt)
    assert allocate(kv, a, 12)
    kv.free(a)
    # 17 tokens: 3 cached blocks + 2 new ones, but only 1 block is free beyond the hits.
    b = make_request("b", 17, 1, prompt=[*prompt, 1, 2, 3, 4, 5])
    assert not allocate(kv, b, 17)
    assert kv.num_free_blocks == 4
    assert kv.get_computed_blocks(b)[1] == 12
    c = make_request("c", 13, 1, prompt=[*prompt, 1])
    assert allocate(kv, c, 13)
    assert kv.num_free_blocks == 0


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    kv = KVCacheManager(6, 4)
    pa, pb = unique_prompt(8), unique_prompt(8)
    a = make_request("a", 8, 1, prompt=pa)
    b = make_request("b", 8, 1, prompt=pb)
    assert allocate(kv, a, 8)
    assert allocate(kv, b, 8)
    kv.free(a)  # freed first: evicted first
    kv.free(b)

    probes = itertools.count()

    def cached(prompt: list[int]) -> int:
        probe = make_request(f"probe-{next(probes)}", 9, 1, prompt=[*prompt, 0])
        return kv.get_computed_blocks(probe)[1]

    assert (cached(pa), cached(pb)) == (8, 8)
    # 3 blocks: the 2 never used, then a's last block (a request's tail goes first).
    assert allocate(kv, make_request("c", 12, 1), 12)
    assert (cached(pa), cached(pb)) == (4, 8)
    assert allocate(kv, make_request("d", 4, 1), 4)
    assert (cached(pa), cached(pb)) == (0, 8)
    assert allocate(kv, make_request("e", 4, 1), 4)
    assert (cached(pa), cached(pb)) == (0, 4)


# -- through the scheduler and the engine ---------------------------------------------


def ttft_and_cached(
    prompt: list[int], *earlier: list[int], caching: bool = True
) -> tuple[float, int]:
    """TTFT and prefix hit of a prompt sent after ``earlier`` prompts have finished."""
    engine, clock = make_engine(H100, enable_prefix_caching=caching)
    for before in earlier:
        engine.add_request(before, 2)
        drain(engine, clock)
    request = engine.add_request(prompt, 2)
    drain(engine, clock)
    assert request.first_token_time is not None
    return request.first_token_time - request.arrival_time, request.num_cached_tokens


def test_shared_prefix_is_a_cache_hit_with_a_shorter_ttft() -> None:
    shared = unique_prompt(1000)
    first = [*shared, *unique_prompt(50)]
    second = [*shared, *unique_prompt(50)]
    cold, cold_hit = ttft_and_cached(second)
    warm, warm_hit = ttft_and_cached(second, first)
    assert cold_hit == 0
    assert warm_hit == 992  # 62 full blocks of 16 lie inside the shared 1,000 tokens
    assert warm < cold / 2


def test_identical_prompt_hits_all_but_its_last_block() -> None:
    prompt = unique_prompt(64)
    _, hit = ttft_and_cached(prompt, prompt)
    assert hit == 48
    assert hit % 16 == 0


def test_no_hit_and_no_speedup_with_prefix_caching_disabled() -> None:
    shared = unique_prompt(1000)
    second = [*shared, *unique_prompt(50)]
    cold, _ = ttft_and_cached(second, caching=False)
    warm, hit = ttft_and_cached(second, [*shared, *unique_prompt(50)], caching=False)
    assert hit == 0
    assert warm == pytest.approx(cold)


def test_request_admitted_beside_a_running_one_shares_its_prefix() -> None:
    sched = make_scheduler(block_size=16, num_gpu_blocks=64, max_model_len=512)
    prompt = unique_prompt(160)
    sched.add_request(make_request("a", 0, 5, prompt=prompt))
    step(sched)
    sched.add_request(make_request("b", 0, 5, prompt=[*prompt, *unique_prompt(40)]))
    out, _ = step(sched)
    b_chunk = next(c for c in out.chunks if c.request_id == "b")
    assert sched.requests["b"].num_cached_tokens == 160
    assert (b_chunk.num_computed_before, b_chunk.num_tokens) == (160, 40)
    a_blocks = sched.kv.blocks_of("a")
    assert sched.kv.blocks_of("b")[:10] == a_blocks[:10]
    # a: 161 tokens -> 11 blocks; b: 200 -> 13, of which 10 are a's.
    assert sched.kv.num_free_blocks == 64 - 11 - 3
