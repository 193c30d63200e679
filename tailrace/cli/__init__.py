"""Command line: tailrace train | sft | eval | report.

    tailrace train [--config run.yaml] [--section.key=value ...] [--resume RUN_DIR]
    tailrace sft   [--sft.key=value ...]          build (or reuse) the warm-started default model
    tailrace eval  [--model.path=DIR] [...]       held-out accuracy and response-length histogram
    tailrace report RUN_DIR                       write RUN_DIR/report.html

Bad input ends in one line naming the problem and the fix (exit code 2); nothing already written to a
run directory is touched by a failing command.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console

from tailrace.errors import ConfigError

console = Console(highlight=False, soft_wrap=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    from tailrace.engine.errors import EngineError
    from tailrace.model.checkpoint import CheckpointError
    from tailrace.tasks.base import TaskError
    from tailrace.tokenizer import TokenizerError

    return ConfigError, CheckpointError, TaskError, TokenizerError, EngineError


def _split(argv: list[str], flags: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull `--flag VALUE` / `--flag=VALUE` for the named flags out of argv; the rest are overrides."""
    found, rest, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in flags:
            if "=" in a:
                found[name] = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                found[name] = argv[i + 1]
                i += 1
            else:
                raise ConfigError(f"{name} needs a value")
        else:
            rest.append(a)
        i += 1
    return found, rest


