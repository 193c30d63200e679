"""`RowState`: everything the device needs about each cache row, as preallocated tensors.

Per row: the next decode input and its position, the index of the next response token, the noise
key, sampling parameters, a stop-token mask, and output buffers holding each sampled token and its
logprob at its response index (as wide as the longest response admitted so far, see `reserve`). Rows
move with the engine's slots (`move`), so a decode step reads and updates a contiguous slice with a
handful of tensor ops and never crosses to the host.
"""

from __future__ import annotations

import torch

from tailrace.engine.sequence import Sequence

# columns of `ints`
TOK, POS, IDX, KEY, TOPK, MINNEW = range(6)
# columns of `floats`
INV_T, NOISE, TOPP = range(3)
TOP_P_OFF = 2.0  # a top_p that never cuts (avoids rounding at exactly 1.0)


class RowState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        with torch.inference_mode(False):  # plain tensors: usable in and out of inference mode
            self.ints = torch.zeros(num_rows, 6, dtype=torch.int64, device=device)
            self.floats = torch.zeros(num_rows, 3, dtype=torch.float32, device=device)
            self.stop_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
            self.out_tok = torch.zeros(num_rows, 0, dtype=torch.int64, device=device)
            self.out_lp = torch.zeros(num_rows, 0, dtype=torch.float32, device=device)
        self._all = (self.ints, self.floats, self.stop_mask, self.out_tok, self.out_lp)

    def reserve(self, width: int) -> None:
        """Make the output buffers hold response indices [0, width) (at least doubling when they grow,
        so a run widens them a few times at most)."""
        n = self.out_tok.shape[1]
        if width <= n:
            return
        width = max(width, 2 * n)
        with torch.inference_mode(False):
            tok = self.out_tok.new_zeros(self.out_tok.shape[0], width)
            lp = self.out_lp.new_zeros(self.out_lp.shape[0], width)
            tok[:, :n], lp[:, :n] = self.out_tok, self.out_lp
        self.out_tok, self.out_lp = tok, lp
        self._all = (self.ints, self.floats, self.stop_mask, self.out_tok, self.out_lp)

    def set(self, row: int, seq: Sequence) -> None:
        """Initialize a row for a newly admitted sequence (one small host->device copy per field)."""
        p = seq.req.params
        V = self.vocab_size
        greedy = p.temperature == 0
        top_k = V if greedy or p.top_k == 0 else min(p.top_k, V)
        top_p = TOP_P_OFF if greedy or p.top_p >= 1.0 else p.top_p
        dev = self.ints.device
        self.ints[row] = torch.tensor(
            # min_new_tokens bans stop tokens only: 0 without them (the sampler's per-row path reads it)
            [0, len(seq.ids), seq.num_resumed, seq.key, top_k, p.min_new_tokens if p.stop_token_ids else 0],
            dtype=torch.int64,
        ).to(dev, non_blocking=True)
        self.floats[row] = torch.tensor(
            [1.0 if greedy else 1.0 / p.temperature, 0.0 if greedy else 1.0, top_p], dtype=torch.float32
        ).to(dev, non_blocking=True)
        self.stop_mask[row] = False
        if p.stop_token_ids:
            self.stop_mask[row, list(p.stop_token_ids)] = True

    def move(self, src: int, dst: int) -> None:
        for t in self._all:
            t[dst] = t[src]

    def sampling_args(self, rows: slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword arguments of `sampler.sample` for these rows (views for a slice)."""
        ints, floats = self.ints[rows], self.floats[rows]
        return dict(
            inv_temp=floats[:, INV_T],
            noise_scale=floats[:, NOISE],
            top_p=floats[:, TOPP],
            top_k=ints[:, TOPK],
            key=ints[:, KEY],
            index=ints[:, IDX],
            min_new=ints[:, MINNEW],
            stop_mask=self.stop_mask[rows],
        )

    def record(
        self, rows: slice | torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, advance_pos: bool
    ) -> torch.Tensor:
        """Store sampled tokens at each row's response index, make them the next decode inputs and
        advance the index (and the position, for decode rows). Returns the stop flags (B,) bool."""
        if isinstance(rows, slice):
            idx = self.ints[rows, IDX : IDX + 1]  # (B, 1) view
            self.out_tok[rows].scatter_(1, idx, tokens[:, None])
            self.out_lp[rows].scatter_(1, idx, logprobs[:, None])
            self.ints[rows, TOK] = tokens
            self.ints[rows, (POS if advance_pos else IDX) : IDX + 1] += 1
            stop = self.stop_mask[rows].gather(1, tokens[:, None])
        else:
            idx = self.ints[rows, IDX]
            self.out_tok.index_put_((rows, idx), tokens)
            self.out_lp.index_put_((rows, idx), logprobs)
            self.ints[rows, TOK] = tokens
            self.ints[rows, IDX] += 1
            if advance_pos:
                self.ints[rows, POS] += 1
            stop = self.stop_mask[rows].gather(1, tokens[:, None])
        return stop.squeeze(1)

    def extend(
        self, rows: list[int], counts: list[int], tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> None:
        """Append counts[i] more tokens to row rows[i] after the ones `record` stored (a verified
        draft's extra tokens; tokens, logprobs (sum(counts),) in row order): the last becomes its next
        decode input, and its index and position advance by counts[i]."""
        dev = self.ints.device
        r = torch.tensor([row for row, c in zip(rows, counts) for _ in range(c)], device=dev)
        j = torch.tensor([i for c in counts for i in range(c)], device=dev)
        idx = self.ints[r, IDX] + j
        self.out_tok.index_put_((r, idx), tokens)
        self.out_lp.index_put_((r, idx), logprobs)
        rows_t, n = torch.tensor(rows, device=dev), torch.tensor(counts, device=dev)
        self.ints[rows_t, TOK] = tokens[n.cumsum(0) - 1]
        self.ints[rows_t, POS] += n
        self.ints[rows_t, IDX] += n

    def outputs(
        self, rows: list[int], start: list[int], stop: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        """Tokens and logprobs at response indices [start, stop) of each row: one device->host copy."""
        if not rows:
            return []
        hi = max(stop)
        lo = min(start)
        r = torch.tensor(rows, device=self.out_tok.device)
        # Token ids are exact in float64, so both come back in one copy.
        toks, lps = torch.stack((self.out_tok[r, lo:hi].double(), self.out_lp[r, lo:hi].double())).tolist()
        return [
            ([int(x) for x in t[s - lo : e - lo]], lp[s - lo : e - lo])
            for t, lp, s, e in zip(toks, lps, start, stop)
        ]
