"""`Scenario`: one simulated run — cluster, flow, workload — loadable from YAML like a run config, and
`simulate()`, which builds the real scheduler and policy over simulated engines and runs it.

    name: dora-64
    cluster: {hardware: h800, model: qwen2.5-32b, engines: 8, engine_gpus: 4, slots: 0, trainer_gpus: 32}
    flow: {mode: sync, prompts_per_round: 64, samples_per_prompt: 16, train_batch: 1024, steps: 10}
    lengths: {kind: lognormal, median: 6000, max_len: 30720, runaway: 0.05, prompt: 512}

`flow` is tailrace's own FlowConfig (the section a real run's config.yaml has), so a policy sees the
same options in a simulated run as in a real one. `scenario_from_run(RUN_DIR)` rebuilds the scenario
of a real run (its flow, rollout and model shape on the "cpu" preset, its recorded lengths).

Several policies in one run (`policies`, as a real run's: one entry each, a name and any of the
sections flow, shaping, store and policy_options on top of the scenario's own, e.g.
`[{name: solver}, {name: verifier, flow: {mode: multiversion, max_staleness: 2}}]`) share the engines
(`flow.multi.PolicySet`); each has its own scheduler and its own trainer of `cluster.trainer_gpus`
devices, so the run holds engines x engine_gpus + policies x trainer_gpus devices. Every policy draws
the same prompts and lengths (they key on prompt and sample, and `seed` is the run's): a policy alone
in a scenario of its own sections is the run it would have had by itself. As in a real run, each
policy's files go to RUN_DIR/policies/<name>/ and the engines' and trainers' timeline (trainer lanes
`trainer-<name>`) to RUN_DIR/events.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tailrace.config import ConfigError, FlowConfig, ShapingConfig, StoreConfig, load_config
from tailrace.config.fields import section, setting
from tailrace.config.load import policy_configs
from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy, recommended_mode
from tailrace.flow.replay import ReplayOptions
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import check_mode, make_shaping
from tailrace.records import StepRecord, read_metrics
from tailrace.sim.cluster import SimCluster
from tailrace.sim.costs import CostModel
from tailrace.sim.engine import TOKEN, SimEngine
from tailrace.sim.failures import FailureSpec
from tailrace.sim.hardware import get_hardware, preset_path
from tailrace.sim.lengths import LengthModel, make_lengths
from tailrace.sim.models import ModelShape, get_model
from tailrace.sim.recorder import Recorder, write_timeline
from tailrace.types import Prompt

MAX_AUTO_SLOTS = 256  # vLLM's default max_num_seqs: the cap when slots are sized from KV memory
# what a policy of a simulated run may set for itself; the rest (cluster, lengths, seed, ...) is the run's
POLICY_SECTIONS = ("flow", "shaping", "store", "policy_options", "join_at_s")


@dataclass
class ClusterSpec:
    hardware: str = setting("cpu", "a hardware preset (tailrace sim presets lists them)")
    hardware_overrides: dict[str, Any] = section(
        dict, "fields of the hardware preset to replace, e.g. {train_mfu: 0.4}"
    )
    model: str = setting("tailrace-default", "a model preset name, or a path to a HF config.json")
    model_config: dict[str, Any] = section(dict, "HF config.json fields; given, they replace `model`")
    engines: int = setting(1, "rollout engines (data-parallel replicas)")
    engine_gpus: int = setting(1, "devices per engine (tensor parallel)")
    slots: int = setting(64, "concurrent sequences per engine; 0 = size from KV memory (capped at 256)")
    lookahead: int = setting(16, "samples queued per engine beyond its slots")
    trainer_gpus: int = setting(1, "devices of the trainer (of each policy's, with several policies)")
    colocated: bool = setting(False, "trainer and engines share devices: engines pause while training runs")
    recompute_logprobs: bool = setting(
        True, "the trainer runs a forward for old-policy logprobs before each step"
    )
    checkpoint_s: float = setting(0.0, "trainer seconds to write a checkpoint after each publishing step")
    micro_batch_tokens: int = setting(
        0, "> 0: the trainer pads micro-batches of this many tokens (tailrace's); 0: packed"
    )
    weight_broadcast: str = setting(
        "tree", "how a new version reaches the engines: tree (pipelined broadcast) or flat (a copy each)"
    )
    lora_rank: int = setting(
        0,
        "a LoRA run (train.lora.rank): each version is a rank-r adapter on every projection, so a new "
        "version moves and a resident one costs the adapter's bytes, and training skips the base's "
        "weight gradients; 0 = whole weights",
    )
    train_updates: int = setting(
        1, "optimizer updates a train step takes (train.mini_batches x train.epochs), each its overhead"
    )
    train_epochs: int = setting(1, "passes a train step makes over its batch (train.epochs)")
    critic: bool = setting(
        False,
        "PPO's critic (train.advantage=gae): the trainer also runs a value model of the policy's size, "
        "a forward before the updates and a forward and backward each pass",
    )
    gradient_checkpointing: bool = setting(
        False,
        "the trainer keeps each layer's input alone and runs its forward again in the backward "
        "(train.gradient_checkpointing): a third more compute a pass",
    )
    reference: bool = setting(
        False,
        "a KL penalty (train.loss.kl_coef > 0): the trainer runs the reference's forward each pass",
    )
    kv_memory: bool = setting(
        True,
        "engines hold a KV cache of the memory their weights leave (admission waits, growing contexts "
        "preempt and recompute, a second resident version takes its weights' worth); false = unbounded",
    )

    def __post_init__(self) -> None:
        for k in ("engines", "engine_gpus", "trainer_gpus"):
            if getattr(self, k) < 1:
                raise ConfigError(f"cluster.{k}={getattr(self, k)}: must be at least 1")
        if self.lora_rank < 0:
            raise ConfigError(f"cluster.lora_rank={self.lora_rank}: must be >= 0 (0 = whole weights)")
        if not 1 <= self.train_epochs <= self.train_updates:
            raise ConfigError(
                f"cluster.train_epochs={self.train_epochs}, train_updates={self.train_updates}: need "
                "1 <= train_epochs <= train_updates (an epoch is at least one update)"
            )
        if self.slots < 0 or self.lookahead < 0:
            raise ConfigError(
                "cluster.slots and cluster.lookahead must be >= 0 (slots 0 = size from KV memory)"
            )


@dataclass
class SpecSim:
    alpha: float = setting(
        0.0,
        "speculative decoding: the drafter's acceptance per drafted token (bench/spec.py measures it; "
        "0 = off)",
    )
    gamma: int = setting(5, "draft tokens per verify step")
    min_speedup: float = setting(1.05, "the toggle: speculate only where the cost model predicts this")

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1 or self.gamma < 1 or self.min_speedup <= 0:
            raise ConfigError(
                f"spec: alpha={self.alpha} must lie in [0, 1], gamma={self.gamma} >= 1, "
                f"min_speedup={self.min_speedup} > 0"
            )


@dataclass
class Scenario:
    name: str = setting("scenario", "the scenario's name, in its run directory's name")
    cluster: ClusterSpec = section(ClusterSpec, "the simulated devices, model and engines")
    flow: FlowConfig = section(
        lambda: FlowConfig(steps=20), "a real run's flow section, driving the same policy"
    )
    shaping: ShapingConfig = section(ShapingConfig, "a real run's shaping section, on top of flow.mode")
    store: StoreConfig = section(StoreConfig, "a real run's store section: its replay buffer")
    train_size: int | None = setting(
        None, "training prompts cycled in epochs (their lengths come back; null = always fresh prompts)"
    )
    lengths: dict[str, Any] = section(
        lambda: {"kind": "lognormal", "median": 60, "max_len": 320, "prompt": 20},
        "response lengths: {kind: constant | lognormal | empirical, ...} (sim/lengths.py)",
    )
    accuracy: float = setting(0.5, "probability a sample is rewarded (only shaping policies look at rewards)")
    seed: int = setting(0, "seed of the lengths and rewards")
    journal: bool = setting(True, "write journal.jsonl (every token id: turn off at scale)")
    poll_s: float = setting(0.0, "the driver polls at most every poll_s virtual seconds (0 = at every event)")
    policy_options: dict[str, Any] = section(dict, "extra options for the flow policy (make_policy)")
    policies: list[dict[str, Any]] = section(
        list,
        "several policies in one simulated run, sharing the engines, as a real run's: one entry each, {name, "
        "and any of the sections flow, shaping, store, policy_options}, each on top of the scenario's own "
        "(e.g. [{name: solver}, {name: verifier, flow: {mode: multiversion}}]); each has its own "
        "scheduler, versions, staleness bound and trainer of cluster.trainer_gpus devices (empty = one)",
    )
    join_at_s: float = setting(
        0.0,
        "a policy's own key (in policies): the virtual second it joins the running run, as tailrace policy "
        "join does (0 = from the start; at least one policy starts)",
    )
    failures: FailureSpec = section(FailureSpec, "workers that die and come back (RobustRL's recovery)")
    spec: SpecSim = section(SpecSim, "speculative decoding in the engines (an expected-value model)")

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ConfigError(f"accuracy={self.accuracy}: must lie in [0, 1]")
        if self.train_size is not None and self.train_size < 1:
            raise ConfigError(f"train_size={self.train_size}: must be positive, or null for fresh prompts")
        if self.poll_s < 0:
            raise ConfigError(f"poll_s={self.poll_s}: must be >= 0 (0 = poll after every event)")
        if not isinstance(self.lengths, dict) or "kind" not in self.lengths:
            raise ConfigError("lengths: give a mapping with kind: constant | lognormal | empirical")
        if self.flow.mode is None:  # as a real run with flow.mode null would run
            self.flow = dataclasses.replace(self.flow, mode=recommended_mode(self.shaping.name)[0])
        if self.join_at_s < 0:
            raise ConfigError(f"join_at_s={self.join_at_s}: must be >= 0 virtual seconds")
        if len(self.policy_scenarios()) > 1 and self.cluster.colocated:
            raise ConfigError(
                f"policies: {len(self.policies)} policies with cluster.colocated=true: the simulator gives "
                "each policy's trainer devices of its own; set cluster.colocated: false"
            )

    def policy_scenarios(self) -> list[tuple[str, Scenario]]:
        """(name, this scenario with the policy's sections) for each policy; ("", self) for one."""
        return policy_configs(self, POLICY_SECTIONS)

    def run_dirs(self, out_dir: str | Path) -> list[Path]:
        """Where each policy's files go: `out_dir` itself for one policy, out_dir/policies/<name> for
        several (as a real run's)."""
        named = self.policy_scenarios()
        return [Path(out_dir)] if len(named) == 1 else [Path(out_dir) / "policies" / n for n, _ in named]

    @property
    def gpus(self) -> int:
        """Devices of the run: the engines', and each policy's trainer's unless colocated."""
        c, trainers = self.cluster, len(self.policy_scenarios())
        return c.engines * c.engine_gpus + (0 if c.colocated else trainers * c.trainer_gpus)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_scenario(path: str | Path | None = None, overrides: list[str] | None = None) -> Scenario:
    return load_config(path, overrides, cls=Scenario)


def apply_overrides(scn: Scenario, overrides: list[str]) -> Scenario:
    """The scenario with `--section.key=value` overrides applied (validated like a loaded one)."""
    if not overrides:
        return scn
    import tempfile

    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(scn.to_dict(), f)
        f.flush()
        return load_scenario(f.name, overrides)


# ---------------------------------------------------------------------------------------------------
def model_shape(spec: str) -> ModelShape:
    p = Path(spec)
    if p.suffix == ".json" or p.is_dir():
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        return shape_from_hf(cfg, p.stem if p.suffix else p.name)
    try:
        return get_model(spec)
    except KeyError as e:
        raise ConfigError(str(e).strip('"')) from None


def shape_from_hf(cfg: dict, name: str) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (dense Llama/Qwen2/Qwen3, or Qwen3-MoE, Qwen2-MoE (its
    shared expert too), OLMoE, Mixtral or Granite's MoE: the experts `num_experts` or `num_local_experts`;
    the last three's intermediate_size wide)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    every = cfg.get("model_type") in (
        "olmoe",
        "mixtral",
        "granitemoe",
    )  # their experts intermediate_size wide
    width = cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if every else 0)
    qwen2_moe = cfg.get("model_type") == "qwen2_moe"
    return ModelShape(
        name,
        h,
        cfg["num_hidden_layers"],
        heads,
        cfg.get("num_key_value_heads") or heads,
        cfg.get("head_dim") or h // heads,
        cfg.get("intermediate_size", 0),
        cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=cfg.get("model_type") == "qwen2" or (qwen2_moe and cfg.get("qkv_bias", True)),
        experts=experts,
        experts_per_token=cfg.get("num_experts_per_tok", 0),
        expert_intermediate=width,
        shared_intermediate=cfg.get("shared_expert_intermediate_size", 0) if qwen2_moe else 0,
    )


