"""`DraftNet`: the online-trained drafter's own weights -- 1-2 decoder layers and a final norm on top of
the policy's token embeddings, read out through the policy's LM head (TLT).

The embeddings and head are never the net's: every forward takes them from the live policy version,
frozen, so the net has no vocab-sized parameters and follows each weight update's embeddings at once.
Its layers are tailrace's own `DecoderLayer`s, in the target's width and heads (so its k/v fit the
engine's paged cache layout), initialized from the target's first layers and its final norm: before
any training the net is the policy cut after its first layers ("early exit"). It trains in fp32 with
its own AdamW on next-token cross-entropy over recent rollouts' responses (the policy's own sampled
tokens: self-distillation), the prompt as context only.

`draft_model` builds, per policy version, the `CausalLM` the engine's backend runs for drafting: the
net's layers (copied, in the engine's dtype) between that version's embeddings and head (shared).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.decoder import CausalLM, DecoderLayer, RMSNorm, local_rotary, run_layers
from tailrace.model.decoder import embed as scale_embed
from tailrace.model.decoder import logits as scale_logits
from tailrace.model.rope import Rotary

LR = 3e-3
TOKENS_PER_STEP = 2048  # a training step's batch: random recent responses while, padded, it holds this many


class DraftNet(nn.Module):
    def __init__(self, target: CausalLM, layers: int):
        """`layers` decoder layers shaped as `target`'s, initialized from its first ones (fp32, CPU or
        the target's device)."""
        super().__init__()
        norope, types, dense = (
            target.config.no_rope_layers,
            target.config.layer_types,
            target.config.mlp_only_layers,
        )
        self.config = dataclasses.replace(
            target.config, num_hidden_layers=layers, no_rope_layers=norope and norope[:layers],
            layer_types=types and types[:layers], mlp_only_layers=tuple(i for i in dense if i < layers),
        )  # fmt: skip
        dev = target.model.embed_tokens.weight.device
        self.layers = nn.ModuleList(DecoderLayer(self.config, i) for i in range(layers))
        c = self.config  # the target's final norm as it is (OLMo2's scales in fp32, Gemma's by 1 + w)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, scale_fp32=c.post_norms, offset=c.norm_offset)
        with torch.no_grad():
            for mine, theirs in zip(self.layers, target.model.layers):
                for p, q in zip(mine.parameters(), theirs.parameters()):
                    p.copy_(q)
            self.norm.weight.copy_(target.model.norm.weight)
        self.to(dev, torch.float32)
        self.rotary = Rotary(self.config).to(dev)
        self.local_rotary = local_rotary(self.config)
        if self.local_rotary is not None:
            self.local_rotary.to(dev)
        self.opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    def forward(self, ids: torch.Tensor, embed: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V), reading the policy's `embed` (V, hidden) and `head` (V, hidden)."""
        x = scale_embed(F.embedding(ids, embed), self.config)  # (B, T, hidden)
        x = run_layers(self.layers, x, self.rotary, self.local_rotary, ids.shape[1])
        return scale_logits(F.linear(self.norm(x), head), self.config)

    def loss(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]], embed, head) -> torch.Tensor:
        """Mean next-token cross-entropy over the response tokens of (prompt, response) pairs."""
        ids, mask = _pack(batch, self.config.context_limit, self.rotary.cos.device)
        logits = self(ids[:, :-1], embed, head)
        nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        m = mask[:, 1:].flatten()
        return (nll * m).sum() / m.sum().clamp_min(1)

    def train_step(
        self, data: Sequence[tuple[Sequence[int], Sequence[int]]], embed, head, rng: random.Random
    ) -> float:
        """One AdamW step on a random batch of `data` (at most TOKENS_PER_STEP tokens padded, or one
        response); returns its loss.
        `embed`, `head`: fp32 tensors usable by autograd (not inference tensors), not trained."""
        picks, longest, cap = [], 0, self.config.context_limit
        for i in rng.sample(range(len(data)), len(data)):
            n = min(cap, len(data[i][0]) + len(data[i][1]))
            if picks and (len(picks) + 1) * max(longest, n) > TOKENS_PER_STEP:
                break
            picks.append(data[i])
            longest = max(longest, n)
        with torch.inference_mode(False), torch.enable_grad():
            loss = self.loss(picks, embed, head)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return loss.item()

    @torch.inference_mode()
    def draft_model(self, version: CausalLM) -> CausalLM:
        """The drafting model for one policy version: this net's layers (copied, in `version`'s dtype)
        between its embeddings and head (shared)."""
        with torch.device("meta"):
            m = CausalLM(self.config)
        w = version.model.embed_tokens.weight
        state = {f"model.{k}": t.detach().to(w.dtype, copy=True) for k, t in self.state_dict().items()}
        state["model.embed_tokens.weight"] = w
        state["lm_head.weight"] = version.lm_head.weight
        m.load_state_dict(state, assign=True)
        m.lm_head.weight = version.lm_head.weight  # tied or not, the version's head
        return m.to(w.device, w.dtype).eval().requires_grad_(False)

    @torch.inference_mode()
    def copy_into(self, m: CausalLM) -> None:
        """Refresh a `draft_model`'s layers from this net's current weights."""
        for k, t in self.state_dict().items():
            m.get_parameter(f"model.{k}").copy_(t)


def _pack(batch, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T) of prompt + response, cut at max_len, and a mask of the response tokens."""
    seqs = [(tuple(p) + tuple(r))[:max_len] for p, r in batch]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    mask = torch.zeros(len(seqs), T)
    for i, ((p, _), s) in enumerate(zip(batch, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(p) : len(s)] = 1.0
    return ids.to(device), mask.to(device)
