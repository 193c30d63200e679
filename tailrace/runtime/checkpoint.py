"""Checkpoints: RUN_DIR/checkpoints/step_N/ holds the run after N optimizer steps.

    model/                 a complete HF checkpoint: config.json, model.safetensors (the trainer's fp32
                           weights) and the source checkpoint's tokenizer files and chat template, so
                           transformers and `tailrace eval --model.path=.../model` load it as it is
                           (a LoRA run's: the base with the adapter merged in, in its last
                           checkpoint only: the others hold adapter/ alone, megabytes)
    adapter/               a LoRA run's adapter in PEFT's files (`peft.PeftModel.from_pretrained`)
    optimizer.safetensors  AdamW's state (`state.<parameter index>.<name>`) and the RNG state (`rng`)
    critic.safetensors     PPO's critic (train.advantage=gae): its weights (`model.<name>`) and AdamW's
                           state (`state.<parameter index>.<name>`)
    reference.safetensors  the KL reference, once train.loss.ref_sync_steps has moved it from the
                           run's start: its parameters by name, or a LoRA run's reference adapter
                           (`<projection>.ref_A`, `.ref_B`)
    trainer.json           the trainer's step count
    scheduler.json         the scheduler, store and ledger as of step N, and its journal position
    config.yaml            the config the run was under (a resume refuses a changed one)
    checkpoint.json        written last: the format and the size of every file above

Nothing is read back with pickle: tensors are safetensors, everything else JSON or YAML. A checkpoint
is built in step_N.tmp/ (the trainer writes its part, then the driver its own and the manifest) and
renamed to step_N/ when whole, so a step_N/ whose files have the manifest's sizes is complete; what
an interrupted save leaves (`*.tmp`) is removed by the next resume. Optimizer hyperparameters are not
stored: they come from the config, which a resume refuses to change.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tailrace.common import one_line
from tailrace.config import load_config
from tailrace.model import lora
from tailrace.model.checkpoint import CheckpointError, save_pretrained
from tailrace.runtime.rundir import step_dirs
from tailrace.trainer.grpo import GRPOTrainer

FORMAT = 1
MANIFEST = "checkpoint.json"
OPTIMIZER = "optimizer.safetensors"
CRITIC = "critic.safetensors"
REFERENCE = "reference.safetensors"
TRAINER = "trainer.json"
SCHEDULER = "scheduler.json"
CONFIG = "config.yaml"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


# -- when ------------------------------------------------------------------------------------------

AUTO_BYTES = 1 << 30  # under this a checkpoint after every step costs little (about a second to write)
AUTO_MINUTES = 30.0  # above it: a 7B model's ~84 GB takes minutes to write; a crash loses <= 30 minutes


@dataclass
class Cadence:
    """When to checkpoint: after a publishing step once `every` steps or `minutes` have passed since the
    last checkpoint (whichever is set; both may be), and always after the run's last step."""

    every: int | None
    minutes: float | None
    last_step: int = 0  # steps done at the last checkpoint (or the start)
    last_s: float = 0.0  # and when, on the driver's clock

    @classmethod
    def of(cls, every: int | None, minutes: float | None, checkpoint_bytes: int) -> Cadence:
        """The configured cadence; with neither set, by size: every step for a checkpoint under
        `AUTO_BYTES` (the built-in model's is a few MB), else every `AUTO_MINUTES`."""
        if every is None and minutes is None:
            return cls(1, None) if checkpoint_bytes < AUTO_BYTES else cls(None, AUTO_MINUTES)
        return cls(every, minutes)

    def due(self, steps: int, now: float) -> bool:
        """Whether the step that brings the run to `steps` done (and publishes) should be saved."""
        by_steps = self.every is not None and steps - self.last_step >= self.every
        return by_steps or (self.minutes is not None and now - self.last_s >= 60 * self.minutes)

    def saved(self, steps: int, now: float) -> None:
        self.last_step, self.last_s = steps, now


# -- the trainer's part (in the trainer process) -----------------------------------------------


