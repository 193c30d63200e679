"""In-process helpers for commands that need no worker processes (tailrace eval)."""

from __future__ import annotations

from pathlib import Path

import torch

from tailrace.config import RunConfig
from tailrace.engine import build_engine
from tailrace.model import lora
from tailrace.model.checkpoint import load_pretrained
from tailrace.runtime.evaluate import Evaluator, generate_episodes
from tailrace.runtime.procs import available_cores, resolve_device
from tailrace.runtime.session import Session


def evaluate_model(cfg: RunConfig, progress=None, on_done=None, adapter: Path | None = None) -> dict:
    """Held-out accuracy of `cfg`'s model (with the PEFT `adapter` merged in, when given) on one
    in-process engine; `progress` follows a warm start, `on_done(done, total)` the evaluation."""
    ses = Session(cfg, progress)
    try:
        torch.set_num_threads(len(available_cores()))
        device = resolve_device(cfg.device)
        if adapter is None:
            model = load_pretrained(ses.model_path, dtype=getattr(torch, cfg.model.dtype), device=device)
        else:  # merged in fp32, then to the engine's dtype
            model = lora.merged(load_pretrained(ses.model_path, dtype=torch.float32), lora.load_peft(adapter))
            model = model.to(device, getattr(torch, cfg.model.dtype))
        r = cfg.rollout
        engine = build_engine(
            model,
            num_slots=cfg.eval.batch,
            device=device,
            seed=cfg.seed,
            max_context=r.max_context,
            expected_context=ses.expected_context(cfg.eval.max_new_tokens),
            kv_memory_gb=r.kv_memory_gb,
        )
        print(engine.describe(), flush=True)
        evaluator = Evaluator(ses, cfg.eval)
        reqs = evaluator.requests(version=0)
        context = r.max_context or ses.model_cfg.max_position_embeddings
        out = evaluator.summarize(
            reqs, generate_episodes(engine, ses, evaluator.prompts, reqs, context, on_done)
        )
        out["model"] = str(ses.model_path)
        return out
    finally:
        ses.close()
