"""`QuantDrafter`: the live policy, quantized, drafts for itself (EfficientRollout's self-speculation).

Per version the engine holds, a quantized copy of its weights on the engine's own backend, rebuilt at
every `load` (a weight update): int8, the backend's fused layer weights rounded per output row
(`FusedWeights(int8=True)`; on CPU with AVX-512 BF16 they stay int8 and run on the C int8 GEMM, half
the bytes a bf16 step reads); int4, `quant.quantized_copy` (dequantized values). The LM head and
embeddings are the policy's own precision. A draft of k tokens is k forward steps of that copy over the
drafting rows, each a one-token piece of its row at the next position, on the target's own KV cache:
the prefix's k/v are the target's (exact, and no prefill or catch-up of a drafter cache), and the
copy's k/v for the drafted positions go where the verify writes the target's next, before anything
reads them. Each draft token is the copy's argmax of (processed logits + the noise the target will use
at that position) -- the same Gumbel noise, so copy and target agree wherever quantization leaves the
perturbed argmax alone, and acceptance stays near 1 for int8.
"""

from __future__ import annotations

import torch

from tailrace.engine.rows import TOK, TOP_P_OFF
from tailrace.engine.sampler import SampleFlags, sample
from tailrace.engine.spec.drafter import DraftEnv, DraftRow
from tailrace.engine.spec.quant import quantized_copy
from tailrace.model.decoder import CausalLM

INT8_COST = 0.6  # a draft step on the int8 GEMM over a bf16 decode step, at a few rows (bench/README.md)
INT8_ALPHA = 0.9  # int8 RTN drafts' acceptance before any is verified (tests: > 0.85 on the tiny model)


class QuantDrafter:
    per_token_cost = True

    def __init__(self, env: DraftEnv, bits: int = 8):
        self.name, self.env, self.bits = f"quant{bits}", env, bits
        self._backends: dict[int, object] = {}
        # the engine's first version now, not inside the first draft: its quantization would be timed as
        # that draft's cost, and a draft step thought to cost a second is never tried again
        self.load(0, env.model_of(0))
        # what the toggle assumes before it has timed a draft or verified one (speculator.py): a draft
        # step on the int8 GEMM reads half the layers' bytes (the LM head, attention and the draw do not
        # shrink); on dequantized weights it costs a target step, and the toggle never tries it
        on_int8 = any(layer.qkv.ks is not None for layer in self._backends[0].w.layers)
        self.cost_prior = INT8_COST if on_int8 else 1.0
        self.alpha_prior = INT8_ALPHA if bits == 8 else None

    def load(self, version: int, model: CausalLM) -> None:
        if self.bits == 8:  # the backend rounds its fused layer weights to int8 (the C int8 GEMM, on CPU)
            self._backends[version] = self.env.make_backend(model, int8=True)
        else:
            self._backends[version] = self.env.make_backend(quantized_copy(model, self.bits))

    def drop(self, version: int) -> None:
        self._backends.pop(version, None)

    def train(self, budget_s: float) -> None:
        return None  # its weights are the policy's

    def add_history(self, prompt, tokens) -> None:
        pass  # drafts from weights

    def release(self, request_id: str) -> None:
        pass

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        for v in sorted({r.version for r in rows}):
            idx = [i for i, r in enumerate(rows) if r.version == v]
            if v not in self._backends:
                self.load(v, self.env.model_of(v))
            for i, toks in zip(idx, self._draft(self._backends[v], [rows[i] for i in idx])):
                out[i] = toks
        return out

    def _draft(self, backend, rows: list[DraftRow]) -> list[list[int]]:
        env, dev = self.env, self.env.cache.device
        at = torch.tensor([r.row for r in rows]).to(dev)  # cache rows
        pos = torch.tensor([r.position for r in rows]).to(dev)
        k = [r.k for r in rows]
        args = env.rows.sampling_args(at)
        flags = sampling_flags(args, env.rows.vocab_size)
        tok = env.rows.ints[at, TOK]
        drafts = torch.zeros(len(rows), max(k), dtype=torch.int64, device=dev)
        live = list(range(len(rows)))
        for j in range(max(k)):
            keep = [n for n, i in enumerate(live) if k[i] > j]
            if len(keep) < len(live):  # rows whose draft is complete drop out
                sel = torch.tensor(keep).to(dev)
                live = [live[n] for n in keep]
                tok, pos = tok[sel], pos[sel]
                args = {key: a[sel] for key, a in args.items()}
            pieces = [(rows[i].row, rows[i].position + j, 1) for i in live]
            want = torch.arange(len(live), device=dev)
            logits = backend.forward(tok, pos + j, env.cache, slice(0, 0), [], pieces, want)
            tok, _ = sample(
                logits, salt=env.salt, flags=flags, kernel=env.kernel, **dict(args, index=args["index"] + j)
            )
            drafts[torch.tensor(live).to(dev), j] = tok
        return [d[:n] for d, n in zip(drafts.tolist(), k)]


def sampling_flags(args: dict[str, torch.Tensor], vocab_size: int) -> SampleFlags:
    """The sampler's flags for rows with these sampling arguments (one host read)."""
    sampled = args["noise_scale"] > 0
    tempered = (args["inv_temp"] != 1) & sampled
    filtered = (args["top_k"] < vocab_size) | (args["top_p"] < TOP_P_OFF)
    banning = args["min_new"] > 0
    s, g, t, f, b, plain = (
        torch.stack([sampled.any(), (~sampled).any(), tempered.any(), filtered.any(), banning.any(),
                     (~(filtered | banning)).any()]).tolist()
    )  # fmt: skip
    return SampleFlags(
        any_sampled=s, any_greedy=g, any_tempered=t, any_filter=f, any_min_new=b, any_plain=plain
    )