def save_trainer(trainer: GRPOTrainer, source_model: Path, out: Path, merged: bool = True) -> None:
    """model/ (with the source checkpoint's tokenizer and chat template), optimizer and step, synced;
    a LoRA trainer's adapter/, and model/ (the merged policy) only when `merged`."""
    _fresh(out)
    _save_policy(trainer.model, source_model, out, merged)
    state = trainer.state_dict()
    tensors = optimizer_tensors(state["optimizer"]["state"])
    tensors["rng"] = torch.get_rng_state()
    _save_state(out, state["step"], tensors)
    if "critic" in state:
        critic = optimizer_tensors(state["critic"]["optimizer"]["state"])
        critic |= {
            f"model.{k}": v.detach().to("cpu").contiguous() for k, v in state["critic"]["model"].items()
        }
        _save_tensors(out / CRITIC, critic)
    reference = trainer.reference_state()
    if reference is not None:
        _save_tensors(out / REFERENCE, {k: t.detach().to("cpu").contiguous() for k, t in reference.items()})


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], **metadata: str) -> None:
    """A safetensors file beside trainer.json, with its mode (safetensors writes 0600), synced."""
    save_file(tensors, str(path), metadata={"format": str(FORMAT), **metadata})
    shutil.copymode(path.parent / TRAINER, path)
    _fsync(path)


def save_external(
    model, source_model: Path, out: Path, steps: int, state: dict[str, torch.Tensor], merged: bool = True
) -> None:
    """An external trainer's part (train.external, written by the run's relay): model/ (its weights
    after the step; with LoRA its adapter/, and model/ merged only when `merged`), its own `state`
    tensors in place of the optimizer's, and the step count."""
    _fresh(out)
    _save_policy(model, source_model, out, merged)
    _save_state(out, steps, {k: t.detach().to("cpu").contiguous() for k, t in state.items()}, external="1")


def _save_policy(model, source_model: Path, out: Path, merged: bool) -> None:
    """model/ (with the source checkpoint's tokenizer and chat template); a LoRA model's adapter/ in
    PEFT's format instead, and model/ (the merged policy) only when `merged`."""
    if lora.has_adapter(model):
        lora.save_peft(lora.adapter_of(model), out / lora.ADAPTER_DIR, str(source_model), model.config)
        if merged:
            save_pretrained(model, out / "model", source_model, lora.merged_state(model))
    else:
        save_pretrained(model, out / "model", companions_from=source_model)


