"""`Slots`: which request owns which KV-cache row, kept so that decoding reads the cache as views.

Layout of the `num_slots` rows (plus one spare row, index `num_slots`, used only as a swap buffer):
  * decode rows are [0, num_decoding), split into one contiguous run per policy version (a *group*),
    so each version's decode forward reads `cache[start:stop]` as a view, never a gather;
  * prefilling requests sit in free rows above the decode region, taken from the top down.
Every change is returned as a list of row moves `(src, dst, request id)` that the caller applies, in order, to
everything indexed by row (KV cache, per-row tensors). A finished decode row is filled by the last row
of its group, and each later group slides down by moving its last row into the gap: 1 + (later groups)
moves. Joining the decode region costs the same. Pure Python, no torch: tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Group:
    version: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


Move = tuple[int, int, str]  # (src row, dst row, id of the request that moves)


class Slots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be at least 1")
        self.num_slots = num_slots
        self.spare = num_slots
        self.owner: list[str | None] = [None] * (num_slots + 1)  # request id per row
        self.row: dict[str, int] = {}
        self.groups: list[Group] = []  # decode groups in row order
        self.num_decoding = 0
        self._decoding: set[str] = set()

    # -- queries ------------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self.row)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self.row)

    def is_decoding(self, rid: str) -> bool:
        return rid in self._decoding

    def group_of(self, version: int) -> Group | None:
        for g in self.groups:
            if g.version == version:
                return g
        return None

    # -- changes ------------------------------------------------------------------------------------

    def admit(self, rid: str) -> int:
        """Give a new (prefilling) request the highest free row; no moves needed."""
        if rid in self.row:
            raise ValueError(f"request {rid!r} already holds row {self.row[rid]}")
        for r in range(self.num_slots - 1, self.num_decoding - 1, -1):
            if self.owner[r] is None:
                self._put(rid, r)
                return r
        raise ValueError("no free slot; check num_free before admitting")

    def start_decoding(self, rid: str, version: int) -> list[Move]:
        """Move a prefilled request into its version's decode group (created at the end if new)."""
        p = self.row[rid]
        if rid in self._decoding:
            raise ValueError(f"request {rid!r} is already decoding")
        g = self.group_of(version)
        if g is None:
            g = Group(version, self.num_decoding, self.num_decoding)
            self.groups.append(g)
        later = self.groups[self.groups.index(g) + 1 :]
        end = self.num_decoding  # the row the decode region grows into
        moves: list[Move] = []
        if not later and p == end:
            pass
        elif not later and self.owner[end] is None:
            moves.append(self._move(p, end))
        else:
            moves.append(self._move(p, self.spare))
            if self.owner[end] is not None:  # another prefilling request is in the way
                moves.append(self._move(end, p))
            for h in reversed(later):  # slide each later group up by one row
                moves.append(self._move(h.start, h.stop))
                h.start += 1
                h.stop += 1
            moves.append(self._move(self.spare, g.stop))
        g.stop += 1
        self.num_decoding += 1
        self._decoding.add(rid)
        return moves

    def release(self, rid: str) -> list[Move]:
        """Free a request's row; a decode row is refilled so the decode region stays compact."""
        r = self.row.pop(rid)
        self.owner[r] = None
        if rid not in self._decoding:
            return []
        self._decoding.discard(rid)
        gi = next(i for i, g in enumerate(self.groups) if g.start <= r < g.stop)
        g = self.groups[gi]
        moves: list[Move] = []
        hole = r
        if hole != g.stop - 1:
            moves.append(self._move(g.stop - 1, hole))
        g.stop -= 1
        hole = g.stop
        for h in self.groups[gi + 1 :]:  # slide each later group down by one row
            if h.stop - 1 != hole:
                moves.append(self._move(h.stop - 1, hole))
            h.start -= 1
            h.stop -= 1
            hole = h.stop
        if not len(g):
            del self.groups[gi]
        self.num_decoding -= 1
        return moves

    def reorder(self, version: int, order: list[str]) -> list[Move]:
        """Permute a decode group's rows so that row `start + i` holds `order[i]` (a permutation of
        the group's requests): one move per displaced row plus one per cycle, through the spare row."""
        g = self.group_of(version)
        assert g is not None and len(order) == len(g) and set(order) == set(self.owner[g.start : g.stop])
        target = {rid: g.start + i for i, rid in enumerate(order)}
        moves: list[Move] = []
        for r in range(g.start, g.stop):
            if target[self.owner[r]] == r:
                continue
            moves.append(self._move(r, self.spare))  # open the cycle at r
            hole = r
            while True:  # fill the hole with the request that belongs there
                src = self.row[order[hole - g.start]]
                if src == self.spare:
                    break
                moves.append(self._move(src, hole))
                hole = src
            moves.append(self._move(self.spare, hole))
        return moves

    # -- internals ----------------------------------------------------------------------------------

    def _put(self, rid: str, r: int) -> None:
        self.owner[r] = rid
        self.row[rid] = r

    def _move(self, src: int, dst: int) -> Move:
        rid = self.owner[src]
        assert rid is not None and self.owner[dst] is None, (src, dst)
        self.owner[src] = None
        self._put(rid, dst)
        return (src, dst, rid)
