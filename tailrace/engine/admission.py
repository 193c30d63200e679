"""Requests into and out of a `TailraceEngine`'s slots and KV blocks (a mixin of it, kept apart so
the step reads on its own): admission first come first served while the prompt's blocks fit, a block
for each decode row as its position reaches one, the youngest request preempted when the pool is
short (it re-prefills and continues as if never interrupted), joining the decode batch, release; and
the per-row counts the sampler's flags are read from.
"""

from __future__ import annotations

import dataclasses

from tailrace.engine.sequence import Sequence
from tailrace.types import SamplingParams


class SlotBook:
    def _grow(self) -> None:
        """A block for each decode row whose position this step starts one; when the pool is short,
        the youngest requests are preempted (see `Paging.grow`)."""
        step = self._decode_step
        due = self._grow_at.pop(step, None)  # None: no row starts a block this step
        if due is None:
            return
        due = [s for s in due if self._seqs.get(s.id) is s and s.grow_step == step]
        g = self.paging.grow([(s.id, s.pos_key + step + 1) for s in due])
        for rid in g.preempted:
            self._preempt(self._seqs[rid])
        self.cache.table.put([(self.slots.row[rid], i, b) for rid, i, b in g.grown])
        for s in due:
            if self._seqs.get(s.id) is s:  # not preempted: its next block starts block_size steps on
                s.grow_step = step + self.kv_size.block_size
                self._grow_at.setdefault(s.grow_step, []).append(s)

    def _admit(self) -> None:
        """Waiting requests into free slots, first come first served, while their prompts' blocks fit
        (a request that does not fit waits at the head, so a long prompt is never overtaken)."""
        while self._waiting and self.slots.num_free:
            seq = self._waiting[0]
            key, cached = self._kept_prefix(seq)
            # it holds at most len(ids) + allowed - 1 positions: its last token's k/v is never written
            limit = len(seq.ids) + seq.allowed - 1
            blocks = self.paging.admit(seq.id, len(seq.ids), limit, seq.age, key, cached)
            if blocks is None:
                return
            self._waiting.popleft()
            seq.prefilled = cached
            self.reused_tokens += cached
            row = self.slots.admit(seq.id)
            self.rows.set(row, seq)
            self.cache.table.set(row, blocks)
            self._prefilling.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Take a running request's slot (its blocks are already free) and queue it first, as a request
        that re-prefills its prompt and the tokens it generated, which it keeps with their logprobs and
        versions: it continues as if never interrupted (the `abort_resume` guarantee)."""
        toks: list[int] = []
        lps: list[float] = []
        if self.slots.is_decoding(seq.id):
            row, r0 = self.slots.row[seq.id], seq.num_resumed
            [(toks, lps)] = self.rows.outputs([row], [r0], [r0 + seq.num_new(self._decode_step)])
        else:
            self._prefilling.remove(seq)
        self._release(seq)
        r = seq.req
        req = dataclasses.replace(
            r,
            resume_ids=r.resume_ids + tuple(toks),
            resume_logprobs=r.resume_logprobs + tuple(lps),
            resume_versions=r.resume_versions + (r.version,) * len(toks),
        )
        again = Sequence(req, seq.key, seq.submitted, self.max_context, seq.age)
        again.first_token = seq.first_token
        self._seqs[seq.id] = again
        self._waiting.appendleft(again)
        self.preemptions += 1

    def _join(self, seq: Sequence) -> None:
        self._apply(self.slots.start_decoding(seq.id, seq.version))
        seq.joined_at = self._decode_step
        seq.pos_key = len(seq.ids) - seq.joined_at  # its decode input's position minus the step counter
        seq.finish_step = seq.joined_at + seq.allowed - 1
        self._finish_at.setdefault(seq.finish_step, []).append(seq)
        bs = self.kv_size.block_size
        past = -(-len(seq.ids) // bs) * bs  # the first position past its prompt's blocks
        seq.grow_step = seq.joined_at + past - len(seq.ids)
        self._grow_at.setdefault(seq.grow_step, []).append(seq)
        self._count(seq, +1)

    def _remove(self, seq: Sequence) -> None:
        del self._seqs[seq.id]
        self._per_version[seq.version] -= 1
        self._per_adapter[seq.req.adapter] -= 1
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free its slot (compacting the decode rows) and its blocks, where it holds them."""
        if self._spec is not None:
            self._spec.drafter.release(seq.id)
        if seq.id not in self.slots.row:
            return
        if self.paging.holds(seq.id):
            self.paging.release(seq.id)
        decoding = self.slots.is_decoding(seq.id)
        self._apply(self.slots.release(seq.id))
        if decoding:
            self._count(seq, -1)

    def _count(self, seq: Sequence, d: int) -> None:
        p = seq.req.params
        sampled = p.temperature > 0
        self._n_sampled += d * sampled
        self._n_tempered += d * (p.temperature not in (0, 1))
        self._n_filter += d * (sampled and (p.top_k > 0 or p.top_p < 1))
        self._n_stop += d * bool(p.stop_token_ids)
        self._n_min_stop += d * bool(p.stop_token_ids and p.min_new_tokens > 0)
        self._n_special += d * special(p, self.vocab_size)

    def _apply(self, moves) -> None:
        for src, dst, _ in moves:
            self.cache.table.move(src, dst)
            self.rows.move(src, dst)


def special(p: SamplingParams, vocab_size: int) -> bool:
    """Whether a row samples through torch ops rather than the kernel (see `sampler.sample`)."""
    filtered = p.temperature > 0 and (0 < p.top_k < vocab_size or p.top_p < 1)
    return bool(filtered or (p.stop_token_ids and p.min_new_tokens))
