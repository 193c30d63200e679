"""`TrainedDrafter`: a small model drafts, trained online on the engine's own rollouts (TLT).

The model is a `DraftNet` (1-2 decoder layers over the live policy's embeddings and head). It learns
from the responses the engine is fed through `add_history` (those it finishes, and those the runtime
relays), in the engine's idle time only (`train`, called by `Engine.idle` with a time budget), so
it tracks the policy as it moves; a weight load gives every version's drafting model that version's
embeddings and head at once, the layers follow at the next idle period.

Drafting runs the drafting model on the engine's own backend and kernels over a small paged KV cache
of its own: the same blocks as the engine's pool (read through the engine's block table, so it needs
no paging of its own), one layer pair instead of the target's L. A request's drafter k/v are written
up to its last real token; a draft first catches up the tokens since (one prefill piece: usually the
accepted drafts and the target's correction), then runs k-1 one-token steps. Recomputing a window per
draft instead would run k forwards over the window (k x W tokens) where this runs about k tokens.
Each draft token is argmax(draft logits + the noise the target will use at that position), the same
Gumbel noise (see `selfdraft`), so drafter and target agree wherever their perturbed argmaxes do.
Memory: its cache adds `layers`/L of the engine's KV pool, outside `kv_memory_gb`'s budget.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence

import torch

from tailrace.engine.sampler import sample
from tailrace.engine.spec.drafter import DraftEnv, DraftRow, Trained
from tailrace.engine.spec.draftnet import DraftNet
from tailrace.engine.spec.selfdraft import sampling_flags
from tailrace.model.decoder import CausalLM

WINDOW = 512  # recent responses kept to train on


class TrainedDrafter:
    per_token_cost = True

    def __init__(self, env: DraftEnv, layers: int = 1, seed: int = 0):
        n = env.model_of(0).config.num_hidden_layers
        if not 1 <= layers <= n:
            raise ValueError(f"a trained drafter of {layers} layers over a {n}-layer policy: use 1..{n}")
        self.name = "trained" if layers == 1 else f"trained{layers}"
        self.env, self.layers = env, layers
        self.net: DraftNet | None = None  # built from the first version it drafts or trains for
        self.cache = None  # its KV pool (built with the net)
        self._models: dict[int, tuple[CausalLM, object]] = {}  # version -> (drafting model, backend)
        self._versions = {0}  # the engine's versions; the newest is live: training reads its embeddings
        self._readout: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, embed, head) fp32
        self._written: dict[str, int] = {}  # request -> positions whose drafter k/v hold its tokens
        self.data: deque[tuple[tuple[int, ...], tuple[int, ...]]] = deque(maxlen=WINDOW)
        self._rng = random.Random(seed)

    # -- the Drafter interface ----------------------------------------------------------------------

    def add_history(self, prompt: tuple[int, ...], tokens: Sequence[int]) -> None:
        if tokens:
            self.data.append((tuple(prompt), tuple(tokens)))

    def load(self, version: int, model: CausalLM) -> None:
        """`version` has new weights: its drafting model takes their embeddings and head now."""
        self._versions.add(version)
        self._models.pop(version, None)
        self._written.clear()  # drafter k/v of the old embeddings: drafts would still be exact, but poor
        if self._readout and self._readout[0] == version:
            self._readout = None

    def drop(self, version: int) -> None:
        self._versions.discard(version)
        self._models.pop(version, None)

    def release(self, request_id: str) -> None:
        self._written.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        for v in sorted({r.version for r in rows}):
            idx = [i for i, r in enumerate(rows) if r.version == v]
            for i, toks in zip(idx, self._draft(self._model(v), [rows[i] for i in idx])):
                out[i] = toks
        return out

    # -- training -----------------------------------------------------------------------------------

    def train(self, budget_s: float) -> Trained | None:
        """Train on recent responses for at most about `budget_s` seconds (whole steps: the last may
        end past it by one step's time); then every drafting model takes the new layers."""
        if not self.data or budget_s <= 0:
            return None
        t0 = time.perf_counter()
        self._ensure_net()
        _, embed, head = self._readout_weights()
        data, steps, loss = list(self.data), 0, float("nan")
        while not steps or time.perf_counter() - t0 < budget_s:
            loss = self.net.train_step(data, embed, head, self._rng)
            steps += 1
        for m, backend in self._models.values():
            self.net.copy_into(m)
            backend.refresh()
        self._written.clear()
        return Trained(steps, time.perf_counter() - t0, loss)

    def _readout_weights(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The live version's embeddings and head as fp32 tensors autograd may read (the engine's are
        inference tensors, possibly bf16), copied once per version."""
        live = max(self._versions)
        if self._readout is None or self._readout[0] != live:
            m = self.env.model_of(live)
            with torch.inference_mode(False):
                e = m.model.embed_tokens.weight.detach().to(torch.float32, copy=True)
                h = m.lm_head.weight.detach().to(torch.float32, copy=True)
            self._readout = (live, e, h)
        return self._readout

    # -- drafting -----------------------------------------------------------------------------------

    def _ensure_net(self) -> None:
        if self.net is None:  # normal tensors (propose runs in inference mode), so training may use them
            with torch.inference_mode(False):
                self.net = DraftNet(self.env.model_of(max(self._versions)), self.layers)
            self.cache = self.env.cache.sibling(self.layers)

    def _model(self, v: int) -> tuple[CausalLM, object]:
        if v not in self._models:
            self._ensure_net()
            m = self.net.draft_model(self.env.model_of(v))
            self._models[v] = (m, self.env.make_backend(m))
        return self._models[v]

    def _draft(self, model: tuple[CausalLM, object], rows: list[DraftRow]) -> list[list[int]]:
        """k steps of the drafting model: a catch-up piece per row (its tokens since its drafter k/v
        end, through its input token), then one-token pieces of the drafted tokens."""
        env, dev, backend = self.env, self.env.cache.device, model[1]
        at = torch.tensor([r.row for r in rows]).to(dev)
        args = env.rows.sampling_args(at)
        flags = sampling_flags(args, env.rows.vocab_size)
        k = [r.k for r in rows]
        pieces, ids = [], []
        for r in rows:
            seq = r.prompt + tuple(r.tokens)  # positions 0..r.position
            w = min(self._written.get(r.request_id, 0), r.position)
            pieces.append((r.row, w, r.position + 1 - w))
            ids += seq[w:]
            self._written[r.request_id] = r.position + 1
        want = torch.tensor(list(_ends(pieces))).to(dev)
        tok = torch.tensor(ids).to(dev)
        pos = torch.tensor([p for _, w, n in pieces for p in range(w, w + n)]).to(dev)
        drafts = torch.zeros(len(rows), max(k), dtype=torch.int64, device=dev)
        live = list(range(len(rows)))
        for j in range(max(k)):
            if j:  # the tokens drafted last, at the next positions
                keep = [n for n, i in enumerate(live) if k[i] > j]
                if len(keep) < len(live):  # rows whose draft is complete drop out
                    sel = torch.tensor(keep).to(dev)
                    live = [live[n] for n in keep]
                    tok = tok[sel]
                    args = {key: a[sel] for key, a in args.items()}
                pieces = [(rows[i].row, rows[i].position + j, 1) for i in live]
                pos = torch.tensor([p for _, p, _ in pieces]).to(dev)
                want = torch.arange(len(live), device=dev)
            logits = backend.forward(tok, pos, self.cache, slice(0, 0), [], pieces, want)
            tok, _ = sample(
                logits, salt=env.salt, flags=flags, kernel=env.kernel, **dict(args, index=args["index"] + j)
            )
            drafts[torch.tensor(live).to(dev), j] = tok
        return [d[:n] for d, n in zip(drafts.tolist(), k)]


def _ends(pieces: list[tuple[int, int, int]]):
    """Index of each piece's last token in the concatenated pieces."""
    off = 0
    for _, _, n in pieces:
        off += n
        yield off - 1