def cost_model(scn: Scenario) -> CostModel:
    c = scn.cluster
    try:
        hw = get_hardware(c.hardware)
        hw = dataclasses.replace(hw, **c.hardware_overrides) if c.hardware_overrides else hw
    except KeyError as e:
        raise ConfigError(str(e).strip('"')) from None
    except TypeError as e:
        raise ConfigError(
            f"cluster.hardware_overrides: {e}; valid keys are the fields of sim.hardware.Hardware"
        ) from None
    shape = shape_from_hf(c.model_config, c.model) if c.model_config else model_shape(c.model)
    return CostModel(
        hw, shape, c.engine_gpus, c.trainer_gpus, c.recompute_logprobs, c.checkpoint_s, c.micro_batch_tokens,
        c.engines, c.weight_broadcast, c.lora_rank, c.train_updates, c.train_epochs, c.critic,
        c.gradient_checkpointing, c.reference,
    )  # fmt: skip


def engine_slots(scn: Scenario, cost: CostModel, lengths: LengthModel) -> int:
    """The scenario's slots, or as many sequences as the KV memory holds beside every policy's weights."""
    if scn.cluster.slots:
        return scn.cluster.slots
    per_seq = lengths.prompt_len(0) + lengths.mean()
    kv = cost.kv_capacity_tokens() - (len(scn.policy_scenarios()) - 1) * cost.version_kv_tokens()
    return max(1, min(MAX_AUTO_SLOTS, int(kv / per_seq)))


