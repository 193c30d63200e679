"""YAML files and `--section.key=value` overrides, mapped mechanically onto the config dataclasses.

An unknown key (with a did-you-mean hint), a value of the wrong type or a non-finite number is a
one-line `ConfigError` before any process starts; each section then validates its values in `__post_init__`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tailrace.common import ConfigError
from tailrace.config.run import RunConfig


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert `value` to the annotated type `tp`; strings from the CLI are parsed as YAML."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. [1, 2]")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return origin(_coerce(v, inner, key) for v in value)
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(map(str, typing.get_args(tp)))}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}={value!r}: expected a number")
        if not math.isfinite(number):  # every float key: inf and nan only ever poison a run
            raise ConfigError(f"{key}={value!r}: must be a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r}: expected a string")
    return value


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of `cls`, nested sections spelled out."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        out += _keys(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [prefix + name]
    return out


def _unknown(key: str, fields: list[str], prefix: str, root: type) -> ConfigError:
    """A typo gets the close key of its section; a key that lives in another section gets that one."""
    guess = [prefix + k for k in difflib.get_close_matches(key, fields, n=1)]
    guess = guess or [k for k in _keys(root) if k.rsplit(".", 1)[-1] == key]
    either = ", ".join(guess[:-1]) + " or " + guess[-1] if len(guess) > 1 else "".join(guess)  # a, b or c
    hint = f"did you mean {either}?" if guess else f"valid keys: {', '.join(fields)}"
    return ConfigError(f"unknown config key {prefix}{key}; {hint}")


# keys a release removed, and why: a config file that still holds one (an older run directory's
# config.yaml, which resume, `tailrace sim --like` and the report read back) loads without it; an
# override that names one is refused with the reason
RETIRED = {
    "shaping.extra_time": "darts' budget of extra candidates comes from its benefit model now "
    "(flow/shaping/benefit.py); use shaping.extra for a fixed share",
}


def _retired_in(tree: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The retired keys `tree` holds, each with the mapping it sits in."""
    found = []
    for key in RETIRED:
        *sections, last = key.split(".")
        node: Any = tree
        for s in sections:
            node = node.get(s) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            found.append((key, node))
    return found


def _build(cls: type, data: dict[str, Any], prefix: str, root: type) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(key, fields, prefix, root)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.", root)
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


def _set_path(tree: dict[str, Any], dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: {p} is not a section")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """["--train.lr=1e-4", "--flow.mode", "pipe"] -> nested dict."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise ConfigError(f"unexpected argument {a!r}; overrides look like --section.key=value")
        body = a[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"--{body} has no value; write --{body}=VALUE")
        _set_path(tree, key, raw)
        i += 1
    return tree


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# what a policy of a several-policy run may set for itself; the rest (model, rollout, runtime, ...)
# is the run's: the engines it shares hold every policy's weights in the one model's layout
POLICY_SECTIONS = ("task", "flow", "shaping", "store", "train", "eval", "seed")
# the keys of those sections that are still the run's: its clock and checkpoints, how the policies
# share the trainer's cores, the driver's one tool pool (every multi-turn policy's tools run there)
RUN_WIDE = {
    "flow": ("time_limit_s", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "share"),
    "task": ("tool_threads",),
}


def policy_configs(cfg: Any, sections: tuple[str, ...] = POLICY_SECTIONS) -> list[tuple[str, Any]]:
    """(name, the run's config with its overrides) for each policy of `cfg.policies`; one unnamed
    ("") policy, `cfg` itself, when there are none. Each is validated as a whole config is. `cfg`: a
    RunConfig, or any config with `policies` (the simulator's Scenario), whose policies may set
    `sections`."""
    if not cfg.policies:
        return [("", cfg)]
    base = dataclasses.asdict(cfg)
    base["policies"] = []
    if "max_policies" in base:  # the run's room for joiners, not a policy's
        base["max_policies"] = None
    out: list[tuple[str, Any]] = []
    for i, entry in enumerate(cfg.policies):
        where = f"policies[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(
                f"{where}: each policy is a mapping with a name, e.g. {{name: sums, flow: {{mode: sync}}}}"
            )
        name = entry["name"]
        if "/" in name or name in {n for n, _ in out}:
            raise ConfigError(f"{where}.name={name!r}: give each policy a unique name without '/'")
        for key, value in entry.items():
            if key != "name" and key not in sections:
                raise ConfigError(
                    f"{where}.{key}: a policy sets only {', '.join(sections)}; {key} is the run's, "
                    f"shared by every policy: set it outside policies"
                )
            if isinstance(value, dict):
                for k in sorted(set(value) & set(RUN_WIDE.get(key, ()))):
                    raise ConfigError(
                        f"{where}.{key}.{k}: the run's, not a policy's: set {key}.{k} outside policies"
                    )
        over = {k: v for k, v in entry.items() if k != "name"}
        try:
            out.append((name, _build(type(cfg), _merge(base, over), "", type(cfg))))
        except ConfigError as e:
            raise ConfigError(f"{where} ({name}): {e}") from None
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, cls: type = RunConfig
) -> Any:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass an existing YAML file to --config")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"config file {p} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {p} holds a {type(data).__name__}, not a mapping; write `section: {{key: value}}`"
            )
    over = parse_overrides(overrides or [])
    for key, _ in _retired_in(over):
        raise ConfigError(f"--{key} was removed: {RETIRED[key]}")
    data = copy.deepcopy(data)
    for key, node in _retired_in(data):
        del node[key.rsplit(".", 1)[1]]
    data = _merge(data, over)
    cfg = _build(cls, data, "", cls)
    if cls is RunConfig:
        policy_configs(cfg)  # a bad policy entry fails here, before any process starts
    return cfg


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
