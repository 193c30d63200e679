"""Response-length models: how long sample `index` of prompt `prompt_id` runs, and how long prompts are.

Every draw is a pure function of (seed, prompt, index), so a resumed partial finishes at the same
length it would have had, two policies see the same workload, and runs repeat exactly.

- `ConstantLengths`: every response the same length (closed-form checks).
- `LognormalLengths`: per-prompt difficulty (a lognormal median per prompt) times intra-prompt spread
  (a lognormal factor per sample), a `runaway` fraction of samples that run to the limit (repetition
  loops: the truncated mass every long-output RL run reports), truncation at `max_len`.
- `EmpiricalLengths`: replays the response lengths recorded in a tailrace run directory's
  journal.jsonl, prompt by prompt (so intra-prompt spread is the recorded one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tailrace.records import Finished, Opened, read_journal
from tailrace.types import Finish

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-mixed 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _hash(key: tuple[int, ...]) -> int:
    h = 0
    for k in key:
        h = (h * 0x9E3779B97F4A7C15 + (k & _M64)) & _M64
    return _mix(_mix(h))


def uniform(*key: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of the integer key (fast, platform-stable)."""
    return (_hash(key) >> 11) / 9007199254740992.0


def normal(*key: int) -> float:
    """A standard normal draw from the key (Box-Muller on the two 32-bit halves of one hash)."""
    h = _hash(key)
    u1, u2 = ((h >> 32) + 0.5) / 4294967296.0, (h & 0xFFFFFFFF) / 4294967296.0
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


P_DIFFICULTY, P_SAMPLE, P_RUNAWAY, P_PROMPT, P_REWARD = 1, 2, 3, 4, 5  # key tags


class LengthModel:
    max_len: int

    def response(self, prompt_id: int, index: int) -> int:
        """Tokens the sample generates; == max_len means it was cut off (finish = length)."""
        raise NotImplementedError

    def prompt_len(self, prompt_id: int) -> int:
        raise NotImplementedError

    def mean(self, n: int = 4000) -> float:
        """Mean response length (sampled over n prompts x 1 sample when not known in closed form)."""
        return sum(self.response(p, 0) for p in range(n)) / n


@dataclass
class ConstantLengths(LengthModel):
    length: int
    prompt: int = 16
    max_len: int = 1 << 30

    def __post_init__(self) -> None:
        if self.length < 1 or self.prompt < 1:
            raise ValueError("constant lengths need length >= 1 and prompt >= 1")
        self.length = min(self.length, self.max_len)

    def response(self, prompt_id: int, index: int) -> int:
        return self.length

    def prompt_len(self, prompt_id: int) -> int:
        return self.prompt

    def mean(self, n: int = 0) -> float:
        return float(self.length)


@dataclass
class LognormalLengths(LengthModel):
    median: float  # median response length of a median prompt, tokens
    max_len: int
    sigma_prompt: float = 0.6  # spread of per-prompt medians (difficulty), log scale
    sigma_sample: float = 0.4  # spread of samples around their prompt's median, log scale
    runaway: float = 0.0  # fraction of samples that run to max_len
    prompt: int = 256  # prompt tokens (mean)
    prompt_sigma: float = 0.0  # lognormal spread of prompt lengths
    seed: int = 0
    _mu: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (self.median >= 1 and self.max_len >= 1 and self.prompt >= 1):
            raise ValueError("lognormal lengths need median >= 1, max_len >= 1, prompt >= 1")
        if min(self.sigma_prompt, self.sigma_sample, self.prompt_sigma) < 0 or not 0 <= self.runaway < 1:
            raise ValueError("lognormal lengths need sigmas >= 0 and 0 <= runaway < 1")

    def _prompt_mu(self, prompt_id: int) -> float:
        mu = self._mu.get(prompt_id)
        if mu is None:
            z = normal(self.seed, P_DIFFICULTY, prompt_id)
            mu = self._mu[prompt_id] = math.log(self.median) + self.sigma_prompt * z
        return mu

    def response(self, prompt_id: int, index: int) -> int:
        if self.runaway and uniform(self.seed, P_RUNAWAY, prompt_id, index) < self.runaway:
            return self.max_len
        n = math.exp(
            self._prompt_mu(prompt_id) + self.sigma_sample * normal(self.seed, P_SAMPLE, prompt_id, index)
        )
        return max(1, min(self.max_len, int(round(n))))

    def prompt_len(self, prompt_id: int) -> int:
        if not self.prompt_sigma:
            return self.prompt
        z = normal(self.seed, P_PROMPT, prompt_id)
        return max(1, int(round(self.prompt * math.exp(self.prompt_sigma * z - self.prompt_sigma**2 / 2))))


@dataclass
class EmpiricalLengths(LengthModel):
    groups: list[list[int]]  # recorded response lengths, one list per prompt (group), in run order
    prompts: list[int]  # recorded prompt lengths, same order
    max_len: int

    @classmethod
    def from_run(cls, run_dir: str | Path, max_len: int | None = None) -> "EmpiricalLengths":
        """Lengths of every finished trajectory in RUN_DIR/journal.jsonl, and of its group's prompt."""
        path = Path(run_dir) / "journal.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; pass a run directory written by tailrace train")
        by_group: dict[int, list[int]] = {}
        prompts: dict[int, int] = {}
        limit = 0
        for e in read_journal(path):  # a torn last line ends the journal
            if isinstance(e, Opened):
                prompts[e.group] = len(e.prompt.token_ids) or 1
            elif isinstance(e, Finished):
                t = e.trajectory
                by_group.setdefault(t.group, []).append(t.length)
                if t.result.finish == Finish.LENGTH:
                    limit = max(limit, t.length)
        if not by_group:
            raise ValueError(f"{path} records no finished trajectory")
        order = sorted(by_group)
        top = max(max(v) for v in by_group.values())
        return cls([by_group[g] for g in order], [prompts.get(g, 1) for g in order], max_len or limit or top)

    def response(self, prompt_id: int, index: int) -> int:
        g = self.groups[prompt_id % len(self.groups)]
        return max(1, min(self.max_len, g[index % len(g)]))

    def prompt_len(self, prompt_id: int) -> int:
        return self.prompts[prompt_id % len(self.prompts)]

    def mean(self, n: int = 0) -> float:
        flat = [x for g in self.groups for x in g]
        return sum(flat) / len(flat)


def make_lengths(spec: dict, seed: int = 0) -> LengthModel:
    """From a scenario's `lengths:` mapping: {kind: constant|lognormal|empirical, ...}."""
    spec = dict(spec)
    kind = spec.pop("kind", "lognormal")
    if kind == "constant":
        return ConstantLengths(**spec)
    if kind == "lognormal":
        spec.setdefault("seed", seed)
        return LognormalLengths(**spec)
    if kind == "empirical":
        return EmpiricalLengths.from_run(spec.pop("run_dir"), **spec)
    raise ValueError(f"lengths.kind={kind!r}: use constant, lognormal or empirical")
