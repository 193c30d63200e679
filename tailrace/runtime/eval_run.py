"""`tailrace eval RUN_DIR`: held-out accuracy of every kept checkpoint of a run, after the fact.

Each whole checkpoint's model directory is evaluated as saved (the same held-out prompts, seeds and
engine as the run's own evaluations: vLLM's for a run on vLLM, where it is installed; a LoRA run's
checkpoint without one, its adapter over the run's base) and appended to the run's metrics.jsonl as an `EvalRecord`
tagged "checkpoint", with the step, version and wall time of the step that wrote it, so `tailrace
report` plots it on the run's accuracy-vs-time curve. Under the run's lock: a run still going is
refused, not raced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tailrace.common import ConfigError
from tailrace.config import load_config
from tailrace.model import lora
from tailrace.records import EvalRecord, StepRecord, on_prompts, read_metrics
from tailrace.runtime import checkpoint
from tailrace.runtime.lock import RunLock
from tailrace.runtime.rundir import RecordFile, RunDir, repair
from tailrace.runtime.standalone import evaluate_model

TAG = "checkpoint"


def is_run_dir(path: str) -> bool:
    return (Path(path) / "config.yaml").is_file() and (Path(path) / "checkpoints").is_dir()


def evaluate_checkpoints(
    run_dir: Path, overrides: list[str], say: Callable[[str], None], progress=None, on_done=None
) -> list[EvalRecord]:
    """Evaluate the run's whole checkpoints not yet evaluated, oldest first; `overrides` may change the
    evaluation (eval.n, eval.batch, ...), never the model."""
    if any(o.startswith("--model.") for o in overrides):
        raise ConfigError(
            "tailrace eval RUN_DIR evaluates the run's own checkpoints; drop --model.* (or evaluate one "
            "model with tailrace eval --model.path=DIR)"
        )
    run = RunDir(run_dir)
    with RunLock(run.path):
        cfg = load_config(run.file("config.yaml"), overrides)
        metrics = run.file("metrics.jsonl")
        records = list(read_metrics(metrics)) if metrics.is_file() else []
        steps = {r.step + 1: r for r in records if isinstance(r, StepRecord)}
        done = {r.step for r in records if isinstance(r, EvalRecord) and r.tag == TAG}
        todo = []
        for ckpt in reversed(checkpoint.step_dirs(run.ckpt)):
            step = int(ckpt.name.removeprefix("step_"))
            why = checkpoint.verify(ckpt)
            if why is not None:
                say(f"step {step}: skipped, the checkpoint is not whole ({why})")
            elif step in done:
                say(f"step {step}: already evaluated (its record is in metrics.jsonl)")
            elif step not in steps:
                say(f"step {step}: skipped, metrics.jsonl has no record of that step")
            else:
                todo.append((step, ckpt))
        if not todo:
            return []
        if metrics.is_file():
            repair(metrics)
        out, f = [], RecordFile(metrics)
        try:
            for step, ckpt in todo:
                if (ckpt / "model").is_dir():
                    summary = evaluate_model(replace(cfg, model=replace(cfg.model, path=str(ckpt / "model"))),
                                             progress, on_done)  # fmt: skip
                else:  # a LoRA run's checkpoint before its last: the run's base with the adapter merged
                    summary = evaluate_model(cfg, progress, on_done, adapter=ckpt / lora.ADAPTER_DIR)
                summary.pop("model")
                s = steps[step]
                rec = EvalRecord(TAG, step, summary, s.version, s.time["wall_s"])
                f.write(rec)
                out.append(rec)
                say(f"step {step}: held-out accuracy {rec.accuracy:.1%} {on_prompts(rec.summary)}")
        finally:
            f.close()
        return out