def _sft_progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    state = {}

    def on_step(step: int, total: int, loss: float) -> None:
        if "p" not in state:
            console.print("warm start: training the default model from scratch (cached for later runs)")
            p = Progress(
                TextColumn("[bold]warm start"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            state["p"], state["t"] = p, p.add_task("sft", total=total, loss=loss)
            p.start()
        state["p"].update(state["t"], completed=step + 1, loss=loss)
        if step + 1 == total:
            state["p"].stop()

    return on_step


def cmd_train(argv: list[str]) -> int:
    from tailrace.cli.choices import check
    from tailrace.config import dump_config, load_config
    from tailrace.report.console import ConsoleUI
    from tailrace.runtime.driver import Driver
    from tailrace.runtime.rundir import RunDir
    from tailrace.runtime.session import Session

    flags, rest = _split(argv, ("--config", "--resume", "--run-dir"))
    resume_from = None
    if "--resume" in flags:
        run = RunDir(flags["--resume"])
        if not run.file("config.yaml").is_file():
            raise ConfigError(
                f"--resume {run.path}: no config.yaml there; pass a run directory written by tailrace train"
            )
        if rest:
            raise ConfigError(
                "--resume continues a run exactly as configured; drop the overrides "
                f"({' '.join(rest)}) or start a new run"
            )
        cfg = load_config(run.file("config.yaml"))
        check(cfg)
        resume_from = run.latest()
        if resume_from is None:
            raise ConfigError(f"--resume {run.path}: no complete checkpoint yet; start the run again instead")
    else:
        cfg = load_config(flags.get("--config"), rest)
        check(cfg)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run = RunDir(flags.get("--run-dir") or Path(cfg.out) / f"{stamp}-{cfg.flow.mode}")
        run.create()
        run.file("config.yaml").write_text(dump_config(cfg))
    session = Session(cfg, progress=_sft_progress())
    ui = ConsoleUI(console)
    console.print(
        f"run directory: {run.path}  (mode {cfg.flow.mode}, {cfg.flow.steps} steps, "
        f"{cfg.flow.prompts_per_round} prompts x {cfg.flow.samples_per_prompt} samples per round)"
    )
    driver = Driver(cfg, run, session, resume_from=resume_from, ui=ui)
    try:
        summary = driver.train()
    finally:
        ui.end()
        driver.close()
        session.close()
    if summary.base_accuracy is not None and summary.final_accuracy is not None:
        gain = 100 * (summary.final_accuracy - summary.base_accuracy)
        console.print(
            f"[bold]held-out accuracy {summary.base_accuracy:.1%} -> {summary.final_accuracy:.1%} "
            f"({gain:+.1f} points) after {summary.steps} steps in {_duration(summary.wall_s)}[/bold]"
        )
    console.print(f"metrics: {run.file('metrics.jsonl')}   report: tailrace report {run.path}")
    return 0


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def cmd_sft(argv: list[str]) -> int:
    from tailrace.cli.choices import check
    from tailrace.config import load_config
    from tailrace.runtime.warmstart import ensure_warm_start, warm_start_dir

    cfg = load_config(None, argv)
    check(cfg)
    cached = (warm_start_dir(cfg.arch, cfg.sft) / "warmstart.json").is_file()
    path = ensure_warm_start(cfg.arch, cfg.sft, _sft_progress())
    console.print(f"{'cached' if cached else 'built'} warm-started model: {path}")
    return 0


def cmd_eval(argv: list[str]) -> int:
    from tailrace.cli.choices import check
    from tailrace.config import load_config
    from tailrace.runtime.standalone import evaluate_model

    cfg = load_config(None, argv)
    check(cfg)
    res = evaluate_model(cfg, progress=_sft_progress())
    console.print(f"model {res['model']}")
    console.print(
        f"held-out accuracy {res['accuracy']:.1%} on {res['n']} prompts of {cfg.task.name} "
        f"(temperature {cfg.eval.temperature})"
    )
    console.print(
        f"response length: p50 {res['p50']:.0f}  p90 {res['p90']:.0f}  p99 {res['p99']:.0f}  "
        f"max {res['max']}  (p99/p50 {res['p99_over_p50']:.1f})"
    )
    peak = max(c for _, _, c in res["histogram"]) or 1
    for lo, hi, c in res["histogram"]:
        console.print(f"  {lo:4d}-{hi:<4d} {c:5d} {'#' * round(40 * c / peak)}")
    return 0


def cmd_report(argv: list[str]) -> int:
    from tailrace.report.html import write_report

    if len(argv) != 1:
        raise ConfigError("usage: tailrace report RUN_DIR")
    out = write_report(Path(argv[0]))
    console.print(f"wrote {out}")
    return 0


def cmd_sim(argv: list[str]) -> int:
    """tailrace sim --config SCENARIO.yaml [--out DIR] [--key=value ...]   simulate a scenario (a run directory)
    tailrace sim --like RUN_DIR [--out DIR] [--key=value ...]      a real run's setup on the cpu preset, compared
    tailrace sim calibrate [--quick] [--dtype D [--out FILE]]      fit the cpu presets on this machine (fp32, bf16)
    tailrace sim presets                                           hardware and model presets"""
    from tailrace.cli.choices import check_names
    from tailrace.report.html import write_report
    from tailrace.sim import compare, scenario

    if argv[:1] == ["calibrate"]:
        from tailrace.sim_calibrate import calibrate

        flags, rest = _split(argv[1:], ("--out", "--dtype"))
        dtypes = flags.get("--dtype", "float32,bfloat16").split(",")
        if (
            any(a != "--quick" for a in rest)
            or any(d not in ("float32", "bfloat16") for d in dtypes)
            or ("--out" in flags and len(dtypes) > 1)
        ):
            raise ConfigError(
                "usage: tailrace sim calibrate [--quick] [--dtype float32|bfloat16 [--out FILE]]"
            )
        for d in dtypes:
            res = calibrate(
                Path(flags["--out"]) if "--out" in flags else None,
                quick="--quick" in rest,
                progress=console.print,
                dtype=d,
            )
            console.print(
                f"saved the {res['hardware']['name']} preset "
                f"(load average {res['load_average'][0]:.1f} while measuring)"
            )
        return 0
    if argv[:1] == ["presets"]:
        from tailrace.sim.hardware import CPU_PRESETS, GPUS
        from tailrace.sim.models import MODELS

        console.print("hardware: " + ", ".join([*GPUS, *CPU_PRESETS]))
        console.print("models:   " + ", ".join(f"{k} ({m.params / 1e9:.2f}B)" for k, m in MODELS.items()))
        return 0
    flags, rest = _split(argv, ("--config", "--like", "--out"))
    if "--like" in flags:
        scn = scenario.apply_overrides(scenario.scenario_from_run(flags["--like"]), rest)
    elif "--config" in flags:
        scn = scenario.load_scenario(flags["--config"], rest)
    else:
        raise ConfigError("usage: tailrace sim --config SCENARIO.yaml | --like RUN_DIR | calibrate | presets")
    check_names(scn)
    out = Path(flags.get("--out") or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-sim-{scn.name}")
    console.print(
        f"simulating {scn.name}: {scn.cluster.gpus} devices ({scn.cluster.hardware}), "
        f"{scn.flow.mode}, {scn.flow.steps} steps -> {out}"
    )
    s = scenario.simulate(scn, out)
    console.print(
        f"{s['steps']} steps in {s['wall_s']:.1f} simulated s ({s['sim_seconds']:.1f} s to simulate): "
        f"{s['time_per_step_s']:.2f} s/step, trainer waiting {s['trainer_wait_ratio']:.2f}, "
        f"bubble {s['bubble_ratio']:.2f}, length bubble {s['length_bubble']:.2f}"
    )
    write_report(out)
    if "--like" in flags:
        real, sim = compare.step_figures(flags["--like"]), compare.step_figures(out)
        for name, r, m, err in compare.compare(real, sim):
            console.print(f"  {name:20s} real {r:10.3f}  sim {m:10.3f}  ({err:+.1%})")
    console.print(f"report: {out / 'report.html'}")
    return 0


COMMANDS = {"train": cmd_train, "sft": cmd_sft, "eval": cmd_eval, "report": cmd_report, "sim": cmd_sim}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except _user_errors() as e:
        console.print(f"[red]error:[/red] {e}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; the run directory keeps everything so far (continue with --resume)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
