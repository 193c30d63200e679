"""`--help`, generated: a verb's usage, flags and sub-verbs, then every config key it takes.

Each key is listed with its type, default and one-line meaning, read from the config dataclasses (the
field's metadata, its annotation, the value of a default-built config); a field that names a registry
entry lists the registry's names (cli/choices.py). Nothing here is a second, hand-kept list of keys.
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
import types
import typing
from typing import Any, Collection, Iterator

from tailrace.cli.choices import Registries, registries
from tailrace.cli.verb import Verb
from tailrace.config.fields import doc

COLUMN = 34  # where the meanings start
NBSP = "\u00a0"  # textwrap breaks lines at ASCII whitespace only


def render(verb: Verb) -> str:
    lines = ["usage: " + "\n       ".join(f"tailrace {u}" for u in verb.usage), "", verb.summary]
    if verb.verbs:
        lines += ["", "verbs:", *(_row(v.word, v.summary) for v in verb.verbs)]
    lines += ["", "options:", _row("-h, --help", "show this help and exit")]
    lines += [_row(f"{f.name} {f.metavar or ''}".rstrip(), f.doc) for f in verb.flags]
    if verb.config is not None:
        cfg = verb.config()
        fields = [f for f in dataclasses.fields(cfg) if verb.sections is None or f.name in verb.sections]
        lines += ["", "config keys, as --section.key=VALUE (VALUE is YAML: 1e-4, true, null, [0.9, 0.95]):"]
        lines += _section(cfg, fields, "", registries())
    if verb.verbs:
        lines += ["", f"`{' '.join(filter(None, ('tailrace', verb.name, 'VERB --help')))}` tells more."]
    return "\n".join(lines)


def _section(cfg: Any, fields: list[dataclasses.Field], prefix: str, table: Registries) -> Iterator[str]:
    """A section's own keys first, then each nested section under a heading of its own."""
    hints = typing.get_type_hints(type(cfg))
    nested = [f for f in fields if dataclasses.is_dataclass(getattr(cfg, f.name))]
    for f in fields:
        if f not in nested:
            value = getattr(cfg, f.name)
            choices = table.get((type(cfg), f.name))
            left = f"--{prefix}{f.name} {type_name(hints[f.name], choices)}"
            default = f"[default: {yaml_value(value)}]".replace(" ", NBSP)  # wrapped as one word
            yield _row(left, f"{doc(f)} {default}".lstrip(), indent=4)
    for f in nested:
        sub = getattr(cfg, f.name)
        yield f"  {prefix}{f.name}" + (f": {doc(f)}" if doc(f) else "")
        yield from _section(sub, list(dataclasses.fields(sub)), f"{prefix}{f.name}.", table)


def type_name(tp: Any, choices: Collection[str] | None = None) -> str:
    """The annotation as the command line spells values: INT, FLOAT|null, {a,b}, [FLOAT,FLOAT]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return "|".join(type_name(a, choices) for a in args if a is not type(None)) + "|null"
    if choices is not None or origin is typing.Literal:
        return "{" + ",".join(map(str, choices if choices is not None else args)) + "}"
    if origin in (tuple, list):
        return (
            "["
            + ",".join(type_name(a) for a in args if a is not Ellipsis)
            + (",..." if origin is list else "")
            + "]"
        )
    if origin is dict:
        return "{KEY: VALUE}"
    return {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR"}.get(tp, "VALUE")


def yaml_value(v: Any) -> str:
    """A default as it would be written in YAML or on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(yaml_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(x)}" for k, x in v.items()) + "}"
    return str(v) if v != "" else '""'


def _row(left: str, right: str, indent: int = 2) -> str:
    """`left` in the first column, `right` wrapped in the second (on the next line if left is long)."""
    width = max(80, min(shutil.get_terminal_size((100, 24)).columns, 120))
    head = " " * indent + left
    lines = textwrap.wrap(right, width - COLUMN) or [""]
    if len(head) + 2 > COLUMN:
        out = [head] + [" " * COLUMN + line for line in lines]
    else:
        out = [head.ljust(COLUMN) + lines[0]] + [" " * COLUMN + line for line in lines[1:]]
    return "\n".join(line.rstrip().replace(NBSP, " ") for line in out)
