"""The same RL run under every overlap mode, side by side, on the local runtime, judged by the wall
time to a held-out accuracy.

    .venv/bin/python bench/modes.py --configs demo --steps 120 --seeds 0,1,2   # the headline (hours)
    .venv/bin/python bench/modes.py --quick    # a smoke run
    .venv/bin/python bench/modes.py --tables   # reprint the last run's tables

Default model, default task, the same number of trained samples in every mode; one rollout process
and one trainer process on separate cores. Every run evaluates its published weights every
`--eval-every` steps (after training, on snapshots: evaluation costs the run's clock nothing) on
`--eval-n` held-out prompts. The headline table, per mode over the seeds: wall time to the target
accuracy (sync's mean final accuracy minus 2 points unless --target says otherwise) as mean, spread
and ratio to sync's mean, and final accuracy mean +- sd (flagged when more than 2 points below
sync's); steps/hour stays as a secondary column. Configurations (CONFIGS), each printed with its
measured sync generation share (the trainer's waiting ratio in sync: the share of a step spent
generating):
  demo       the demo's shape (16 prompts x 8 samples, a step per round), fp32
  balanced   32 prompts x 8 samples, 64 samples a step (4 steps a round, so pipe can pipeline), a 4-slot
             bf16 engine: generation ~half of a sync step
  genheavy   as balanced with a 2-slot bf16 engine: generation-bound (long chain-of-thought RL)
Writes bench/out/modes.json, bench/out/modes_<config>.html (one Gantt per mode) and
bench/out/compare_<config>.html (tailrace report's comparison page of the first seed's runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import dump_config, load_config  # noqa: E402
from tailrace.metrics import time_to_accuracy  # noqa: E402
from tailrace.records import EvalRecord, Mark, Span, StepRecord, dumps, read_events, read_metrics  # noqa: E402
from tailrace.report.compare import write_comparison  # noqa: E402
from tailrace.report.html import gantt  # noqa: E402
from tailrace.runtime.driver import Driver  # noqa: E402
from tailrace.runtime.rundir import RunDir  # noqa: E402
from tailrace.runtime.session import Session  # noqa: E402

MODES = [
    ("sync", {}),
    ("pipe", {}),
    ("async", {"flow.max_staleness": 1}),
    ("async", {"flow.max_staleness": 2}),
    ("partial", {"flow.max_staleness": 1}),
    ("multiversion", {"flow.max_staleness": 1}),
    ("multiversion", {"flow.max_staleness": 2}),
    ("multiversion", {"flow.max_staleness": 4}),
    # shaping on sync (issue #14), judged the same way: --modes sync,sync+tailbatch,sync+darts
    ("sync", {"shaping.name": "tailbatch"}),
    ("sync", {"shaping.name": "darts"}),
    ("sync", {"shaping.name": "april", "train.loss.correction": "tis"}),
    ("sync", {"shaping.name": "sorted", "train.loss.correction": "tis"}),
    # shaping on a streaming mode: --modes sync,sync+darts,multiversion-K1+darts
    ("multiversion", {"flow.max_staleness": 1, "shaping.name": "darts"}),
    ("multiversion", {"flow.max_staleness": 2, "shaping.name": "darts"}),
    # darts with a fixed extra budget: a streaming mode's engine has the slack the priced budget ignores
    ("multiversion", {"flow.max_staleness": 1, "shaping.name": "darts", "shaping.extra": 0.5}),
    # the store's replay buffer (issue #19): --modes sync,sync+replay0.25,multiversion-K1,multiversion-K1+replay0.25
    ("sync", {"store.replay": 0.25}),
    ("multiversion", {"flow.max_staleness": 1, "store.replay": 0.25}),
    # the whole stack, layer by layer (bench/stack.py): + speculative decoding from the prompts' history
    ("multiversion", {"flow.max_staleness": 1, "shaping.name": "darts", "rollout.spec.drafter": "history"}),
    # a LoRA adapter (rank 8, every projection) on the frozen base: --modes multiversion-K1,multiversion-K1+lora8
    ("sync", {"train.lora.rank": 8}),
    ("multiversion", {"flow.max_staleness": 1, "train.lora.rank": 8}),
    # the store's entry filter (store.filter): --modes multiversion-K1,multiversion-K1+filter-informative
    ("sync", {"store.filter": f"{ROOT}/examples/filters.py:informative"}),
    ("multiversion", {"flow.max_staleness": 1, "store.filter": f"{ROOT}/examples/filters.py:informative"}),
    # a trainer of one's own (train.external): examples/external_trainer.py, transformers' model, pulls
    # each step's batch: --modes multiversion-K1,multiversion-K1+external
    ("sync", {"train.external": True}),
    ("multiversion", {"flow.max_staleness": 1, "train.external": True}),
    # ... on a LoRA run, a PEFT adapter: --modes multiversion-K1+lora8,multiversion-K1+lora8+external
    ("multiversion", {"flow.max_staleness": 1, "train.lora.rank": 8, "train.external": True}),
    # GSPO's sequence-level ratio against grpo's per-token one, where the ratio is off 1 (the rollout's
    # anchor): --modes sync,multiversion-K1,multiversion-K1+gspo
    ("multiversion", {"flow.max_staleness": 1, "train.loss.name": "gspo"}),
    ("sync", {"train.loss.name": "gspo"}),
    # CISPO's capped importance weight against PPO's clipped update: --modes multiversion-K1,multiversion-K1+cispo
    ("multiversion", {"flow.max_staleness": 1, "train.loss.name": "cispo"}),
    # DAPO's recipe whole (clip-higher, the token mean, the overlong penalty over the last quarter of the
    # 384 new tokens and overlong filtering; dynamic sampling is the default): --modes
    # sync,multiversion-K1,multiversion-K1+dapo+overlong96
    (
        "multiversion",
        {
            "flow.max_staleness": 1,
            "train.loss.name": "dapo",
            "task.overlong_buffer": 96,
            "train.mask_truncated": True,
        },
    ),
    # PPO's loop: several optimizer updates a step (train.mini_batches, train.epochs), more learning from
    # each rollout: --modes sync,sync+mb4,multiversion-K1,multiversion-K1+mb4,multiversion-K1+ep2
    ("sync", {"train.mini_batches": 4}),
    ("multiversion", {"flow.max_staleness": 1, "train.mini_batches": 4}),
    ("multiversion", {"flow.max_staleness": 1, "train.epochs": 2}),
    # the group's mean, the step's std (Lite PPO, TRL's scale_rewards=batch): --modes
    # sync,multiversion-K1,multiversion-K1+batch_std
    ("multiversion", {"flow.max_staleness": 1, "train.advantage": "batch_std"}),
    # the step's top fifth of tokens by entropy alone ("Beyond the 80/20 Rule"): --modes
    # sync,multiversion-K1,multiversion-K1+top0.2
    ("multiversion", {"flow.max_staleness": 1, "train.loss.top_entropy": 0.2}),
    # PPO's critic and GAE (verl's default algorithm) against the group's baseline, and dual clip (verl's
    # clip_ratio_c): --modes sync,sync+gae,multiversion-K1,multiversion-K1+gae,multiversion-K1+clipc3
    ("sync", {"train.advantage": "gae"}),
    ("multiversion", {"flow.max_staleness": 1, "train.advantage": "gae"}),
    ("multiversion", {"flow.max_staleness": 1, "train.loss.clip_c": 3}),
    # the critic trained alone for the first 10 steps (verl's critic_warmup): --modes
    # multiversion-K1+gae,multiversion-K1+gae+cw10
    ("multiversion", {"flow.max_staleness": 1, "train.advantage": "gae", "train.critic.warmup_steps": 10}),
    # a KL penalty to the start policy, and the reference reset to the policy every 20 steps (ProRL's; TRL's
    # sync_ref_model): --modes multiversion-K1,multiversion-K1+kl0.1,multiversion-K1+kl0.1+reset20
    ("multiversion", {"flow.max_staleness": 1, "train.loss.kl_coef": 0.1}),
    ("multiversion", {"flow.max_staleness": 1, "train.loss.kl_coef": 0.1, "train.loss.ref_sync_steps": 20}),
]

CONFIGS = {
    "demo": [],  # tailrace train's defaults
    # R=32 prompts x G=8 samples per round, B=64 samples per step: a round is 4 steps, so pipe can pipeline.
    # One core each; the engine's slot count (and dtype) sizes the rollout pool against the trainer. On the
    # 2-core testbed (2026-12-01, 16 sync steps) 4 bf16 slots measure generation at 0.50 of a sync step
    # (rollout and training balanced, where overlap can buy the most), 2 bf16 slots at ~0.62 (the
    # rollout-bound share RL papers report: 0.5-0.8). With 6 fp32 slots (this config until 2026-12-01)
    # generation was 0.36 of the step once the C kernels made decoding ~1.5x faster.
    "balanced": [
        "--flow.prompts_per_round=32",
        "--flow.samples_per_prompt=8",
        "--flow.train_batch=64",
        "--train.bf16=true",
        "--model.dtype=bfloat16",
        "--rollout.slots=4",
    ],
    "genheavy": [
        "--flow.prompts_per_round=32",
        "--flow.samples_per_prompt=8",
        "--flow.train_batch=64",
        "--train.bf16=true",
        "--model.dtype=bfloat16",
        "--rollout.slots=2",
    ],
}


def mode_label(mode: str, opts: dict) -> str:
    """e.g. multiversion-K2, sync+darts, multiversion-K1+darts@0.5, sync+replay0.25, sync+lora8,
    multiversion-K1+darts+spec-history, multiversion-K1+filter-informative, multiversion-K1+gspo,
    sync+mb4: the mode, its staleness bound, its shaping, a fixed darts budget, the store's replay ratio, a
    LoRA rank, a drafter, a store filter, a loss, and optimizer updates a step."""
    return (
        mode
        + "".join(f"-K{v}" for k, v in opts.items() if k == "flow.max_staleness")
        + "".join(f"+{v}" for k, v in opts.items() if k == "shaping.name")
        + "".join(f"@{v}" for k, v in opts.items() if k == "shaping.extra")
        + "".join(f"+replay{v}" for k, v in opts.items() if k == "store.replay")
        + "".join(f"+lora{v}" for k, v in opts.items() if k == "train.lora.rank")
        + "".join(f"+spec-{v}" for k, v in opts.items() if k == "rollout.spec.drafter")
        + "".join(f"+filter-{v.rpartition(':')[2]}" for k, v in opts.items() if k == "store.filter")
        + "".join("+external" for k, v in opts.items() if k == "train.external" and v)
        + "".join(f"+{v}" for k, v in opts.items() if k == "train.loss.name")
        + "".join(f"+overlong{v}" for k, v in opts.items() if k == "task.overlong_buffer")
        + "".join(f"+mb{v}" for k, v in opts.items() if k == "train.mini_batches")
        + "".join(f"+ep{v}" for k, v in opts.items() if k == "train.epochs")
        + "".join(f"+{v}" for k, v in opts.items() if k == "train.advantage")
        + "".join(f"+top{v}" for k, v in opts.items() if k == "train.loss.top_entropy")
        + "".join(f"+clipc{v}" for k, v in opts.items() if k == "train.loss.clip_c")
        + "".join(f"+cw{v}" for k, v in opts.items() if k == "train.critic.warmup_steps")
        + "".join(f"+kl{v}" for k, v in opts.items() if k == "train.loss.kl_coef")
        + "".join(f"+reset{v}" for k, v in opts.items() if k == "train.loss.ref_sync_steps")
    )


def run_one(
    config: str,
    mode: str,
    opts: dict,
    steps: int,
    out: Path,
    eval_n: int,
    base: EvalRecord | None,
    seed: int = 0,
    extra: tuple[str, ...] = (),
    eval_every: int = 0,
) -> dict:
    label = mode_label(mode, opts)
    rd = RunDir(out / config / (label if seed == 0 else f"{label}-seed{seed}"))
    if rd.path.exists():
        import shutil

        shutil.rmtree(rd.path)
    rd.create()
    if base is not None:  # the base model is the same in every mode: evaluate it once per configuration
        rd.file("metrics.jsonl").write_text(dumps(base) + "\n")
    over = CONFIGS[config] + [
        f"--flow.mode={mode}",
        f"--flow.steps={steps}",
        f"--eval.n={eval_n}",
        f"--eval.every={eval_every}",
        "--flow.checkpoint_every=1000",
        f"--seed={seed}",
    ]
    over += [f"--{k}={v}" for k, v in opts.items()] + list(extra)
    cfg = load_config(None, over)
    rd.file("config.yaml").write_text(dump_config(cfg))  # as tailrace train: `tailrace sim --like` reads it
    ses = Session(cfg)
    drv = Driver(cfg, rd, ses)
    own = None  # train.external: the example trainer, which joins the run once it listens
    if cfg.train.external:
        own = subprocess.Popen([sys.executable, str(ROOT / "examples" / "external_trainer.py"), str(rd.path)])
    try:
        t0 = time.perf_counter()
        drv.train()
        wall = time.perf_counter() - t0
    finally:
        drv.close()
        ses.close()
        if own is not None and own.wait(timeout=120) != 0:
            raise RuntimeError(f"{label}: the external trainer exited with {own.returncode}")
    return row_of(rd.path, config, mode, label, seed, eval_n, wall)


def row_of(
    run: Path, config: str, mode: str, label: str, seed: int, eval_n: int, total_s: float | None
) -> dict:
    """A finished run's row, read from its run directory (`--tables` rebuilds rows this way where an
    invocation ended before writing modes.json)."""
    cfg = load_config(run / "config.yaml")
    metrics = list(read_metrics(run / "metrics.jsonl"))
    steps_rec = [r for r in metrics if isinstance(r, StepRecord)]
    evals = {e.tag: e for e in metrics if isinstance(e, EvalRecord)}
    last = steps_rec[-1]
    events = list(read_events(run / "events.jsonl"))
    train_wall = last.time["wall_s"]
    stale = {}
    for r in steps_rec:
        for k, v in r.staleness.items():
            stale[k] = stale.get(k, 0) + v
    busy = sum(e.t1 - e.t0 for e in events if isinstance(e, Span) and e.phase == "generate")
    return {
        "config": config,
        "mode": label,
        "seed": seed,
        "wall_s": train_wall,
        "total_s": total_s,
        "steps_per_hour": len(steps_rec) / train_wall * 3600,
        "middle_steps_per_hour": middle_rate(
            steps_rec, cfg.flow.prompts_per_round * cfg.flow.samples_per_prompt // cfg.flow.train_batch
        ),
        "trainer_wait_ratio": last.time["trainer_wait_ratio"],
        "bubble_ratio": last.time["bubble_ratio"],
        "mean_active_batch": last.time["mean_active_batch"],
        "base_record": evals["base"],
        "round_window_s": round_windows(events, cfg.flow.prompts_per_round)
        if mode in ("sync", "pipe")
        else None,
        "engine_busy_s": busy,
        "staleness": stale,
        "final_accuracy": evals["final"].accuracy if "final" in evals else None,
        "accuracy_points": sorted((e.wall_s, e.accuracy) for e in metrics if isinstance(e, EvalRecord)),
        "eval_n": eval_n,
        "base_accuracy": evals["base"].accuracy,
        "run_dir": str(run),
        "events": events,
    }


def rebuilt(root: Path, args) -> list[dict]:
    """The rows of the run directories under ROOT/modes (an invocation that ended before modes.json),
    for the configs, modes and seeds asked for."""
    rows = []
    for config in args.configs.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            for mode, opts in MODES:
                label = mode_label(mode, opts)
                run = root / "modes" / config / (label if seed == 0 else f"{label}-seed{seed}")
                if (args.modes is None or label in args.modes.split(",")) and (
                    run / "metrics.jsonl"
                ).exists():
                    row = row_of(run, config, mode, label, seed, args.eval_n, None)
                    rows.append({k: v for k, v in row.items() if k not in ("events", "base_record")})
    return rows


def middle_rate(steps_rec: list[StepRecord], per_round: int) -> float | None:
    """Steps per hour over the middle rounds: from the end of the first round's last step to the end of
    the last-but-one round's, the same step window in every mode. It leaves out what a run pays once:
    the pipeline's fill (the trainer waits for the first batch) and drain (the engine idles while the
    last steps train), a large share of a 16-step run and a small one of a long run."""
    n = len(steps_rec)
    if n < 3 * per_round:
        return None
    walls = [r.time["wall_s"] for r in steps_rec]
    return (n - 2 * per_round) / (walls[n - per_round - 1] - walls[per_round - 1]) * 3600


def round_windows(events: list[Span | Mark], R: int) -> float | None:
    """Mean rollout-to-train-end window of the on-policy rounds: from the round's first dispatched request
    to the publication of the weights trained on it (round r is groups [rR, (r+1)R), published as v = r+1)."""
    first: dict[int, float] = {}
    marks = [e for e in events if isinstance(e, Mark)]
    for e in marks:
        if e.kind == "group_first_dispatch":
            r = e.data["group"] // R
            first[r] = min(first.get(r, e.t), e.t)
    pub = {e.data["version"]: e.t for e in marks if e.kind == "published"}
    spans = [pub[r + 1] - t for r, t in first.items() if r + 1 in pub]
    return sum(spans) / len(spans) if spans else None


def label_width(rows: list[dict]) -> int:
    """The mode column's width: the longest label's (at least 16), so the tables' columns line up."""
    return max([16, *(len(r["mode"]) for r in rows)])


