"""Your own trainer on a tailrace run: it pulls each step's batch from the run's store and publishes
the weights the engines generate with next. Start the run with `--train.external=true`, then:

    client = TrainerClient(run_dir)                  # waits for the run, then joins it
    model = AutoModelForCausalLM.from_pretrained(client.start, dtype=torch.float32)
    for batch in client.batches():                   # blocks until the scheduler hands out a step
        tb = batch.tensors()                         # input_ids, targets, mask, adv, behav_logp (B, T)
        ...                                          # your loss, backward, optimizer step
        batch.done(model.state_dict(), {"loss": loss.item()})

The run owns the rollout, the store and what a step trains on (the overlap mode, staleness bound,
filters); your trainer owns the update. `batch.publish`: the engines load your weights as the next
version (pass them whenever it is set); `batch.save`: the run takes a checkpoint after this step, and
`done(state=...)` puts your own tensors in it (an optimizer's: `optimizer_state`); a trainer that
starts later finds them in `client.state`. `batch.replay`: a step the trainer before you did since
that checkpoint (it left); train on it as usual, nothing is published. A LoRA run's weights are an
adapter's on the base `client.start`: build it from `client.peft_config()` or load `client.adapter`,
and pass the PEFT model's state_dict as it is. Run your trainer on the relay's machine (on Ray, the node
RUN/trainer.json names): the weights go through its shared memory. When `batches()` ends,
`client.finished` says whether the run trained all its steps. The relay's side is runtime/relay.py;
examples/external_trainer.py is a whole trainer on transformers (and PEFT).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch

from tailrace.common import InputError, one_line
from tailrace.config.train import FUSED_TARGETS, fused_module
from tailrace.model import fused
from tailrace.model.checkpoint import read_config
from tailrace.model.flat import FlatWeights, Layout
from tailrace.model.moe import as_ours
from tailrace.runtime import checkpoint
from tailrace.runtime.relay import NAME, End, Handshake, Refused, Stepped, Work, receive, send
from tailrace.trainer.batch import TrainBatch
from tailrace.trainer.grpo import batch_of
from tailrace.types import Group, Trajectory


class TrainerClientError(InputError):
    """What your trainer did that the run cannot take; the message names it and the fix."""


class Batch:
    """One step's groups, as the scheduler chose them. Answer each with `done` before the next."""

    def __init__(self, work: Work, client: TrainerClient) -> None:
        self.step, self.groups = work.step, work.groups
        self.trainer_version = work.trainer_version  # your weights' version before this step
        self.publish, self.save, self.replay = work.publish, work.save, work.replay
        self._client, self._t0, self.answered = client, time.perf_counter(), False

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def tensors(self, loss: str | None = None, advantage: str | None = None) -> TrainBatch:
        """The step as padded (B, T) tensors, as the built-in trainer builds them (`grpo.batch_of`):
        `targets[b, t]` is the token at t + 1, `mask` 1 on response tokens (tool observations and tokens
        past train.max_staleness excluded), `behav_logp` the engine's logprob of each target (of logits
        / temperature), `adv` each row's advantage, `scale` the loss's aggregation; with train.routing_replay
        `routes` the experts the engine chose at each position (for `tailrace.model.moe.replaying`, or your
        model's own replay). `loss`, `advantage`: others than the run's train.loss.name and
        train.advantage (null: the loss's own)."""
        cfg = self._client.config
        if loss is not None or advantage is not None:
            cfg = replace(
                cfg, loss=replace(cfg.loss, name=loss or cfg.loss.name), advantage=advantage or cfg.advantage
            )
        moe = read_config(self._client.start) if cfg.routing_replay else None
        return batch_of(self.groups, cfg, self.trainer_version, moe)

    def done(
        self,
        weights: Mapping[str, torch.Tensor] | None = None,
        metrics: Mapping[str, float] | None = None,
        state: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        """The step is trained: `weights` (your model's state_dict, by the run's model's names, which
        transformers' Llama and Qwen2 use) are required when `publish` or `save`; `metrics` go into the step's
        record (numbers); `state` (or a function returning it) is saved when `save`."""
        if self.answered:
            raise TrainerClientError(f"step {self.step} was answered already: call done() once per batch")
        c = self._client
        staged = self.publish or self.save  # the engines load them, or the checkpoint holds them
        if staged:
            if weights is None:
                why = f"publishes version {self.trainer_version + 1}" if self.publish else "is checkpointed"
                raise TrainerClientError(
                    f"step {self.step} {why}: pass your weights, batch.done(model.state_dict(), ...)"
                )
            t0 = time.perf_counter()
            c.flatten(weights)  # into the staging file the run's trainer process reads
            c.staged_s = time.perf_counter() - t0
        figures = {
            "tokens": sum(t.length for t in self.trajectories),
            "time_s": time.perf_counter() - self._t0,
        }
        figures.update({k: float(v) for k, v in (metrics or {}).items()})
        saved = None
        if self.save and state is not None:
            saved = {
                k: t.detach().cpu().contiguous() for k, t in (state() if callable(state) else state).items()
            }
        c.answer(Stepped(self.step, figures, staged, saved))
        self.answered = True


class TrainerClient:
    """Your trainer's connection to the run in `run_dir` (started with --train.external=true). It waits
    up to `wait_s` for the run to listen; one trainer at a time."""

    def __init__(self, run_dir: str | Path, wait_s: float = 600.0) -> None:
        self.run_dir = run_dir = Path(run_dir)
        self.conn: Connection = _dial(run_dir, time.monotonic() + wait_s)
        hello = self._recv()
        if not isinstance(hello, Handshake):
            raise TrainerClientError(
                f"{run_dir}: the run sent {type(hello).__name__} instead of its handshake"
            )
        if hello.machine != socket.gethostname() or not Path(hello.staging).is_file():
            self.conn.close()
            raise TrainerClientError(
                f"{run_dir}: the run's trainer process is on {hello.machine}, and your trainer hands it "
                f"the weights through that machine's memory ({hello.staging}): start your trainer there"
            )
        self.start = hello.start  # a HF checkpoint directory: load your model from it
        self.state = hello.state  # your tensors from the checkpoint it belongs to ({} at a fresh start)
        self.steps_done = hello.steps_done  # steps trained: at the start, then the run's at its end
        self.finished: bool | None = None  # once `batches()` ends: the run trained all its steps
        # (False: it stopped before, `tailrace train --resume` goes on; None: it has not ended)
        self.temperature, self.pad_id = hello.temperature, hello.pad_id
        self.config = hello.train  # the run's TrainerConfig, lr resolved
        self.train = asdict(hello.train)  # the same as a dict
        self.layout, self.numel = hello.layout, hello.numel
        # a LoRA run (config.lora.rank > 0): the weights are an adapter's on the base `start`; start from
        # `adapter` (a PEFT directory; None: a fresh one), built as `peft_config()` says
        self.adapter = hello.adapter
        self.dtype = getattr(torch, hello.dtype)
        self.cores, self.threads = hello.cores, hello.threads
        # the weights you publish go into this shared-memory file (the run's trainer process copies them
        # into the engines' ring): no pickling, no socket; one copy of your state_dict
        self.staging = torch.from_file(hello.staging, shared=True, size=self.numel, dtype=self.dtype)
        self.staged_s = 0.0  # how long the last weights took to lay out there
        self._open: Batch | None = None

    def pin(self) -> None:
        """Run this process on the run's trainer cores, with the built-in trainer's torch threads: the
        engines keep off them (on a small machine, a trainer on the engines' cores slows both)."""
        if self.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(self.cores))
        torch.set_num_threads(self.threads)

    def batches(self) -> Iterator[Batch]:
        """Each step's batch, as the run hands them out, until the run ends: `finished` then says
        whether it trained all its steps or stopped before, `steps_done` how many it trained."""
        while True:
            if self._open is not None and not self._open.answered:
                raise TrainerClientError(f"step {self._open.step} is not answered: call batch.done() first")
            msg = self._recv()
            if isinstance(msg, End):
                self.steps_done, self.finished = msg.steps_done, msg.finished
                return
            self._open = Batch(msg, self)
            yield self._open

    def peft_config(self):
        """A LoRA run's adapter as `peft.LoraConfig` (rank, alpha, targets; no dropout, no bias): the
        adapter your PEFT model must have for the engines to generate with it as you train it."""
        lc = self.config.lora
        if not lc.rank:
            raise TrainerClientError("this run trains the whole model (train.lora.rank=0): it has no adapter")
        from peft import LoraConfig

        targets = list(lc.targets)
        if fused.fused(
            read_config(self.start)
        ):  # Phi-3: PEFT adapts its fused modules (whole: Session checks)
            targets = sorted({fused_module(t) for t in targets})
        return LoraConfig(r=lc.rank, lora_alpha=lc.alpha, target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")  # fmt: skip

    def flatten(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`weights` laid out as the engines hold them, in the staging file (`flatten_weights`)."""
        return flatten_weights(weights, self.layout, self.numel, self.dtype, self.start, out=self.staging)

    def answer(self, msg: Stepped) -> None:
        try:
            send(self.conn, msg)
        except OSError:
            raise self._gone() from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _gone(self) -> TrainerClientError:
        return TrainerClientError(
            f"the run in {self.run_dir} went away: it stopped (its console and errors.log say why) or "
            "its trainer process was replaced; start your trainer again: it joins the run, or the "
            "resumed one (tailrace train --resume), from the newest checkpoint"
        )

    def _recv(self):
        try:
            msg = receive(self.conn)
        except (EOFError, OSError):
            raise self._gone() from None
        if isinstance(msg, Refused):
            raise TrainerClientError(f"the run refused your trainer: {msg.line}")
        return msg


def flatten_weights(
    weights: Mapping[str, torch.Tensor],
    layout: Layout,
    numel: int,
    dtype: torch.dtype,
    source: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`weights` (a state_dict by the run's model's names) as one 1-D buffer of `numel` values laid out
    by `layout` (name, shape, offset; tied names share their slice), written into `out` when given.
    `source`: the checkpoint the model should come from, for the error. Everything is checked before
    anything is written."""
    weights = _by_run_names(weights, layout)
    missing = [n for n, _, _ in layout if n not in weights]
    if missing:
        what = (
            "of your PEFT model (get_peft_model(model, client.peft_config())) on the base"
            if ".lora_" in missing[0]
            else "of a model loaded from"
        )
        raise TrainerClientError(
            f"the weights lack {missing[0]!r} ({len(missing)} of {len(layout)} names): pass the state_dict "
            f"{what} {source} (transformers' and PEFT's names are the run's)"
        )
    for name, shape, _ in layout:
        t = weights[name]
        if tuple(t.shape) != tuple(shape):
            raise TrainerClientError(
                f"weights[{name!r}] has shape {tuple(t.shape)}, the run's model {tuple(shape)}: the model is "
                f"not the one in {source}"
            )
    flat = FlatWeights(torch.empty(numel, dtype=dtype) if out is None else out, layout)
    for name, view in flat.views().items():
        view.copy_(weights[name].detach())
    return flat.buffer


_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.*\.lora_[AB])\.[^.]+(\.weight)$")
_FUSED_KEY = re.compile(r"^(.*\.)(" + "|".join(FUSED_TARGETS) + r")(\.(?:lora_[AB]\.)?weight)$")


def _by_run_names(weights: Mapping[str, torch.Tensor], layout: Layout) -> Mapping[str, torch.Tensor]:
    """`weights` with a PEFT model's adapter keys (`base_model.model.<name>.lora_A.<adapter>.weight`)
    under the run's names (`<name>.lora_A.weight`), for a LoRA run's layout; and a fused model's
    (transformers' Phi-3: `qkv_proj`, `gate_up_proj`) split into the run's projections: a weight or a
    B by rows, an A (PEFT's one per fused module) the same for each; transformers 5's experts of a
    mixture of experts (one 3-D weight for all) one matrix each, and Mixtral's and Granite's names ours;
    others as they are."""
    out = as_ours(weights)
    if any(".lora_" in n for n, _, _ in layout):
        for key, t in weights.items():
            m = _PEFT_KEY.match(key)
            if m and m[1] + m[2] not in weights:
                out[m[1] + m[2]] = t
    shapes = {n: shape for n, shape, _ in layout}
    for key, t in list(out.items()):
        m = _FUSED_KEY.match(key)
        if m is None:
            continue
        parts = [f"{m[1]}{p}{m[3]}" for p in FUSED_TARGETS[m[2]]]
        if not all(p in shapes for p in parts):  # a group the run adapts in part: left to be named missing
            continue
        if m[3] == ".lora_A.weight":
            out.update((p, t) for p in parts)
        elif t.shape[0] == sum(shapes[p][0] for p in parts):
            out.update(zip(parts, torch.split(t, [shapes[p][0] for p in parts])))
    return out


def _dial(run_dir: Path, deadline: float) -> Connection:
    """The run's relay, once it listens: a run still starting, or one whose files an earlier process
    left (a killed run being resumed), is tried again until `deadline`."""
    while True:
        try:
            where = json.loads((run_dir / f"{NAME}.json").read_text())
            return Client((where["host"], int(where["port"])), authkey=(run_dir / f"{NAME}.key").read_bytes())
        except (OSError, ValueError, KeyError, AuthenticationError) as e:
            if time.monotonic() > deadline:
                raise TrainerClientError(
                    f"{run_dir}: no run waits for a trainer there ({one_line(e)}); start one with tailrace "
                    "train --train.external=true (or --resume it), or pass its run directory"
                ) from None
        time.sleep(0.2)


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """`opt`'s per-parameter state as flat tensors, as the built-in trainer's checkpoints hold it
    (`state.<index>.<name>`; copies, which the optimizer's next step leaves alone), for
    `Batch.done(state=)`; its hyperparameters are your config's, not saved."""
    return {k: t.clone() for k, t in checkpoint.optimizer_tensors(opt.state_dict()["state"]).items()}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """The state `optimizer_state` saved, back into `opt` (built over the same parameters)."""
    state = checkpoint.optimizer_state(dict(tensors))
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


__all__ = [
    "Batch",
    "Group",
    "TrainerClient",
    "TrainerClientError",
    "flatten_weights",
    "load_optimizer_state",
    "optimizer_state",
]
