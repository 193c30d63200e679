"""`PolicySet`: several policies trained in one run, sharing the rollout engines.

Each policy is a `Scheduler` of its own — its mode, staleness bound, version counter, store, ledger
and trainer — unchanged: it believes it has the engines to itself. The set stands between them and
the engines, which hold every policy's weights side by side:

    policy p's version v  <->  engine version v * S + p      (S: room for S policies, at least P)
    policy p's request id <->  "name/id"                     (its name: no "/"; one policy: "id")

A set with room for one translates nothing (its versions and ids are the engines'; commands and
results pass through untouched), so a driver can always drive a set, at no cost with one policy.

A policy can join a running set (`add`) while there is room (S, fixed when the set is made: the
engines' space must not move under the versions and ids already out): its scheduler's engine books
mirror the live ones, holding none of its weights, so its first poll loads its start version on every
engine (as on an engine that joined), and from then on it is one more policy. A policy leaves by
stopping (`Scheduler.stop`): it finishes the steps it issued and is done; what it still has on the
engines then is aborted (as every policy's is when it is done before the others), so the others get
its slots at once.

`poll` hands out one outbox per policy, its engine commands (Generate, Abort, LoadWeights,
DropWeights) translated into the engines' space; its Train commands stay in the policy's own versions
and steps, tagged with the policy (`Train.policy`), for that policy's trainer. What the engines report
(results, loads, losses, joins and leaves) comes back through the set, translated back and handed to
its policy; what a trainer reports goes straight to its policy's scheduler (`self[p].on_trained`).

So the version barrier is per policy: a policy waits for its own trainer's weights only, never for
another's, and each scheduler checks its own staleness bound and ledger identity at every poll. A
policy sees each engine's whole capacity (one generating alone, while the other trains, gets every
slot); when both generate, the engine queues what exceeds its slots.

Engines that hold one weight version at a time (`Capabilities.versions_at_once == 1`: vLLM, or
rollout.max_versions=1) cannot hold the policies' weights side by side. Each then serves one policy,
its *owner*, and the other policies see it lent (`Scheduler.lend_engine`: out of their view). The
engines are dealt out in turn (engine k to policy k mod P: at least one engine a policy), a joining
engine to the policy with the fewest, and a policy left with none (its engines left) takes one that
another policy with several has no use for at the moment (`_rebalance`); its next poll loads its
weights there, as on an engine that joined. Moving engines more eagerly — to whichever policy has
samples waiting, whenever an owner has none in flight — did not pay on the scripted cluster: each
move costs a weight load, and a sync round is handed to the engines its policy holds when it
starts (4 engines of one slot, 5 seeds: sync + pipe 1.16x slower, sync + multiversion 1.03x).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable, Collection, Iterator, Sequence

from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.scheduler import InvariantError, Outbox, Scheduler
from tailrace.types import Capabilities, GenRequest, GenResult, Prompt, Scored


class PolicySet:
    def __init__(
        self,
        names: Sequence[str],
        schedulers: Sequence[Scheduler],
        turns: bool = True,
        room: int | None = None,
    ) -> None:
        """`turns`: stamp each policy's requests with its priority on the engines (see `poll`); False:
        the engines take every policy's requests in arrival order. `room`: how many policies the set
        can hold, those that join later (`add`) included (default: these)."""
        if len(names) != len(schedulers) or len(names) < 1:
            raise ValueError("PolicySet: one name per scheduler, at least one")
        bad = [n for n in names if not n or "/" in n]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"policy names {list(names)}: give each a unique, non-empty name without '/'")
        self.room = room or len(names)
        if self.room < len(names):
            raise ValueError(f"PolicySet: room for {self.room} policies, given {len(names)}")
        engines = {tuple((e.id, e.slots, e.lookahead) for e in s.engines) for s in schedulers}
        if len(engines) != 1:
            raise ValueError("PolicySet: every policy's scheduler must be built with the same engines")
        self.names = tuple(names)
        self.turns = turns
        self._scheds = tuple(schedulers)
        self._polled: list[Outbox] = []  # the last poll's outboxes so far (see `salvage`)
        self._index = {n: p for p, n in enumerate(self.names)}
        ones = {s.capabilities.versions_at_once == 1 for s in schedulers}
        self.one_version = len(names) > 1 and ones == {True}  # engines dealt out: one owner each
        self._owner: dict[int, int] | None = None  # engine -> its policy (one_version; set at first use)

    def __len__(self) -> int:
        return len(self._scheds)

    @property
    def translates(self) -> bool:
        """Whether policies' versions and ids differ from the engines' (a set with room for several)."""
        return self.room > 1

    def refusal(self, name: str, capabilities: Capabilities) -> str | None:
        """Why policy `name` on engines of `capabilities` cannot join (`add`); None: it can."""
        if len(self) >= self.room:
            return (
                f"policy {name!r} cannot join: the run has room for {self.room} policies and holds "
                f"{len(self)} ({', '.join(self.names)}); start a run with a larger max_policies"
            )
        if not name or "/" in name or name in self._index:
            return (
                f"policy name {name!r}: give each policy a unique, non-empty name without '/' "
                f"(the run's: {', '.join(self.names)})"
            )
        if self.one_version or capabilities.versions_at_once == 1:
            return (
                f"policy {name!r} cannot join: the engines hold one weight version at a time, each dealt "
                "to one policy when the run starts"
            )
        return None

    def add(self, name: str, sched: Scheduler) -> int:
        """Policy `name` joins the running set (between polls), `sched` not yet polled. Returns its index."""
        why = self.refusal(name, sched.capabilities)
        if why:
            raise ValueError(why)
        sched.mirror_engines(self._scheds[0])
        p = len(self)
        self._scheds += (sched,)
        self.names += (name,)
        self._index[name] = p
        return p

    def __getitem__(self, p: int) -> Scheduler:
        return self._scheds[p]

    def __iter__(self) -> Iterator[Scheduler]:
        return iter(self._scheds)

    @property
    def engines(self):
        """The live engines (ids, slots, lookahead), as their owners' books have them (each policy
        counts its own requests in flight), by id."""
        if not self.one_version:
            return self._scheds[0].engines
        self._owners()
        return tuple(sorted((e for s in self._scheds for e in s.engines), key=lambda e: e.id))

    def owner(self, engine: int) -> int | None:
        """The policy engine `engine` serves now (one-version engines); None: it serves every policy."""
        return self._owners().get(engine) if self.one_version else None

    def _owners(self) -> dict[int, int]:
        """The engines dealt out in turn, once (after a resume's restore: its books are the owners')."""
        if self._owner is None:
            ids = [e.id for e in self._scheds[0].engines]
            if len(ids) < len(self):
                raise ValueError(
                    f"{len(self)} policies on engines that hold one weight version at a time need at least "
                    f"{len(self)} engines, one each; raise rollout.engines to {len(self)} or more"
                )
            self._owner = {}
            for k, eid in enumerate(ids):
                self._deal(eid, k % len(self))
                e = self._scheds[k % len(self)].engine(eid)
                if len(e.loaded) > 1:  # a resume restored older versions: the engine holds the newest only
                    e.loaded = {max(e.loaded)}
        return self._owner

    def _deal(self, engine: int, p: int) -> None:
        """Engine `engine` (new to the set) serves policy `p`: every other policy lends it."""
        self._owner[engine] = p
        for q, s in enumerate(self._scheds):
            if q != p:
                s.lend_engine(engine)

    def _rebalance(self) -> None:
        """A policy left without an engine (its engines left) takes one another policy has no use for
        now (nothing of its in flight or loading), never that policy's last."""
        owners = self._owners()
        counts = Counter(owners.values())
        for q, sq in enumerate(self._scheds):
            if counts[q] or sq.done:
                continue
            for eid, p in sorted(owners.items()):
                s = self._scheds[p]
                if counts[p] > 1 and s.can_lend(eid):
                    s.lend_engine(eid)
                    sq.take_engine(eid, set())
                    owners[eid] = q
                    counts[p] -= 1
                    counts[q] += 1
                    s.mark("engine_lent", engine=eid, to=self.names[q])
                    break

    # ------------------------------------------------------------------ the engines' space
    def version(self, p: int, v: int) -> int:
        """Policy p's version v as the engines hold it."""
        return v * self.room + p

    def policy_version(self, g: int) -> tuple[int, int]:
        """(policy, its version) of engine version `g`."""
        return g % self.room, g // self.room

    def request_id(self, p: int, rid: str) -> str:
        return f"{self.names[p]}/{rid}" if self.translates else rid  # one policy: the ids as they are

    def split(self, request_id: str) -> tuple[int, str]:
        """(policy, its own request id) of an engine request id."""
        if not self.translates:
            return 0, request_id
        name, sep, rid = request_id.partition("/")
        if not sep or name not in self._index:
            raise InvariantError(f"request {request_id!r} belongs to no policy of {list(self.names)}")
        return self._index[name], rid

    def policy_of(self, request_id: str) -> int:
        return self.split(request_id)[0]

    # ------------------------------------------------------------------ driving
    @property
    def done(self) -> bool:
        return all(s.done for s in self._scheds)

    def salvage(self) -> list[Outbox]:
        """After a poll that raised bad input: each policy's booked journal entries and marks (see
        `Scheduler.salvage`), those polled before the error included; no commands."""
        done = [replace(o, commands=[]) for o in self._polled]
        return done + [s.salvage() for s in self._scheds[len(done) :]]

    def poll(self, now: float) -> list[Outbox]:
        """Every policy's poll, its engine commands in the engines' space (one outbox per policy, in
        order: the driver keeps each policy's journal and marks apart)."""
        outs = self._polled = []  # (what `salvage` hands back if a policy's poll raises)
        for p, s in enumerate(self._scheds):
            out = s.poll(now)
            if self.translates:  # a set of one translates nothing
                # the engines serve first the policy whose oldest unfinished group began first (ties: the
                # lower index), so policies fall into turns: one generates while another trains
                first = min((g.opened for g in s.open.values()), default=now)
                out.commands = [self._outward(p, c, (first, p) if self.turns else ()) for c in out.commands]
            outs.append(out)
        if self.one_version:
            self._rebalance()
        return outs

    def _outward(self, p: int, c, priority: tuple):
        if isinstance(c, Generate):
            return Generate(c.engine, tuple(self._request(p, r, priority) for r in c.requests))
        if isinstance(c, Abort):
            return Abort(c.engine, tuple(self.request_id(p, r) for r in c.request_ids), c.reason)
        if isinstance(c, (LoadWeights, DropWeights)):
            return type(c)(c.engine, self.version(p, c.version))
        if isinstance(c, Train):
            return replace(c, policy=p)
        raise TypeError(f"unknown command {c!r}")

    def _request(self, p: int, r: GenRequest, priority: tuple) -> GenRequest:
        return replace(
            r,
            priority=priority,
            id=self.request_id(p, r.id),
            version=self.version(p, r.version),
            resume_versions=_mapped(r.resume_versions, lambda v: self.version(p, v)),
        )

    def _result(self, p: int, r: GenResult) -> GenResult:
        foreign = sorted(g for g in set(r.versions) if g % self.room != p)
        if foreign:
            q = self.policy_version(foreign[0])[0]
            raise InvariantError(
                f"request {r.request_id} of policy {self.names[p]} has a token of engine version "
                f"{foreign[0]}, policy {self.names[q]}'s"
            )
        versions = _mapped(r.versions, lambda g: g // self.room)
        return replace(r, request_id=self.split(r.request_id)[1], versions=versions)

    # ------------------------------------------------------------------ what the engines report
    def on_results(
        self,
        engine: int,
        results: Sequence[GenResult],
        scores: Sequence[Scored],
        now: float,
        calls: Collection[str] = (),
    ) -> None:
        """An engine's results of any policies (as `Scheduler.on_results`), each handed to its own."""
        if not self.translates:  # a set of one translates nothing
            self._scheds[0].on_results(engine, results, scores, now, calls=calls)
            return
        by: dict[int, tuple[list[GenResult], list[Scored], set[str]]] = {}
        for r in results:
            p = self.policy_of(r.request_id)
            by.setdefault(p, ([], [], set()))[0].append(self._result(p, r))
        for s in scores:
            p, rid = self.split(s.request_id)
            by.setdefault(p, ([], [], set()))[1].append(replace(s, request_id=rid))
        for c in calls:
            p, rid = self.split(c)
            by.setdefault(p, ([], [], set()))[2].add(rid)
        for p, (res, sc, cl) in sorted(by.items()):
            self._scheds[p].on_results(engine, res, sc, now, calls=cl)

    def on_loaded(self, engine: int, version: int, now: float) -> None:
        p, v = self.policy_version(version)
        if self.one_version:  # it holds this version only now (a load outside the policies': evaluation)
            self.on_replaced(engine)
        self._scheds[p].on_loaded(engine, v, now)

    def on_load_missed(self, engine: int, version: int, now: float) -> None:
        p, v = self.policy_version(version)
        self._scheds[p].on_load_missed(engine, v, now)

    def on_replaced(self, engine: int) -> None:
        """(One-version engines) engine `engine` now holds weights no policy asked for (an evaluation's):
        no policy's books hold any of their versions there (its owner's next poll loads its own)."""
        for s in self._scheds:
            if engine not in s.departed:
                s.engine(engine).loaded.clear()

    def on_engine_steps(self, steps: int, decode_tokens: int, prefill_tokens: int, busy_s: float) -> None:
        for s in self._scheds:  # each policy's shaping prices the engines it shares
            s.on_engine_steps(steps, decode_tokens, prefill_tokens, busy_s)

    def on_engine_lost(self, engine: int, now: float) -> int:
        return sum(s.on_engine_lost(engine, now) for s in self._scheds)

    def add_engine(self, slots: int, lookahead: int, started: bool = True) -> int:
        """An engine joins (every policy's, or on one-version engines the policy with the fewest)."""
        owners = self._owners() if self.one_version else {}
        ids = {s.add_engine(slots, lookahead, started) for s in self._scheds}
        if len(ids) != 1:
            raise InvariantError(f"the policies gave a joining engine different ids {sorted(ids)}")
        eid = ids.pop()
        if self.one_version:
            counts = Counter(owners.values())
            self._deal(eid, min(range(len(self)), key=lambda q: counts[q]))
        return eid

    def engine_started(self, engine: int) -> None:
        for s in self._scheds:
            s.engine_started(engine)

    @property
    def starting(self) -> set[int]:
        """Engines that joined and are not up yet (every policy's books agree)."""
        return self._scheds[0].starting

    def remove_engine(self, engine: int, now: float) -> int:
        if self.one_version:
            self._owners().pop(engine, None)
        return sum(s.remove_engine(engine, now) for s in self._scheds)

    def loaded(self, engine: int) -> set[int]:
        """The engine versions engine `engine` holds, every policy's (one-version engines: its owner's)."""
        if self.one_version:
            self._owners()
        return {self.version(p, v) for p, s in enumerate(self._scheds) for v in s.engine(engine).loaded}

    def loading(self, engine: int) -> set[int]:
        """The engine versions engine `engine` was asked to load and has not reported."""
        return {
            self.version(p, v)
            for p, s in enumerate(self._scheds)
            for v in s.engine(engine).loading - s.engine(engine).loaded
        }

    # ------------------------------------------------------------------ per request
    def prompt_of(self, request_id: str) -> Prompt:
        p, rid = self.split(request_id)
        return self._scheds[p].prompt_of(rid)

    def calls_of(self, request_id: str) -> int:
        p, rid = self.split(request_id)
        return self._scheds[p].calls_of(rid)

    def is_pregen(self, request_id: str) -> bool:
        return Scheduler.is_pregen(self.split(request_id)[1])

    def on_observation(self, request_id: str, token_ids: Sequence[int], now: float) -> None:
        p, rid = self.split(request_id)
        self._scheds[p].on_observation(rid, token_ids, now)

    # ------------------------------------------------------------------ books
    def ledger_record(self) -> dict:
        """Each policy's ledger record, by name."""
        return {n: s.ledger_record() for n, s in zip(self.names, self._scheds)}


def _mapped(values: Sequence[int], f: Callable[[int], int]) -> Sequence[int]:
    """`values` with `f` applied to each. A run-length sequence that maps itself (the simulator's
    `sim.runs.Runs`) maps run by run: a long trajectory's versions are never expanded token by token."""
    own = getattr(values, "map", None)
    return own(f) if own is not None else tuple(f(v) for v in values)
