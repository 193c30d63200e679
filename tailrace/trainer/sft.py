"""Supervised fine-tuning on (prompt ids, response ids) pairs: the warm start's training loop.

Loss is next-token cross-entropy on response tokens only. Batches are length-bucketed (sorted by
length, cut to a token budget, shuffled) so padding stays small without packing unrelated
sequences into one attention window.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from tailrace.model.attention import sdpa_only
from tailrace.trainer.schedule import LRSchedule


def bucket_batches(lengths: Sequence[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped so that (longest in batch) x (batch size) <= batch_tokens; order shuffled."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    device: torch.device,
    prompt_weight: float = 0.0,
):
    """Right-padded (inputs, targets, mask): targets[t] = seq[t+1]; mask 1 on response targets and
    `prompt_weight` on prompt targets (predicting the prompt teaches its structure, e.g. a b c ...)."""
    seqs = [list(p) + list(r) for p, r in pairs]
    T = max(len(s) for s in seqs) - 1
    inp = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    tgt = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.float32)
    for b, ((p, _), s) in enumerate(zip(pairs, seqs)):
        n = len(s) - 1
        inp[b, :n] = torch.tensor(s[:-1])
        tgt[b, :n] = torch.tensor(s[1:])
        mask[b, : len(p) - 1] = prompt_weight
        mask[b, len(p) - 1 : n] = 1.0  # predicting response token j from everything before it
    return inp.to(device), tgt.to(device), mask.to(device)


def sft(
    model: torch.nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    lr: float,
    warmup: int,
    batch_tokens: int,
    epochs: int,
    pad_id: int,
    seed: int,
    bf16: bool = False,
    prompt_weight: float = 0.0,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Train `model` in place; returns the per-step losses. `on_step(step, total, loss)` for progress.
    `bf16` autocasts the forward (weights and optimizer stay fp32): on CPUs with AVX512-BF16 it is
    about twice as fast, since fp32 GEMMs there run through a slower BLAS path. Attention goes through
    SDPA (`sdpa_only`), so a recipe trains the model it always has."""
    device = next(model.parameters()).device
    rng = random.Random(seed)
    lengths = [len(p) + len(r) for p, r in pairs]
    plan = [b for _ in range(epochs) for b in bucket_batches(lengths, batch_tokens, rng)]
    # warmup, then cosine to a tenth (the recipe every default model was built with)
    sched = LRSchedule(lr=lr, warmup=warmup, total=max(1, len(plan)), decay="cosine", floor=0.1)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    model.train()
    losses = []
    with sdpa_only():  # the model the recipe has always trained (model/attention.py)
        for step, idx in enumerate(plan):
            for g in opt.param_groups:
                g["lr"] = sched.lr_at(step)
            inp, tgt, mask = collate([pairs[i] for i in idx], pad_id, device, prompt_weight)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(inp)
            nll = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="none")
            loss = (nll * mask.flatten()).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, len(plan), losses[-1])
    model.eval()
    return losses
