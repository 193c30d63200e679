"""In-process helpers for commands that need no worker processes (tailrace eval)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from tailrace.common import InputError
from tailrace.config import RunConfig
from tailrace.engine import build_engine
from tailrace.engine.adapter_versions import AdapterVersions
from tailrace.model import lora
from tailrace.model.checkpoint import CONFIG, load_pretrained
from tailrace.runtime.evaluate import Evaluator, generate_episodes
from tailrace.runtime.procs import available_cores, resolve_device, resolve_dtype
from tailrace.runtime.session import Session


def evaluate_model(cfg: RunConfig, progress=None, on_done=None, adapter: Path | None = None) -> dict:
    """Held-out accuracy of `cfg`'s model (with the PEFT `adapter` merged in, when given) on one
    in-process engine of the run's backend; `progress` follows a warm start, `on_done(done, total)`
    the evaluation."""
    ses = Session(cfg, progress)
    try:
        torch.set_num_threads(len(available_cores()))
        engine = _engine(cfg, ses, adapter)
        print(engine.describe(), flush=True)
        evaluator = Evaluator(ses, cfg.eval)
        reqs = evaluator.requests(version=0)
        out = evaluator.summarize(
            reqs, generate_episodes(engine, ses, evaluator.per_request, reqs, ses.context, on_done)
        )
        out["model"] = str(ses.model_path)
        return out
    finally:
        ses.close()


def _engine(cfg: RunConfig, ses: Session, adapter: Path | None):
    """The engine the run's own evaluations ran on: vLLM's (an adapter as vLLM's LoRA over the base)
    where rollout.backend=vllm and vLLM imports here, else tailrace's (an adapter merged in)."""
    r, device = cfg.rollout, resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    common = dict(
        num_slots=cfg.eval.batch, seed=cfg.seed, max_context=r.max_context, kv_memory_gb=r.kv_memory_gb
    )
    if r.backend == "vllm":
        from tailrace.engine.vllm_engine import vllm_available

        missing = vllm_available()
        if missing is None:
            peft = lora.load_peft(adapter, ses.model_cfg) if adapter is not None else None
            engine = build_engine(str(ses.model_path), backend="vllm", dtype=dtype,
                                  lora_rank=peft.rank if peft else 0, max_adapters=1, **common)  # fmt: skip
            if peft is None:
                return engine
            engine = AdapterVersions(engine, peft.alpha)
            engine.load_adapter_version(peft, 0)
            return engine
        print(f"evaluating on tailrace's engine (the run rolled out on vLLM): {missing}", flush=True)
    if adapter is None:
        model = load_pretrained(ses.model_path, dtype=getattr(torch, dtype), device=device)
    else:  # merged in fp32, then to the engine's dtype
        model = lora.merged(
            load_pretrained(ses.model_path, dtype=torch.float32), lora.load_peft(adapter, ses.model_cfg)
        )
        model = model.to(device, getattr(torch, dtype))
    return build_engine(
        model, device=device, expected_context=ses.expected_context(cfg.eval.max_new_tokens), **common
    )


def with_checkpoint(cfg: RunConfig) -> tuple[RunConfig, Path | None]:
    """`cfg` with model.path a model directory, and the PEFT adapter to merge into it (or None), where
    model.path names a run's checkpoint (step_N: its model/, or its adapter/ alone: a LoRA run's
    checkpoint before its last) or an adapter directory itself: the adapter's base is the model its
    adapter_config.json names (base_model_name_or_path)."""
    if cfg.model.path is None:
        return cfg, None
    path = Path(cfg.model.path)
    if (path / CONFIG).is_file() or not path.is_dir():
        return cfg, None  # a model (or nothing: loading it says what is wrong)
    if (path / "model" / CONFIG).is_file():
        return replace(cfg, model=replace(cfg.model, path=str(path / "model"))), None
    adapter = path / lora.ADAPTER_DIR if (path / lora.ADAPTER_DIR / lora.ADAPTER_CONFIG).is_file() else path
    if not (adapter / lora.ADAPTER_CONFIG).is_file():
        return cfg, None
    try:
        base = json.loads((adapter / lora.ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if not base or not (Path(base) / CONFIG).is_file():
        raise InputError(
            f"model.path={path}: a LoRA adapter over {base or 'a base its adapter_config.json does not name'}, "
            "which is not a local checkpoint; evaluate a run's checkpoints over the run's base with "
            "tailrace eval RUN_DIR, or set base_model_name_or_path in its adapter_config.json to the base's directory"
        )
    return replace(cfg, model=replace(cfg.model, path=str(base))), adapter