def table(rows: list[dict]) -> str:
    w = label_width(rows)
    sync = next(r for r in rows if r["mode"] == "sync")
    head = (
        f"{'mode':{w}s} {'wall s':>7s} {'steps/h':>8s} {'speedup':>8s} {'middle':>7s} {'wait':>5s} {'bubble':>6s} "
        f"{'batch':>6s} {'window s':>8s} {'acc':>6s}  staleness"
    )
    lines = [head, "-" * len(head)]

    def middle(r):
        a, b = r.get("middle_steps_per_hour"), sync.get("middle_steps_per_hour")
        return f"{a / b:6.2f}x" if a and b else f"{'-':>7s}"

    for r in rows:
        win = f"{r['round_window_s']:8.1f}" if r["round_window_s"] is not None else f"{'-':>8s}"
        lines.append(
            f"{r['mode']:{w}s} {r['wall_s']:7.1f} {r['steps_per_hour']:8.0f} "
            f"{sync['wall_s'] / r['wall_s']:7.2f}x {middle(r)} {r['trainer_wait_ratio']:5.2f} {r['bubble_ratio']:6.2f} "
            f"{r['mean_active_batch']:6.1f} {win} {(r['final_accuracy'] or 0):6.3f}  {json.dumps(r['staleness'])}"
        )
    base = rows[0]["base_accuracy"]
    lines.append(
        f"base accuracy {base:.3f}; speedup = sync wall / mode wall; middle = steps/hour over the middle "
        "rounds vs sync's (no pipeline fill or drain); wait = trainer waiting ratio, "
        "bubble = rollout bubble ratio, "
        "batch = engine mean active batch while generating, window = rollout-to-train-end time of a round"
    )
    pipe = next((r for r in rows if r["mode"] == "pipe"), None)
    if pipe and pipe["round_window_s"] and sync["round_window_s"]:
        lines.append(
            f"pipe cuts the rollout-to-train-end window by {1 - pipe['round_window_s'] / sync['round_window_s']:.0%}"
        )
    return "\n".join(lines)


