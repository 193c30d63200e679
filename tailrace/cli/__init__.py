"""Command line: tailrace train | sft | eval | serve | model | engine | policy | report | trace | sim.
`tailrace VERB --help` documents each verb.

Every way a command can end is one line and an exit code:
    0    done
    2    bad input (a config value, a path, a checkpoint, a dataset, a run directory): the line names
         it and the fix; nothing already in a run directory is touched
    3    a fault while running (a worker died, hung or failed; training went non-finite; the disk
         filled): the line gives the cause; the run directory keeps everything up to its last checkpoint
    130  Ctrl-C, 143 SIGTERM: the run directory keeps everything so far (continue with --resume)
"""

from __future__ import annotations

import atexit
import difflib
import os
import signal
import sys
import threading
import warnings
from typing import Any

from rich.text import Text

from tailrace.cli import commands, sim
from tailrace.cli.commands import Terminated, console
from tailrace.cli.verb import Flag, Verb
from tailrace.common import ConfigError, Fault, InputError, one_line
from tailrace.config import RunConfig
from tailrace.records import DamagedLineWarning

KEYS = "[--section.key=VALUE ...]"


def _scenario() -> Any:
    from tailrace.sim.scenario import Scenario  # numpy and the simulator: only for tailrace sim

    return Scenario()


TAILRACE = Verb(
    "",
    "Fast RL post-training (GRPO family) of language models.",
    ("VERB [-h] [...]",),
    verbs=(
        Verb(
            "train",
            "RL post-training: warm-start or load the policy, then rollout and GRPO steps, evaluated",
            (
                f"train [--supervise] [--config FILE] [--run-dir DIR] {KEYS}",
                "train [--supervise] --resume RUN_DIR",
            ),
            commands.train,
            flags=(
                Flag("--config", "FILE", "a YAML file of config keys (section: {key: value}); overrides win"),
                Flag("--run-dir", "DIR", "the new run directory (default: OUT/<date>-<time>-<mode>)"),
                Flag("--resume", "RUN_DIR", "continue a killed run from its last checkpoint, as configured"),
                Flag(
                    "--supervise",
                    None,
                    "run the driver as a child process and resume it (--resume) when it dies of a fault, "
                    "at most max_restarts times an hour",
                ),  # fmt: skip
            ),
            config=RunConfig,
        ),
        Verb(
            "sft",
            "build (or reuse, from the cache) the warm-started built-in model",
            (f"sft {KEYS}",),
            commands.sft,
            config=RunConfig,
            sections=("arch", "sft"),
        ),
        Verb(
            "eval",
            "held-out accuracy and response-length histogram of a model, or of every checkpoint of a run",
            (f"eval {KEYS}", "eval RUN_DIR [--eval.KEY=VALUE ...]"),
            commands.evaluate,
            config=RunConfig,
            sections=("model", "arch", "task", "sft", "rollout", "eval", "seed", "device"),
        ),
        Verb(
            "serve",
            "an OpenAI-compatible endpoint (completions, chat completions, streaming) on a rollout engine, "
            "with the policy version and token logprobs in every response",
            (f"serve {KEYS}",),
            commands.serve,
            config=RunConfig,
            sections=("model", "arch", "task", "sft", "rollout", "serve", "seed", "device"),
        ),
        Verb(
            "report",
            "write RUN_DIR/report.html (timeline, lengths, rewards), or one page comparing several runs",
            ("report RUN_DIR", "report RUN_DIR RUN_DIR ... [--out FILE] [--target ACCURACY]"),
            commands.report,
            flags=(
                Flag("--out", "FILE", "where the comparison page goes (default: compare.html)"),
                Flag("--target", "ACCURACY", "the accuracy to time runs to (default: lowest final - 0.02)"),
            ),
        ),
        Verb(
            "model",
            "model checkpoints: import a GGUF file or a transformers directory",
            ("model import SRC --out DIR [--dtype D]",),
            verbs=(
                Verb(
                    "model import",
                    "turn a GGUF file (dequantized) or a transformers checkpoint directory (safetensors) "
                    "into a checkpoint tailrace reads, tokenizer and chat template included",
                    ("model import SRC --out DIR [--dtype D]",),
                    commands.import_model,
                    flags=(
                        Flag("--out", "DIR", "the new checkpoint directory"),
                        Flag("--dtype", "D", "float32 (default) or bfloat16: the weights' dtype on disk"),
                    ),
                ),
            ),
        ),
        Verb(
            "engine",
            "rollout engines that join a running job (tailrace train, local or on Ray) or leave it",
            ("engine join RUN_DIR [--cores LIST]", "engine leave RUN_DIR ENGINE_ID"),
            verbs=(
                Verb(
                    "engine join",
                    "start a rollout engine (the run's engine config, a free core if there is one) that "
                    "joins the job running in RUN_DIR and works until the run ends or it is told to "
                    "leave (engine leave, or SIGTERM to this process)",
                    ("engine join RUN_DIR [--cores LIST]",),
                    commands.engine_join,
                    flags=(
                        Flag("--cores", "LIST", "the cores to pin it to, e.g. 0 or 2,3 (default: see above)"),
                    ),
                ),
                Verb(
                    "engine leave",
                    "remove engine ENGINE_ID from the job running in RUN_DIR (its in-flight samples are "
                    "requeued, none lost); its id is in RUN_DIR/events.jsonl (engine_join) or its join line",
                    ("engine leave RUN_DIR ENGINE_ID",),
                    commands.engine_leave,
                ),
            ),
        ),
        Verb(
            "policy",
            "policies (tenants) that join a running run (tailrace train with max_policies) or leave it",
            ("policy join RUN_DIR NAME [--section.key=value ...]", "policy leave RUN_DIR NAME"),
            verbs=(
                Verb(
                    "policy join",
                    "add policy NAME to the run in RUN_DIR: the run's config with these overrides of the "
                    "sections a policy sets (task, flow, shaping, store, train, eval, seed), its own "
                    "scheduler, versions and trainer on the run's engines; files in RUN_DIR/policies/NAME",
                    ("policy join RUN_DIR NAME [--section.key=value ...]",),
                    commands.policy_join,
                ),
                Verb(
                    "policy leave",
                    "policy NAME of the run in RUN_DIR trains one more step, checkpointed, and stops",
                    ("policy leave RUN_DIR NAME",),
                    commands.policy_leave,
                ),
            ),
        ),
        Verb(
            "trace",
            "write RUN_DIR/trace.json, the run as a Chrome/Perfetto trace (engines, trainer, weight sync, "
            "each step's longest requests)",
            ("trace RUN_DIR",),
            commands.trace,
        ),
        Verb(
            "sim",
            "simulate a scenario (a run directory), or a real run's setup on the cpu preset, compared",
            (
                f"sim --config SCENARIO.yaml [--out DIR] {KEYS}",
                f"sim --like RUN_DIR [--out DIR] {KEYS}",
                "sim calibrate [--quick] [--dtype D] [--out FILE]",
                "sim presets",
            ),
            sim.simulate,
            flags=(
                Flag("--config", "FILE", "the scenario, a YAML file of the keys below"),
                Flag("--like", "RUN_DIR", "the scenario of a real run (its flow, rollout, model, lengths)"),
                Flag("--out", "DIR", "the simulated run directory (default: runs/<date>-<time>-sim-<name>)"),
            ),
            config=_scenario,
            verbs=(
                Verb(
                    "sim calibrate",
                    "fit the simulator's cpu presets to this machine (fp32 cpu, bf16 cpu-bf16)",
                    ("sim calibrate [--quick] [--dtype D] [--out FILE]",),
                    sim.calibrate,
                    flags=(
                        Flag("--quick", None, "fewer, shorter measurements"),
                        Flag("--dtype", "D", "float32, bfloat16, or both: float32,bfloat16 (the default)"),
                        Flag("--out", "FILE", "write the preset here instead of the cache (one dtype only)"),
                    ),
                ),
                Verb("sim presets", "list the hardware and model presets", ("sim presets",), sim.presets),
            ),
        ),
    ),
)


