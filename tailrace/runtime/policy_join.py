"""Policies that join a running run and leave it: `tailrace policy join RUN_DIR NAME [--section.key=value
...]`, `tailrace policy leave RUN_DIR NAME` — tenants coming to and going from a running service
(MARLaaS), each with its own task, scheduler, versions, trainer and, in a LoRA run, its own adapter on
the engines' one base model.

A run takes joiners when it starts with a policies list (even of one) and room for more
(`max_policies`): the engines' space of versions is laid out for that many when the run starts
(flow/multi.py). The joiner's entry is the one it would have in the config's policies list (its name
and any of the policy sections); it is checked here against the run's config.yaml, as the run checks
its own policies, before anything is sent. The driver checks what only it knows (the name free, room
left, the shared memory's staleness), starts the policy's trainer, evaluates its base weights, appends
the entry to RUN_DIR/config.yaml (so `--resume` brings it back) and answers in one line; the policy's
files go to RUN_DIR/policies/NAME/ like those of the policies the run started with.

A policy that leaves trains one more step, checkpointed as its last; its final evaluation comes when
the run ends.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tailrace.common import ConfigError, Fault, InputError
from tailrace.config.load import load_config, parse_overrides, policy_configs
from tailrace.runtime.join import PolicyJoin, PolicyLeave, connect

ANSWER_S = 900.0  # a join starts a trainer process and evaluates the base weights: minutes at most


def entry_for(run_dir: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    """The joining policy's entry of the run's policies list, its values typed as the run's config.yaml
    holds them, checked against that config as the run checks its own policies."""
    from tailrace.cli.choices import check  # (the registries: torch)

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise InputError(
            f"{run_dir}: no config.yaml there; pass the run directory of a running tailrace train"
        )
    cfg = load_config(path)
    if not cfg.policies or (cfg.max_policies or len(cfg.policies)) <= len(cfg.policies):
        raise ConfigError(
            f"{run_dir}: the run has no room for another policy (policies: {len(cfg.policies)}, max_policies: "
            f"{cfg.max_policies}); start runs that take joiners with a policies list and room, e.g. "
            "--policies='[{name: main}]' --max_policies=4"
        )
    entry = {"name": name, **parse_overrides(overrides)}
    joined = dataclasses.replace(cfg, policies=[*cfg.policies, entry])
    try:
        _, pc = policy_configs(joined)[-1]
    except ConfigError as e:
        raise ConfigError(str(e).replace(f"policies[{len(cfg.policies)}] ", "")) from None
    check(joined)
    return _typed(entry, pc)


def _typed(entry: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """`entry` (its leaves strings from the command line) with each leaf as `cfg` holds it."""
    out = {}
    for k, v in entry.items():
        if k == "name":
            out[k] = v
        elif isinstance(v, dict):
            out[k] = _typed(v, getattr(cfg, k))
        else:
            out[k] = getattr(cfg, k)
    return out


def ask(run_dir: Path, msg: PolicyJoin | PolicyLeave) -> tuple[bool, str]:
    """Send `msg` to the job running in `run_dir` and wait for its answer: (done, its line)."""
    with connect(run_dir) as conn:
        conn.send(msg)
        if not conn.poll(ANSWER_S):
            raise Fault(f"{run_dir}: no answer in {ANSWER_S:.0f} s; its events.jsonl says what became of it")
        try:
            return conn.recv()
        except EOFError:
            raise Fault(f"{run_dir}: the run ended before it answered") from None


def join_policy(run_dir: Path, name: str, overrides: list[str]) -> str:
    """Policy `name` (the run's config with `overrides` of its policy sections) joins the run."""
    ok, line = ask(run_dir, PolicyJoin(entry_for(run_dir, name, overrides)))
    if not ok:
        raise InputError(line)
    return line


def leave_policy(run_dir: Path, name: str) -> str:
    ok, line = ask(run_dir, PolicyLeave(name))
    if not ok:
        raise InputError(line)
    return line
