"""The verbs that run on the run config: train, sft, eval, and report on what train wrote."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path

from rich.console import Console

from tailrace.cli.verb import Args
from tailrace.common import ConfigError, Fault, InputError, one_line
from tailrace.config import RunConfig, dump_config, load_config

# markup off: what tailrace prints is text, and paths and messages may hold [brackets]; a styled line
# says its style (style="bold"), never in markup
console = Console(highlight=False, soft_wrap=True, markup=False)


def _sft_progress():
    announce = {}

    def on_step(step: int, total: int, loss: float) -> None:
        if not announce:
            console.print("warm start: training the default model from scratch (cached for later runs)")
            announce["bar"] = _progress("warm start", "steps")
        announce["bar"](step + 1, total, f"loss {loss:.3f}")

    return on_step


def _eval_progress():
    return _progress("evaluating", "responses")


def _progress(label: str, unit: str):
    """on(done, total, note=""): a progress bar with an ETA on a terminal; where the output is not a
    terminal (a log file), a plain line at every tenth instead ("evaluating: 64/625 responses, ETA 55 s")."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    state = {}

    def on(done: int, total: int, note: str = "") -> None:
        if not console.is_terminal:
            t0 = state.setdefault("t0", time.perf_counter())
            tenth = done * 10 // total
            if tenth > state.get("tenth", 0):
                state["tenth"] = tenth
                eta = (time.perf_counter() - t0) * (total - done) / done
                print(
                    f"{label}: {done}/{total} {unit}, ETA {eta:.0f} s{', ' + note if note else ''}",
                    flush=True,
                )
            return
        if "p" not in state:
            p = Progress(
                TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]} ETA"),
                TimeRemainingColumn(), console=console, transient=True,
            )  # fmt: skip
            state["p"], state["t"] = p, p.add_task(label, total=total, note=note)
            p.start()
        state["p"].update(state["t"], completed=done, note=note)
        if done >= total:
            state.pop("p").stop()

    return on


def load(path: str | Path | None, overrides: list[str]) -> RunConfig:
    """The run config of a file and overrides, every registry name in it checked."""
    return load_run(path, overrides)[0]


def load_run(path: str | Path | None, overrides: list[str]) -> tuple[RunConfig, str | None]:
    """`load`, and why the run has its overlap mode where flow.mode is null (the recommended one)."""
    return checked_run(load_config(path, overrides))