def baseline(rows: list[dict]) -> str:
    """The mode the others are compared with: sync when it ran, else the first mode listed."""
    modes = [r["mode"] for r in rows]
    return "sync" if "sync" in modes else modes[0]


def spread(rows: list[dict]) -> str:
    """Across seeds: per mode, the speedup over the same seed's baseline run (sync, where it ran) and
    the final accuracy."""
    w = label_width(rows)
    import statistics

    sync = {r["seed"]: r for r in rows if r["mode"] == baseline(rows)}
    lines = [
        f"{'mode':{w}s} {'speedup mean':>12s} {'min-max':>12s} {'middle mean':>11s} {'acc mean':>9s} "
        f"{'acc sd':>7s}  seeds"
    ]
    for label in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == label and r["seed"] in sync]
        sp = [sync[r["seed"]]["wall_s"] / r["wall_s"] for r in rs]
        mid = [
            r["middle_steps_per_hour"] / sync[r["seed"]]["middle_steps_per_hour"]
            for r in rs
            if r.get("middle_steps_per_hour") and sync[r["seed"]].get("middle_steps_per_hour")
        ]
        acc = [r["final_accuracy"] or 0.0 for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        m = f"{statistics.mean(mid):10.2f}x" if mid else f"{'-':>11s}"
        lines.append(
            f"{label:{w}s} {statistics.mean(sp):11.2f}x {min(sp):5.2f}-{max(sp):.2f}x {m} "
            f"{statistics.mean(acc):9.3f} {sd:7.3f}  {len(rs)}"
        )
    return "\n".join(lines)


def reached(rows: list[dict], target: float) -> list[float]:
    """The wall times at which the runs that reached `target` first did (those that never did left out)."""
    times = (time_to_accuracy(r["accuracy_points"], target) for r in rows)
    return [t for t in times if t is not None]


def time_to_target(rows: list[dict], target: float | None = None) -> str:
    """The headline: per mode over its seeds, wall time to the target accuracy and final accuracy."""
    w = label_width(rows)
    import statistics

    def sd(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    base_mode = baseline(rows)
    sync_final = [r["final_accuracy"] or 0.0 for r in rows if r["mode"] == base_mode]
    sync_mean = statistics.mean(sync_final) if sync_final else None
    finals = [r["final_accuracy"] or 0.0 for r in rows]
    how = "given"
    if target is None:
        base, how = (
            (sync_mean, f"{base_mode}'s mean final")
            if sync_mean is not None
            else (min(finals), "lowest final")
        )
        target = base - 0.02
        how += f" {base:.3f} minus 2 points"
    n = rows[0]["eval_n"]
    head = (
        f"{'mode':{w}s} {'to target s':>11s} {'sd':>6s} {'vs sync':>8s} {'reached':>7s} "
        f"{'final acc':>9s} {'sd':>6s} {'steps/h':>8s}"
    )
    lines = [head, "-" * len(head)]
    sync_t = None
    for label in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == label]
        got = reached(rs, target)
        acc = [r["final_accuracy"] or 0.0 for r in rs]
        t_mean = statistics.mean(got) if got else None
        if label == base_mode:
            sync_t = t_mean
        ratio = f"{t_mean / sync_t:7.2f}x" if t_mean and sync_t else f"{'-':>8s}"
        flag = (
            f"  < {base_mode} - 2 pts"
            if sync_mean is not None and statistics.mean(acc) < sync_mean - 0.02
            else ""
        )
        t_txt = f"{t_mean:11.1f} {sd(got):6.1f}" if got else f"{'never':>11s} {'':6s}"
        lines.append(
            f"{label:{w}s} {t_txt} {ratio} {len(got):>3d}/{len(rs):<3d} {statistics.mean(acc):9.3f} "
            f"{sd(acc):6.3f} {statistics.mean(r['steps_per_hour'] for r in rs):8.0f}{flag}"
        )
    res = 0.5 / n**0.5
    lines.append(
        f"target accuracy {target:.3f} ({how}); held-out n = {n} "
        f"(standard error at most {res:.3f}); to target = first evaluated version at or above it, its "
        f"publication wall time (resolution: the evaluation cadence); vs sync = mean time / {base_mode}'s mean time"
    )
    return "\n".join(lines)


def per_step(rows: list[dict]) -> str:
    """Learning per step, not per second: per mode, the mean held-out accuracy over seeds at each
    evaluated step (read from each run's metrics), and the mean staleness of what it trained."""
    w = label_width(rows)
    import statistics

    table: dict[str, dict[int, list[float]]] = {}
    stale: dict[str, list[float]] = {}
    for r in rows:
        evals = [e for e in read_metrics(Path(r["run_dir"]) / "metrics.jsonl") if isinstance(e, EvalRecord)]
        for e in evals:
            table.setdefault(r["mode"], {}).setdefault(0 if e.tag == "base" else e.step, []).append(
                e.accuracy
            )
        hist = {int(k): v for k, v in r["staleness"].items()}
        stale.setdefault(r["mode"], []).append(
            sum(k * v for k, v in hist.items()) / max(1, sum(hist.values()))
        )
    steps = sorted({s for t in table.values() for s in t})
    lines = [f"{'mode':{w}s} " + " ".join(f"{'step ' + str(s):>9s}" for s in steps) + f" {'staleness':>9s}"]
    for mode, t in table.items():
        cells = " ".join(f"{100 * statistics.mean(t[s]):8.1f}%" if s in t else f"{'-':>9s}" for s in steps)
        lines.append(f"{mode:{w}s} {cells} {statistics.mean(stale[mode]):9.2f}")
    lines.append("held-out accuracy at each evaluated step, mean over seeds; staleness: mean versions behind")
    return "\n".join(lines)


def by_difficulty(rows: list[dict]) -> str:
    """Final held-out accuracy per difficulty bucket (the task's; chainsum: terms), mean over seeds:
    shaping trains on short answers, and the long chains must not collapse."""
    w = label_width(rows)
    import statistics

    acc: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        evals = [e for e in read_metrics(Path(r["run_dir"]) / "metrics.jsonl") if isinstance(e, EvalRecord)]
        final = next((e for e in evals if e.tag == "final"), None)
        for b, d in (final.summary.get("by_difficulty", {}) if final else {}).items():
            acc.setdefault(r["mode"], {}).setdefault(b, []).append(d["accuracy"])
    if not acc:
        return "(no accuracy by difficulty in these runs' evaluations)"
    buckets = list(dict.fromkeys(b for m in acc.values() for b in m))
    lines = [f"{'mode':{w}s} " + " ".join(f"{b:>8s}" for b in buckets)]
    for mode, m in acc.items():
        lines.append(f"{mode:{w}s} " + " ".join(f"{100 * statistics.mean(m[b]):7.1f}%" for b in buckets))
    lines.append("final held-out accuracy by difficulty bucket, mean over seeds")
    return "\n".join(lines)


def generation_share(rows: list[dict]) -> str:
    sync = [r for r in rows if r["mode"] == "sync"]
    if not sync:
        return ""
    share = sum(r["trainer_wait_ratio"] for r in sync) / len(sync)
    return f"sync generation share (trainer waiting ratio, mean over {len(sync)} seed(s)): {share:.2f}"


def timelines(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    from tailrace.report.html import _png

    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.6 * len(rows)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        gantt(ax, r["events"], r["mode"])
    path.write_text(f"<html><body><h1>{path.stem}</h1>{_png(fig)}</body></html>")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--configs", default="balanced,genheavy")
    ap.add_argument("--modes", default=None, help="comma list of labels, e.g. sync,pipe,multiversion-K2")
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (0: base and final)")
    ap.add_argument("--target", type=float, default=None, help="accuracy to time to (default: sync - 2 pts)")
    ap.add_argument("--seeds", default="0", help="comma list of run seeds; with several, a spread table too")
    ap.add_argument(
        "--tables", action="store_true", help="reprint the tables of the last run (bench/out/modes.json)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run, e.g. --set rollout.attention=bmm (repeatable)",
    )
    ap.add_argument(
        "--out", default=str(ROOT / "bench" / "out"), help="where run directories, JSON and HTML go"
    )
    args = ap.parse_args()
    root = Path(args.out)
    if args.tables:
        saved = (
            json.loads((root / "modes.json").read_text())
            if (root / "modes.json").exists()
            else rebuilt(root, args)
        )
        for config in dict.fromkeys(r["config"] for r in saved):
            rows = [r for r in saved if r["config"] == config]
            for seed in dict.fromkeys(r.get("seed", 0) for r in rows):
                if any(r["mode"] == "sync" for r in rows):  # the speedups are against sync's run
                    print(f"\n== {config}, seed {seed} ==")
                    print(table([r for r in rows if r.get("seed", 0) == seed]))
            if len({r.get("seed", 0) for r in rows}) > 1:
                print(f"\n== {config}: spread over seeds ==")
                print(spread([{"seed": 0, **r} for r in rows]))
            if all("accuracy_points" in r for r in rows):
                print(f"\n== {config}: wall time to held-out accuracy ==")
                print(time_to_target(rows, args.target))
                print(generation_share(rows))
                print(f"\n== {config}: held-out accuracy per step ==")
                print(per_step(rows))
                print(by_difficulty(rows))
        return
    steps = 4 if args.quick else args.steps
    eval_n = 32 if args.quick else args.eval_n
    eval_every = 2 if args.quick else args.eval_every
    out = root / "modes"
    seeds = [int(x) for x in args.seeds.split(",")]
    results = []
    for config in args.configs.split(","):
        base, every = None, []
        for seed in seeds:
            rows = []
            for mode, opts in MODES:
                label = mode_label(mode, opts)
                if args.modes and label not in args.modes.split(","):
                    continue
                print(f"[{config} seed {seed}] {label} ...", flush=True)
                rows.append(
                    run_one(
                        config,
                        mode,
                        opts,
                        steps,
                        out,
                        eval_n,
                        base,
                        seed,
                        tuple(f"--{kv}" for kv in args.set),
                        eval_every,
                    )
                )
                base = rows[-1].pop("base_record")
            print(
                f"\n== {config}, seed {seed} ({steps} steps each; speedup = sync wall / mode wall, same run) =="
            )
            if any(r["mode"] == "sync" for r in rows):  # the speedups are against sync's run
                print(table(rows), flush=True)
            if seed == seeds[0]:
                timelines(rows, root / f"modes_{config}.html")
                write_comparison([Path(r["run_dir"]) for r in rows], root / f"compare_{config}.html")
            every += [{k: v for k, v in r.items() if k != "events"} for r in rows]
        if len(seeds) > 1:
            print(f"\n== {config}: spread over seeds {args.seeds} ==")
            print(spread(every), flush=True)
        print(f"\n== {config}: wall time to held-out accuracy, seeds {args.seeds} ==")
        print(time_to_target(every, args.target))
        print(generation_share(every))
        print(f"\n== {config}: held-out accuracy per step ==")
        print(per_step(every))
        print(by_difficulty(every), flush=True)
        results += every
    root.mkdir(parents=True, exist_ok=True)
    (root / "modes.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
