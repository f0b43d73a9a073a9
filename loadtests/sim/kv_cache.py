"""The KV cache in fixed-size blocks, with prefix caching by chained block hash.

A block holds ``block_size`` tokens. A full block's hash covers its tokens and the
hash of the block before it, so equal hashes mean equal prefixes. Freed blocks keep
their contents (and hash) until they are reused: they sit in a free list ordered
least recently freed first, and a later request with the same prefix takes them
back instead of recomputing them. This is the model of vLLM's V1
``KVCacheManager`` that the scheduler needs: can these tokens get slots, which
prefix is already computed, and how full is the cache.

With ``enable_kv_cache_events`` the manager also records vLLM's KV-cache events
(:mod:`loadtests.sim.kv_events`) where vLLM's block pool does: ``BlockStored`` when
full blocks get a hash (one event per run of consecutive blocks of a request,
parent and tokens included), ``BlockRemoved`` when a cached block is reused and
its hash dropped, ``AllBlocksCleared`` on :meth:`KVCacheManager.reset_prefix_cache`.
The engine takes them once per step (:meth:`KVCacheManager.take_events`). Here a
hash names at most one block: a block whose hash another block already holds is
not cached again, and gets no event (vLLM caches both copies and announces both),
so replaying the events yields exactly the hashes this cache can hit.
"""

from __future__ import annotations

from collections import OrderedDict

from loadtests.sim.kv_events import (
    AllBlocksCleared,
    AnyKVCacheEvent,
    block_removed,
    block_stored,
)
from loadtests.sim.request import SimRequest


def block_hashes(token_ids: list[int], block_size: int, start: list[int]) -> list[int]:
    """Extend ``start`` (hashes of the first blocks) to every full block of tokens."""
    hashes = list(start)
    parent = hashes[-1] if hashes else 0
    for i in range(len(hashes), len(token_ids) // block_size):
        chunk = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hash((parent, chunk))
        hashes.append(parent)
    return hashes


class KVCacheManager:
    """Block accounting for the running requests of one engine."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashed: dict[str, int] = {}
        self._req_hashes: dict[str, list[int]] = {}
        self._events: list[AnyKVCacheEvent] | None = [] if enable_kv_cache_events else None

    # -- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (including cached ones that may be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, as vLLM's ``kv_cache_usage_perc``."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._req_blocks.get(request_id, []))

    @property
    def cached_hashes(self) -> set[int]:
        """The block hashes a prefix lookup can hit now."""
        return set(self._cached)

    def take_events(self) -> list[AnyKVCacheEvent]:
        """The KV-cache events since the last call, oldest first (none when off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def _hashes(self, request: SimRequest) -> list[int]:
        known = self._req_hashes.get(request.request_id, [])
        if len(known) < request.num_tokens // self.block_size:
            known = block_hashes(request.token_ids(), self.block_size, known)
            self._req_hashes[request.request_id] = known
        return known

    def get_computed_blocks(self, request: SimRequest) -> tuple[list[int], int]:
        """The cached blocks that hold a prefix of the request, and their token count.

        The last token is always left to compute (a step must produce logits).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._hashes(request)[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- changes ---------------------------------------------------------------

    def allocate_slots(
        self,
        request: SimRequest,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
    ) -> bool:
        """Reserve blocks so that ``num_new_tokens`` more tokens can be computed.

        ``computed_blocks`` are prefix-cache hits for a request not yet holding any
        block. Returns False, changing nothing, when the free blocks do not suffice.
        """
        computed_blocks = computed_blocks or []
        held = self._req_blocks.setdefault(request.request_id, [])
        num_computed = (
            request.num_computed_tokens
            + request.num_inflight_tokens
            + len(computed_blocks) * self.block_size
        )
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(held) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if self._ref_cnt[b] == 0)
        if needed > len(self._free) - reclaimed:
            if not held:
                del self._req_blocks[request.request_id]
            return False
        for block in computed_blocks:
            if self._ref_cnt[block] == 0:
                del self._free[block]
            self._ref_cnt[block] += 1
            held.append(block)
        for _ in range(max(needed, 0)):
            held.append(self._take_free_block())
        self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._block_hash[block]
        if old is not None:
            if self._cached.get(old) == block:
                del self._cached[old]
                if self._events is not None:
                    self._events.append(block_removed(old))
            self._block_hash[block] = None
        self._ref_cnt[block] = 1
        return block

    def _cache_full_blocks(self, request: SimRequest, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._req_hashed.get(rid, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._hashes(request)
        blocks = self._req_blocks[rid]
        run_start: int | None = None  # first block of the run of newly cached ones
        for i in range(start, end):
            h = hashes[i]
            if h not in self._cached:
                self._cached[h] = blocks[i]
                self._block_hash[blocks[i]] = h
                if run_start is None:
                    run_start = i
            elif run_start is not None:
                self._record_stored(request, hashes, run_start, i)
                run_start = None
        if run_start is not None:
            self._record_stored(request, hashes, run_start, end)
        self._req_hashed[rid] = end

    def _record_stored(self, request: SimRequest, hashes: list[int], start: int, end: int) -> None:
        """A ``BlockStored`` for the request's blocks ``start`` to ``end`` (exclusive)."""
        if self._events is None:
            return
        size = self.block_size
        parent = hashes[start - 1] if start > 0 else None
        tokens = request.token_ids()[start * size : end * size]
        self._events.append(block_stored(hashes[start:end], parent, tokens, size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as vLLM's ``reset_prefix_cache``; refused (False,
        nothing changed) while a request holds blocks."""
        if len(self._free) < self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def free(self, request: SimRequest) -> None:
        """Release the request's blocks; cached contents stay reusable until evicted.

        Blocks go to the free list tail-first, so a request's last blocks are evicted
        before its first ones (its prefix is the part most likely to be shared).
        """
        rid = request.request_id
        for block in reversed(self._req_blocks.pop(rid, [])):
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                self._free[block] = None
        self._req_hashed.pop(rid, None)
        self._req_hashes.pop(rid, None)
