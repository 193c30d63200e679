"""A trainer of your own (`train.external`): the run's trainer process is a relay, and your trainer
pulls each step's batch from it (`tailrace.client.TrainerClient`, in a process you start).

The driver and the scheduler do not know the difference: the relay takes `TrainOrder`s and answers
`TrainerReport`s as the built-in trainer does, writes published weights into the engines' ring, and
writes the trainer's part of each checkpoint. What it relays:

    relay --Handshake--> your trainer     where to start: a HF checkpoint directory, your own state
                                          as you saved it there, the layout the weights must fill
    relay --Work-------> your trainer     a step's groups (the scheduler chose them from its store)
    relay <--Stepped---- your trainer     its metrics, your state when the step is checkpointed; its
                                          weights, when the step publishes or is checkpointed, it has
                                          written into a shared-memory file the relay copies from

It listens on loopback (on Ray: the address its actor's node is known by, which the driver reached
it at), authenticated by a key made for the run: RUN_DIR/trainer.json (address) and RUN_DIR/trainer.key,
both mode 0600, so only the run's owner can train it. One trainer at a time, on the relay's machine
(the weights go through its shared memory): on Ray, the node trainer.json names.

Your trainer may come and go: until one is connected the engines keep generating up to the run's
staleness bound and the step waits. One that leaves (its process ended, its connection broke, or it
sent what the relay refuses) is waited for again; the next one starts from the newest checkpoint the
relay saved and first redoes the steps since (`Batch.replay`: train them, publish nothing), so its
weights and state are the ones the lost one had. Nothing the run produced is lost.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from tailrace.common import InputError, one_line
from tailrace.config import TrainerConfig
from tailrace.config.train import auto_lr
from tailrace.model import lora
from tailrace.model.checkpoint import load_pretrained
from tailrace.model.flat import Layout, flatten_parameters
from tailrace.runtime.checkpoint import read_state, save_external, steps_of
from tailrace.runtime.join import LOOPBACK, listen, unlisten, write_private
from tailrace.runtime.messages import Ready, Shutdown, TrainerReport, TrainOrder
from tailrace.runtime.procs import pin
from tailrace.runtime.shared_base import SharedBase
from tailrace.runtime.weights import SharedWeights
from tailrace.runtime.workers import serving
from tailrace.types import Group

NAME = "trainer"  # RUN/trainer.json (where the relay listens) and RUN/trainer.key (join.listen)
SAVED_S = 30.0  # how long a new trainer waits for the driver to make the last saved checkpoint whole


# -- what the relay and your trainer say to each other ---------------------------------------------


@dataclass(frozen=True)
class Handshake:
    """To a trainer that connected: where its model and state start, and what the weights must fill."""

    start: str  # a HF checkpoint directory: the weights the engines hold of `steps_done`
    state: dict[str, torch.Tensor]  # your trainer's state as you saved it there ({}: a fresh start)
    steps_done: int  # optimizer steps in `start`
    layout: Layout  # every name the weights need: its shape and offset
    numel: int  # values in the published weights (tied names share their offset)
    staging: str  # a shared-memory file of `numel` values: your trainer writes the weights it publishes there
    machine: str  # the relay's host name: your trainer runs there (the staging file is its memory)
    dtype: str  # the engines' weights dtype ("float32")
    temperature: float  # the rollout's: the recorded logprobs are of logits / temperature
    pad_id: int
    train: TrainerConfig  # the run's train section, to use as you see fit; lr resolved (train.lr null:
    # by the model's size, as the built-in trainer's)
    cores: tuple[int, ...]  # the run's trainer cores (this machine's): yours, as the engines keep off them
    threads: int  # torch threads the built-in trainer would run there
    adapter: str | None = None  # a LoRA run's (train.lora.rank > 0): the PEFT adapter directory to start
    # from on the base `start` (None: a fresh adapter); the weights you publish are the adapter's alone


@dataclass(frozen=True)
class Work:
    """One optimizer step: train on `groups`; publish the weights when `publish` (the engines load them
    as the next version); with `save` the run checkpoints after it: your weights (published or not)
    and your state go into the checkpoint."""

    step: int
    groups: tuple[Group, ...]
    trainer_version: int  # the version your weights are at before this step
    publish: bool
    save: bool
    replay: bool  # a step the lost trainer did since the last checkpoint: train it, publish nothing


@dataclass(frozen=True)
class Stepped:
    step: int
    metrics: dict[str, float]
    staged: bool  # your weights after the step are in the staging file (asked when it publishes or saves)
    state: dict[str, torch.Tensor] | None  # with `save`


@dataclass(frozen=True)
class Refused:
    """The relay refuses what your trainer sent (the line names it and the fix); it waits for another."""

    line: str


@dataclass(frozen=True)
class End:
    """No more batches: the run trained its last step (`finished`), or it stopped before (SIGTERM, a
    time limit, a failure; `tailrace train --resume` goes on). `steps_done`: the run's trained steps."""

    steps_done: int
    finished: bool