def checked_run(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """A loaded config with its overlap mode settled (`with_mode`) and every registry name checked."""
    from tailrace.cli.choices import check  # the registries: torch
    from tailrace.runtime.run_modes import with_mode

    cfg, why = with_mode(cfg)
    check(cfg)
    return cfg, why


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (exit code 143 instead of 130). `received` stays set once one
    came: a library may catch it and raise a plain KeyboardInterrupt of its own (Ray's `ray.get` and
    `ray.wait` do), and the run must still exit 143 (a supervisor restarts after neither, but says which)."""

    received = False

    @classmethod
    def by(cls, e: KeyboardInterrupt) -> bool:
        """Whether `e` ended the run because of SIGTERM."""
        return isinstance(e, cls) or cls.received


def train(args: Args) -> int:
    flags, rest = args.flags, args.rest
    if "--supervise" in flags:  # the supervisor's driver, a child, starts its workers itself
        return _supervise(flags, rest)
    loaded = None if "--resume" in flags else load_config(flags.get("--config"), rest)  # no torch yet
    _start_workers_early(loaded, flags.get("--resume"))
    from tailrace.cli.choices import check, check_backend, slow_settings
    from tailrace.runtime.lock import RunLock
    from tailrace.runtime.resume import plan_resume
    from tailrace.runtime.run_modes import with_mode
    from tailrace.runtime.rundir import RunDir, repair

    if "--resume" in flags:
        run = RunDir(flags["--resume"])
        if not run.file("config.yaml").is_file():
            raise ConfigError(
                f"--resume {run.path}: no config.yaml there; pass a run directory written by tailrace train"
            )
        extension = _extend(run, rest) if rest else None
    else:
        cfg, why = checked_run(loaded)
        check_backend(cfg)
        for line in slow_settings(cfg):
            console.print(line)
        cfg.train.lora.check_init()  # train.lora.init is read when the run starts (policies share it)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run = RunDir(flags.get("--run-dir") or Path(cfg.out) / f"{stamp}-{cfg.flow.mode}")
        run.create()
    with RunLock(run.path):  # held until the run ends: a second process is refused, naming this one
        resume = None
        if "--resume" in flags and extension is not None:  # under the lock: no run of it is going on
            tmp = run.file("config.yaml.tmp")
            tmp.write_text(extension)
            os.replace(tmp, run.file("config.yaml"))
        if "--resume" in flags and (planned := _plan_policies(run)) is not None:
            cfg, resume = planned  # a run of several policies: each resumes from its own checkpoint
            cfg, why = with_mode(cfg)
            check(cfg)
            check_backend(cfg)
            for k, res in enumerate(resume):
                if isinstance(res, RunDir):  # no checkpoint yet: its records but the base evaluation go
                    _start_over(res)
                    console.print(f"{res.path.name}: no checkpoint yet, so it starts over")
                    resume[k] = None
                    continue
                for note in res.commit():
                    console.print(f"{res.run.path.name}: {note}")
            repaired = repair(run.file("events.jsonl")).message()  # the engines' timeline
            if repaired:
                console.print(repaired)
        elif "--resume" in flags:
            resume = plan_resume(run)
            cfg, why = with_mode(resume.cfg)  # a config.yaml written with flow.mode null
            check(cfg)
            check_backend(cfg)
            for note in resume.commit():
                console.print(note)
        else:
            run.begin(dump_config(cfg))
        return _train(cfg, run, resume, why)


EXTEND = ("--flow.steps", "--flow.time_limit_s")  # what `--resume RUN` may be given: a run trained on


def _extend(run, rest: list[str]) -> str:
    """`--resume RUN --flow.steps=N [--flow.time_limit_s=S]`: the run, finished or not, trains on to N
    steps from its newest checkpoint (its optimizer and books as they were). The new values go into
    RUN/config.yaml before anything starts; anything else given is refused, as is a run of several
    policies (each has its own steps), fewer steps, or a time limit the run has already reached. Returns
    the new config.yaml (written once the run's lock is held)."""
    from tailrace.records import StepRecord, read_metrics
    from tailrace.runtime.resume import train_on
    from tailrace.runtime.rundir import policy_dirs

    keys = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    if not keys <= set(EXTEND):
        why = " (a run of one policy may train on: --flow.steps=N, --flow.time_limit_s=S)"
    elif policy_dirs(run.path):
        why = " (a run of several policies is not trained on: each policy has its own flow.steps)"
    else:
        why = ""
    if why:
        raise ConfigError(
            "--resume continues a run exactly as configured; drop the overrides "
            f"({' '.join(rest)}) or start a new run" + train_on(run) + why
        )
    then = load_config(run.file("config.yaml"))
    now = load_config(run.file("config.yaml"), rest)
    if now.flow.steps < then.flow.steps:
        raise ConfigError(
            f"--resume {run.path} --flow.steps={now.flow.steps}: the run has {then.flow.steps} steps; a run's "
            "steps may only grow"
        )
    metrics = run.file("metrics.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged line: the resume repairs it and says so
        steps = [r for r in read_metrics(metrics) if isinstance(r, StepRecord)] if metrics.is_file() else []
    if now.flow.steps == then.flow.steps and len(steps) >= then.flow.steps:
        raise ConfigError(
            f"--resume {run.path}: the run trained all its {then.flow.steps} steps; pass a larger --flow.steps "
            "to train it on"
        )
    limit = now.flow.time_limit_s
    if limit is not None and steps and steps[-1].time["wall_s"] >= limit:
        raise ConfigError(
            f"--resume {run.path}: the run has trained {steps[-1].time['wall_s']:.0f} s, past "
            f"flow.time_limit_s={limit:g}; pass a larger --flow.time_limit_s (or null) too"
        )
    return dump_config(now)


def _start_workers_early(cfg: RunConfig | None, resume: str | None) -> None:
    """A local run's fork server starts before this process imports torch, so the two imports overlap
    (`procs.start_fork_server`). `cfg`: the new run's config, or None for `--resume` of `resume`, whose
    config.yaml is read here (no torch); one that does not load, or a Ray run, starts nothing: the
    resume's own checks say what is wrong."""
    if cfg is None:
        try:
            cfg = load_config(Path(resume) / "config.yaml", [])
        except Exception:  # noqa: BLE001 -- best effort: plan_resume reads it again and reports it
            return
    if cfg.runtime.kind == "local":
        from tailrace.runtime.procs import start_fork_server

        start_fork_server()


def _plan_policies(run):
    """A run of several policies resumes policy by policy, each from its own newest checkpoint
    (`plan_resume` on policies/<name>/; one that finished waits for the others): (the run's config, each
    policy's Resume, or its RunDir where it has no checkpoint yet and starts over), or None for a run of
    one policy. Checked before anything changes; the run's config.yaml must still make each policy's."""
    from tailrace.config.load import policy_configs
    from tailrace.runtime import checkpoint
    from tailrace.runtime.resume import Resume, changed_keys, plan_resume, train_on
    from tailrace.runtime.rundir import RunDir

    try:
        cfg = load_config(run.file("config.yaml"))
    except ConfigError:
        return None  # the resume's own checks say what is wrong
    if not cfg.policies:
        return None
    resumes = []
    for name, pc in policy_configs(cfg):
        pol = RunDir(run.path / "policies" / name)
        if not checkpoint.step_dirs(pol.ckpt):  # killed before its first checkpoint: it starts over
            resumes.append(pol)
            continue
        res = plan_resume(pol, finished_ok=True)
        keys = changed_keys(res.cfg, pc)
        if keys:
            raise ConfigError(
                f"--resume {run.path}: its config.yaml changed policy {name}'s {', '.join(keys)} since the run "
                f"wrote {res.run.file('config.yaml')}; restore them, or start a new run"
            )
        resumes.append(res)
    if all(isinstance(r, Resume) and r.finished for r in resumes):
        raise InputError(
            f"--resume {run.path}: the run finished (every policy wrote its final evaluation); start a new run "
            f"(tailrace report {run.path} compares its policies)"
            + train_on(resumes[0].run, f"policy {resumes[0].run.path.name}'s")
        )
    return cfg, resumes


def _start_over(pol) -> None:
    """A policy of a run of several that had no checkpoint when the run stopped: it starts over, its
    base evaluation kept (the same weights), its steps and journal dropped (they are redone)."""
    from tailrace.records import EvalRecord
    from tailrace.runtime.rundir import truncate_metrics

    truncate_metrics(pol.file("metrics.jsonl"), lambda r: isinstance(r, EvalRecord) and r.tag == "base")
    for name in ("journal.jsonl", "events.jsonl"):
        pol.file(name).write_text("")


def _supervise(flags: dict[str, str], rest: list[str]) -> int:
    """`train --supervise`: this process runs the driver as a child and resumes it after a fault
    (runtime/supervisor.py). The run directory is settled here, so a restart knows what to resume."""
    from tailrace.cli.choices import check_backend
    from tailrace.runtime.supervisor import supervise

    if "--resume" in flags:
        run_dir = Path(flags["--resume"])
        path = run_dir / "config.yaml"
        cfg = load_config(path if path.is_file() else None, [])  # a missing one: the child says so
        argv = ["--resume", str(run_dir), *rest]
    else:
        cfg = load(flags.get("--config"), rest)  # bad input ends here, before any child starts
        check_backend(cfg)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(flags.get("--run-dir") or Path(cfg.out) / f"{stamp}-{cfg.flow.mode}")
        config = ["--config", flags["--config"]] if "--config" in flags else []
        argv = [*config, "--run-dir", str(run_dir), *rest]
    return supervise(argv, run_dir, cfg.max_restarts, console.print)


def _train(cfg: RunConfig, run, resume, why: str | None = None) -> int:
    """`why`: the reason for the run's overlap mode where flow.mode is null."""
    from tailrace.config.load import policy_configs
    from tailrace.config.train import auto_lr
    from tailrace.report.console import ConsoleUI
    from tailrace.runtime.driver import Driver
    from tailrace.runtime.run_modes import with_mode
    from tailrace.runtime.session import Session
    from tailrace.runtime.supervisor import DriverLost
    from tailrace.trainer.schedule import LRSchedule

    named = policy_configs(cfg)
    sessions = [Session(pc, progress=_sft_progress()) for _, pc in named]
    session = sessions[0]
    ui = ConsoleUI(console)
    if cfg.policies:
        each = [f"{n} ({m.flow.mode}, {m.flow.steps} steps, task {m.task.name})" for n, m in
                ((n, with_mode(pc)[0]) for n, pc in named)]  # fmt: skip
        console.print(f"{len(named)} policies sharing the rollout engines: {'; '.join(each)}")
    console.print(
        f"run directory: {run.path}  (mode {cfg.flow.mode}, {cfg.flow.steps} steps, "
        f"{cfg.flow.prompts_per_round} prompts x {cfg.flow.samples_per_prompt} samples per round)"
    )
    if why is not None:
        baseline = "; --flow.mode=sync for the on-policy baseline" if cfg.flow.mode != "sync" else ""
        console.print(f"mode {cfg.flow.mode} (flow.mode null: {why}{baseline})")
    if cfg.train.loss.correction is None:
        from tailrace.flow.policies import POLICIES

        own = POLICIES[cfg.flow.mode].own_correction(cfg.flow.steps_per_round, cfg.store.replay > 0)
        replay = " with replay" if cfg.store.replay else ""
        console.print(
            f"off-policy correction {own} (train.loss.correction null: the {cfg.flow.mode} mode's own{replay})"
        )
    if cfg.train.lr is None:
        n, rank = session.num_params(), cfg.train.lora.rank
        adapter = f", a rank-{rank} LoRA adapter's: 10x" if rank else ""
        console.print(
            f"learning rate {auto_lr(n, bool(rank)):.2g} (train.lr null: by the policy's {n / 1e6:.1f}M "
            f"parameters{adapter})"
        )
    for name, pc in named if cfg.policies else [(None, cfg)]:
        t = pc.train
        schedule = LRSchedule(1.0, t.lr_warmup_steps, pc.flow.steps, t.lr_schedule, t.lr_min_ratio).describe()
        if schedule:
            whose = f" of policy {name}" if name else ""
            console.print(f"learning rate{whose}: {schedule} (train.lr_warmup_steps, train.lr_schedule)")
    driver = None
    try:
        driver = Driver(cfg, run, sessions, resume=resume, ui=ui, driver_lost=DriverLost.from_env())
        summary = driver.train()
    except KeyboardInterrupt as e:
        console.print(f"{'terminated' if Terminated.by(e) else 'interrupted'}; {_continue(run)}")
        return 143 if Terminated.by(e) else 130
    except (Fault, OSError) as e:  # OSError: the run directory's disk filled or turned read-only
        raise Fault(f"{one_line(e)}; {_continue(run)}") from None
    finally:
        ui.end()
        if driver is not None:
            driver.close()
        for s in sessions:
            s.close()
    for name, (base, final) in summary.policies.items():
        if base is not None and final is not None:
            console.print(
                f"{name}: held-out accuracy {base:.1%} -> {final:.1%} ({100 * (final - base):+.1f} points)"
            )
    if not summary.policies and summary.base_accuracy is not None and summary.final_accuracy is not None:
        gain = 100 * (summary.final_accuracy - summary.base_accuracy)
        console.print(
            f"held-out accuracy {summary.base_accuracy:.1%} -> {summary.final_accuracy:.1%} "
            f"({gain:+.1f} points) after {summary.steps} steps in {_duration(summary.wall_s)}",
            style="bold",
        )
    if summary.policies:
        dirs = " ".join(str(run.path / "policies" / n) for n in summary.policies)
        console.print(f"metrics: {run.path}/policies/<name>/metrics.jsonl   report: tailrace report {dirs}")
    else:
        console.print(f"metrics: {run.file('metrics.jsonl')}   report: tailrace report {run.path}")
    return 0


def _continue(run) -> str:
    """How to go on after a run stopped early."""
    from tailrace.runtime.checkpoint import step_dirs
    from tailrace.runtime.rundir import policy_dirs

    if not step_dirs(run.ckpt) and not policy_dirs(run.path):  # several: a policy without one starts over
        return f"no checkpoint was written yet: start the run again (remove {run.path} or pass another --run-dir)"
    return f"{run.path} keeps everything so far: continue with tailrace train --resume {run.path}"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def sft(args: Args) -> int:
    from tailrace.runtime.warmstart import ensure_warm_start, warm_start_dir

    cfg = load(None, args.rest)
    cached = (warm_start_dir(cfg.arch, cfg.sft) / "warmstart.json").is_file()
    path = ensure_warm_start(cfg.arch, cfg.sft, _sft_progress())
    console.print(f"{'cached' if cached else 'built'} warm-started model: {path}")
    return 0


def serve(args: Args) -> int:
    from tailrace.cli.choices import check_backend
    from tailrace.serve import serve as run_server

    cfg = load(None, args.rest)
    check_backend(cfg, training=False)
    run_server(cfg, console.print, _sft_progress())
    return 0


def evaluate(args: Args) -> int:
    from tailrace.records import on_prompts
    from tailrace.runtime.eval_run import evaluate_checkpoints, is_run_dir
    from tailrace.runtime.evaluate import difficulty_line
    from tailrace.runtime.standalone import evaluate_model, with_checkpoint

    if args.rest and not args.rest[0].startswith("-"):
        if not is_run_dir(args.rest[0]):
            raise ConfigError(
                f"{args.rest[0]} is not a run directory (no config.yaml and checkpoints/); give a run "
                "directory, or a model with --model.path=DIR"
            )
        load(Path(args.rest[0]) / "config.yaml", args.rest[1:])  # every override checked first
        done = evaluate_checkpoints(
            Path(args.rest[0]), args.rest[1:], console.print, _sft_progress(), _eval_progress()
        )
        console.print(f"{len(done)} checkpoint(s) evaluated; tailrace report {args.rest[0]} plots them")
        return 0
    cfg, adapter = with_checkpoint(load(None, args.rest))
    res = evaluate_model(cfg, progress=_sft_progress(), on_done=_eval_progress(), adapter=adapter)
    console.print(f"model {res['model']}" + (f" with the LoRA adapter {adapter} merged" if adapter else ""))
    console.print(
        f"held-out accuracy {res['accuracy']:.1%} {on_prompts(res)} of {cfg.task.name} "
        f"(temperature {cfg.eval.temperature})"
    )
    if difficulty_line(res):
        console.print(f"by difficulty: {difficulty_line(res)}")
    console.print(
        f"response length: p50 {res['p50']:.0f}  p90 {res['p90']:.0f}  p99 {res['p99']:.0f}  "
        f"max {res['max']}  (p99/p50 {res['p99_over_p50']:.1f})"
    )
    peak = max(c for _, _, c in res["histogram"]) or 1
    for lo, hi, c in res["histogram"]:
        console.print(f"  {lo:4d}-{hi:<4d} {c:5d} {'#' * round(40 * c / peak)}")
    return 0


def _run_dir(args: Args, verb: str) -> Path:
    if len(args.rest) != 1 or args.rest[0].startswith("-"):
        raise ConfigError(f"usage: tailrace {verb} RUN_DIR")
    return Path(args.rest[0])


def report(args: Args) -> int:
    from tailrace.runtime.rundir import policy_dirs

    args = dataclasses.replace(
        args, rest=[str(d) for a in args.rest for d in policy_dirs(Path(a)) or [Path(a)]]
    )
    if len(args.rest) > 1:
        from tailrace.report.compare import write_comparison

        if any(a.startswith("-") for a in args.rest):
            raise ConfigError("usage: tailrace report RUN_DIR [RUN_DIR ...] [--out FILE] [--target ACCURACY]")
        target = _fraction(args.flags["--target"], "--target") if "--target" in args.flags else None
        out = write_comparison(
            [Path(p) for p in args.rest], Path(args.flags.get("--out", "compare.html")), target
        )
        console.print(f"wrote {out}")
        return 0
    from tailrace.report.html import write_report

    console.print(f"wrote {write_report(_run_dir(args, 'report'))}")
    return 0


def _fraction(raw: str, flag: str) -> float:
    try:
        x = float(raw)
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 1.0:
        raise ConfigError(f"{flag} {raw}: give an accuracy between 0 and 1, e.g. 0.8")
    return x


def trace(args: Args) -> int:
    from tailrace.report.trace import write_trace

    out = write_trace(_run_dir(args, "trace"))
    console.print(f"wrote {out} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def import_model(args: Args) -> int:
    from tailrace.model.importer import import_model

    if len(args.rest) != 1 or args.rest[0].startswith("-") or "--out" not in args.flags:
        raise ConfigError("usage: tailrace model import SRC --out DIR [--dtype float32|bfloat16]")
    dtype = args.flags.get("--dtype", "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype {dtype}: use float32 or bfloat16")
    r = import_model(args.rest[0], args.flags["--out"], dtype)
    c = r.config
    window = " (LongRoPE's short range)" if c.context_limit < c.max_position_embeddings else ""
    console.print(
        f"wrote {r.path}: {c.model_type}, {r.parameters / 1e6:.1f}M parameters, {c.num_hidden_layers} layers, "
        f"context {c.context_limit}{window}, {dtype}, chat template {'yes' if r.chat_template else 'no'}; "
        f"logits match the source within {r.max_logit_diff:.1e}"
    )
    console.print(f"use it: tailrace eval --model.path={r.path}   tailrace train --model.path={r.path} ...")
    return 0


def engine_join(args: Args) -> int:
    from tailrace.runtime.join import join

    if len(args.rest) != 1:
        raise ConfigError("tailrace engine join RUN_DIR: name the run directory of a running tailrace train")
    raw = args.flags.get("--cores", "")
    try:
        cores = tuple(int(c) for c in raw.split(",") if c)
    except ValueError:
        raise ConfigError(
            f"--cores {raw}: write core numbers separated by commas, e.g. --cores 0,1"
        ) from None
    return join(Path(args.rest[0]), cores)


def engine_leave(args: Args) -> int:
    from tailrace.runtime.join import leave

    if len(args.rest) != 2 or not args.rest[1].isdigit():
        raise ConfigError(
            "tailrace engine leave RUN_DIR ENGINE_ID: name the run directory and the engine's id"
        )
    leave(Path(args.rest[0]), int(args.rest[1]))
    console.print(f"asked engine {args.rest[1]} to leave the job in {args.rest[0]}")
    return 0


def policy_join(args: Args) -> int:
    from tailrace.runtime.policy_join import join_policy

    if len(args.rest) < 2 or args.rest[0].startswith("-") or args.rest[1].startswith("-"):
        raise ConfigError(
            "usage: tailrace policy join RUN_DIR NAME [--section.key=value ...] (the sections a policy sets)"
        )
    console.print(join_policy(Path(args.rest[0]), args.rest[1], args.rest[2:]))
    return 0


def policy_leave(args: Args) -> int:
    from tailrace.runtime.policy_join import leave_policy

    if len(args.rest) != 2:
        raise ConfigError("usage: tailrace policy leave RUN_DIR NAME")
    console.print(leave_policy(Path(args.rest[0]), args.rest[1]))
    return 0
