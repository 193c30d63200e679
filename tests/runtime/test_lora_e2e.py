"""`tailrace train` with `train.lora`, end to end through real processes: the trainer publishes its
adapter alone, the engines serve each version as an adapter over the one base they loaded, a
checkpoint holds the merged model and the adapter in PEFT's files, and a resume continues exactly."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tailrace.cli import main
from tailrace.model import lora
from tailrace.model.checkpoint import load_pretrained
from tests.runtime.conftest import TINY_RUN, as_qwen3_moe, checkpoints, unfinish

# The tiny model earns no reward on chainsum, and a KL penalty cannot move a fresh adapter (the policy
# is the reference until it moves); on one-digit answers it is right now and then, which is signal.
# A high learning rate moves the adapter far enough that an engine serving the base instead would show
# in the logprob gap.
LORA = ["--train.lora.rank=4", "--train.lora.alpha=8", "--train.lr=0.05", "--flow.samples_per_prompt=8",
        "--flow.train_batch=32"]  # fmt: skip


def gaps_small(steps: list[dict], measured: int | None = None) -> bool:
    """The engine-vs-trainer logprob gap within fp32 rounding at every step that measured one (nan: no
    token of the step was sampled under the weights it trained from), and at least `measured` steps
    measured one (None: half of them). An overlapped mode's count depends on timing: a loaded machine
    can leave most of its steps without an on-policy token."""
    gaps = [s["train"]["logprob_gap_max"] for s in steps]
    enough = len(gaps) // 2 if measured is None else measured
    return all(not g >= 1e-3 for g in gaps) and sum(g == g for g in gaps) >= enough


def step_records(run: Path) -> list[dict]:
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in recs if r["kind"] == "step"]


def test_a_lora_run_publishes_adapters_saves_peft_files_and_resumes_exactly(
    tiny_model, tmp_path, digits, capfd
):
    run = tmp_path / "run"
    argv = ["train", f"--model.path={tiny_model}", *TINY_RUN, *LORA, digits, "--flow.mode=sync",
            "--flow.keep_checkpoints=4"]  # fmt: skip
    assert main([*argv, f"--run-dir={run}"]) == 0
    steps = step_records(run)
    assert len(steps) == 4
    # the engines sampled each step's tokens under the trainer's own adapter: the trainer recomputes
    # their logprobs to fp32 rounding (the base alone would be off by the adapter's update)
    assert gaps_small(steps)
    base = load_pretrained(tiny_model)
    last = checkpoints(run)[-1]
    adapter = lora.load_peft(last / lora.ADAPTER_DIR)
    assert adapter.rank == 4 and adapter.alpha == 8.0
    assert json.loads((last / lora.ADAPTER_DIR / lora.ADAPTER_CONFIG).read_text())[
        "base_model_name_or_path"
    ] == str(tiny_model)
    saved = load_pretrained(last / "model")  # the merged policy, a plain checkpoint
    want = lora.merged(load_pretrained(tiny_model), adapter)
    moved = 0.0
    for (name, w), b in zip(want.state_dict().items(), base.state_dict().values()):
        assert torch.allclose(saved.state_dict()[name], w, atol=1e-6), name
        moved = max(moved, float((w - b).abs().max()))
    assert moved > 1e-2  # the adapter changed the policy (the gap check above is not vacuous)
    # the checkpoints before the last hold the adapter alone; `tailrace eval RUN` merges it into the base
    assert [(c / "model").is_dir() for c in checkpoints(run)] == [False, False, False, True]
    assert all((c / lora.ADAPTER_DIR / lora.ADAPTER_WEIGHTS).is_file() for c in checkpoints(run))
    assert main(["eval", str(run), "--eval.n=16"]) == 0
    evals = [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r.get("tag") == "checkpoint"
    ]
    assert [e["step"] for e in evals] == [1, 2, 3, 4]
    # a checkpoint's directory evaluates as a model too: its adapter over the base its adapter_config
    # names, the figure `tailrace eval RUN` gave it (the same held-out requests, seeded)
    capfd.readouterr()
    flags = [digits, "--eval.n=16", "--eval.max_new_tokens=32"]
    assert main(["eval", f"--model.path={checkpoints(run)[0]}", *flags]) == 0
    assert f"held-out accuracy {evals[0]['accuracy']:.1%} on 16" in capfd.readouterr().out

    # killed after its third checkpoint: the resume trains the fourth step from its adapter (the next
    # test checks what a LoRA checkpoint restores) and saves it
    again = unfinish(Path(shutil.copytree(run, tmp_path / "again")))
    assert main(["train", "--resume", str(again)]) == 0
    assert [r["step"] for r in step_records(again)] == [0, 1, 2, 3]
    assert step_records(again)[-1]["train"]["logprob_gap_max"] < 1e-3
    assert lora.load_peft(checkpoints(again)[-1] / lora.ADAPTER_DIR).rank == 4


def test_a_lora_checkpoint_restores_the_adapter_and_adamw(tiny_model, tmp_path):
    """What a resumed (or replacement) trainer builds from a LoRA checkpoint: the base from the source
    checkpoint, the adapter from adapter/, AdamW's state and step, bit for bit."""
    from tailrace.config import TrainerConfig
    from tailrace.config.train import LoraConfig
    from tailrace.runtime.checkpoint import save_trainer
    from tailrace.runtime.trainer_worker import TrainerSpec, build_trainer
    from tests.trainer.test_grpo import make_groups

    spec = TrainerSpec(str(tiny_model), TrainerConfig(lr=0.05, lora=LoraConfig(rank=4)), 1, (), seed=0)
    tr = build_trainer(spec)
    for step in range(2):
        tr.step(make_groups(tr.model, seed=step), trainer_version=step)
    save_trainer(tr, tiny_model, tmp_path / "ckpt")
    back = build_trainer(replace(spec, seed=1, resume_from=str(tmp_path / "ckpt")))
    assert torch.equal(back.flat.buffer, tr.flat.buffer) and back.steps == 2
    params = lambda t: [p for g in t.opt.param_groups for p in g["params"]]  # noqa: E731
    for p, q in zip(params(tr), params(back), strict=True):
        assert all(torch.equal(tr.opt.state[p][k], back.opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))
    # and the two step on alike
    groups = make_groups(tr.model, seed=9)
    assert tr.step(groups, 2)["loss"] == back.step(groups, 2)["loss"]
    assert torch.equal(back.flat.buffer, tr.flat.buffer)


