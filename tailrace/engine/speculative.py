"""`SpeculativeSteps`: the engine step's speculative decoding (a mixin of `TailraceEngine`, kept apart
so the step's plain path reads on its own).

Per step, when the engine has a `Speculator`: `_draft` picks the decode rows that draft and how far
(the speculator's toggle and ladder, cut to what the row may still emit and the blocks spare for it),
gives them blocks for the drafted positions and asks the drafter; the step's forward then runs each
draft as a piece of its row after the row's decode token (the target's logits at every position, one
pass over the weights with everything else); `_verify` samples the target's own token at each draft
position and keeps the agreeing prefix (see `spec.accept`); `_advance` moves the row's host-side
counters and schedules, and returns the blocks of rejected positions. What a rejected draft wrote in
the cache lies past the row's position: never read, overwritten as the row goes on.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tailrace.engine.rows import TOK
from tailrace.engine.sampler import sample
from tailrace.engine.sequence import Sequence
from tailrace.engine.spec import accept
from tailrace.engine.spec.drafter import DraftRow


class SpeculativeSteps:
    def _draft(self, active: int) -> tuple[list[Draft], float]:
        """The decode rows that draft this step and their drafts, as long as the `Speculator` says pays
        (cut to the row's remaining length, the blocks spare for it, and its first stop token); and the
        drafter's seconds. A drafting row holds blocks for its drafted positions until `_advance`."""
        spec, step = self._spec, self._decode_step
        cap = spec.cap(active)
        if not cap:
            return [], 0.0
        want = []
        for b, rid in enumerate(self.slots.owner[:active]):
            seq = self._seqs[rid]
            g = spec.gamma(seq.accepted, seq.compared, active, cap, step)
            g = spec.budget(seq.req.prompt_ids, min(g, seq.allowed - seq.num_new(step) - 1))
            if g > 0:
                want.append((b, seq, g))
        if not want:
            return [], 0.0
        # blocks for the drafted positions p + 1 .. p + g (p, the row's input position, is held)
        grown = self.paging.extend([(seq.id, seq.pos_key + step + g + 1) for _, seq, g in want])
        self.cache.table.put([(self.slots.row[rid], i, blk) for rid, i, blk in grown])
        stale = [seq for _, seq, _ in want if len(seq.host) < seq.num_resumed + seq.num_new(step)]
        if stale:  # host copies of responses decoded since these rows last drafted
            outs = self.rows.outputs(
                [self.slots.row[s.id] for s in stale],
                [len(s.host) for s in stale],
                [s.num_resumed + s.num_new(step) for s in stale],
            )
            for s, (toks, _) in zip(stale, outs):
                s.host.extend(toks)
        rows = []
        for b, seq, g in want:
            p = seq.pos_key + step
            g = min(g, self.paging.held(seq.id) - p - 1)
            rows.append(DraftRow(seq.id, seq.req.prompt_ids, seq.host, g, b, p, seq.version))
        rows = [r for r in rows if r.k > 0]
        t = time.perf_counter()
        proposals = spec.drafter.propose(rows) if rows else []
        took = time.perf_counter() - t
        if rows:
            steps = max(r.k for r in rows)
            spec.toggle.observe_draft(len(rows), steps, took)
            if spec.drafter.per_token_cost:
                spec.stats.draft_passes += steps
        drafts = []
        for r, toks in zip(rows, proposals):
            seq = self._seqs[r.request_id]
            toks = _clean(toks[: r.k], self.vocab_size, seq.req.params.stop_token_ids)
            if toks:
                drafts.append(Draft(seq, r.row, r.position, toks))
            else:
                self.paging.shrink(seq.id, r.position + 1)
        spec.stats.draft_s += took
        return drafts, took

    def _verify(
        self, drafts: list[Draft], logits: torch.Tensor, n_completed: int, stops: torch.Tensor | None
    ) -> Verified:
        """Sample the target's own token at every draft position, with the noise plain decoding uses
        there (same key, same response index); keep each row's agreeing prefix and the target's token
        after it (`spec.accept`), store them after the token `_sample_decode` drew for the row, and
        advance the row past them. `stops`: the step's stop flags (`_stop_flags`), read to the host
        with the tokens: a verify step reads the device once, as a plain step does."""
        dev, spec = self.device, self._spec
        n_tok = [len(d.tokens) for d in drafts]
        at = torch.tensor([d.row for d, n in zip(drafts, n_tok) for _ in range(n)]).to(dev, non_blocking=True)
        args = self.rows.sampling_args(at)
        args["index"] = args["index"] + torch.tensor([j for n in n_tok for j in range(n)]).to(dev)
        flags = self._flags([d.seq.req.params for d in drafts])
        toks, lps = sample(logits, salt=self._salt, flags=flags, kernel=self._sample_kernel, **args)
        first = self.rows.ints[torch.tensor([d.row for d in drafts]).to(dev), TOK]  # drawn by _sample_decode
        stop_part = () if stops is None else (stops.to(toks.dtype),)
        host = torch.cat((first, toks, *stop_part)).tolist()
        out = Verified()
        out.stopped = [i for i, f in enumerate(host[len(drafts) + len(toks) :]) if f]
        rows, counts, sel, off = [], [], [], len(drafts)
        for i, (d, n) in enumerate(zip(drafts, n_tok)):
            target = [host[i]] + host[off : off + n]
            a, e, stopped = accept.verify(d.tokens, target, d.seq.req.params.stop_token_ids)
            spec.verified(d.seq.version, n, a, min(a + 1, n))
            out.count(d.seq.version, d.seq.req.adapter, n, a)
            d.seq.accepted, d.seq.compared = spec.record(d.seq.accepted, d.seq.compared, a, min(a + 1, n))
            d.seq.host.extend(target[:e])
            if e > 1:
                rows.append(d.row)
                counts.append(e - 1)
                sel += range(off - len(drafts), off - len(drafts) + e - 1)
                out.extra += e - 1
                if stopped:
                    out.stopped.append(n_completed + d.row)
            d.extra = e - 1
            off += n
        if rows:
            idx = torch.tensor(sel).to(dev, non_blocking=True)
            self.rows.extend(rows, counts, toks[idx], lps[idx])
        for d in drafts:
            self._advance(d.seq, d.extra)
        return out

    def _advance(self, seq: Sequence, extra: int) -> None:
        """After a verify: the row's count, position and schedules move `extra` tokens on, and it keeps
        the blocks of the positions written (the rejected drafts' k/v lie past them, never read)."""
        step = self._decode_step
        if extra:
            seq.new_at_join += extra
            seq.pos_key += extra
            seq.finish_step -= extra
            self._finish_at.setdefault(seq.finish_step, []).append(seq)
        nxt = seq.pos_key + step  # the next input's position: every one before it is written
        self.paging.shrink(seq.id, nxt)
        if extra:
            bs = self.kv_size.block_size
            seq.grow_step = -(-nxt // bs) * bs - seq.pos_key  # when its input reaches its blocks' end
            self._grow_at.setdefault(seq.grow_step, []).append(seq)


@dataclasses.dataclass(slots=True)
class Draft:
    seq: Sequence
    row: int  # its decode (= cache) row
    pos: int  # its input's position; the draft takes the positions after it
    tokens: list[int]
    extra: int = 0  # tokens the verify emitted beyond the one plain decoding would have


@dataclasses.dataclass
class Verified:
    drafted: int = 0
    accepted: int = 0
    # policy version -> [drafted, accepted]
    by_version: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    by_adapter: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # of rows naming one
    extra: int = 0  # tokens emitted beyond one per decode row
    # rows that sampled a stop token, as `_stop_flags` indexes them: its flags, then the verifies'
    stopped: list[int] = dataclasses.field(default_factory=list)

    def count(self, version: int, adapter: str | None, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        _add(self.by_version.setdefault(version, [0, 0]), drafted, accepted)
        if adapter:
            _add(self.by_adapter.setdefault(adapter, [0, 0]), drafted, accepted)


def _add(counts: list[int], drafted: int, accepted: int) -> None:
    counts[0] += drafted
    counts[1] += accepted


def _clean(tokens: list[int], vocab_size: int, stop_ids: tuple[int, ...]) -> list[int]:
    """A draft cut before its first id outside the vocabulary and after its first stop token (the
    target cannot go on past a stop)."""
    out = []
    for t in tokens:
        if not 0 <= t < vocab_size:
            break
        out.append(t)
        if t in stop_ids:
            break
    return out
