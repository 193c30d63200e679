"""The simulator's verbs: simulate a scenario or a real run's setup, calibrate the cpu presets, list presets."""

from __future__ import annotations

import time
from pathlib import Path

from tailrace.cli.commands import console
from tailrace.cli.verb import Args
from tailrace.common import ConfigError

DTYPES = ("float32", "bfloat16")


def simulate(args: Args) -> int:
    from tailrace.cli.choices import check_names
    from tailrace.report.html import write_report
    from tailrace.sim import compare, scenario

    flags, rest = args.flags, args.rest
    if "--like" in flags:
        scn = scenario.apply_overrides(scenario.scenario_from_run(flags["--like"]), rest)
    elif "--config" in flags:
        scn = scenario.load_scenario(flags["--config"], rest)
    else:
        raise ConfigError("usage: tailrace sim --config SCENARIO.yaml | --like RUN_DIR | calibrate | presets")
    check_names(scn)
    out = Path(flags.get("--out") or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-sim-{scn.name}")
    flows, dirs = [ps.flow for _, ps in scn.policy_scenarios()], scn.run_dirs(out)
    console.print(
        f"simulating {scn.name}: {scn.gpus} devices ({scn.cluster.hardware}), "
        f"{'+'.join(f.mode for f in flows)}, {'+'.join(str(f.steps) for f in flows)} steps -> {out}"
    )
    s = scenario.simulate(scn, out)
    console.print(
        f"{s['steps']} steps in {s['wall_s']:.1f} simulated s ({s['sim_seconds']:.1f} s to simulate): "
        f"{s['time_per_step_s']:.2f} s/step, trainer waiting {s['trainer_wait_ratio']:.2f}, "
        f"bubble {s['bubble_ratio']:.2f}, length bubble {s['length_bubble']:.2f}"
    )
    joined = {name: ps.join_at_s for name, ps in scn.policy_scenarios() if ps.join_at_s}
    for name, p in s.get("policies", {}).items():
        at = f"joined at {joined[name]:.1f} s, " if name in joined else ""
        console.print(
            f"  {name} ({p['policy']}): {p['steps']} steps, {at}finished at {p['wall_s']:.1f} s, "
            f"trainer waiting {p['trainer_wait_ratio']:.2f}, staleness {p['staleness']}"
        )
    for d in dirs:
        if scn.shaping.name != "none":
            for line in ([d.name] if len(dirs) > 1 else []) + shaping_lines(d / "metrics.jsonl"):
                console.print(line)
        write_report(d)
    if "--like" in flags:  # the real run's own flow is the first policy's
        real, sim = compare.step_figures(flags["--like"]), compare.step_figures(dirs[0])
        if scenario.rolled_out_on(flags["--like"]) == "vllm":
            console.print(
                "note: the run rolled out on vLLM, and the cpu presets cost tailrace's engine (as calibrated "
                "by tailrace sim calibrate): its rollout figures compare two engines, not the model"
            )
        for name, r, m, err in compare.compare(real, sim):
            console.print(f"  {name:20s} real {r:10.3f}  sim {m:10.3f}  ({err:+.1%})")
    console.print("report: " + ", ".join(str(d / "report.html") for d in dirs))
    return 0


def shaping_lines(metrics: Path) -> list[str]:
    """Per step: lengths generated vs trained (p50/p99/max), tokens shaping discarded, its discards."""
    from tailrace.records import StepRecord, read_metrics

    lines = ["step  generated p50/p99/max   trained p50/p99/max   extra tokens  shaping discards"]
    tokens = discards = 0
    for r in read_metrics(metrics):
        if not isinstance(r, StepRecord):
            continue
        g, t = r.ledger.get("generated", {}), r.length
        extra, tokens = r.ledger["shaping_tokens"] - tokens, r.ledger["shaping_tokens"]
        shaped, discards = r.discards.get("shaping", 0) - discards, r.discards.get("shaping", 0)
        lines.append(
            f"{r.step:4d}  {g.get('p50', 0):5.0f} {g.get('p99', 0):5.0f} {g.get('max', 0):5.0f}       "
            f"{t['p50']:5.0f} {t['p99']:5.0f} {t['max']:5.0f}     {extra:10d}  {shaped:8d}"
        )
    return lines


def calibrate(args: Args) -> int:
    from tailrace.calibrate import calibrate

    flags = args.flags
    dtypes = flags.get("--dtype", ",".join(DTYPES)).split(",")
    if args.rest or any(d not in DTYPES for d in dtypes) or ("--out" in flags and len(dtypes) > 1):
        raise ConfigError("usage: tailrace sim calibrate [--quick] [--dtype float32|bfloat16 [--out FILE]]")
    for d in dtypes:
        res = calibrate(
            Path(flags["--out"]) if "--out" in flags else None,
            quick="--quick" in flags,
            progress=console.print,
            dtype=d,
        )
        console.print(
            f"saved the {res['hardware']['name']} preset (load average {res['load_average'][0]:.1f} while measuring)"
        )
    return 0


def presets(args: Args) -> int:
    from tailrace.sim.hardware import CPU_PRESETS, GPUS
    from tailrace.sim.models import MODELS

    if args.rest:
        raise ConfigError("usage: tailrace sim presets")
    console.print("hardware: " + ", ".join([*GPUS, *CPU_PRESETS]))
    console.print("models:   " + ", ".join(f"{k} ({m.params / 1e9:.2f}B)" for k, m in MODELS.items()))
    return 0
