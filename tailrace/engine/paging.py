"""`Paging`: which sequence gets KV blocks, and which is preempted when there are none (no torch).

Decisions the engine applies (as `Slots` returns row moves), over a `BlockPool`:
  * `admit`: a waiting request gets the blocks of everything it prefills (prompt + resumed tokens) only
    if they fit leaving a reserve of one free block per holder that can still grow (itself included;
    one that holds the blocks of its limit -- prompt + max new tokens -- cannot). A decode step takes
    at most one new block per sequence, so the step after an admission never preempts; a larger reserve
    would need the requests' actual lengths, which nobody knows. A lone request always fits (the engine
    sizes the pool for one request of its context limit), so a long prompt cannot wait forever.
  * `extend` (speculative decoding): blocks for a sequence's draft positions, only from those the
    admission reserve leaves spare (never preempting: a draft that does not fit is cut short), and
    `shrink` returns the blocks of rejected positions once the draft is verified.
  * `grow`: a sequence whose next position starts a new block gets one. When the pool is short, the
    youngest holder (the latest arrival) is preempted -- all its blocks freed -- until the need fits
    or the needing sequence was itself the youngest. Needs are served oldest first, so the oldest
    holder always progresses (no livelock), and the caller requeues a preempted request at the front,
    where it is admitted again before any later arrival.
  * `keep` (multi-turn): a finished sequence's blocks stay, under a key of their own, for a
    continuation that `admit` lets adopt them (it then prefills only what follows them). Kept blocks
    count as free for every decision: the pool takes them back, oldest first, before it would refuse
    an admission or preempt anyone.
Ages are arrival numbers (smaller = older); a preempted request keeps its age when readmitted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tailrace.engine.block_pool import BlockPool


@dataclass(frozen=True)
class Growth:
    preempted: tuple[str, ...]  # sequences whose blocks were all freed, youngest first
    grown: tuple[tuple[str, int, int], ...]  # (sequence, index in its block list, new block)


class Paging:
    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks, block_size)
        self._age: dict[str, int] = {}  # the holders (sequences owning blocks) and their arrival numbers
        self._limit: dict[str, int] = {}  # the most positions each holder may come to hold
        self._kept: OrderedDict[str, int] = OrderedDict()  # kept blocks' key -> positions, oldest first
        self._keys = 0

    @property
    def num_holders(self) -> int:
        return len(self._age)

    @property
    def num_kept_blocks(self) -> int:
        return sum(len(self.pool.owned[k]) for k in self._kept)

    def is_kept(self, key: str) -> bool:
        return key in self._kept

    def keep(self, rid: str, positions: int) -> str:
        """`rid` finished: the blocks of its first `positions` stay (the rest return) under the key
        returned, until a continuation adopts them or the pool needs them."""
        del self._age[rid], self._limit[rid]
        self._keys += 1
        key = f"kept.{self._keys}"
        self.pool.owned[key] = self.pool.owned.pop(rid)
        self.pool.truncate(key, positions)
        self._kept[key] = positions
        return key

    def forget(self, key: str) -> None:
        """Kept blocks no continuation may adopt any more (their weights changed): back to the pool."""
        if self._kept.pop(key, None) is not None:
            self.pool.release(key)

    def _room(self, blocks: int) -> None:
        """Free at least `blocks` blocks as far as kept ones allow, taking them back oldest first."""
        while self.pool.num_free < blocks and self._kept:
            self.pool.release(self._kept.popitem(last=False)[0])

    def holds(self, rid: str) -> bool:
        return rid in self._age

    def held(self, rid: str) -> int:
        """Positions the blocks `rid` holds can take."""
        return len(self.pool.owned[rid]) * self.pool.block_size

    def admit(
        self, rid: str, tokens: int, limit: int, age: int, adopt: str | None = None, cached: int = 0
    ) -> list[int] | None:
        """The blocks for `rid`'s first `tokens` positions (of at most `limit` it may come to hold), or
        None: not now (stop admitting). `adopt`: the key of kept blocks whose first `cached` positions
        `rid` takes over (they hold its first `cached` positions' k/v); the rest are new."""
        if rid in self._age:
            raise ValueError(f"{rid!r} already holds blocks")
        pool = self.pool
        if adopt is not None and (adopt not in self._kept or cached > self._kept[adopt]):
            raise ValueError(f"{adopt!r} does not keep {cached} positions")
        reserve = sum(pool.short_by(r, n) > 0 for r, n in self._limit.items())
        reserve += pool.blocks_for(limit) > pool.blocks_for(tokens)
        reuse = pool.blocks_for(cached) if adopt is not None else 0
        other_kept = self.num_kept_blocks - (len(pool.owned[adopt]) if adopt is not None else 0)
        if pool.blocks_for(tokens) - reuse + reserve > pool.num_free + other_kept:
            return None
        if adopt is not None:
            del self._kept[adopt]
            pool.owned[rid] = pool.owned.pop(adopt)
            pool.truncate(rid, cached)
        self._room(pool.blocks_for(tokens) - reuse + reserve)
        self._age[rid], self._limit[rid] = age, limit
        pool.allocate(rid, tokens)
        return list(pool.owned[rid])

    def grow(self, needs: list[tuple[str, int]]) -> Growth:
        """Blocks so that each holder `rid` of `needs` holds `tokens` positions, preempting the youngest
        holders while the pool is short (a needing sequence may be among them)."""
        preempted: list[str] = []
        grown: list[tuple[str, int, int]] = []
        for rid, tokens in sorted(needs, key=lambda n: self._age[n[0]]):
            short = self.pool.short_by(rid, tokens)
            self._room(short)
            while rid in self._age and short > self.pool.num_free:
                victim = max(self._age, key=self._age.__getitem__)
                self.release(victim)
                preempted.append(victim)
            if rid in self._age and short:
                first = len(self.pool.owned[rid])
                grown += [(rid, first + i, b) for i, b in enumerate(self.pool.allocate(rid, tokens))]
        return Growth(tuple(preempted), tuple(grown))

    def extend(self, needs: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        """For each holder `rid` of `needs`, in order, blocks so it holds up to `tokens` positions, as
        far as blocks beyond the admission reserve allow (see `admit`). Returns (rid, index in its block
        list, new block) of the blocks handed out."""
        pool = self.pool
        spare = pool.num_free - sum(pool.short_by(r, n) > 0 for r, n in self._limit.items())
        out: list[tuple[str, int, int]] = []
        for rid, tokens in needs:
            n = min(pool.short_by(rid, tokens), spare)
            if n > 0:
                first = len(pool.owned[rid])
                new = pool.allocate(rid, (first + n) * pool.block_size)
                out += [(rid, first + i, b) for i, b in enumerate(new)]
                spare -= n
        return out

    def shrink(self, rid: str, tokens: int) -> None:
        """`rid` keeps the blocks of its first `tokens` positions; the rest return to the pool."""
        self.pool.truncate(rid, tokens)

    def release(self, rid: str) -> None:
        """`rid` finished, was aborted or preempted: its blocks return to the pool."""
        del self._age[rid], self._limit[rid]
        self.pool.release(rid)
