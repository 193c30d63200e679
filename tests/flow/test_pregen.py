"""BubbleSpec's pre-generation on the scripted cluster (sync): when a round's samples still running
fall to `pregen_below` of the engines' slots, the idle slots generate the next round's prompts (one
response each) with the current weights. Nothing from them is trained or counted in the ledger: the
driver hands them to the engines' history drafters, where they draft for the same prompts under the
next weights. Outstanding ones are aborted when the next round starts."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tests.flow.scripted import ScriptedCluster, prompts


def build(R, G, U, steps, below=0.25, slots=8, zero_signal="train"):
    policy = make_policy("sync", zero_signal, pregen_below=below)
    return Scheduler(policy, prompts(), [(slots, 0)], FlowSpec(R, G, U, steps))


def test_the_tail_of_a_round_pre_generates_the_next_rounds_prompts():
    """R = 2, G = 2, 8 slots: at tick 3 only g1's second sample runs (1 <= 0.25 x 8), so prompts 2
    and 3, the next round's, are generated on idle slots; round 2 then opens exactly those prompts."""
    lengths = {0: [3, 3], 1: [3, 20]}
    s = build(R=2, G=2, U=2, steps=2)
    c = ScriptedCluster(s, lambda g, i: lengths.get(g, [4, 4])[i], slots=8, pregen_len=5)
    c.run()
    marks = [m.data for m in c.marks if m.kind == "pregen"]
    assert marks == [{"prompts": [2, 3], "version": 0}]
    taken = s.take_pregen()
    assert [p.id for p, _ in taken] == [2, 3] and all(len(r.token_ids) == 5 for _, r in taken)
    assert [[g.prompt_id for g in t.groups] for t in c.trained] == [[0, 1], [2, 3]]
    assert s.ledger.state_dict() == {"produced": 8, "trained": 8, "discarded": {}}
    assert not s.take_pregen()


def test_pre_generation_still_running_is_aborted_when_the_next_round_starts():
    lengths = {0: [3, 3], 1: [3, 20]}
    s = build(R=2, G=2, U=2, steps=2)
    c = ScriptedCluster(s, lambda g, i: lengths.get(g, [4, 4])[i], slots=8, pregen_len=500)
    c.run()
    aborts = [m for m in c.marks if m.kind == "pregen_aborted"]
    assert len(aborts) == 1 and aborts[0].data["requests"] == 2
    assert s.ledger.trained == 8 and not s.pregen_in_flight()
    assert [p.id for p, r in s.take_pregen()] == [2, 3]  # their partial responses still draft


def test_no_pre_generation_unless_asked():
    s = Scheduler(make_policy("sync"), prompts(), [(8, 0)], FlowSpec(2, 2, 2, 2))
    c = ScriptedCluster(s, lambda g, i: 3 + 17 * (g == 1 and i == 1), slots=8)
    c.run()
    assert not [m for m in c.marks if m.kind == "pregen"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(2, 12), below=st.sampled_from([0.25, 0.5, 1.0]),
       pregen_len=st.integers(1, 60), zero_signal=st.sampled_from(["train", "replace"]))  # fmt: skip
def test_pre_generation_never_changes_what_is_trained(seed, slots, below, pregen_len, zero_signal):
    def run(below):
        rng = random.Random(seed)
        lengths = {}
        s = build(4, 2, 2, 6, below, slots, zero_signal)
        c = ScriptedCluster(s, lambda g, i: lengths.setdefault((g, i), max(1, int(rng.lognormvariate(1.8, 0.9)))),
                            slots=slots, train_ticks=3, pregen_len=pregen_len,
                            reward=lambda g, i: float((g + i) % 3 == 0))  # fmt: skip
        c.run(max_ticks=50_000)
        return s, c

    s, c = run(below)
    plain, pc = run(None)

    def trained(cluster):  # a group's samples in index order (their completion order follows timing)
        return [[(g.prompt_id, sorted(t.sample_index for t in g.trajectories)) for g in t.groups]
                for t in cluster.trained]  # fmt: skip

    assert trained(c) == trained(pc)
    assert s.ledger.state_dict() == plain.ledger.state_dict()
    s.ledger.check(s.in_store())