def send(conn: Connection, msg: object) -> None:
    """By the standard pickler: a `Connection`'s own would hand torch tensors over as shared memory,
    which only a process of the same family may open."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


# -- the relay (the run's trainer process) ----------------------------------------------------------


class Relay:
    def __init__(self, run_dir: Path, ckpt: Path | None, model_path: str, weights: SharedWeights,
                 hello: dict, host: str = LOOPBACK, base: SharedBase | None = None) -> None:  # fmt: skip
        """`ckpt`: the checkpoint the run resumed from (None: it starts from `model_path`); `host`:
        the address it listens on; `base`: a LoRA run's frozen base in shared memory, if the driver
        made one. A LoRA run's (train.lora.rank > 0) weights are the adapter alone, on the base of
        `model_path`: your trainer starts from that base and the adapter in `adapter`."""
        cfg: TrainerConfig = hello["train"]
        self.lora = bool(cfg.lora.rank)
        start = Path(model_path) if self.lora or ckpt is None else ckpt / "model"  # LoRA: the base
        steps_done = steps_of(ckpt) if ckpt is not None else 0
        self.run_dir, self.model_path, self.weights = run_dir, model_path, weights
        # the published weights as a model, for the checkpoint's model/ (and adapter/): the parameters
        # it publishes view `flat`
        self.model = self._model(start, weights.dtype, cfg, base)
        adapter = self._adapter(ckpt, cfg)
        if adapter is not None:
            lora.load_adapter_into(self.model, lora.load_peft(adapter, self.model.config))
        self.flat = flatten_parameters(self.model, trainable=self.lora)
        if tuple(n for n, _, _ in self.flat.layout) != tuple(n for n, _, _ in weights.layout):
            raise InputError(f"{start}: its tensors are not the run's model's (train.external)")
        # where a trainer that connects starts: the newest checkpoint (its model/ or, with LoRA, the base
        # and its adapter/; its directory; steps)
        self.saved: tuple[Path, Path | None, int, Path | None] = (start, ckpt, steps_done, adapter)
        self.steps_done = steps_done  # the run's steps trained (its trainers' answers, not redone ones)
        self.since: list[TrainOrder] = []  # orders answered since then: a new trainer redoes them
        self.client: Connection | None = None
        self.told = False  # said that the run waits for a trainer
        # what your trainer publishes, written by it in place: no pickling, no socket (bench/README.md)
        self.staging_path = staging_file(run_dir)
        numel = self.flat.buffer.numel()
        n = sum(p.numel() for p in self.model.parameters())  # train.lr null: by size, as the built-in's
        hello = {**hello, "train": dataclasses.replace(cfg, lr=cfg.lr or auto_lr(n, self.lora))}
        self.staging = torch.from_file(str(self.staging_path), shared=True, size=numel, dtype=weights.dtype)
        dtype = str(weights.dtype).removeprefix("torch.")
        self.hello = {**hello, "layout": weights.layout, "numel": numel, "dtype": dtype,
                      "staging": str(self.staging_path), "machine": socket.gethostname()}  # fmt: skip
        self.listener = listen(run_dir, NAME, host)
        self.arrived: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._accept, name="relay-desk", daemon=True).start()

    def step(self, order: TrainOrder) -> TrainerReport:
        t = order.train
        t0 = time.perf_counter()
        got = self._ask(order, replay=order.replay)
        t1 = time.perf_counter()
        self.since.append(order)
        self.steps_done = max(self.steps_done, t.step + 1)
        if order.replay:
            return TrainerReport(t.step, got.metrics, None, None, (t0, t1), None, replay=True)
        sync = None
        metrics = dict(got.metrics)
        if t.publish is not None:
            self.weights.write(t.publish, self.staging)
            sync = (t1, time.perf_counter())
            metrics["weight_sync_s"] = sync[1] - sync[0]
        save_s = 0.0
        if order.save_dir:
            s0 = time.perf_counter()
            self.flat.buffer.copy_(self.staging)  # the trainer's weights after this step, published or not
            save_external(
                self.model, Path(self.model_path), Path(order.save_dir), t.step + 1, got.state or {},
                merged=order.merged,
            )  # fmt: skip
            save_s = time.perf_counter() - s0
            final = Path(order.save_dir.removesuffix(".tmp"))  # the driver makes it whole next
            if self.lora:
                self.saved = (Path(self.model_path), final, t.step + 1, final / lora.ADAPTER_DIR)
            else:
                self.saved = (final / "model", final, t.step + 1, None)
            self.since = []
        return TrainerReport(t.step, metrics, t.publish, order.save_dir, (t0, t1), sync, save_s)

    def close(self, steps: int) -> None:
        """The run is over: its trainer told so (`steps`: the policy's flow.steps)."""
        if self.client is not None:
            try:
                send(self.client, End(self.steps_done, self.steps_done >= steps))
            except Exception:  # noqa: BLE001 — it finds the run gone either way
                pass
            self.client.close()
        unlisten(self.listener, self.run_dir, NAME)
        self.staging_path.unlink(missing_ok=True)

    # -- a trainer's connection ---------------------------------------------------------------

    def _ask(self, order: TrainOrder, replay: bool) -> Stepped:
        """`order` trained by the connected trainer (waiting for one as long as it takes)."""
        while True:
            conn = self._connected()
            try:
                send(conn, _batch(order, replay))
                got = receive(conn)
            except Exception as e:  # whatever a trainer's connection or pickle raises ends that trainer
                self._lose(
                    f"its connection broke ({one_line(e) or type(e).__name__}) during step {order.train.step}"
                )
                continue
            why = self._refusal(got, order, replay)
            if why is None:
                return got
            try:
                send(conn, Refused(why))
            except Exception:  # noqa: BLE001 — it is dropped either way
                pass
            self._lose(f"it sent what the relay refuses: {why}")

    def _connected(self) -> Connection:
        """The connected trainer, once it has redone the steps since the newest checkpoint."""
        while self.client is None:
            if not self.told:
                print(f"trainer: waiting for your trainer to join: TrainerClient({str(self.run_dir)!r}) "
                      "(tailrace.client; README: \"Your own trainer\")", flush=True)  # fmt: skip
                self.told = True
            conn = self.arrived.get()
            try:
                send(conn, self._handshake())
                for old in self.since:  # its weights and state become the lost trainer's
                    send(conn, _batch(old, replay=True))
                    got = receive(conn)
                    if not isinstance(got, Stepped) or got.step != old.train.step:
                        raise EOFError("it did not redo the steps since the checkpoint")
            except Exception as e:  # noqa: BLE001 — a trainer's connection or pickle
                conn.close()
                print(f"trainer: a trainer that joined left at once ({one_line(e)})", flush=True)
                continue
            self.client = conn
            print(f"trainer: your trainer joined (it starts at step {self.saved[2]}, "
                  f"{len(self.since)} step(s) redone)", flush=True)  # fmt: skip
        return self.client

    def _handshake(self) -> Handshake:
        start, ckpt, steps, adapter = self.saved
        deadline = time.monotonic() + SAVED_S
        while not (ckpt or start).is_dir() and time.monotonic() < deadline:  # the driver makes it whole
            time.sleep(0.1)
        state = read_state(ckpt) if ckpt is not None else {}
        return Handshake(
            str(start), state, steps, **self.hello, adapter=None if adapter is None else str(adapter)
        )

    @staticmethod
    def _model(start: Path, dtype: torch.dtype, cfg: TrainerConfig, base: SharedBase | None):
        """The model the published weights are the parameters of (with LoRA: a fresh adapter on the
        frozen base, shared with the other trainers when the driver shares it)."""
        if not cfg.lora.rank:
            return load_pretrained(start, dtype=dtype)
        model = base.model() if base is not None else load_pretrained(start, dtype=dtype)
        return lora.attach(model, cfg.lora)

    def _adapter(self, ckpt: Path | None, cfg: TrainerConfig) -> Path | None:
        """With LoRA, the adapter the run starts from: its checkpoint's, else train.lora.init (None: a
        fresh one, whose B is zero: the base's outputs, whatever A your trainer draws)."""
        if not self.lora:
            return None
        if ckpt is not None:
            return ckpt / lora.ADAPTER_DIR
        return Path(cfg.lora.init) if cfg.lora.init else None

    def _refusal(self, got: object, order: TrainOrder, replay: bool) -> str | None:
        t = order.train
        if not isinstance(got, Stepped) or got.step != t.step:
            return f"step {t.step} wants a Stepped reply for that step (use TrainerClient)"
        if not all(isinstance(v, (int, float)) for v in got.metrics.values()):
            return f"step {t.step}'s metrics must be numbers"
        if (t.publish is None and order.save_dir is None) or replay:
            return None
        if not got.staged:
            return (f"step {t.step} publishes or is checkpointed: it needs its weights in the staging file "
                    "(Batch.done(weights=model.state_dict()))")  # fmt: skip
        if not bool(torch.isfinite(self.staging).all()):
            return f"step {t.step}'s weights are not all finite: nothing was published (lower the lr?)"
        return None

    def _lose(self, why: str) -> None:
        if self.client is not None:
            self.client.close()
        self.client, self.told = None, False
        print(f"trainer: your trainer left: {why}; the next one starts from step {self.saved[2]}'s "
              f"weights and redoes {len(self.since)} step(s)", flush=True)  # fmt: skip

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except AuthenticationError:  # not the run's key
                continue
            except OSError:  # closed
                return
            if self.client is not None or not self.arrived.empty():
                try:
                    send(conn, Refused("another trainer is connected to this run: one at a time"))
                except OSError:
                    pass
                conn.close()
                continue
            self.arrived.put(conn)


def staging_file(run_dir: Path) -> Path:
    """A new file, only its owner's, in memory where the machine has /dev/shm (else in the run
    directory), sized by its user (`torch.from_file` grows it); those of relays no longer alive go."""
    where = Path("/dev/shm") if Path("/dev/shm").is_dir() else run_dir
    for old in where.glob("tailrace-relay-*"):
        if not _alive(int(old.name.rsplit("-", 1)[1])):
            old.unlink(missing_ok=True)
    path = where / f"tailrace-relay-{os.getpid()}"
    write_private(path, b"")
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _host(conn: Connection) -> str:
    """Where the relay listens: the address its connection to the driver comes in at (a Ray actor's
    node, as Ray knows it), else loopback (a local run's trainer process talks over a pipe)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            if s.family in (socket.AF_INET, socket.AF_INET6):
                return s.getsockname()[0]
    except OSError:
        pass
    return LOOPBACK


def _batch(order: TrainOrder, replay: bool) -> Work:
    t = order.train
    return Work(t.step, t.groups, t.trainer_version, t.publish is not None and not replay,
                 order.save_dir is not None and not replay, replay)  # fmt: skip


def relay_main(conn, counter, spec, weights: SharedWeights) -> None:
    """The run's trainer process under train.external (`spec`: runtime/trainer_worker.TrainerSpec)."""
    with serving(conn, counter):
        pin(spec.cores)
        torch.set_num_threads(spec.threads)
        cfg = spec.cfg
        hello = {
            "temperature": cfg.temperature, "pad_id": cfg.pad_id, "train": cfg,
            "cores": tuple(spec.cores), "threads": spec.threads,
        }  # fmt: skip
        ckpt = Path(spec.resume_from) if spec.resume_from else None
        relay = Relay(Path(spec.relay), ckpt, spec.model_path, weights, hello, _host(conn), spec.base)
        if spec.publish_start:
            weights.write(spec.start_version, relay.flat.buffer)
        conn.send(Ready(spec.start_version))
        try:
            while not isinstance(order := conn.recv(), Shutdown):
                conn.send(relay.step(order))
        finally:
            relay.close(spec.steps)