@pytest.mark.slow
def test_two_lora_policies_share_the_base_on_the_engines(tiny_model, tmp_path, digits, capfd):
    """Each policy's versions are adapters on the same engines (engine version v * 2 + p), and their
    trainers map one copy of the base (an fp32 checkpoint's: the page cache's); each trains its own
    adapter, saved in its own directory."""
    run = tmp_path / "run"
    policies = "[{name: sums}, {name: other, seed: 7, flow: {mode: multiversion}}]"
    argv = ["train", f"--model.path={tiny_model}", *TINY_RUN, *LORA, digits, "--flow.mode=sync"]
    assert main([*argv, f"--run-dir={run}", f"--policies={policies}"]) == 0
    assert "each trainer maps the base from the checkpoint's files" in capfd.readouterr().out
    adapters = []
    for name in ("sums", "other"):
        d = run / "policies" / name
        steps = step_records(d)
        assert len(steps) == 4 and steps[-1]["ledger"]["trained"] == 32 * 4
        assert gaps_small(steps, measured=None if name == "sums" else 1), [s["train"] for s in steps]
        adapters.append(lora.load_peft(checkpoints(d)[-1] / lora.ADAPTER_DIR))
    a, b = (x.weights[0, "q_proj"][1] for x in adapters)
    assert not torch.equal(a, b)  # two adapters, each its own policy's


