"""Partial rollout's costs in the simulator, checked by hand: a resumed sample is prefilled again with
its prompt and every token it had (the old KV cache belongs to the old weights), at the engine's
prefill rate; and a weight update stops every engine at once, for the load and then for the
re-prefill of what it was running."""

import pytest

from tailrace.flow.commands import Generate
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.sim.cluster import SimCluster
from tailrace.sim.engine import SimEngine
from tailrace.sim.scenario import prompt_stream
from tailrace.types import GenRequest, SamplingParams
from tests.sim.test_cluster import Capture
from tests.sim.test_engine import COST, Table


class Placed(Capture):
    """Also records the engine each request was sent to."""

    def __init__(self):
        super().__init__()
        self.engine: dict[str, int] = {}

    def record(self, out):
        super().record(out)
        for c in out.commands:
            if isinstance(c, Generate):
                self.engine |= {r.id: c.engine for r in c.requests}


def test_a_resumed_sample_is_prefilled_with_its_prompt_and_generated_tokens_at_the_prefill_rate():
    """qwen2.5-7b on one H100: 4,050 tokens are compute-bound (2 x 7.1 GFLOP a token plus causal
    attention at 50% of 989 TFLOP/s, ~0.12 s, against ~6 ms to read the weights)."""
    P, g, L = 50, 4000, 4100
    m, hw = COST.model, COST.hw
    resumed = GenRequest(
        "0.0.1", (1,) * P, SamplingParams(), version=1,
        resume_ids=(1,) * g, resume_logprobs=(-1.0,) * g, resume_versions=(0,) * g,
    )  # fmt: skip
    eng = SimEngine(0, 4, COST, Table({(0, 0): L}))
    eng.loaded = {1}
    eng.post(Generate(0, (resumed,)))
    now = eng.plan(0.0)
    assert eng.fire().results == []  # the admission: the prefill moves the engine's clock
    n = P + g
    flops = 2 * m.matmul_params * n + m.attn_flops_per_context_token * n * n / 2
    prefill = flops / (hw.peak_flops * hw.flops_eff) + hw.step_overhead_s
    assert eng.t_b == pytest.approx(prefill, rel=1e-12)
    assert prefill > 10 * COST.prefill_time([P])  # the prompt alone: reading the weights once
    while (nxt := eng.plan(now)) is not None:
        now = nxt
        done = eng.fire().results
    # then it decodes its remaining L - g tokens over its whole context
    assert now == pytest.approx(prefill + COST.decode_segment({1: (1, n)}).time(L - g), rel=1e-12)
    assert done[0].first_token == pytest.approx(prefill, rel=1e-12)


def test_a_weight_update_stops_every_engine_for_the_load_and_the_re_prefill():
    """Two engines run two short groups (100 tokens) and two long ones (3,000). The short groups make
    step 1; its weights reach both engines at once: each stops for the load, then its long samples are
    interrupted and prefilled again, together on their engine, with their prompt and the tokens they
    have, and finish under the new version over that whole context."""
    P, short, long_ = 50, 100, 3000
    lengths = Table({(p, i): (short if p < 2 else long_) for p in range(4) for i in range(2)}, prompt=P)
    policy = make_policy("partial", max_staleness=1)
    sched = Scheduler(policy, prompt_stream(lengths), [(4, 0)] * 2, FlowSpec(4, 2, 2, 2))
    engs = [SimEngine(i, 4, COST, lengths) for i in range(2)]
    rec = Placed()
    cl = SimCluster(sched, engs, COST, rec)
    cl.run()
    published = next(s.t1 for s in cl.trainer_spans if s.phase == "sync" and s.version == 1)
    step = COST.decode_segment({0: (4, 4 * (P + long_))}).step_time(0)  # longer than any step here
    loads = [[s for s in e.spans if s.phase == "sync"] for e in engs]
    for (load,) in loads:  # every engine stops, at its first step boundary after the publish
        assert published <= load.t0 <= published + step
        assert load.t1 - load.t0 == pytest.approx(COST.load_time(), rel=1e-12)
    longs = [t.result for c in rec.trains[1:] for g in c.groups for t in g.trajectories]
    assert len(longs) == 4
    for r in longs:
        g = r.versions.count(0)
        assert 0 < g < long_ and r.versions == (0,) * g + (1,) * (long_ - g)
        assert r.submitted >= min(load.t1 for (load,) in loads)
        batch = [x for x in longs if rec.engine[x.request_id] == rec.engine[r.request_id]]
        context = [P + x.versions.count(0) for x in batch]
        assert r.first_token - r.submitted == pytest.approx(COST.prefill_time(context), rel=1e-12)
        decode = COST.decode_segment({1: (len(batch), sum(context))}).time(long_ - g)
        assert r.finished - r.first_token == pytest.approx(decode, rel=1e-12)
