"""A scripted cluster for scheduler tests: engines that emit one token per tick per running sample,
a trainer that takes a fixed number of ticks per step, weight loads that take a fixed time.
Lengths come from a function of (group, index), so tests choose any distribution."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Sample, Train
from tailrace.types import Finish, GenResult, Prompt, Trajectory


def prompts():
    i = 0
    while True:
        yield Prompt(id=i, token_ids=(1, 2, 3), task="scripted", answer=str(i))
        i += 1


@dataclass
class Running:
    sample: Sample
    target: int
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ScriptedCluster:
    def __init__(
        self,
        sched,
        length: Callable[[int, int], int],
        slots: int,
        train_ticks: int = 5,
        load_ticks: int = 1,
        reward: Callable[[int, int], float] = lambda g, i: float(i % 2),
    ):
        self.s, self.length, self.slots = sched, length, slots
        self.train_ticks, self.load_ticks, self.reward = train_ticks, load_ticks, reward
        n = len(sched.engines)
        self.queue = [[] for _ in range(n)]
        self.running: list[list[Running]] = [[] for _ in range(n)]
        self.loaded = [{0} for _ in range(n)]
        self.loads: list[tuple[int, int, int]] = []  # (done tick, engine, version)
        self.trainer: list[Train] = []
        self.train_left = 0
        self.trained: list[Train] = []
        self.t = 0
        self.busy_slot_ticks = 0
        self.generated: list[Trajectory] = []  # every finished (not aborted) trajectory this cluster made

    def execute(self, cmds) -> None:
        for c in cmds:
            if isinstance(c, Generate):
                for smp in c.samples:
                    assert smp.version in self.loaded[c.engine], "dispatched a version the engine lacks"
                    self.queue[c.engine].append(
                        Running(
                            smp,
                            self.length(smp.group, smp.index),
                            list(smp.resume_ids),
                            list(smp.resume_versions),
                        )
                    )
            elif isinstance(c, Abort):
                out = []
                for pool in (self.queue[c.engine], self.running[c.engine]):
                    for r in [r for r in pool if r.sample.id in c.sample_ids]:
                        pool.remove(r)
                        out.append(self._traj(r, Finish.ABORTED))
                self.s.on_results(c.engine, out, self.t)
            elif isinstance(c, Train):
                self.trainer.append(c)
            elif isinstance(c, LoadWeights):
                self.loads.append((self.t + self.load_ticks, c.engine, c.version))
            elif isinstance(c, DropWeights):
                assert not any(r.sample.version == c.version for r in self.running[c.engine]), (
                    "dropped in use"
                )
                self.loaded[c.engine].discard(c.version)

    def _traj(self, r: Running, finish: Finish) -> Trajectory:
        smp = r.sample
        res = GenResult(smp.id, tuple(r.tokens), tuple(0.0 for _ in r.tokens), tuple(r.versions), finish)
        rew = self.reward(smp.group, smp.index) if finish != Finish.ABORTED else 0.0
        return Trajectory(
            group=smp.group,
            sample_index=smp.index,
            prompt_id=smp.prompt.id,
            prompt_ids=smp.prompt.token_ids,
            result=res,
            reward=rew,
            correct=rew > 0,
            dispatch_version=smp.version,
        )

    def tick(self) -> None:
        self.t += 1
        for i, (done_t, e, v) in enumerate(list(self.loads)):
            if done_t <= self.t:
                self.loads.remove((done_t, e, v))
                self.loaded[e].add(v)
                self.s.on_loaded(e, v, self.t)
        for e in range(len(self.running)):
            run = self.running[e]
            while len(run) < self.slots and self.queue[e]:
                run.append(self.queue[e].pop(0))
            self.busy_slot_ticks += len(run)
            finished = []
            for r in run:
                r.tokens.append(7)
                r.versions.append(r.sample.version)
                if len(r.tokens) >= r.target:
                    finished.append(r)
            for r in finished:
                run.remove(r)
            if finished:
                out = [self._traj(r, Finish.STOP) for r in finished]
                self.generated.extend(out)
                self.s.on_results(e, out, self.t)
        if self.trainer:
            self.train_left += 1
            if self.train_left >= self.train_ticks:
                c = self.trainer.pop(0)
                self.train_left = 0
                self.trained.append(c)
                self.s.on_trained(c.step, self.t)
                if c.publish is not None:
                    self.s.on_published(c.publish, self.t)

    def run(self, max_ticks: int = 100_000) -> None:
        while not self.s.done and self.t < max_ticks:
            self.execute(self.s.poll(self.t))
            self.tick()
        assert self.s.done, f"run did not finish in {max_ticks} ticks"
        self.execute(self.s.poll(self.t))