@pytest.mark.slow
def test_a_run_starts_from_a_peft_adapter(tiny_model, tmp_path, digits):
    """train.lora.init: a second run starts from the first's last adapter. Its trainer and its engines
    hold it as version 0: its base evaluation is the first run's final one, and the engines sample its
    first step under the trainer's own weights."""
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["train", f"--model.path={tiny_model}", *TINY_RUN, *LORA, digits, "--flow.mode=sync"]
    assert main([*argv, f"--run-dir={first}"]) == 0
    init = checkpoints(first)[-1] / lora.ADAPTER_DIR
    assert main([*argv, f"--run-dir={second}", f"--train.lora.init={init}", "--flow.steps=1"]) == 0

    def evals(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return {r["tag"]: r for r in map(json.loads, lines) if r["kind"] == "eval"}

    final, base = evals(first)["final"], evals(second)["base"]
    assert base["accuracy"] == final["accuracy"] and base["histogram"] == final["histogram"]
    # the engines sampled step 1 under the trainer's version 0, the moved adapter (not the base)
    assert gaps_small(step_records(second))


def test_an_init_adapter_that_does_not_fit_the_config_is_one_line(tmp_path, capsys):
    """Checked when a run starts (exit 2, no run directory), not at every load of the config: a finished
    run's resume, report or evaluation does not need the adapter any more."""
    from tailrace.config import load_config
    from tests.runtime.conftest import one_line, run

    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    )
    start = ["train", f"--run-dir={tmp_path / 'run'}", "--train.lora.rank=4"]
    rc, out = run(capsys, *start, f"--train.lora.init={d}")
    assert rc == 2 and not (tmp_path / "run").exists()
    assert "has r=8" in one_line(out) and "set --train.lora.rank=8 --train.lora.alpha=16 " in one_line(out)
    rc, out = run(capsys, *start, f"--train.lora.init={tmp_path / 'none'}")
    assert rc == 2 and "not a readable PEFT adapter config" in one_line(out)
    cfg = load_config(
        overrides=["--train.lora.rank=8", "--train.lora.targets=[q_proj]", f"--train.lora.init={d}"]
    )
    cfg.train.lora.check_init()  # fits
    assert load_config(overrides=["--train.lora.rank=4", f"--train.lora.init={tmp_path / 'none'}"])  # loads


def mapped_from(t: torch.Tensor, d: Path) -> bool:
    """Whether `t`'s data lies in this process's mapping of a file in `d` (the page cache's pages)."""
    at = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= at < hi:
            return len(rest) == 5 and Path(rest[4]).parent == Path(d).resolve()
    return False