def _find(argv: list[str]) -> tuple[Verb, list[str]]:
    """The verb argv names (following sub-verbs) and the arguments after it."""
    verb = TAILRACE
    while argv and verb.verbs and not argv[0].startswith("-"):
        sub = verb.sub(argv[0])
        if sub is None and verb.run is None:
            names = [v.word for v in verb.verbs]
            close = difflib.get_close_matches(argv[0], names, n=1)
            hint = f"did you mean {close[0]}?" if close else f"use one of {', '.join(names)}"
            raise ConfigError(f"unknown verb {argv[0]!r}; {hint} (tailrace --help lists them)")
        if sub is None:
            break
        verb, argv = sub, argv[1:]
    return verb, argv


def _check_sections(verb: Verb, overrides: list[str]) -> None:
    """A verb that reads only some sections rejects keys of the others instead of ignoring them."""
    from tailrace.config.load import parse_overrides

    for key, value in parse_overrides(overrides).items():
        if key not in verb.sections:
            raise ConfigError(
                f"tailrace {verb.name} does not read {key}{'.*' if isinstance(value, dict) else ''}; "
                f"it reads {', '.join(verb.sections)} (tailrace {verb.name} --help lists the keys)"
            )


def entry() -> None:
    """The `tailrace` console script: `main`, then out without the interpreter's teardown of its
    modules, which took ~1 s after every run (torch's). The exit handlers still run (Ray's shutdown,
    multiprocessing's children), and stdout and stderr are flushed. Every file a run holds open is
    line-buffered (`rundir.RecordFile`), and the rest are closed by their writers. A thread still
    running, not a daemon, gets the ordinary exit, which waits for it."""
    rc = main()
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(rc)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    Terminated.received = False  # main may run again in one process (the tests)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", DamagedLineWarning)
            warnings.showwarning = _warn
            return _run(argv)
    except InputError as e:
        return _error(e, 2)
    except (Fault, OSError) as e:  # OSError: the disk filled, a directory turned read-only, ...
        return _error(e, 3)
    except KeyboardInterrupt as e:
        console.print("terminated" if Terminated.by(e) else "interrupted")
        return 143 if Terminated.by(e) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(argv: list[str]) -> int:
    verb, rest = _find(argv)
    if "-h" in rest or "--help" in rest or (verb.run is None and not rest):
        from tailrace.cli.usage import render

        print(render(verb))
        return 0
    if verb.run is None:
        raise ConfigError(
            f"{rest[0]}: name a verb first, e.g. tailrace train {rest[0]} (see tailrace --help)"
        )
    args = verb.parse(rest)
    if verb.sections is not None:  # (a positional argument, like eval's RUN_DIR, is the verb's own)
        _check_sections(verb, [a for a in args.rest if a.startswith("-")])
    return verb.run(args)


def _error(e: BaseException, code: int) -> int:
    console.print(Text("error:", style="red"), one_line(e))
    return code


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    console.print(Text("warning:", style="yellow"), str(message))


def _terminate(signum, frame) -> None:
    Terminated.received = True
    raise Terminated()
