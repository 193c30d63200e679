"""The store's replay buffer: groups trained once, trained again by later optimizer steps (experience
replay, as AstraFlow's replay buffer and ExGRPO's).

An optimizer step of U fresh groups also carries up to round(ratio x U) replayed ones. A group enters
the buffer when the step that trained it finishes, if its rewards differ (a zero-signal group has no
advantage to teach the second time either); the buffer keeps the newest `capacity`. On exit a step
first evicts, untrained, every group whose oldest token is more than `max_age` versions behind the
trainer (the staleness filter), then takes the groups of largest reward variance (the size of GRPO's
advantages: p(1 - p) for a 0/1 reward), newest first among equals, that no unfinished step holds;
each group is replayed at most `uses` times. Replayed tokens train off-policy against the logprobs
that sampled them (a behaviour-anchored correction; the run config insists on one).

The ledger's identity counts each trajectory once, trained by its first step; replays are counted
apart, per trajectory trained again (`replayed`). The buffer's state is as of the finished steps: a
pick is booked when its step finishes (`on_trained`), so a checkpoint taken between a pick and its
step's end resumes as a run that never stopped. Pure: no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import pvariance

from tailrace.records import prompt_from_json, prompt_to_json, trajectory_from_json, trajectory_to_json
from tailrace.types import Group, Prompt, Trajectory


@dataclass(frozen=True)
class ReplayOptions:
    ratio: float  # replayed groups per fresh group in a step (0 = no replay)
    capacity: int  # groups held at most (the newest)
    max_age: int  # versions an oldest token may lag the trainer when replayed
    uses: int  # times a group may be replayed


@dataclass
class Entry:
    prompt: Prompt
    group: int  # the group's id (a replayed group keeps it)
    done: list[Trajectory]
    step: int  # the step that first trained it
    uses: int = 0  # replays finished

    @property
    def variance(self) -> float:
        return pvariance([t.reward for t in self.done])

    @property
    def oldest(self) -> int:
        return min(t.oldest_version for t in self.done)

    def as_group(self) -> Group:
        return Group(self.group, self.prompt.id, tuple(self.done))


@dataclass
class ReplayBuffer:
    options: ReplayOptions
    entries: list[Entry] = field(default_factory=list)  # oldest first
    picked: dict[int, list[Entry]] = field(default_factory=dict)  # unfinished step -> its replays
    replayed: int = 0  # trajectories trained again, by finished steps
    expired: int = 0  # groups the staleness filter evicted untrained

    def pick(self, step: int, fresh: int, trainer_version: int) -> list[Group]:
        """The replays of train step `step`, which trains `fresh` fresh groups at `trainer_version`."""
        o = self.options
        kept = [e for e in self.entries if trainer_version - e.oldest <= o.max_age]
        self.expired += len(self.entries) - len(kept)
        self.entries = kept
        held = {id(e) for es in self.picked.values() for e in es}
        free = [e for e in self.entries if id(e) not in held]
        free.sort(key=lambda e: (-e.variance, -e.step, -e.group))
        chosen = free[: round(o.ratio * fresh)]
        self.picked[step] = chosen
        return [e.as_group() for e in chosen]

    def on_trained(self, step: int, trained: list[tuple[Prompt, int, list[Trajectory]]]) -> None:
        """Step `step` finished: its replays are booked, and the groups it trained fresh (prompt, id,
        trajectories) enter the buffer if their rewards differ."""
        for e in self.picked.pop(step, []):
            e.uses += 1
            self.replayed += len(e.done)
        self.entries = [e for e in self.entries if e.uses < self.options.uses]
        self.entries += [
            Entry(p, g, list(done), step) for p, g, done in trained if len({t.reward for t in done}) > 1
        ]
        del self.entries[: max(0, len(self.entries) - self.options.capacity)]

    def record(self) -> dict:
        """For a step record's ledger: trajectories replayed, groups held and evicted as stale."""
        return {"replayed": self.replayed, "held": len(self.entries), "expired": self.expired}

    # -- checkpoints: as of the finished steps (picks of unfinished steps are not booked) -----------------
    def to_json(self) -> dict:
        return {
            "entries": [
                {"prompt": prompt_to_json(e.prompt), "group": e.group, "step": e.step, "uses": e.uses,
                 "done": [trajectory_to_json(t) for t in e.done]}
                for e in self.entries
            ],
            "replayed": self.replayed, "expired": self.expired,
        }  # fmt: skip

    def load_json(self, d: dict) -> None:
        self.entries = []
        for ed in d["entries"]:
            p = prompt_from_json(ed["prompt"])
            done = [trajectory_from_json(t, p.token_ids) for t in ed["done"]]
            self.entries.append(Entry(p, ed["group"], done, ed["step"], ed["uses"]))
        self.replayed, self.expired, self.picked = d["replayed"], d["expired"], {}