def optimizer_tensors(state: dict[int, dict]) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state (`state_dict()["state"]`) as flat tensors on the CPU,
    `state.<parameter index>.<name>` (a CPU optimizer's own tensors, not copies)."""
    return {
        f"state.{i}.{name}": (t if isinstance(t, torch.Tensor) else torch.tensor(t))
        .detach()
        .to("cpu")
        .contiguous()
        for i, s in state.items()
        for name, t in s.items()
    }


def optimizer_state(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """`optimizer_tensors` back: the per-parameter state by index (other keys, e.g. `rng`, left out)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("state."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = t
    return state


def read_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The tensors of `ckpt`'s optimizer file: the built-in optimizer's and RNG, or the state an external
    trainer saved there (`save_external`)."""
    try:
        with safe_open(str(ckpt / OPTIMIZER), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:  # safetensors' own errors, a missing file
        raise _damaged(ckpt, e) from None


def steps_of(ckpt: Path) -> int:
    """The optimizer steps `ckpt` holds (its trainer.json)."""
    return int(json.loads((ckpt / TRAINER).read_text())["step"])


def load_trainer(trainer: GRPOTrainer, ckpt: Path) -> None:
    """The optimizer state, step count and RNG of `ckpt` into a trainer built on `ckpt`/model."""
    tensors = read_state(ckpt)
    try:
        step = steps_of(ckpt)
        state = optimizer_state(tensors)
        params = [p for g in trainer.opt.param_groups for p in g["params"]]
        for i, s in state.items():
            if s["exp_avg"].shape != params[i].shape:
                raise ValueError(f"parameter {i} has shape {tuple(params[i].shape)}, its state another")
        optimizer = {"state": state, "param_groups": trainer.opt.state_dict()["param_groups"]}
        whole = {"model": trainer.model.state_dict(), "optimizer": optimizer, "step": step}
        if trainer.critic is not None and (ckpt / CRITIC).is_file():  # else it starts afresh, as a new run's
            whole["critic"] = _critic_state(trainer, ckpt)
        trainer.load_state_dict(whole)
        if (ckpt / REFERENCE).is_file():  # else the reference is the run's start, as built
            with safe_open(str(ckpt / REFERENCE), framework="pt") as fh:
                trainer.load_reference({k: fh.get_tensor(k) for k in fh.keys()})
        torch.set_rng_state(tensors["rng"])
    except Exception as e:  # a bad key, a shape, a missing file
        raise _damaged(ckpt, e) from None


def _critic_state(trainer: GRPOTrainer, ckpt: Path) -> dict:
    with safe_open(str(ckpt / CRITIC), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    model = {k.removeprefix("model."): t for k, t in tensors.items() if k.startswith("model.")}
    groups = trainer.critic.opt.state_dict()["param_groups"]
    return {"model": model, "optimizer": {"state": optimizer_state(tensors), "param_groups": groups}}


def _fresh(out: Path) -> None:
    """An empty `out`: a save of this step that an earlier, killed process began is removed."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def _save_state(out: Path, steps: int, tensors: dict[str, torch.Tensor], **metadata: str) -> None:
    _write(out / TRAINER, json.dumps({"step": steps}) + "\n")
    _save_tensors(out / OPTIMIZER, tensors, **metadata)


def _damaged(ckpt: Path, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"{ckpt} does not load ({one_line(e)}); it is damaged: move it away to resume from the "
        "checkpoint before it"
    )


# -- the driver's part ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """A checkpoint made whole: where, and its bytes by part."""

    path: Path
    model: int
    optimizer: int
    total: int


def finalize(tmp: Path, scheduler: dict, config: str) -> Saved:
    """Add the driver's files and the manifest to the trainer's `step_N.tmp/`, then rename it."""
    _write(tmp / SCHEDULER, json.dumps(scheduler))
    _write(tmp / CONFIG, config)
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    _write(tmp / MANIFEST, json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    os.replace(tmp, final)
    _fsync(final.parent)
    model = sum(n for name, n in files.items() if name.startswith("model/"))
    total = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    return Saved(final, model, files[OPTIMIZER], total)


def verify(ckpt: Path) -> str | None:
    """None if `ckpt` is whole (every file of its manifest there, at its size, the tensors' headers, the
    JSON and the config readable); else why not, in a few words. Cheap: no tensor is read."""
    if not (ckpt / MANIFEST).is_file():
        if (ckpt / "trainer.pt").exists():
            return "written by an older tailrace (trainer.pt, a pickle this version never loads)"
        return f"no {MANIFEST}: its save never finished"
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        for name, size in files.items():
            f = ckpt / name
            if not f.is_file() or f.stat().st_size != size:
                return f"{name} is {'missing' if not f.is_file() else 'not the size it was saved at'}"
        weights = (
            "model/model.safetensors"
            if "model/model.safetensors" in files
            else f"{lora.ADAPTER_DIR}/{lora.ADAPTER_WEIGHTS}"
        )
        for name in (OPTIMIZER, weights):
            with safe_open(str(ckpt / name), framework="pt") as fh:
                fh.keys()
        state = json.loads((ckpt / SCHEDULER).read_text())
        step = json.loads((ckpt / TRAINER).read_text())["step"]
        load_config(ckpt / CONFIG)
    except Exception as e:  # JSON, YAML, safetensors or a missing key: damage either way
        return f"unreadable ({one_line(e)})"
    counts = (
        [state.get(k) for k in ("journal_seq", "steps_done", "version")] if isinstance(state, dict) else []
    )
    if len(counts) != 3 or not all(type(n) is int and n >= 0 for n in [*counts, step]):
        return f"{SCHEDULER} or {TRAINER} does not hold its counts"
    return None


def leftovers(run_dir: Path) -> list[Path]:
    """What interrupted writes left in a run directory: `step_N.tmp/` directories, `*.tmp` files."""
    found = sorted(run_dir.rglob("*.tmp"))
    return [p for p in found if not any(q in p.parents for q in found)]  # not those inside another


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    for old in step_dirs(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _write(f: Path, text: str) -> None:
    with open(f, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
