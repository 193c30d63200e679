"""`TorchBackend`: the reference backend, one engine step of one version in torch ops; runs wherever
torch does (CUDA, CPU with several threads, CPU without a C compiler).

The B decode rows (one token each) and the prefill pieces (prompt chunks, causal within the piece)
are one (M, hidden) batch through every GEMM (`FusedWeights`): one pass over the weights per step, no
padding. Per layer:
  * RoPE on q and k in one op set, looked up in a table built by `tailrace.model.rope` (the model's own
    table function, so positions rotate identically); the k/v writes are index copies into the blocks
    the cache's block table names for each token's row and position;
  * decode attention of one query per row over that row's blocks, gathered into a contiguous copy
    (one `index_select` per chunk and layer: exact, and the reference the C kernels are held to),
    chunk by chunk (`engine.chunks`), with gather indices and additive masks built once per step.
    `variant`, chosen once: 'bmm': two batched GEMMs per chunk, in fp32 whenever the cache is fp32;
    with a bf16/fp16 cache the scores GEMM runs as K @ q^T with an fp32 softmax, and up to
    `UPCAST_MAX_BATCH` rows on fp32 upcast copies, whichever is faster at that batch
    (bench/README.md); 'sdpa': `F.scaled_dot_product_attention` in the cache's dtype;
  * prefill pieces attend causally to their row's blocks (gathered), in fp32; the short ones (at most
    `SHORT_PIECE` tokens: speculation's drafts, a prompt's last chunk) in one batched attention per
    layer, padded to the longest, rather than a dozen ops each per layer (on a GPU a verify step of
    many rows was launch-bound on them).
The attended lengths come from the host, so the step needs no device->host sync. Supports exactly
what `CausalLM` supports (Llama/Qwen2 biases, Qwen3's q/k norms, every RoPE type via the table); tests
pin it to the logits of `CausalLM.forward` over whole sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

from tailrace.engine.adapters import LoraStep
from tailrace.engine.backends.weights import FusedWeights, norm_qk
from tailrace.engine.chunks import Chunk
from tailrace.engine.ckernel import Kernels
from tailrace.engine.kv_cache import KVCache
from tailrace.model.decoder import CausalLM, act_fn, embed, logits
from tailrace.model.moe import mix, shared
from tailrace.model.rope import inv_freq_and_scale, rope_table

UPCAST_MAX_BATCH = 8  # bf16/fp16 decode attention of at most this many rows runs on fp32 copies
SHORT_PIECE = 32  # prefill pieces of at most this many tokens attend together (see module doc)
Span = tuple[int, int, int]  # (row, start, n): a prefill piece's n tokens at positions start.. of a row


class TorchBackend:
    kernel: Kernels | None = None  # no C kernels: the sampler runs on torch ops too

    def __init__(
        self,
        model: CausalLM,
        max_context: int,
        kv_dtype: torch.dtype,
        variant: str = "bmm",
        packed: bool | None = None,
        gemm: Kernels | None = None,
        int8: bool = False,
        upcast_max_batch: int | None = None,
    ):
        """`model` on its device, in its dtype; `max_context`, `kv_dtype`: the positions a cache row
        addresses and the cache's dtype; `variant`: decode attention, 'bmm' or 'sdpa'; `packed`, `gemm`
        (the C kernels whose GEMM serves the linears), `int8` (a quantized drafter's layers): see
        `FusedWeights`. `upcast_max_batch`: with a bf16/fp16 cache, decode attention of at most this
        many rows (default `UPCAST_MAX_BATCH`) runs on fp32 copies, as prefill pieces always do
        (unbounded: a row's token is computed alike whatever the batch, and decoded or verified, which
        speculation's exactness needs)."""
        if variant not in ("bmm", "sdpa"):
            raise ValueError(f"variant={variant!r}: use 'bmm' or 'sdpa'")
        if model.config.attn_logit_softcapping is not None:  # SDPA cannot cap the scores (Gemma 2's)
            variant = "bmm"
        self.name, self.model, self.kv_dtype = variant, model, kv_dtype
        self.upcast_max_batch = UPCAST_MAX_BATCH if upcast_max_batch is None else upcast_max_batch
        self.w = w = FusedWeights(model, packed, gemm, int8)
        cfg = model.config
        self.cos_sin = _table(cfg, max_context, w)  # (max_context, 2, R): R = rotary_dim
        # OLMo3's sliding layers rotate by a table of their own (None: theirs is the full layers')
        self.local_cos_sin = _table(cfg.local(), max_context, w) if cfg.local_rope is not None else None
        self.local = [
            self.local_cos_sin is not None and cfg.local_at(i) for i in range(cfg.num_hidden_layers)
        ]
        # SmolLM3's layers without RoPE: False at theirs (the C kernels rotate by an identity table there)
        self.rope = [cfg.rope_at(i) for i in range(cfg.num_hidden_layers)]
        # routing replay (model/moe.py): while a forward runs over a cache that keeps routes, the experts
        # each sparse layer chose, in layer order, written to the cache once the layers are done
        self._chosen: list[torch.Tensor] | None = None
        self.arange = torch.arange(max_context, device=w.device)
        self.heads = torch.arange(w.Hkv, device=w.device)
        self._rows_cache: dict[tuple[int, int], torch.Tensor] = {}
        # decode attention: its per-step state (from the decode rows' positions) and its per-layer call,
        # kept as the class's functions: bound methods kept on self would make a reference cycle, and a
        # dropped policy version would then wait for the garbage collector (~700 MB a version at 135M)
        cls = type(self)
        if variant == "sdpa":
            self._decode_state, self._attend_decode = cls._sdpa_masks, cls._attend_sdpa
        elif kv_dtype == torch.float32:  # fp32 attention (an fp32 cache may serve a bf16 model)
            self._decode_state, self._attend_decode = cls._bmm_masks, cls._attend_fp32
        else:
            self._decode_state, self._attend_decode = cls._bmm_masks, cls._attend_low

    def refresh(self) -> None:
        self.w.refresh()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rows: slice,
        chunks: list[Chunk],
        pieces: Sequence[Span] = (),
        want: torch.Tensor | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """See `Backend.forward`."""
        B, M = rows.stop - rows.start, tokens.shape[0]
        x = embed(F.embedding(tokens, self.w.embed), self.model.config)  # (M, hidden)
        self._chosen = [] if cache.routes is not None else None
        try:
            x = self._layers(x, positions, cache, rows, chunks, pieces, self.w.packed_at(M), lora)
            if self._chosen:  # each token's experts go where its k/v go: its block, its offset
                at = cache.places(self._token_rows(rows, pieces), positions)
                cache.routes.index_copy_(0, at, torch.stack(self._chosen, 1).to(cache.routes.dtype))
        finally:
            self._chosen = None
        if want is not None:
            x = x.index_select(0, want)
        elif M > B:
            x = x[:B]
        return logits(
            self.w.lm_head(self._rms(x, self.w.norm), self.w.packed_at(x.shape[0])), self.model.config
        )

    def _layers(self, x, positions, cache, rows, chunks, pieces, pk: bool, lora=None) -> torch.Tensor:
        """The layers over x (M, hidden), `pk`: GEMMs on packed weights; `lora`: the tokens' adapters."""
        w = self.w
        B, M = rows.stop - rows.start, x.shape[0]
        H, Hkv, D = w.H, w.Hkv, w.D
        bs, table = cache.block_size, cache.table.t
        trow = self._token_rows(rows, pieces)
        blk = table[trow, positions // bs].long()  # (M,) the block holding each token's position
        widx = ((blk[:, None] * Hkv + self.heads) * bs + (positions % bs)[:, None]).reshape(-1)  # (M Hkv,)
        rot = [self.cos_sin[positions].split(1, dim=1)]  # cos, sin (M, 1, R): R = rotary_dim
        if self.local_cos_sin is not None:
            rot.append(self.local_cos_sin[positions].split(1, dim=1))
        windows = set(w.windows)  # the layers' windows (None: none): the masks differ by window
        # read by every layer of a window
        dec = {
            win: self._decode_state(self, positions[:B], chunks, table, rows.start, bs, win)
            for win in windows
        }
        offsets = list(accumulate((n for _, _, n in pieces[:-1]), initial=B))  # each piece's first token
        short = [j for j, (_, _, n) in enumerate(pieces) if n <= SHORT_PIECE]
        short = short if len(short) > 1 else []
        together = self._short_pieces(offsets, pieces, short, table, bs, windows) if short else None
        # per other piece: its token offset, n, and per window its row's blocks (Hkv nb,) from the first its
        # window reads, the positions they hold, the mask (1, n G, those)
        prefill = []
        for j in sorted(set(range(len(pieces))) - set(short)):
            row, start, n = pieces[j]
            per = {}
            for win in windows:
                idx, S, m = self._reach(
                    table[row : row + 1], start + n, start, self.arange[start : start + n, None], win, bs
                )
                per[win] = (idx, S, m.repeat_interleave(w.G, dim=0)[None])
            prefill.append((offsets[j], n, per))
        order = None  # token order of the pieces' outputs when the batched ones come first out of turn
        if together is not None and prefill:
            spans = [(offsets[j], pieces[j][2]) for j in short] + [(o, n) for o, n, _ in prefill]
            at = [o - B + i for o, n in spans for i in range(n)]  # each output token's place
            order = torch.empty(len(at), dtype=torch.long)
            order[torch.tensor(at)] = torch.arange(len(at))
            order = order.to(x.device)
        for i, lw in enumerate(w.layers):
            qkv = self._qkv(i, lw, x, pk, lora)  # (M, (H + 2 Hkv) D)
            qk = qkv[:, : (H + Hkv) * D].view(M, H + Hkv, D)
            if self.rope[i]:
                qk = _rotate(qk, *rot[self.local[i]])
            ck, cv = cache.k[i], cache.v[i]
            ck.view(-1, D).index_copy_(0, widx, qk[:, H:].reshape(M * Hkv, D).to(ck.dtype))
            cv.view(-1, D).index_copy_(0, widx, qkv[:, (H + Hkv) * D :].reshape(M * Hkv, D).to(cv.dtype))
            win = w.windows[i]
            outs = [self._attend_pieces(qk[:, :H], ck, cv, together, win)] if together is not None else []
            for off, n, per in prefill:
                idx, S, m = per[win]
                k, v = _gather(ck, idx, Hkv, S), _gather(cv, idx, Hkv, S)  # (Hkv, S, D)
                outs.append(self._attend_piece(qk[off : off + n, :H], k, v, m))
            if order is not None:
                outs = [_cat(outs).index_select(0, order)]
            if B:
                outs.insert(0, self._attend_decode(self, qk[:B, :H], ck, cv, dec[win]))
            x = self._mlp(i, lw, self._o(i, lw, _cat(outs), x, pk, lora), pk, lora)
        return x

    def _qkv(self, i: int, lw, x: torch.Tensor, pk: bool, lora, qk_norm: bool = True) -> torch.Tensor:
        """The fused q/k/v projection of x's RMSNorm (of x itself in a post-norm layer; with the tokens'
        adapter terms, then OLMo2's q/k norms, and Qwen3's unless `qk_norm` is False), (M, (H + 2 Hkv) D),
        RoPE not yet applied."""
        xn = x if lw.norm_attn is None else self._rms(x, lw.norm_attn)
        qkv = lw.qkv(xn, pk)
        if lora is not None:
            lora.add(i, "qkv", xn, qkv, self.kernel)
        if lw.q_norm is not None:  # OLMo2: q over its H D columns, k over its Hkv D, in place
            nq, nk = lw.q_norm.shape[0], lw.k_norm.shape[0]
            q, k = qkv[:, :nq], qkv[:, nq : nq + nk]
            q.copy_(self._rms(q, lw.q_norm))
            k.copy_(self._rms(k, lw.k_norm))
        if qk_norm and lw.qk_norm is not None:
            norm_qk(qkv, lw.qk_norm, self.w.D, self.w.eps)
        return qkv

    def _o(self, i: int, lw, o: torch.Tensor, x: torch.Tensor, pk: bool, lora) -> torch.Tensor:
        """x + the attention output o (M, H D) projected (and its adapter terms; normed in a post-norm
        layer)."""
        m = self.model.config.residual_multiplier  # Granite's: the output's weight into the residual
        y = lw.o.add(o, x, pk) if lw.post_attn is None and m == 1.0 else lw.o(o, pk)
        if lora is not None:
            lora.add(i, "o", o, y, self.kernel)
        if m != 1.0:
            return x + y * m
        return y if lw.post_attn is None else x + self._rms(y, lw.post_attn)

    def _mlp(self, i: int, lw, x: torch.Tensor, pk: bool, lora) -> torch.Tensor:
        """x + the MLP of x's RMSNorm (with the tokens' adapter terms on gate/up and down; in a post-norm
        layer, x + the RMSNorm of the MLP of x)."""
        xn = x if lw.norm_mlp is None else self._rms(x, lw.norm_mlp)
        m = self.model.config.residual_multiplier
        if lw.experts is not None:  # a sparse layer (no adapter terms: LoRA leaves an MoE's MLPs be)
            y = self._experts(lw, xn, pk)
            y = y if m != 1.0 or lw.post_mlp is not None else x + y
        else:
            gu = lw.gate_up(xn, pk)
            if lora is not None:
                lora.add(i, "gate_up", xn, gu, self.kernel)
            h = self._act_mul(gu)
            y = lw.down.add(h, x, pk) if lw.post_mlp is None and m == 1.0 else lw.down(h, pk)
            if lora is not None:
                lora.add(i, "down", h, y, self.kernel)
        if m != 1.0:
            return x + y * m
        return y if lw.post_mlp is None else x + self._rms(y, lw.post_mlp)

    def _experts(self, lw, xn: torch.Tensor, pk: bool) -> torch.Tensor:
        """The mixture of experts over xn (M, hidden): each expert's GEMMs over the rows routed to it;
        the experts each row chose kept for the cache's routes where it keeps them."""
        cfg = self.model.config

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return self._swiglu(lw.experts[e], rows)

        chosen = self._chosen
        record = None if chosen is None else lambda _probs, own, _used: chosen.append(own)
        y = mix(xn, lw.router(xn, pk), cfg.num_experts_per_tok, cfg.norm_topk_prob, expert, record=record)
        if lw.shared is None:
            return y
        return y + shared(
            xn, lambda rows: lw.shared_gate(rows, pk), lambda rows: self._swiglu(lw.shared, rows)
        )

    def _swiglu(self, expert: tuple, rows: torch.Tensor) -> torch.Tensor:
        """An expert's (gate_up, down) over `rows`, packed GEMMs where that many rows take them."""
        gate_up, down = expert
        at = self.w.packed_at(rows.shape[0])
        return down(self._act_mul(gate_up(rows, at)), at)

    def _reach(
        self, table_rows, S: int, first: int | None, pos: torch.Tensor, window: int | None, bs: int
    ) -> tuple:
        """What queries at positions `pos` (a column, or (P, n, 1)), the lowest `first` (None: unknown),
        of the rows `table_rows` read of their caches' positions [0, S) in a layer with `window`: the
        gather index of their blocks from the one where `first`'s window starts (k0, `_keys_from`), the
        positions gathered (S - k0), and the additive fp32 mask over them (pos' shape but S - k0 last)."""
        k0 = _keys_from(first, window, bs)
        return self._gather_index(table_rows, S, bs, k0), S - k0, _hidden(self.arange[k0:S], pos, window)

    def _gather_index(self, table_rows: torch.Tensor, S: int, bs: int, k0: int = 0) -> torch.Tensor:
        """(n Hkv nb,) indices into k.view(-1, bs, D) of the nb blocks holding positions [k0, S) (k0 a
        multiple of bs: where a window's reads start) of each of the n rows of table_rows (n, W), per kv
        head, in (row, head, position) order."""
        blocks = table_rows[:, k0 // bs : -(-S // bs)].long()  # (n, nb)
        return (blocks[:, None, :] * self.w.Hkv + self.heads[None, :, None]).reshape(-1)

    # -- decode attention: q (B, H, D) over each row's positions up to S per chunk (gathered from its
    # -- blocks; a windowed layer's from the block where its lowest row's window starts, `_keys_from`);
    # -- returns (B, H D) in the model's dtype. The per-step state: (lo, hi, the positions gathered,
    # -- gather index, mask) per chunk.

    def _bmm_masks(self, pos, chunks, table, r0, bs, window=None) -> list[tuple]:
        """Per chunk, the additive fp32 mask ((hi - lo) Hkv, 1, S - k0) hiding positions past each row's own
        (and those before its `window`; broadcast over the G query heads of a kv head)."""
        out = []
        for lo, hi, S, *first in chunks:
            idx, S, m = self._reach(
                table[r0 + lo : r0 + hi], S, first[0] if first else None, pos[lo:hi, None], window, bs
            )
            out.append(
                (lo, hi, S, idx, m.repeat_interleave(self.w.Hkv, dim=0).view((hi - lo) * self.w.Hkv, 1, S))
            )
        return out

    def _sdpa_masks(self, pos, chunks, table, r0, bs, window=None) -> list[tuple]:
        """Per chunk, the additive mask (hi - lo, 1, 1, S - k0) in the cache's dtype."""
        out = []
        for lo, hi, S, *first in chunks:
            idx, S, m = self._reach(
                table[r0 + lo : r0 + hi], S, first[0] if first else None, pos[lo:hi, None], window, bs
            )
            out.append((lo, hi, S, idx, m.to(self.kv_dtype).view(hi - lo, 1, 1, S)))
        return out

    def _attend_fp32(self, q, ck, cv, state, upcast: bool = False) -> torch.Tensor:
        """fp32 GEMMs (`upcast`: on fp32 copies of a low-precision cache's blocks)."""
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.reshape(B * Hkv, G, D).float()
        outs = []
        for lo, hi, S, idx, m in state:
            k3, v3 = (
                _gather(ck, idx, (hi - lo) * Hkv, S),
                _gather(cv, idx, (hi - lo) * Hkv, S),
            )  # (n Hkv, S, D)
            if upcast:
                k3, v3 = k3.float(), v3.float()
            s = _scores(m, q[lo * Hkv : hi * Hkv], k3.transpose(1, 2), self.w)  # (n Hkv, G, S)
            outs.append(torch.bmm(torch.softmax(s, dim=-1), v3))
        return _cat(outs).reshape(B, self.w.H * D).to(self.w.dtype)

    def _attend_low(self, q, ck, cv, state) -> torch.Tensor:
        """A bf16/fp16 cache: small batches as `_attend_fp32` on upcast copies; larger ones in the cache's
        dtype, the scores as K @ q^T (the faster order for low-precision GEMMs), fp32 softmax."""
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        if B <= self.upcast_max_batch:
            return self._attend_fp32(q, ck, cv, state, upcast=True)
        q = q.reshape(B * Hkv, G, D)
        outs = []
        for lo, hi, S, idx, m in state:
            k3, v3 = _gather(ck, idx, (hi - lo) * Hkv, S), _gather(cv, idx, (hi - lo) * Hkv, S)
            s = torch.bmm(k3, q[lo * Hkv : hi * Hkv].transpose(1, 2)).transpose(1, 2)
            s = (
                torch.add(m, s, alpha=self.w.scale)
                if self.w.softcap is None
                else _cap(s * self.w.scale, self.w) + m
            )
            outs.append(torch.bmm(torch.softmax(s, dim=-1).to(self.w.dtype), v3))
        return _cat(outs).reshape(B, self.w.H * D).to(self.w.dtype)

    def _attend_sdpa(self, q, ck, cv, state) -> torch.Tensor:
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.view(B, Hkv, G, D).to(ck.dtype)  # GQA: the query heads of one kv head -> G queries
        outs = [
            F.scaled_dot_product_attention(
                q[lo:hi],
                _gather(ck, idx, (hi - lo) * Hkv, S).view(hi - lo, Hkv, S, D),
                _gather(cv, idx, (hi - lo) * Hkv, S).view(hi - lo, Hkv, S, D),
                attn_mask=m,
                scale=self.w.scale,
            )
            for lo, hi, S, idx, m in state
        ]
        return _cat(outs).reshape(B, self.w.H * D).to(self.w.dtype)

    def _attend_piece(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of one prefill piece, in fp32: q (n, H, D); k, v (Hkv, S, D) cache views;
        mask (1, n G, S). Returns (n, H D) in the model dtype."""
        n, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.reshape(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D).float()  # rows ordered (n, G)
        s = _scores(mask, q, k.float().transpose(1, 2), self.w)  # (Hkv, n G, S)
        o = torch.bmm(torch.softmax(s, dim=-1), v.float())  # (Hkv, n G, D)
        return o.view(Hkv, n, G * D).transpose(0, 1).reshape(n, Hkv * G * D).to(self.w.dtype)

    def _short_pieces(
        self, offsets: list[int], pieces: Sequence[Span], short: list[int], table, bs: int, windows=(None,)
    ) -> tuple:
        """The per-step state of `_attend_pieces` for pieces `short` (indices into `pieces`, whose first
        tokens are at `offsets` in the step's): P pieces padded to the longest, n_max tokens, attending to
        positions [0, S) of their rows: the tokens' places in that padding (a padded place repeats its
        piece's last token) and the real ones' places in the output, and for each of `windows` the rows'
        blocks from where the earliest piece's window starts (k0), S - k0, the causal mask
        (P Hkv, n_max G, S - k0)."""
        w, dev = self.w, self.w.device
        sel = [pieces[j] for j in short]
        n_max, S = max(n for _, _, n in sel), max(start + n for _, start, n in sel)
        take = [offsets[j] + min(i, pieces[j][2] - 1) for j in short for i in range(n_max)]
        keep = [p * n_max + i for p, (_, _, n) in enumerate(sel) for i in range(n)]
        last = [start + min(i, n - 1) for _, start, n in sel for i in range(n_max)]  # each place's position
        last_t = torch.tensor(last).to(dev, non_blocking=True).view(len(sel), n_max, 1)
        rows = torch.tensor([row for row, _, _ in sel]).to(dev, non_blocking=True)
        per = {}
        for win in windows:
            idx, n, m = self._reach(table[rows], S, min(start for _, start, _ in sel), last_t, win, bs)
            per[win] = (idx, n, m.repeat_interleave(w.G, dim=1).repeat_interleave(w.Hkv, dim=0))
        take_t = torch.tensor(take).to(dev, non_blocking=True)
        keep_t = torch.tensor(keep).to(dev, non_blocking=True)
        return len(sel), n_max, take_t, keep_t, per

    def _attend_pieces(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: tuple, window=None
    ) -> torch.Tensor:
        """Causal attention of several short prefill pieces at once, in fp32, as `_attend_piece` does
        each: q (M, H, D) every token of the step; k, v the layer's cache; `window`: the layer's. Returns
        (their n, H D)."""
        P, n_max, take, keep, per = state
        idx, S, m = per[window]
        Hkv, G, D = self.w.Hkv, self.w.G, self.w.D
        q = q.index_select(0, take).view(P, n_max, Hkv, G, D).transpose(1, 2)  # (P, Hkv, n_max, G, D)
        q = q.reshape(P * Hkv, n_max * G, D).float()
        k3, v3 = _gather(k, idx, P * Hkv, S).float(), _gather(v, idx, P * Hkv, S).float()  # (P Hkv, S, D)
        s = _scores(m, q, k3.transpose(1, 2), self.w)  # (P Hkv, n_max G, S)
        o = torch.bmm(torch.softmax(s, dim=-1), v3).view(P, Hkv, n_max, G * D).transpose(1, 2)
        return o.reshape(P * n_max, Hkv * G * D).index_select(0, keep).to(self.w.dtype)

    # -- the rest of a layer

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as the model's: normalized in fp32 and rounded to the dtype, then times `weight` (for
        bf16 as HF's weight * x.float() ... .to(bf16)); OLMo2's times `weight` in fp32, then rounded."""
        if self.w.scale_fp32:  # (Gemma's `weight`: fp32 1 + w)
            return F.rms_norm(x.float(), (x.shape[-1],), eps=self.w.eps).mul_(weight).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), eps=self.w.eps).mul_(weight)

    def _act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up projection's output (M, 2 I); Gemma's gelu (tanh)."""
        i = gu.shape[1] // 2  # intermediate_size, or an expert's width
        return act_fn(self.model.config)(gu[:, :i]).mul_(gu[:, i:])

    def _token_rows(self, rows: slice, pieces: Sequence[Span]) -> torch.Tensor:
        """(M,) cache row of each token: the decode rows, then each prefill piece's row n times."""
        key = (rows.start, rows.stop)
        base = self._rows_cache.get(key)
        if base is None:
            if len(self._rows_cache) > 1024:
                self._rows_cache.clear()
            base = self._rows_cache[key] = torch.arange(rows.start, rows.stop, device=self.w.device)
        if not pieces:
            return base
        tail = torch.tensor([r for r, _, n in pieces for _ in range(n)]).to(self.w.device, non_blocking=True)
        return torch.cat((base, tail))


def _scores(m: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, w: FusedWeights) -> torch.Tensor:
    """m + scale q kt, batched; with Gemma 2's softcap c, m + c tanh(scale q kt / c) (the mask after the cap)."""
    if w.softcap is None:
        return torch.baddbmm(m, q, kt, alpha=w.scale)
    return _cap(torch.bmm(q, kt).mul_(w.scale), w).add_(m)


def _cap(s: torch.Tensor, w: FusedWeights) -> torch.Tensor:
    """Scores capped by Gemma 2's softcap c: c tanh(s / c), in place."""
    return s.div_(w.softcap).tanh_().mul_(w.softcap)


def _keys_from(first: int | None, window: int | None, bs: int) -> int:
    """The first position to gather for queries at `first` and after (None: unknown): 0, or, in a layer
    with a `window`, the start of the block where the window of `first` begins (whole blocks, so the
    gather reads blocks as they lie)."""
    if window is None or first is None or first + 1 <= window:
        return 0
    return (first + 1 - window) // bs * bs


def _hidden(keys: torch.Tensor, pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The additive fp32 mask of queries at `pos` (a column, or (P, n, 1)) over `keys` (positions): -inf at
    the keys after a query's position and, with a `window`, at those up to its position - window."""
    hide = keys > pos
    if window is not None:
        hide |= keys <= pos - window
    return torch.where(hide, float("-inf"), 0.0)


def _gather(c: torch.Tensor, idx: torch.Tensor, n: int, S: int) -> torch.Tensor:
    """(n, S, D): positions [0, S) of the n (row, kv head)s whose blocks `idx` lists, from cache tensor
    c (blocks, Hkv, bs, D) (a copy: blocks lie anywhere in the pool)."""
    bs, D = c.shape[2], c.shape[3]
    return c.view(-1, bs, D).index_select(0, idx).view(n, -1, D)[:, :S]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _table(cfg, max_context: int, w) -> torch.Tensor:
    """RoPE's (max_context, 2, R) table of cos and sin (sin's first half negated), computed in fp32, in
    the weights' dtype as the model's (bf16 models rotate in bf16); R = rotary_dim, D but for a partial rotary."""
    cos, sin = rope_table(*inv_freq_and_scale(cfg), max_context)
    return torch.stack((cos, sin), dim=1).to(w.device, w.dtype)


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first R dims of each head (cos, sin (M, 1, R), sin's first half negated), the rest as
    they are (Phi-4-mini's partial rotary; R = D elsewhere)."""
    R = cos.shape[-1]
    if R < qk.shape[-1]:
        return torch.cat((_rotate(qk[..., :R], cos, sin), qk[..., R:]), dim=-1)
    half = R // 2
    return torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)