def prompt_stream(lengths: LengthModel, train_size: int | None = None) -> Iterator[Prompt]:
    """Prompts 0, 1, 2, ... (or 0 .. train_size - 1 over and over): the id picks the lengths."""
    i = 0
    while True:
        pid = i if train_size is None else i % train_size
        yield Prompt(id=pid, token_ids=(TOKEN,) * lengths.prompt_len(pid), answer="")
        i += 1


def build(scn: Scenario, out_dir: str | Path | None = None) -> SimCluster:
    named = scn.policy_scenarios()
    policies, shapings = [], []
    for name, ps in named:
        f = ps.flow
        try:
            if ps.store.filter:
                raise ValueError(
                    f"store.filter={ps.store.filter}: the simulator does not run a filter (its samples have "
                    "no text); drop it, or simulate flow.zero_signal's drops alone"
                )
            options = {k: v for k, v in dataclasses.asdict(f).items() if k != "mode"} | ps.policy_options
            policies.append(make_policy(f.mode, **options))
            if policies[-1].external:
                raise ValueError(
                    "flow.mode=external trains an external agent's groups, and the simulator has no agent; "
                    "simulate the mode its rollouts would follow (e.g. async)"
                )
            check_mode(ps.shaping.name, f.mode)
            shapings.append(make_shaping(ps.shaping.name, window=f.prompts_per_round, **ps.shaping.options()))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"scenario {scn.name}{f', policy {name}' if name else ''}: {e}") from None
    try:
        lengths = make_lengths(scn.lengths, scn.seed)
    except (TypeError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"scenario {scn.name}: {e}") from None
    cost = cost_model(scn)
    slots = engine_slots(scn, cost, lengths)
    pool = [(slots, scn.cluster.lookahead)] * scn.cluster.engines
    scheds: list[Scheduler] = [
        Scheduler(
            policy,
            prompt_stream(lengths, scn.train_size),
            pool,
            FlowSpec(
                ps.flow.prompts_per_round, ps.flow.samples_per_prompt, ps.flow.groups_per_step, ps.flow.steps
            ),
            shaping=shaping,
            replay=ReplayOptions(**ps.store.options()),
        )
        for (_, ps), policy, shaping in zip(named, policies, shapings)
    ]
    if not scn.policies and scn.join_at_s or all(ps.join_at_s for _, ps in named):
        raise ConfigError(
            f"scenario {scn.name}: join_at_s is a policy's own key (in policies), and at least one policy "
            "starts at 0"
        )
    dirs = scn.run_dirs(out_dir) if out_dir is not None else [None] * len(named)
    recs = [Recorder(d, journal=scn.journal, timeline=len(named) == 1) for d in dirs]
    # those that start, then those that join (tailrace policy join), in the order they join
    order = sorted(range(len(named)), key=lambda k: named[k][1].join_at_s)
    first = [k for k in order if not named[k][1].join_at_s]
    pset = PolicySet(
        [named[k][0] or "policy" for k in first], [scheds[k] for k in first], scn.flow.share == "turns",
        room=len(named),
    )  # fmt: skip
    joins = [(named[k][1].join_at_s, named[k][0], scheds[k], recs[k]) for k in order if k not in first]
    kv = cost.kv_capacity_tokens() if scn.cluster.kv_memory else None
    sp = scn.spec
    spec = (sp.alpha, sp.gamma, sp.min_speedup) if sp.alpha > 0 else None
    start = [pset.version(p, 0) for p in range(len(pset))]
    engines = [
        SimEngine(i, slots, cost, lengths, start_versions=start, kv_tokens=kv, spec=spec)
        for i in range(scn.cluster.engines)
    ]
    return SimCluster(
        pset, engines, cost, [recs[k] for k in first], scn.cluster.colocated, scn.poll_s, scn.accuracy,
        scn.seed, scn.failures, joins,
    )  # fmt: skip


