"""A verb of the command line, as data: what it is called, its flags, the config it takes, its handler.

The dispatcher (cli/__init__.py) and the help (cli/usage.py) both read these records, so the help
lists exactly the flags a verb parses and the config keys it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tailrace.common import ConfigError


@dataclass(frozen=True)
class Flag:
    name: str  # "--resume"
    metavar: str | None  # "RUN_DIR"; None = a switch that takes no value
    doc: str


@dataclass(frozen=True)
class Args:
    flags: dict[str, str]  # the verb's flags that were given -> their value ("" for a switch)
    rest: list[str]  # everything else: --section.key=value overrides, or a positional argument


@dataclass(frozen=True)
class Verb:
    name: str  # as typed after `tailrace`, e.g. "sim calibrate"
    summary: str  # one line, for the parent's list of verbs
    usage: tuple[str, ...]  # the forms it is called in, after `tailrace `
    run: Callable[[Args], int] | None = None  # None: only its sub-verbs do something
    flags: tuple[Flag, ...] = ()
    config: Callable[[], Any] | None = None  # builds the default config its --section.key=value keys set
    sections: tuple[str, ...] | None = None  # the top-level keys of `config` it reads; None = all
    verbs: tuple[Verb, ...] = ()  # sub-verbs, e.g. sim calibrate

    @property
    def word(self) -> str:
        """The last word of its name: what its parent's command line names it by."""
        return self.name.rsplit(" ", 1)[-1]

    def sub(self, word: str) -> Verb | None:
        return next((v for v in self.verbs if v.word == word), None)

    def parse(self, argv: list[str]) -> Args:
        """Pull this verb's flags (`--flag VALUE`, `--flag=VALUE`, or a bare switch) out of argv."""
        flags = {f.name: f for f in self.flags}
        found, rest, i = {}, [], 0
        while i < len(argv):
            name, eq, value = argv[i].partition("=")
            flag = flags.get(name)
            if flag is None:
                rest.append(argv[i])
            elif flag.metavar is None:
                if eq:
                    raise ConfigError(f"{name} is a switch and takes no value; write {name} alone")
                found[name] = ""
            elif eq:
                found[name] = value
            elif i + 1 < len(argv):
                found[name] = argv[i + 1]
                i += 1
            else:
                raise ConfigError(f"{name} needs a value; write {name} {flag.metavar}")
            i += 1
        return Args(found, rest)
