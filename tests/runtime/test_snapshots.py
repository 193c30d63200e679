"""When `eval.every` keeps the published weights, and what it keeps."""

import torch

from tailrace.runtime.snapshots import Snapshots
from tailrace.runtime.weights import SharedWeights


def test_a_snapshot_at_the_first_publishing_step_at_or_past_each_multiple(tmp_path):
    s = Snapshots(tmp_path, every=3)
    # steps 3 and 4 did not publish (say), 5 did: it stands in for 3; 6 is due again
    assert [n for n in (1, 2, 5, 6, 7, 8, 10, 12) if s.due(n)] == [5, 6, 10, 12]
    assert not any(Snapshots(tmp_path, every=0).due(n) for n in range(1, 10))
    resumed = Snapshots(tmp_path, every=3, steps_done=6)  # a resumed run: the next one is at 9
    assert [n for n in (7, 8, 9) if resumed.due(n)] == [9]


def test_pending_snapshots_are_those_without_a_record_oldest_first(tmp_path):
    s = Snapshots(tmp_path, every=2)
    for step, v in ((2, 2), (4, 4), (6, 6)):
        s.take(step, v, wall_s=step * 1.5, buffer=torch.full((5,), float(v)))
    todo = s.pending(evaluated={4})
    assert [(p.step, p.version, p.wall_s) for p in todo] == [(2, 2, 3.0), (6, 6, 9.0)]
    assert torch.equal(Snapshots.load(todo[1]), torch.full((5,), 6.0))
    assert not list(s.dir.glob("*.tmp"))


def test_a_snapshot_whose_ring_slot_was_rewritten_while_saved_is_not_kept(tmp_path):
    """The driver saves a view of the ring's slot; a trainer that began rewriting the slot meanwhile
    would leave a file of two versions under the first one's number. The ring's second read says so,
    and nothing is kept."""
    ring = SharedWeights((("w", (4,), 0),), 4, torch.float32, slots=2)
    ring.write(2, torch.full((4,), 2.0))
    s = Snapshots(tmp_path, every=1)
    flat = ring.read(2)
    kept = s.take(2, 2, 1.0, flat.buffer, lambda: ring.intact(2, flat))
    assert kept is not None and torch.equal(Snapshots.load(kept), torch.full((4,), 2.0))

    ring.write(3, torch.full((4,), 3.0))
    flat = ring.read(3)

    def overwritten() -> bool:  # the trainer publishes version 5 into the same slot during the save
        ring.write(5, torch.full((4,), 5.0))
        return ring.intact(3, flat)

    assert s.take(3, 3, 2.0, flat.buffer, overwritten) is None
    assert [p.version for p in s.pending(evaluated=set())] == [2] and not list(s.dir.glob("*.tmp"))