def simulate(scn: Scenario, out_dir: str | Path | None = None) -> dict:
    """Run the scenario; returns the summary (also written to out_dir/summary.json with the run files)."""
    t0, c0 = time.perf_counter(), time.process_time()
    cl = build(scn, out_dir)
    named = scn.policy_scenarios()
    if out_dir is not None:
        import yaml

        each = zip(scn.run_dirs(out_dir), (ps for _, ps in named)) if len(named) > 1 else ()
        for path, config in [(Path(out_dir), scn), *each]:  # the run's, and each policy's own
            (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    cl.run()
    if out_dir is not None and len(named) > 1:  # the engines' and trainers' timeline is the run's
        write_timeline(cl, Path(out_dir) / "events.jsonl", [f"trainer-{n}" for n, _ in named])
    summary = dict(
        cl.summary,
        scenario=scn.name,
        gpus=scn.gpus,
        slots=cl.engines[0].slots,
        sim_seconds=time.perf_counter() - t0,
        sim_cpu_seconds=time.process_time() - c0,
    )
    if scn.failures.active:  # the same run without failures: the effective training time ratio
        clean = build(dataclasses.replace(scn, failures=FailureSpec()))
        clean.run()
        summary["failures"] = dict(summary["failures"], clean_wall_s=clean.now, ettr=clean.now / cl.now)
    if out_dir is not None:
        (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def calibration(name: str = "cpu") -> dict:
    """Extra measurements `tailrace sim calibrate` saved with a cpu preset (empty if none)."""
    path = preset_path(name)
    return json.loads(path.read_text()).get("extra", {}) if path.is_file() else {}


def _recorded_micro_batch(run_dir: Path) -> int:
    """The micro-batch tokens the run's trainer sized from its memory budget (its step records say), or
    8,192 (the fixed size of runs from before budgets)."""
    return int(_recorded(run_dir, "micro_batch_tokens") or 8192)


def _recorded(run_dir: Path, key: str) -> float:
    """What the run's first step record with `key` says of it (its trainer's figures), or 0."""
    path = run_dir / "metrics.jsonl"
    for r in read_metrics(path) if path.is_file() else ():
        if isinstance(r, StepRecord) and r.train.get(key):
            return float(r.train[key])
    return 0.0


def rolled_out_on(run_dir: str | Path) -> str:
    """The rollout backend of a real run (its config.yaml's rollout.backend)."""
    from tailrace.config import RunConfig

    return load_config(Path(run_dir) / "config.yaml", cls=RunConfig).rollout.backend


def scenario_from_run(run_dir: str | Path) -> Scenario:
    """The scenario of a real tailrace run: its flow and rollout settings, its model's shape on the cpu
    preset of its engine's dtype ("cpu" for fp32, "cpu-bf16" for bf16; the trainer is costed by the same
    preset, as calibrated: fp32 trainer with the fp32 engine, bf16 autocast with the bf16 one) and the
    lengths its journal recorded."""
    from tailrace.config import RunConfig

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} has no config.yaml; pass a run directory written by tailrace train")
    cfg = load_config(run_dir / "config.yaml", cls=RunConfig)
    if cfg.policies:
        name = cfg.policies[0]["name"]
        raise ConfigError(
            f"{run_dir} trained {len(cfg.policies)} policies: simulate one policy's run directory, e.g. "
            f"--like {run_dir / 'policies' / name}"
        )
    r, s = cfg.rollout, cfg.arch
    model, shape = "tailrace-default", {}
    if cfg.model.path:
        model = str(Path(cfg.model.path) / "config.json")
    else:  # the warm-started default model, shaped by the run's arch section (char tokenizer: 100 ids)
        shape = {
            "hidden_size": s.hidden_size,
            "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads,
            "num_hidden_layers": s.num_layers,
            "intermediate_size": s.intermediate_size,
            "vocab_size": 100,
            "tie_word_embeddings": True,
            "model_type": "llama",
        }
    preset = "cpu-bf16" if cfg.model.dtype == "bfloat16" else "cpu"
    # the trainer writes a checkpoint every `checkpoint_every` publishing steps: its measured cost, spread
    # (null: the runtime's choice for a model this small, every step; a cadence in minutes is charged so too)
    ckpt = calibration(preset).get("checkpoint_s", 0.0) / (cfg.flow.checkpoint_every or 1)
    flow = cfg.flow
    cluster = ClusterSpec(
        hardware=preset,
        model=model,
        model_config=shape,
        engines=r.engines,
        # the trainer's pass before its updates: PPO's kept logprobs, the entropies top_entropy picks by
        recompute_logprobs=cfg.train.mini_batches * cfg.train.epochs > 1 or cfg.train.loss.top_entropy < 1,
        train_updates=cfg.train.mini_batches * cfg.train.epochs,
        train_epochs=cfg.train.epochs,
        critic=cfg.train.advantage == "gae",
        gradient_checkpointing=bool(_recorded(run_dir, "gradient_checkpointing")),
        reference=cfg.train.loss.kl_coef > 0,
        checkpoint_s=ckpt,
        micro_batch_tokens=cfg.train.micro_batch_tokens or _recorded_micro_batch(run_dir),
        slots=r.slots,
        lookahead=r.lookahead,
    )
    lengths = {"kind": "empirical", "run_dir": str(run_dir), "max_len": r.max_new_tokens}
    return Scenario(
        name=f"like-{run_dir.name}",
        cluster=cluster,
        flow=flow,
        shaping=cfg.shaping,
        store=dataclasses.replace(cfg.store, filter=None),  # (its lengths are the filtered run's own)
        lengths=lengths,
        seed=cfg.seed,
    )