@pytest.mark.parametrize(
    "bf16,moe,stored",
    [
        (False, False, "bf16"),
        (True, False, "exact"),
        (True, True, "exact"),
        (True, False, "fp32"),
        (False, False, "fp32"),
    ],
)
def test_trainers_over_one_shared_base_train_as_over_their_own(tiny_model, tmp_path, bf16, moe, stored):
    """runtime/shared_base.py: what a trainer's own load would copy is in shared memory once, and each
    trainer's frozen parameters are those tensors (no copy); what the checkpoint stores as the trainer
    holds it (fp32) each trainer maps from the file, as its own load does (the page cache's one copy).
    A trainer over them steps exactly as one over a base loaded for itself. `stored`: a bf16 checkpoint
    (everything converted: all shared), an fp32 one of values bf16 holds exactly (a bf16 trainer keeps
    its projections, and an MoE's experts, in bf16: those shared, the rest mapped), an fp32 one (every
    tensor mapped: nothing to share)."""
    from tailrace.config import TrainerConfig
    from tailrace.config.train import LoraConfig
    from tailrace.model import save_pretrained
    from tailrace.runtime.shared_base import share
    from tailrace.runtime.trainer_worker import TrainerSpec, build_trainer
    from tests.trainer.test_grpo import make_groups

    if moe:
        tiny_model = as_qwen3_moe(tiny_model, tmp_path / "moe")
    if stored != "fp32":  # its weights as a bf16 checkpoint holds them: stored so, or read into fp32
        low = load_pretrained(tiny_model).to(torch.bfloat16)
        save_pretrained(low if stored == "bf16" else low.float(), tmp_path / "b", companions_from=tiny_model)
        tiny_model = tmp_path / "b"
    cfg = TrainerConfig(lr=0.05, bf16=bf16, lora=LoraConfig(rank=4))
    spec = TrainerSpec(str(tiny_model), cfg, 1, (), seed=0)
    own = build_trainer(spec)
    q, emb = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"
    base, why = share(tiny_model, cfg.lora, bf16)
    if stored == "fp32":
        assert base is None and "each trainer maps the base from the checkpoint's files" in why
        assert mapped_from(own.model.get_parameter(q), tiny_model)  # its own load: no copy of the base
        return
    assert base is not None and "share one copy" in why
    a, b = build_trainer(replace(spec, base=base)), build_trainer(replace(spec, base=base))
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa[q].data_ptr() == pb[q].data_ptr() == base.tensors[q].data_ptr() and pa[q].is_shared()
    assert pa[q].dtype == (torch.bfloat16 if bf16 else torch.float32)
    if stored == "bf16":
        assert base.mapped == () and pa[emb].is_shared()
        # the tied head is the embedding's one copy (state_dict gives the two names two tensor objects)
        assert base.tensors["lm_head.weight"].data_ptr() == base.tensors[emb].data_ptr()
    else:  # the embedding and the norms stay fp32 as stored: mapped by each trainer, not copied
        assert emb in base.mapped and emb not in base.tensors and not pa[emb].is_shared()
        assert mapped_from(pa[emb], tiny_model) and mapped_from(pb[emb], tiny_model)
        assert "MB more mapped from the checkpoint's files" in why
    if moe:
        e = "model.layers.0.mlp.experts.1.up_proj.weight"
        assert pa[e].dtype == own.model.get_parameter(e).dtype == torch.bfloat16 and pa[e].is_shared()
    for step in range(2):
        groups = make_groups(own.model, seed=step)
        assert own.step(groups, step)["loss"] == a.step(groups, step)["loss"]
    assert torch.equal(own.flat.buffer, a.flat.buffer)
    assert torch.equal(pb[q], base.tensors[q])  # nothing wrote to the shared base


@pytest.mark.slow
def test_a_lora_run_replaces_a_lost_engine_and_trainer_exactly(tiny_model, tmp_path, digits):
    """An engine killed, then the trainer: the new engine loads the live versions' adapters, the new
    trainer its checkpoint's adapter and AdamW state and replays the steps since; every step once,
    every trajectory once, and the engines keep sampling under the trainer's own adapters."""
    import os
    import signal

    from tests.runtime.conftest import assert_exact, recoveries, start_cli, wait_for_steps, workers_of
    from tests.runtime.test_faults import finish
    from tests.runtime.test_recovery_modes import wait_for_recovery

    run = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, *LORA, digits, "--flow.steps=6",
        "--flow.mode=multiversion", "--rollout.engines=2", "--eval.n=4", "--flow.checkpoint_every=2",
    )  # fmt: skip
    try:
        wait_for_steps(run, p, 1)
        os.kill(workers_of(p.pid)[2], signal.SIGKILL)  # engine 1
        wait_for_recovery(run, p, "engine1")
        wait_for_steps(run, p, 3)
        os.kill(workers_of(p.pid)[0], signal.SIGKILL)  # the trainer
        rc, out = finish(p, timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert rc == 0, out
    assert sorted(m.data["worker"] for m in recoveries(run)) == ["engine1", "trainer"], out
    assert_exact(run, 6)
    steps = step_records(run)  # multiversion: how many steps measure a gap is timing
    assert gaps_small(steps, measured=1), [(s["version"], s["train"]["logprob_gap_max"]) for s in steps]
