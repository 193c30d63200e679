"""`CostModel`: seconds for each thing a cluster does, from a `Hardware` and a `ModelShape`.

Decode step (one forward per policy version in the batch; an engine is a tensor-parallel group of
`engine_gpus` devices, so bandwidth and FLOPs scale with it):

    memory  = (weight bytes read + KV bytes of the version's context) / (g * mem_bw * bw_eff)
    compute = (2 * matmul params * batch + attention FLOPs over the context) / (g * peak * flops_eff)
    step    = sum over versions of [max(memory, compute) + step_overhead + 2 * layers * tp_sync (g > 1)]
              + per_seq * batch

Prefill: the same roofline over the prompt tokens admitted at once (attention is causal: a prompt of
p tokens costs p^2/2 context reads). Weight load on an engine: fixed latency + its bytes over the
NIC (each of the g devices receives its 1/g shard in parallel). Train step: (6 + 2 if the old
policy's logprobs are recomputed) * matmul params per token, plus causal attention, at `train_mfu`
of the trainer's peak, plus a fixed per-step overhead; packed sequences by default, or padded
micro-batches like tailrace's own trainer (`micro_batch_tokens`). Publish (trainer side): the bytes over
NVLink of one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tailrace.sim.hardware import Hardware
from tailrace.sim.models import ModelShape
from tailrace.sim.segment import Segment
from tailrace.trainer.packing import micro_batches

BROADCAST_CHUNK = 4 << 20  # bytes a broadcast tree forwards at a time (NCCL's pipelining granularity)


@dataclass(frozen=True)
class CostModel:
    hw: Hardware
    model: ModelShape
    engine_gpus: int = 1  # devices per engine (tensor-parallel group)
    trainer_gpus: int = 1
    recompute_logprobs: bool = True  # the trainer runs a forward of the old policy before its step
    checkpoint_s: float = (
        0.0  # trainer time to write a checkpoint after a publishing step (measured, not modelled)
    )
    micro_batch_tokens: int = (
        0  # > 0: the trainer pads micro-batches (tailrace's trainer); 0: packed sequences
    )
    engines: int = 1  # engines a new version goes to
    broadcast: str = (
        "tree"  # how: a pipelined broadcast tree (NCCL's), or flat (the trainer sends each a copy)
    )
    lora_rank: int = 0  # > 0: versions are adapters of this rank on every projection (a LoRA run)
    # a train step's optimizer updates (train.mini_batches x train.epochs) and its passes over the batch
    train_updates: int = 1
    train_epochs: int = 1
    critic: bool = False  # PPO's critic (train.advantage=gae): a second model of the policy's size trained
    gradient_checkpointing: bool = False  # each pass's forward runs again in its backward (the critic's too)
    reference: bool = False  # a KL penalty (train.loss.kl_coef > 0): the reference's forward each pass

    def __post_init__(self) -> None:
        if self.engine_gpus < 1 or self.trainer_gpus < 1 or self.engines < 1:
            raise ValueError("engine_gpus, trainer_gpus and engines must be at least 1")
        if not 1 <= self.train_epochs <= self.train_updates:
            raise ValueError("train_epochs and train_updates: need 1 <= train_epochs <= train_updates")
        if self.broadcast not in ("tree", "flat"):
            raise ValueError(f"broadcast={self.broadcast!r}: use tree or flat")

    # -- rollout ---------------------------------------------------------------------------------
    @property
    def _bw(self) -> float:
        return self.engine_gpus * self.hw.mem_bw * self.hw.bw_eff

    @property
    def _flops(self) -> float:
        return self.engine_gpus * self.hw.peak_flops * self.hw.flops_eff

    @property
    def forward_overhead(self) -> float:
        tp = 2 * self.model.layers * self.hw.tp_sync_s if self.engine_gpus > 1 else 0.0
        return self.hw.step_overhead_s + tp

    def version_terms(self, batch: int, context: int) -> tuple[float, float, float, float]:
        """(a, b, c, d) of one version's forward: memory a + b k, compute c + d k at step k of a
        segment in which `batch` sequences with `context` tokens in total each gain a token a step."""
        m, bw, fl = self.model, self._bw, self._flops
        kv = m.kv_bytes_per_token(self.hw.dtype_bytes)
        attn = m.attn_flops_per_context_token
        a = m.weight_bytes_read(batch, self.hw.dtype_bytes) / bw + kv * context / bw
        c = 2.0 * m.matmul_params * batch / fl + attn * context / fl
        return a, kv * batch / bw, c, attn * batch / fl

    def decode_segment(self, batch: dict[int, tuple[int, int]]) -> Segment:
        """batch: version -> (running sequences, their total context in tokens)."""
        terms, seqs = [], 0
        for b, ctx in batch.values():
            if b > 0:
                terms.append(self.version_terms(b, ctx))
                seqs += b
        return Segment(
            len(terms) * self.forward_overhead + self.hw.per_seq_s * seqs, tuple(terms), self.hw.host_gap_s
        )

    def spec_factor(self, batch: dict[int, tuple[int, int]], alpha: float, gamma: int) -> float:
        """Time per generated token with speculative decoding over without, at a segment's first step:
        a verify step runs gamma + 1 query tokens per row (compute x (gamma + 1); the weights and the KV
        cache are read once) and yields (1 - alpha^(gamma+1)) / (1 - alpha) tokens per row in
        expectation (alpha: the drafter's acceptance per token). Drafting itself is taken as free (a
        history drafter's suffix walk); below 1, speculation saves time."""
        plain = self.decode_segment(batch)
        g = gamma + 1
        verify = Segment(plain.base, tuple((a, b, c * g, d * g) for a, b, c, d in plain.terms), plain.gap)
        tokens = g if alpha >= 1 else (1 - alpha**g) / (1 - alpha)
        return verify.step_time(0) / (tokens * plain.step_time(0))

    def decode_step_time(self, batch: int, context: int) -> float:
        """One step of one version: `batch` sequences reading `context` tokens in total."""
        return self.decode_segment({0: (batch, context)}).step_time(0)

    def prefill_time(self, lengths: list[int]) -> float:
        """Prefill of sequences of these lengths (prompt, plus any resumed tokens), admitted together."""
        if not lengths:
            return 0.0
        m = self.model
        tokens = sum(lengths)
        flops = 2.0 * m.matmul_params * tokens + m.attn_flops_per_context_token * sum(
            p * p / 2 for p in lengths
        )
        mem = m.weight_bytes_read(tokens, self.hw.dtype_bytes) / self._bw
        return max(mem, flops / self._flops) + self.forward_overhead

    def kv_capacity_tokens(self, reserve: float = 0.1) -> int:
        """Tokens of KV cache an engine holds after its weights (keeping `reserve` of memory free)."""
        free = self.engine_gpus * self.hw.mem_bytes * (1 - reserve) - self.weight_bytes
        return max(0, int(free / self.model.kv_bytes_per_token(self.hw.dtype_bytes)))

    def version_kv_tokens(self) -> int:
        """Tokens of KV cache one more resident policy version displaces (its weights' bytes)."""
        return int(self.version_bytes / self.model.kv_bytes_per_token(self.hw.dtype_bytes))

    # -- weights -----------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        return self.model.params * self.hw.dtype_bytes

    @property
    def version_bytes(self) -> float:
        """What a new version moves and a resident one holds: the weights, or a LoRA run's adapter (rank
        r on q, k, v, o, gate, up and down of every layer: r x (in + out) each; a MoE's experts are
        taken as one dense MLP of `intermediate`)."""
        if not self.lora_rank:
            return self.weight_bytes
        m = self.model
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        per_layer = (m.hidden + q) * 2 + (m.hidden + kv) * 2 + (m.hidden + m.intermediate) * 3
        return self.lora_rank * per_layer * m.layers * self.hw.dtype_bytes

    def load_time(self) -> float:
        """One engine receives and installs a new version, sent to all `engines` at once. Tree: a
        pipelined broadcast (each engine forwards chunks as they arrive), so the bytes cross each link
        once and each level of the binary tree adds a chunk's latency; flat: the trainer's NICs send
        every engine its own copy, sharing their bandwidth."""
        link = self.engine_gpus * self.hw.weight_load_bw
        if self.broadcast == "flat":
            rate = min(link, self.trainer_gpus * self.hw.net_bw / self.engines)
            return self.hw.sync_fixed_s + self.version_bytes / rate
        hops = math.ceil(math.log2(self.engines)) if self.engines > 1 else 0
        per_level = min(BROADCAST_CHUNK, self.version_bytes) / link + self.hw.link_latency_s
        return self.hw.sync_fixed_s + self.version_bytes / link + hops * per_level

    def publish_time(self) -> float:
        """The trainer gathers its shards into one sendable copy (one node's NVLink)."""
        return self.version_bytes / (min(self.trainer_gpus, 8) * self.hw.scaleup_bw)

    # -- training ------------------------------------------------------------------------------------
    def train_flops(self, lengths: list[int]) -> float:
        """FLOPs of one train step over sequences of these lengths (prompt + response). With
        `micro_batch_tokens`, every row is computed at its micro-batch's padded length, micro-batches
        formed as tailrace's trainer forms them (longest first, rows x longest <= micro_batch_tokens)."""
        m = self.model
        # forward 2, backward 4 FLOPs a parameter and token (a LoRA run's frozen base: 2, the input's
        # gradient alone) each pass over the batch, and the old policy's forward when it is recomputed;
        # a critic: its values' forward, and its own forward and backward each pass; gradient
        # checkpointing: each pass's forward once more, in the backward; a KL penalty: the reference's
        # forward each pass
        again = 2.0 if self.gradient_checkpointing else 0.0
        mult = (4.0 if self.lora_rank else 6.0) * self.train_epochs + (
            2.0 if self.recompute_logprobs else 0.0
        )
        mult += (again + (2.0 if self.reference else 0.0)) * self.train_epochs
        mult += (2.0 + (6.0 + again) * self.train_epochs) if self.critic else 0.0
        rows = self.padded(lengths) if self.micro_batch_tokens else lengths
        attn = m.attn_flops_per_context_token * sum(n * n / 2 for n in rows)
        return mult * m.matmul_params * sum(rows) + (mult / 2) * attn

    def padded(self, lengths: list[int]) -> list[int]:
        """Each row's computed length once micro-batches are padded to their longest row."""
        return [lengths[idx[0]] for idx in micro_batches(lengths, self.micro_batch_tokens) for _ in idx]

    def train_time(self, lengths: list[int]) -> float:
        peak = self.trainer_gpus * self.hw.peak_flops * self.hw.train_mfu
        optimizers = 2 if self.critic else 1  # each update steps the critic's too
        return (
            self.train_flops(lengths) / peak + self.hw.train_step_overhead_s * self.train_updates * optimizers
        )
