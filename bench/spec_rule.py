"""The acceptance rule, measured: the engine's exact matching under shared Gumbel noise against the
standard min(1, p/q) rule (Leviathan et al.), on the same drafts of real rollouts.

    .venv/bin/python bench/spec_rule.py                        # quant8, quant4, trained, history at T = 1
    .venv/bin/python bench/spec_rule.py --temperatures 1.0,0.7 --seed 1
    .venv/bin/python bench/spec_rule.py --drafters trained --train-s 0   # the untrained drafter

The engine accepts a draft token iff it equals the target's own token there, argmax(log p + g) with the
noise g of (request seed, response index) (`spec.accept`). Model drafters draft argmax(log q + g) with
that same g, so a position's acceptance is the Gumbel coupling's agreement, which has a closed form:
with g = -log E, E ~ Exp(1), both pick x iff E_y >= E_x max(p_y/p_x, q_y/q_x) for every y, so
    P[agree] = sum_x p_x q_x / sum_y max(p_y q_x, q_y p_x)
(Daliri, Musco, Suresh, arXiv 2408.07978: it is >= (1 - TV) / (1 + TV)). The standard rule accepts a draft
x ~ q with probability min(1, p(x)/q(x)): sum_x min(p, q) = 1 - TV per position, the most any
coupling gives. A lookup drafter's draft is a point mass: both rules accept it with probability p(x).

Workload (as `spec_drift.py`): the warm-started chainsum policy (`ensure_warm_start`, cached), fp32,
one thread; `--prompts` training prompts x `--samples` samples (EOS stops, up to `--max-new` tokens)
through `--slots` slots, toggle off (every decode row drafts the ladder's length). Per temperature an
earlier round of the same prompts (other seeds) runs without speculation; its responses are given to
every drafting engine (`add_history`: the history drafter's index, the trained drafter's data), which
then idles (`--train-s`: the trained drafter learns). The measured round's tokens are checked equal
to a run without speculation. `Probe` hooks the engine's step stages (draft, decode draw, verify) to
keep, per drafted position, the target's processed distribution p (softmax of logits / temperature;
top-p and top-k off, the default) and the drafter's q; its recount of accepted drafts must equal the
engine's own, or the bench stops.

Per drafter, over the positions the engine judged (each verify's accepted drafts and its first
rejected one, contexts as plain decoding has them): acceptance measured (exact), its closed form,
the standard rule's sum min(p, q), and the coupling bound; per verify: accepted drafts measured, and
the standard rule's expectation on the same draft, sum_m prod_{j<m} min(1, p_j(x_j)/q_j(x_j)) (the
target's p_j at a draft position is the verify's: conditioned on the drafted prefix, as the standard
rule's would be); and tokens per verify, (1 - a^(g+1)) / (1 - a) at the ladder's gamma g.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tailrace.engine.spec.selfdraft as selfdraft  # noqa: E402
import tailrace.engine.spec.trained as trained  # noqa: E402
from tailrace.config import ArchConfig, SFTConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.engine.rows import IDX, INV_T  # noqa: E402
from tailrace.engine.sampler import gumbel_noise, seed_key, vocab_salt  # noqa: E402
from tailrace.engine.spec import SpecOptions  # noqa: E402
from tailrace.engine.spec.accept import accepted  # noqa: E402
from tailrace.engine.spec.costs import expected_length  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402
from tailrace.tasks.chainsum import ChainSumTask  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

# -- the arithmetic (tests/engine/test_spec_rule.py) -------------------------------------------------


def standard_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(N, V) probabilities -> (N,): the standard rule's acceptance of a draft x ~ q, sum_x min(p, q)."""
    return torch.minimum(p, q).sum(-1)


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(N, V) probabilities -> (N,): P[argmax(log p + g) == argmax(log q + g)], g i.i.d. Gumbel (the
    module doc's closed form); a one-hot q gives p(x)."""
    out = []
    for a, b in zip(p.double().split(chunk), q.double().split(chunk)):
        pq = a * b  # (n, V): p_x q_x
        denom = torch.maximum(a[:, None, :] * b[:, :, None], b[:, None, :] * a[:, :, None]).sum(-1)  # (n, x)
        out.append(torch.where(pq > 0, pq / denom.clamp_min(1e-300), 0.0).sum(-1))
    return torch.cat(out).to(p.dtype)


def expected_accepted(ratios: list[float]) -> float:
    """Expected accepted drafts of a verify whose draft token j the standard rule accepts with
    probability ratios[j] = min(1, p_j(x_j) / q_j(x_j)), given all before it were: sum_m prod_{j<m}."""
    total, run = 0.0, 1.0
    for r in ratios:
        run *= r
        total += run
    return total


# -- the measurement ---------------------------------------------------------------------------------


class Probe(TailraceEngine):
    """An engine that keeps, per verify, p and q at every draft position (see the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.q: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # (key, index) -> (q, token)
        self.rows_p, self.judged = [], []  # per verify: dicts; per judged position: (exact, p, q, x)

    def _draft(self, active):
        self.q.clear()
        return super()._draft(active)

    def _sample_decode(self, logits):
        self._dec = logits.float().clone()  # (B, V): the target's logits at each row's decode position
        return super()._sample_decode(logits)

    def _verify(self, drafts, logits, n_completed):
        seen, off = [], 0
        for d in drafts:
            n = len(d.tokens)
            key = seed_key(d.seq.req.params.seed)
            idx = int(self.rows.ints[d.row, IDX]) - 1  # draft[0]'s response index (the decode draw's)
            z = torch.cat((self._dec[d.row : d.row + 1], logits[off : off + n - 1].float()))  # (n, V)
            z = z * self.rows.floats[d.row, INV_T]  # as the sampler tempers
            p = torch.softmax(z, -1)
            g = gumbel_noise(torch.full((n,), key), torch.arange(idx, idx + n), vocab_salt(p.shape[1]))
            target = (z + g).argmax(-1).tolist()  # the sampler's draw
            qs = [self.q.get((key, idx + j)) for j in range(n)]
            if qs[0] is None:  # a lookup draft: a point mass
                q = torch.nn.functional.one_hot(torch.tensor(d.tokens), p.shape[1]).float()
            else:
                assert [t for _, t in qs] == list(d.tokens), "the recorded draft is not the engine's"
                q = torch.stack([x for x, _ in qs])
            x = torch.tensor(d.tokens)
            px, qx = p.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]
            a = accepted(d.tokens, target)
            ratios = (px / qx.clamp_min(1e-30)).clamp_max(1.0).tolist()
            self.rows_p.append({"n": n, "a": a, "std": expected_accepted(ratios)})
            self.judged += [(j < a, p[j], q[j]) for j in range(min(a + 1, n))]
            seen.append(a)
            off += n
        v = super()._verify(drafts, logits, n_completed)
        if sum(seen) != v.accepted:
            raise SystemExit(f"Probe counted {sum(seen)} accepted drafts, the engine {v.accepted}")
        return v


def recording(real, engines: list[Probe]):
    """A drafter module's `sample`, recording each row's processed q into the live probe."""

    def sample(logits, **kw):
        toks, lps = real(logits, **kw)
        q = torch.softmax(logits.float() * kw["inv_temp"][:, None], -1)
        for k, i, row, t in zip(kw["key"].tolist(), kw["index"].tolist(), q, toks.tolist()):
            engines[-1].q[(k, i)] = (row, t)
        return toks, lps

    return sample


def requests(prompts, samples, temperature, max_new, eos, epoch, seed) -> list[GenRequest]:
    params = dict(temperature=temperature, max_new_tokens=max_new, stop_token_ids=(eos,))
    base = (seed * 10 + epoch) * 1_000
    return [
        GenRequest(f"e{epoch}-p{i}-s{j}", ids, SamplingParams(seed=(base + i) * 100 + j, **params))
        for i, ids in enumerate(prompts)
        for j in range(samples)
    ]


def summarize(eng: Probe) -> dict:
    exact = torch.tensor([e for e, _, _ in eng.judged], dtype=torch.float64)
    p = torch.stack([p for _, p, _ in eng.judged]).double()
    q = torch.stack([q for _, _, q in eng.judged]).double()
    std, coupled = standard_acceptance(p, q), gumbel_agreement(p, q)
    st = eng.spec_stats
    gamma = st.gamma
    out = {
        "positions": len(exact),
        "verifies": len(eng.rows_p),
        "gamma": gamma,
        "mean_draft": sum(r["n"] for r in eng.rows_p) / len(eng.rows_p),
        "exact": exact.mean().item(),
        "engine_exact": st.accepted / st.compared,  # the engine's own books: must equal "exact"
        "closed_form": coupled.mean().item(),
        "standard": std.mean().item(),
        "bound": (std / (2 - std)).mean().item(),  # (1 - TV) / (1 + TV) per position
        "top2": p.topk(2, -1).values.sum(-1).mean().item(),  # how peaked the target is
        "acc_exact": sum(r["a"] for r in eng.rows_p) / len(eng.rows_p),
        "acc_standard": sum(r["std"] for r in eng.rows_p) / len(eng.rows_p),
        "train_steps": st.train_steps,
        "train_s": st.train_s,
    }
    out["len_exact"], out["len_standard"] = (expected_length(out[k], gamma) for k in ("exact", "standard"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="quant8,quant4,trained,history")
    p.add_argument("--temperatures", default="1.0", help="comma-separated (the task's default is 1.0)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-new", type=int, default=384)
    p.add_argument("--train-s", type=float, default=20.0, help="the trained drafter's idle period")
    p.add_argument("--seed", type=int, default=0, help="picks the prompts and the requests' seeds")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "spec_rule.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    policy = load_pretrained(ensure_warm_start(ArchConfig(), SFTConfig()), dtype=torch.float32)
    tok = char_tokenizer()
    exs = ChainSumTask().examples("train", a.prompts, seed=11 + a.seed)
    prompts = [tuple(tok.encode(e.question, bos=True)) for e in exs]
    probes: list[Probe] = []
    selfdraft.sample, trained.sample = recording(selfdraft.sample, probes), recording(trained.sample, probes)
    print(f"{a.prompts} prompts x {a.samples} samples through {a.slots} slots, fp32, toggle off, seed {a.seed}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    head = (f"{'T':>4} {'drafter':8} {'positions':>9} {'verifies':>8} {'gamma':>5} {'draft':>5} | per position: "
            f"{'exact':>5} {'closed':>6} {'std':>5} {'std-cl':>6} {'bound':>5} | accepted/verify: {'exact':>5} "
            f"{'std':>5} | tokens/verify at gamma: {'exact':>5} {'std':>5} | p top-2 | drafter training")  # fmt: skip
    table = {}
    for temp in [float(t) for t in a.temperatures.split(",")]:
        off = TailraceEngine(policy, num_slots=a.slots, seed=0, kv_memory_gb=0.5)
        earlier = off.generate(requests(prompts, a.samples, temp, a.max_new, tok.eos_id, 1, a.seed))
        reqs = requests(prompts, a.samples, temp, a.max_new, tok.eos_id, 2, a.seed)
        ref = [r.token_ids for r in off.generate(reqs)]
        print(f"\n{head}", flush=True)
        for name in a.drafters.split(","):
            opts = SpecOptions(name, toggle=False, train_s=a.train_s)
            probes.append(Probe(policy, num_slots=a.slots, seed=0, kv_memory_gb=0.5, spec=opts))
            eng = probes[-1]
            for r, x in zip(reqs, earlier):
                eng.add_history(r.prompt_ids, x.token_ids)
            while eng.idle(0.05):  # the trained drafter learns (others return None at once)
                pass
            if [r.token_ids for r in eng.generate(reqs)] != ref:
                raise SystemExit(f"T={temp}: {name} changed the outputs")
            s = table.setdefault(str(temp), {})[name] = summarize(eng)
            gap = s["standard"] - s["closed_form"]
            print(f"{temp:4.1f} {name:8} {s['positions']:9d} {s['verifies']:8d} {s['gamma']:5d} "
                  f"{s['mean_draft']:5.2f} | {s['exact']:20.3f} {s['closed_form']:6.3f} {s['standard']:5.3f} "
                  f"{gap:+6.3f} {s['bound']:5.3f} | {s['acc_exact']:22.2f} {s['acc_standard']:5.2f} | "
                  f"{s['len_exact']:29.2f} {s['len_standard']:5.2f} | {s['top2']:7.3f} | {s['train_steps']} steps, "
                  f"{s['train_s']:.0f} s", flush=True)  # fmt: skip
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
