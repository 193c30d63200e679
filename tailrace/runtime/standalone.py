"""In-process helpers for commands that need no worker processes (tailrace eval)."""

from __future__ import annotations

import zlib

import torch

from tailrace.config import RunConfig
from tailrace.engine import build_engine
from tailrace.model.checkpoint import load_pretrained
from tailrace.runtime.evaluate import summarize
from tailrace.runtime.procs import available_cores
from tailrace.runtime.session import Session
from tailrace.types import GenRequest, SamplingParams


def evaluate_model(cfg: RunConfig, progress=None) -> dict:
    ses = Session(cfg, progress)
    try:
        torch.set_num_threads(len(available_cores()))
        model = load_pretrained(ses.model_path, dtype=getattr(torch, cfg.model.dtype))
        engine = build_engine(model, num_slots=cfg.eval.batch, seed=cfg.seed)
        prompts = ses.heldout(cfg.eval.n)
        reqs = [
            GenRequest(
                id=f"eval.{i}",
                prompt_ids=p.token_ids,
                params=SamplingParams(
                    temperature=cfg.eval.temperature,
                    max_new_tokens=cfg.eval.max_new_tokens,
                    stop_token_ids=(ses.tok.eos_id,),
                    seed=zlib.crc32(f"eval/{p.id}".encode()),
                ),
            )
            for i, p in enumerate(prompts)
        ]
        results = engine.generate(reqs)
        scores = ses.score_results(prompts, results)
        out = summarize([len(r.token_ids) for r in results], [ok for _, ok in scores])
        out["model"] = str(ses.model_path)
        return out
    finally:
        ses.close()
