"""bench/sim.py: the simulator on the published setups (TECHNIQUES.md §1, §2, §4), next to the
published figures, plus the scale check and (with --real RUN_DIR) the CPU-testbed validation.

    .venv/bin/python bench/sim.py [--quick] [--real RUN_DIR ...] [--no-scale]

Every scenario uses the hardware presets and efficiency constants of tailrace/sim/hardware.py as
they are; nothing is tuned per row. What a paper does not state is an assumption, written once per
setup below (ASSUMPTIONS) and printed with the table. Where a simulated figure misses the published
range, the table names the assumption that explains it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrace.config import FlowConfig  # noqa: E402
from tailrace.sim import compare  # noqa: E402
from tailrace.sim.scenario import (
    ClusterSpec,
    Scenario,
    apply_overrides,
    cost_model,  # noqa: E402
    scenario_from_run,
    simulate,
)

ASSUMPTIONS = {
    "rolloutpipe": "8x A100-80G, disaggregated: 4 rollout engines (TP1) + 4 trainer GPUs; max response 8,192; "
    "lognormal lengths median 2,500 (prompt sigma 0.6, sample sigma 0.5), 5% run to the limit; "
    "prompt 256 tokens; old-policy logprobs recomputed; 2 rounds per R. pipe is run twice: with "
    "tailrace's FGD as written (admit only the F_w = U frontier groups) and with FGD as an "
    "admission priority (F_w = R: every group of the round admitted, lowest-numbered first)",
    "dora": "H800, engines of 4 GPUs (TP4), half the GPUs roll out and half train, in every mode; 128 prompts x 8 "
    "samples per step, train batch = 1,024; 30,720-token limit; lognormal lengths median 4,000 (prompt "
    "sigma 0.7, sample sigma 0.5), 2% run to the limit (mean/max ~0.2, inside the published bubble "
    "range); prompt 1,024; partial and multiversion with K = 1 and a rollout batch of 2x the train "
    "batch per version (the most K = 1 admits); a K = 3 row shows the sensitivity",
}


def rolloutpipe(R: int, mode: str, rounds: int = 2, frontier: int | None = None) -> Scenario:
    return Scenario(
        name=f"rolloutpipe-R{R}-{mode}",
        cluster=ClusterSpec(
            hardware="a100-80g",
            model="qwen3-1.7b",
            engines=4,
            engine_gpus=1,
            slots=0,
            lookahead=0,
            trainer_gpus=4,
        ),
        flow=FlowConfig(
            mode=mode, prompts_per_round=R, samples_per_prompt=8, train_batch=16, steps=rounds * R // 2
        ),
        lengths={
            "kind": "lognormal",
            "median": 2500,
            "max_len": 8192,
            "sigma_prompt": 0.6,
            "sigma_sample": 0.5,
            "runaway": 0.05,
            "prompt": 256,
        },
        policy_options={"frontier": frontier} if frontier else {},
        journal=False,
    )


def dora(gpus: int, mode: str, steps: int = 10, K: int = 1, placement: str = "shared") -> Scenario:
    half = gpus // 2
    streaming = mode in ("partial", "multiversion")
    return Scenario(
        name=f"dora-{gpus}-{mode}",
        cluster=ClusterSpec(
            hardware="h800",
            model="qwen2.5-32b",
            engines=half // 4,
            engine_gpus=4,
            slots=0,
            lookahead=0,
            trainer_gpus=half,
        ),
        flow=FlowConfig(
            mode=mode,
            prompts_per_round=128,
            samples_per_prompt=8,
            train_batch=1024,
            steps=steps,
            max_staleness=K,
        ),
        lengths={
            "kind": "lognormal",
            "median": 4000,
            "max_len": 30720,
            "sigma_prompt": 0.7,
            "sigma_sample": 0.5,
            "runaway": 0.02,
            "prompt": 1024,
        },
        policy_options={"rollout_groups": 256, "placement": placement} if streaming else {},
        journal=False,
    )


def scale(steps: int = 20) -> Scenario:
    return Scenario(
        name="scale-1024",
        cluster=ClusterSpec(
            hardware="h800",
            model="qwen2.5-32b",
            engines=192,
            engine_gpus=4,
            slots=0,
            lookahead=16,
            trainer_gpus=256,
        ),
        flow=FlowConfig(
            mode="sync", prompts_per_round=512, samples_per_prompt=16, train_batch=8192, steps=steps
        ),
        lengths={
            "kind": "lognormal",
            "median": 4000,
            "max_len": 30720,
            "sigma_prompt": 0.7,
            "sigma_sample": 0.5,
            "runaway": 0.02,
            "prompt": 1024,
        },
        journal=False,
        poll_s=1.0,
    )


def steady_step_s(s: dict, warm: int = 2) -> float:
    """Time per optimizer step after the first `warm` steps (pipelines filled; the streaming modes
    alternate short and long steps, so measure over several)."""
    ends = s["step_end_s"]
    warm = min(warm, len(ends) - 1)
    return (ends[-1] - ends[warm - 1]) / (len(ends) - warm) if warm else ends[-1] / len(ends)


def rng(lo: float, hi: float, fmt: str = "{:.0%}") -> str:
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def row(rows, setup, figure, published: tuple[float, float] | str, sim: float, fmt="{:.0%}", note=""):
    if isinstance(published, tuple):
        lo, hi = published
        if lo == hi:  # a point figure: within 15%
            ok = "~yes" if abs(sim - lo) <= 0.15 * abs(lo) else "no"
        else:
            ok = "yes" if lo <= sim <= hi else "no"
        pub = rng(lo, hi, fmt)
    else:
        ok, pub = "-", published
    rows.append((setup, figure, pub, fmt.format(sim), ok, note))


def run(quick: bool, real: list[str], do_scale: bool) -> list[tuple]:
    rows: list[tuple] = []
    t0 = time.perf_counter()
    # ---- §2 RolloutPipe: sync (slime) vs pipe (CGP + FGD)
    for R in (32, 64, 96):
        sy = simulate(rolloutpipe(R, "sync"))
        pp = simulate(rolloutpipe(R, "pipe", frontier=R))  # FGD as a priority
        hard = simulate(rolloutpipe(R, "pipe"))  # FGD as written: only U groups admitted
        setup = f"RolloutPipe Qwen3-1.7B R={R}"
        gain = 1 - pp["window_s"] / sy["window_s"]
        row(
            rows,
            setup,
            "window shorter than sync",
            (0.307, 0.423),
            gain,
            note=""
            if gain >= 0.307
            else "the gain is bounded by training's share of the round; our trainer is faster than theirs "
            "(see waiting)",
        )
        row(
            rows,
            setup,
            "  same, FGD admitting only F_w=U",
            (0.307, 0.423),
            1 - hard["window_s"] / sy["window_s"],
            note="16 samples in flight on 4 engines x 166 slots: FGD as a hard limit starves big engines",
        )
        row(
            rows,
            setup,
            "trainer waiting, sync",
            (0.47, 0.52),
            sy["trainer_wait_ratio"],
            note="" if 0.47 <= sy["trainer_wait_ratio"] <= 0.52 else _why_rp(sy),
        )
        row(
            rows,
            setup,
            "trainer waiting, pipe",
            (0.14, 0.33),
            pp["trainer_wait_ratio"],
            note=""
            if pp["trainer_wait_ratio"] <= 0.33
            else "follows from the sync row: less training to overlap",
        )
        if R == 96:
            row(
                rows,
                setup,
                "first dispatch pipe / sync",
                (52 / 543, 61 / 509),
                pp["first_dispatch_s"] / sy["first_dispatch_s"],
                fmt="{:.3f}",
                note="ratio: cancels the unknown hardware",
            )
            row(
                rows,
                setup,
                "first dispatch, sync (s)",
                (509, 543),
                sy["first_dispatch_s"],
                fmt="{:.0f}",
                note=""
                if 509 <= sy["first_dispatch_s"] <= 543
                else "absolute rollout time: GPU type/count and "
                "lengths are assumptions (ours rolls out ~2.8x faster)",
            )
            row(
                rows,
                setup,
                "first dispatch, pipe (s)",
                (52, 61),
                pp["first_dispatch_s"],
                fmt="{:.0f}",
                note="" if 52 <= pp["first_dispatch_s"] <= 61 else "as above",
            )
    # ---- §4 DORA and §1 bubbles: sync vs partial vs multiversion
    n = 8 if quick else 12
    for gpus in (64, 128):
        sy, pa, mv = (simulate(dora(gpus, m, n)) for m in ("sync", "partial", "multiversion"))
        setup = f"DORA Qwen2.5-32B 30K, {gpus} GPUs"
        t_sy, t_pa, t_mv = steady_step_s(sy, 4), steady_step_s(pa, 4), steady_step_s(mv, 4)
        pub = 1.56 if gpus == 64 else 1.93
        row(
            rows,
            setup,
            "multiversion step speedup vs sync",
            (pub, pub),
            t_sy / t_mv,
            fmt="{:.2f}x",
            note=_why_dora(t_sy / t_mv, pub),
        )
        row(
            rows,
            setup,
            "partial step speedup vs sync",
            (1.56 / 1.18, 1.56 / 1.18) if gpus == 64 else "-",
            t_sy / t_pa,
            fmt="{:.2f}x",
            note="derived from two published figures: 1.56x (multiversion vs sync) / 1.18x (multiversion vs "
            "partial)"
            if gpus == 64
            else "not published at 128 GPUs: a prediction",
        )
        if gpus == 64:
            row(
                rows,
                setup,
                "multiversion speedup vs partial",
                (1.18, 1.18),
                t_pa / t_mv,
                fmt="{:.2f}x",
                note=_why_partial(t_pa / t_mv),
            )
            row(
                rows,
                setup,
                "rollout-only share, sync",
                (0.65, 0.65),
                sy["rollout_only_share"],
                note=_why_share(sy["rollout_only_share"], 0.65),
            )
            row(
                rows,
                setup,
                "rollout-only share, multiversion",
                (0.12, 0.12),
                mv["rollout_only_share"],
                note=_why_share(mv["rollout_only_share"], 0.12),
            )
        mv3 = simulate(dora(gpus, "multiversion", n, K=3))
        row(
            rows,
            setup,
            "  multiversion K=3 speedup vs sync",
            (pub, pub),
            t_sy / steady_step_s(mv3, 6),
            fmt="{:.2f}x",
            note=f"sensitivity to K (the paper trains with K = 1 and K = 3); shared placement keeps up to K + 1 "
            f"versions resident, each displacing its weights' worth of KV cache: {mv3['preemptions']} preemptions",
        )
        mv3d = simulate(dora(gpus, "multiversion", n, K=3, placement="dedicated"))
        row(
            rows,
            setup,
            "  same, DORA's dedicated placement",
            (pub, pub),
            t_sy / steady_step_s(mv3d, 6),
            fmt="{:.2f}x",
            note=f"each engine serves ~one version, so the cache stays its own: {mv3d['preemptions']} preemptions",
        )
        row(
            rows,
            f"§1 sync bubble, {gpus} GPUs",
            "(max L - mean L) / max L",
            (0.74, 0.885),
            sy["length_bubble"],
            note="a property of the length distribution alone (its mean/max was chosen inside this range)",
        )
    # ---- scale
    if do_scale:
        s = simulate(scale(6 if quick else 20))
        row(
            rows,
            "scale: 1,024 H800, Qwen2.5-32B, 30K",
            f"CPU seconds to simulate {s['steps']} steps",
            (0, 60),
            s["sim_cpu_seconds"],
            fmt="{:.1f}",
            note=f"wall {s['sim_seconds']:.0f} s on the shared machine (load "
            f"{os.getloadavg()[0]:.1f}); {s['gen_tokens'] / 1e9:.2f}B tokens, {s['sim_events']} engine events",
        )
    # ---- the CPU testbed against a real run
    for r in real:
        rows += validate(r)
    rows.append(("", "", "", "", "", f"bench wall time {time.perf_counter() - t0:.0f} s"))
    return rows


def validate(real: str) -> list[tuple]:
    """The CPU testbed: a real run's setup simulated (a) with the calibrated cpu preset, (b) with the
    trainer speed the run itself achieved, (c) with the trainer's and the engine's (one factor on the
    engine's costs) — the machine is shared, so (a) mixes the model's error with contention; (b) and
    (c) leave the simulator's composition of rollout, training, sync and the tail."""
    rows: list[tuple] = []
    scn = scenario_from_run(real)
    mode = scn.flow.mode
    cost = cost_model(scn)
    overhead, rate = compare.trainer_rate(real, cost)
    hw = cost.hw
    trainer = {"train_mfu": min(1.0, rate / hw.peak_flops), "train_step_overhead_s": overhead}
    r = compare.step_figures(real)
    runs = [
        ("calibrated cpu preset", "cal", scn),
        (
            "trainer speed as in the run",
            "tr",
            apply_overrides(scn, [f"--cluster.hardware_overrides={trainer}"]),
        ),
    ]
    for label, tag, sc in runs:
        out = Path("runs") / f"sim-like-{Path(real).parent.name}-{Path(real).name}-{tag}"
        simulate(sc, out)
        if tag == "tr":  # then the engine too: one factor, its busy time in the run over the simulated one
            f = compare.generate_busy_s(real) / compare.generate_busy_s(out)
            engine = {
                "step_overhead_s": hw.step_overhead_s * f,
                "per_seq_s": hw.per_seq_s * f,
                "mem_bw": hw.mem_bw / f,
                "flops_eff": min(1.0, hw.flops_eff / f),
            }
            runs.append(
                (
                    f"trainer and engine speed as in the run (engine x{f:.2f})",
                    "both",
                    apply_overrides(scn, [f"--cluster.hardware_overrides={trainer | engine}"]),
                )
            )
        m = compare.step_figures(out)
        for name in ("step_s", "train_s", "rollout_s", "trainer_wait_ratio", "bubble_ratio"):
            fmt = "{:.0%}" if "ratio" in name else "{:.2f}"
            # within 15%; a figure near zero (a trainer that never waits) within 2 points or 0.02 s
            lo, hi = min(0.85 * r[name], r[name] - 0.02), max(1.15 * r[name], r[name] + 0.02)
            row(
                rows,
                f"CPU testbed {mode}, {label}",
                f"{name} (real {fmt.format(r[name])})",
                (max(0.0, lo), hi),
                m[name],
                fmt=fmt,
                note="target: within 15% of the real run (2 points / 0.02 s near zero)",
            )
    rows.append(
        (
            f"CPU testbed {mode}",
            "trainer FLOP/s: calibrated vs in the run",
            "",
            f"{hw.peak_flops * hw.train_mfu / 1e9:.1f} vs {rate / 1e9:.1f} G",
            "-",
            f"the machine was shared (load {os.getloadavg()[0]:.1f} now): a pinned role gets what is left",
        )
    )
    return rows


def _why_rp(sy: dict) -> str:
    if sy["trainer_wait_ratio"] > 0.52:
        return (
            "our trainer is fast vs rollout: 35% MFU + 1 s/step is optimistic for B=16-sample steps on 4 GPUs "
            "(published ~50% means training takes as long as rollout)"
        )
    return "rollout too fast vs training: the assumed length distribution is shorter than the paper's"


def _why_dora(got: float, pub: float) -> str:
    if abs(got - pub) / pub <= 0.15:
        return "within 15%"
    if got < pub:
        return (
            "tail-bound: with K = 1 every version's longest sample (up to 30K tokens, 330-900 s of decode) "
            "must finish within two steps; DORA migrates requests and gives each engine one version"
        )
    return "larger gain: sync is tail-bound under the assumed length tail at the 30K limit"


def _why_partial(got: float) -> str:
    if abs(got - 1.18) / 1.18 <= 0.15:
        return "within 15%"
    return (
        "our partial is the faster one: its interruptions cost little (a re-prefill is compute-bound, and "
        "at K = 1 a weight update finds few samples in flight), while multiversion's shared engines run one "
        "forward per version in the batch, two whenever old-version tails decode beside the newest (DORA's "
        "request migration, which would gather the tails, is not modelled)"
    )


def _why_share(got: float, pub: float) -> str:
    if abs(got - pub) <= 0.1:
        return "within 10 points"
    return "the trainer still waits for each version's tail (K = 1), so rollout runs alone much of the time"


def table(rows) -> str:
    head = ("setup", "figure", "published", "simulated", "in range", "note")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(6)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(head, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke test)")
    ap.add_argument(
        "--real",
        nargs="*",
        default=[],
        help="real `tailrace train` run directories to validate the CPU testbed against",
    )
    ap.add_argument("--no-scale", action="store_true", help="skip the 1,024-GPU scale check")
    a = ap.parse_args()
    for r in a.real:  # a wrong directory fails now, not after the published scenarios
        scenario_from_run(r)
    rows = run(a.quick, a.real, not a.no_scale)
    print(table(rows))
    print("\nAssumptions (not stated by the papers; the same for every row of a setup):")
    for k, v in ASSUMPTIONS.items():
        print(f"- {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
