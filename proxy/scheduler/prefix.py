"""What each engine's prefix cache holds: the scheduler's prefix index.

A prompt is cut into blocks of the engine's block size; a block's hash covers its
token ids and the hash of the block before it (:func:`chain`), so equal hashes
mean equal prefixes, as in vLLM's own prefix cache. An engine's index is the set
of block hashes it is believed to hold, in least recently used order.

It is kept one of two ways, its :class:`IndexMode`:

- ``events``: from the engine's own KV-cache events (vLLM's
  ``--kv-events-config``; :mod:`proxy.engines` decodes them into
  :class:`Stored`, :class:`Removed` and :class:`Cleared`). The engine names its
  blocks by hashes of its own; a stored block carries its token ids, so the
  index hashes them again with :func:`chain` and keeps the engine's name of each
  block beside it, to find it when the engine removes it. Exact, up to the
  events in flight.
- ``routed``: from what was sent there. A request's blocks are held once its
  prefill is done (the engine computed and cached them), and the least recently
  used ones age out past the engine's cache size in blocks (``vllm:cache_config_info``).
  The engine's own ``cached_tokens`` corrects it when an answer says fewer
  tokens were cached than expected: the blocks past the reported ones are
  dropped, and the size the index ages at shrinks (it grows back by a block per
  answer that matched). An approximation, as every router without events makes.

In both, the blocks of a prompt in prefill there are *pending*: routing counts
them (a prompt sent behind it finds them computed by its turn), the budget does
not (a prompt sent beside it computes them too, as the engine has not cached
them yet).

Pure: no I/O and no clock; the scheduler owns one index per engine.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Cleared", "IndexMode", "PrefixIndex", "Removed", "Stored", "chain"]

ROOT = 0  # the parent of a prompt's first block


def chain(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> tuple[int, ...]:
    """The hashes of every full block of ``token_ids`` after ``parent``'s block.

    Python's hash of a tuple of ints is the same in every process (no seed), and
    the index never leaves the process anyway."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class IndexMode(enum.StrEnum):
    EVENTS = "events"
    ROUTED = "routed"


