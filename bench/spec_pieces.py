"""Verify steps on the torch backend: short prefill pieces (speculation's drafts) attended one by one
against all together in one batched call (`torch_ref.SHORT_PIECE`), side by side in one process.

    .venv/bin/python bench/spec_pieces.py                  # CPU, batches 8 and 32
    python3 bench/spec_pieces.py --device cuda --batches 8,32,64

The warm-started chainsum policy, fp32, one thread, `attention='bmm'` (the torch backend, the one CUDA
runs). Every row drafts every step (toggle off) from a history holding the very responses it will
produce (same seeds), so nearly every draft is accepted: the verify path at its busiest, not a
rollout's mix. Each configuration is a fresh engine; a plain batch-invariant engine runs the same
requests in turn with it, and the tokens are checked equal. Printed per batch and setting: the
speculating call's and the plain call's median wall time over --rounds, and plain / speculating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig, SFTConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.engine.backends import torch_ref  # noqa: E402
from tailrace.engine.spec import SpecOptions  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402
from tailrace.tasks.chainsum import ChainSumTask  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", type=int, default=2, help="alternations of the two settings")
    p.add_argument("--max-new", type=int, default=96)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = load_pretrained(ensure_warm_start(ArchConfig(), SFTConfig()), dtype=torch.float32)
    tok = char_tokenizer()
    params = dict(temperature=1.0, max_new_tokens=a.max_new, stop_token_ids=(tok.eos_id,))
    settings = {"one by one": 0, "together": torch_ref.SHORT_PIECE}
    print(f"fp32 on {a.device}, every row drafting (toggle off), history = the same seeds' responses")
    for b in (int(x) for x in a.batches.split(",")):
        ps = [tuple(tok.encode(e.question, bos=True)) for e in ChainSumTask().examples("train", b, seed=11)]
        reqs = [GenRequest(f"r{i}", p, SamplingParams(seed=i, **params)) for i, p in enumerate(ps)]
        ratios: dict[str, list[float]] = {k: [] for k in settings}
        for _ in range(a.turns):
            for name, short in settings.items():
                torch_ref.SHORT_PIECE = short
                kw = dict(num_slots=b, seed=0, attention="bmm", device=a.device)
                spec = TailraceEngine(model, spec=SpecOptions("history", toggle=False), **kw)
                plain = TailraceEngine(model, batch_invariant=True, **kw)
                for p, r in zip(ps, plain.generate(reqs)):
                    spec.add_history(p, r.token_ids)
                spec.generate([GenRequest("w" + r.id, r.prompt_ids, r.params) for r in reqs])  # warm-up
                s_t, p_t = [], []
                for _ in range(a.rounds):
                    t = time.perf_counter()
                    out = spec.generate(reqs)
                    s_t.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    ref = plain.generate(reqs)
                    p_t.append(time.perf_counter() - t)
                    if [r.token_ids for r in out] != [r.token_ids for r in ref]:
                        raise SystemExit(f"batch {b}, {name}: speculation changed the outputs")
                sm, pm = statistics.median(s_t), statistics.median(p_t)
                ratios[name].append(pm / sm)
                st = spec.spec_stats
                print(f"batch {b:3d} {name:10}: speculating {sm * 1e3:6.0f} ms, plain {pm * 1e3:6.0f} ms, "
                      f"plain/speculating {pm / sm:.2f}x (acceptance {st.accepted / max(1, st.compared):.2f})",
                      flush=True)  # fmt: skip
        print(f"batch {b:3d}: " + ", ".join(f"{k} {statistics.median(v):.2f}x" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