@dataclass(frozen=True, slots=True)
class Stored:
    """The engine cached blocks ``hashes`` (its own names), the first one's parent
    ``parent`` (None: a prompt's first block), holding ``token_ids``
    (``block_size`` per block)."""

    hashes: Sequence[int | bytes]
    parent: int | bytes | None
    token_ids: Sequence[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """The engine evicted blocks ``hashes`` (its own names)."""

    hashes: Sequence[int | bytes]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (a reset)."""


KVEvent = Stored | Removed | Cleared


class PrefixIndex:
    """One engine's cached blocks, at most ``capacity`` of them.

    ``match`` is a read: it changes nothing (not even the order)."""

    __slots__ = (
        "_blocks",
        "_by_engine_hash",
        "_ours",
        "_pending",
        "block_size",
        "capacity",
        "limit",
        "mode",
    )

    def __init__(self, block_size: int, capacity: int, mode: IndexMode = IndexMode.ROUTED):
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be at least 1")
        self.block_size = block_size
        self.capacity = capacity  # the engine's cache size in blocks
        self.limit = capacity  # what the routed index ages at (corrected by answers)
        self.mode = mode
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._by_engine_hash: dict[int | bytes, int] = {}  # events: the engine's name -> ours
        self._ours: dict[int, int | bytes] = {}  # events: ours -> the engine's name
        self._pending: dict[int, int] = {}  # blocks of prompts in prefill: how many hold each

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[int], pending: bool = False) -> int:
        """How many of ``blocks`` (a prompt's, from :func:`chain`) lead the prompt in
        this engine's cache; with ``pending``, or are being computed there."""
        held = self._blocks
        coming = self._pending if pending else {}
        n = 0
        for block in blocks:
            if block not in held and block not in coming:
                break
            n += 1
        return n

    def holds_first(self, blocks: Sequence[int]) -> bool:
        """Whether the prompt's first block is here or coming (a quick look)."""
        return bool(blocks) and (blocks[0] in self._blocks or blocks[0] in self._pending)

    # -- prompts in prefill ----------------------------------------------------

    def sent(self, blocks: Sequence[int]) -> None:
        """A prompt of ``blocks`` began its prefill here."""
        pending = self._pending
        for block in blocks:
            pending[block] = pending.get(block, 0) + 1

    def prefilled(self, blocks: Sequence[int]) -> None:
        """That prompt's prefill is done: its blocks are cached, so they are held now
        (kept from events too: the engine's events for them may come after its
        first token does, and a prompt routed in between must find them; the
        event names them, and a later removal drops them)."""
        self._unsent(blocks)
        self._hold(blocks)

    def dropped(self, blocks: Sequence[int]) -> None:
        """That prompt left before its prefill was done (failed, aborted, cancelled)."""
        self._unsent(blocks)

    def _unsent(self, blocks: Sequence[int]) -> None:
        pending = self._pending
        for block in blocks:
            n = pending.get(block, 0) - 1
            if n > 0:
                pending[block] = n
            else:
                pending.pop(block, None)

    # -- routed ----------------------------------------------------------------

    def routed(self, blocks: Sequence[int]) -> None:
        """A prompt of ``blocks`` was computed here: they are cached."""
        if self.mode is IndexMode.ROUTED:
            self._hold(blocks)

    def _hold(self, blocks: Sequence[int]) -> None:
        held = self._blocks
        for block in blocks:
            held[block] = None
            held.move_to_end(block)
        self._age()

    def answered(self, blocks: Sequence[int], expected: int, reported: int) -> None:
        """The engine said ``reported`` blocks of a prompt of ``blocks`` were cached
        where the index expected ``expected``: fewer means the index outlived what
        the engine kept, so the blocks between are dropped and the index ages
        sooner; as many or more, later (up to the engine's cache size)."""
        if self.mode is not IndexMode.ROUTED:
            return
        if reported < expected:
            for block in blocks[reported:expected]:
                self._blocks.pop(block, None)
            self.limit = max(1, int(self.limit * 0.9))
            self._age()
        elif self.limit < self.capacity:
            self.limit += 1

    def resize(self, capacity: int) -> None:
        """The engine's cache holds ``capacity`` blocks (learnt after start)."""
        capacity = max(1, capacity)
        self.limit = capacity if self.limit == self.capacity else min(self.limit, capacity)
        self.capacity = capacity
        self._age()

    def _age(self) -> None:
        held = self._blocks
        limit = self.limit if self.mode is IndexMode.ROUTED else 2 * self.capacity
        while len(held) > limit:
            block, _ = held.popitem(last=False)
            name = self._ours.pop(block, None)
            if name is not None:
                self._by_engine_hash.pop(name, None)

    # -- events ----------------------------------------------------------------

    def apply(self, events: Iterable[KVEvent]) -> None:
        """The engine's KV-cache events, in the order it sent them."""
        self.mode = IndexMode.EVENTS
        for event in events:
            if isinstance(event, Stored):
                self._stored(event)
            elif isinstance(event, Removed):
                self._removed(event.hashes)
            else:
                self.clear()
        self._age()

    def _stored(self, event: Stored) -> None:
        size = event.block_size
        if size != self.block_size:
            return  # another cache group's blocks (or a misconfigured engine)
        parent = ROOT if event.parent is None else self._by_engine_hash.get(event.parent)
        if parent is None:
            return  # its parent was never seen: not a prefix this index can name
        held, names, ours = self._blocks, self._by_engine_hash, self._ours
        tokens = event.token_ids
        for i, name in enumerate(event.hashes):
            block_tokens = tuple(tokens[i * size : (i + 1) * size])
            if len(block_tokens) < size:
                break
            parent = hash((parent, block_tokens))
            held[parent] = None
            held.move_to_end(parent)
            names[name] = parent
            ours[parent] = name

    def _removed(self, hashes: Iterable[int | bytes]) -> None:
        for name in hashes:
            block = self._by_engine_hash.pop(name, None)
            if block is not None:
                self._blocks.pop(block, None)
                self._ours.pop(block, None)

    def clear(self) -> None:
        """Forget every block (the engine reset its cache, or its events were lost)."""
        self._blocks.clear()
        self._by_engine_hash.clear()
        self._ours.clear()
