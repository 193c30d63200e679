import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailrace.records import Finished, Mark, StepRecord, read_events, read_journal, read_metrics
from tests.runtime.prebuild import TINY_ARCH, TINY_SFT, piece  # noqa: F401 (TINY_*: the vLLM tests')

TINY_RUN = [
    "--flow.steps=4",
    "--flow.prompts_per_round=4",
    "--flow.samples_per_prompt=4",
    "--flow.train_batch=16",
    "--rollout.max_new_tokens=32",
    "--rollout.slots=8",
    "--eval.n=16",
    "--eval.max_new_tokens=32",
]


@pytest.fixture(scope="session")
def tiny_model(request) -> Path:
    """A tiny warm-started chainsum model (seconds to build), as a normal HF checkpoint directory
    (tests/runtime/prebuild.py builds it beside the tests before)."""
    return piece(request.config, "tiny_model")


@pytest.fixture(scope="session")
def tool_model(request) -> Path:
    """The tiny chainsum model fine-tuned briefly on chaincalc demonstrations (it learns to call)."""
    return piece(request.config, "tool_model")


@pytest.fixture(scope="session")
def _built_kernels(request) -> Path | None:
    """The engine's C kernels built once for the session (None where they cannot be): every test's own
    cache starts with a copy, so the processes of each run do not compile them again (seconds each)."""
    return piece(request.config, "_built_kernels")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch, _built_kernels):
    cache = tmp_path / "cache"
    if _built_kernels is not None:
        shutil.copytree(_built_kernels, cache / "kernels")
    monkeypatch.setenv("TAILRACE_CACHE", str(cache))
    yield


@pytest.fixture(autouse=True)
def _no_leftover_workers():
    """A test that failed or timed out inside a run can leave that run's workers (trainer, engines)
    alive: they would hold cores and files into the next tests (a sandbox test once timed out at 0.5 s
    behind them). After each test, the workers of runs in this process get a moment to exit, then
    are killed."""
    yield
    deadline = time.monotonic() + 3.0
    while (left := workers_of(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="session")
def finished_run(tiny_model, tmp_path_factory) -> Path:
    """A whole run of TINY_RUN (4 steps, a checkpoint after each, the last three kept) from a copy of the
    tiny model that carries a chat template. The tiny model earns no reward, so a KL penalty makes every
    step move the weights and the optimizer. Copy it (`copy_run`) before changing anything in it."""
    from tailrace.cli import main

    root = tmp_path_factory.mktemp("finished")
    source = root / "model"
    shutil.copytree(tiny_model, source)
    (source / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    run = root / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={source}", *TINY_RUN, "--flow.keep_checkpoints=3"]
    argv.append("--flow.mode=sync")  # reproducible: the resume tests count on its schedule
    assert main([*argv, "--train.loss.kl_coef=0.01"]) == 0
    return run


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def checkpoints(run: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    return sorted(p for p in (run / "checkpoints").glob("step_*") if p.is_dir() and "." not in p.name)


def unfinish(run: Path) -> Path:
    """Make a finished run look killed after its next-to-last checkpoint: the final evaluation and the
    last checkpoint are gone (the journal and metrics keep what the lost step wrote, as after a crash)."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(l for l in lines if '"tag":"final"' not in l))
    shutil.rmtree(checkpoints(run)[-1])
    return run


@pytest.fixture
def unfinished_run(finished_run, tmp_path) -> Path:
    return unfinish(copy_run(finished_run, tmp_path / "run"))


def run_cli(*args: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """`tailrace ARGS` in a subprocess (output captured as text)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "tailrace.cli", *args], env=env, capture_output=True, text=True,
        timeout=timeout, **kw,
    )  # fmt: skip


def start_cli(*args: str, **kw) -> subprocess.Popen:
    """`tailrace ARGS` started in a subprocess of its own session (so a test can signal its group)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw,
    )  # fmt: skip


def wait_for_steps(run: Path, proc: subprocess.Popen, n: int, timeout: float = 240) -> None:
    """Until the run has written `n` step records (the process must stay alive meanwhile)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        f = run / "metrics.jsonl"
        if f.exists() and f.read_text().count('"kind":"step"') >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps within {timeout} s")


def workers_of(pid: int) -> list[int]:
    """The worker processes a driver runs, trainer first, then the engines in order (by the names they
    give themselves: tr-trainer, tr-engine0, ...; pids may wrap, so their order says nothing). They
    are the children of the driver's fork server (runtime/procs.py), so the driver's grandchildren."""
    parent, comm = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            comm[int(d.name)] = (d / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
    found = [
        (comm[p] != "tr-trainer", comm[p], p)
        for p in comm
        if comm[p].startswith("tr-") and pid in (parent[p], parent.get(parent[p]))
    ]
    return [p for *_, p in sorted(found)]


def run(capsys, *argv) -> tuple[int, str]:
    """`tailrace ARGV` in this process: its exit code and everything it printed."""
    from tailrace.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, (out.out + out.err).strip()


def one_line(out: str) -> str:
    """The output's last line, after checking the output holds no traceback."""
    assert "Traceback" not in out, out[-3000:]
    return out.strip().splitlines()[-1]


@pytest.fixture
def digits(tmp_path) -> str:
    """A jsonl task of one-digit answers (the tiny model gets some right: a reward signal)."""
    f = tmp_path / "digits.jsonl"
    rows = [{"question": f"q{i}: a={i % 9 + 1} b=0. a+b?", "answer": str(i % 9 + 1)} for i in range(200)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"--task.name=jsonl:{f}"


def assert_exact(run_dir, steps: int):
    """Every step once, every finished trajectory once, each trained group trained once and whole,
    and the ledger's identity: checked against the journal, not only the ledger's own counts. A step
    issued by a driver that died before it was checkpointed is issued again by the resumed driver:
    the later issue is the step's (as the report reads them)."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]
    assert [r.step for r in records] == list(range(steps))
    done = [(e.trajectory.group, e.trajectory.sample_index) for e in read_journal(run_dir / "journal.jsonl")
            if isinstance(e, Finished)]  # fmt: skip
    assert len(done) == len(set(done)), "a trajectory was finished twice"
    issued = {m.data["step"]: m.data["groups"] for m in read_events(run_dir / "events.jsonl")
              if isinstance(m, Mark) and m.kind == "train_issued"}  # fmt: skip
    assert sorted(issued) == list(range(steps))  # a step a resumed driver issued again: its groups count
    trained = [g for groups in issued.values() for g in groups]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    per_group = {g: sum(1 for d, _ in done if d == g) for g in trained}
    ledger = records[-1].ledger
    assert ledger["trained"] == sum(per_group.values()) == sum(r.samples for r in records)
    assert ledger["produced"] == len(done)
    assert ledger["produced"] == ledger["trained"] + ledger["in_store"] + sum(ledger["discarded"].values())


def recoveries(run_dir):
    return [m for m in read_events(run_dir / "events.jsonl") if isinstance(m, Mark) and m.kind == "recovery"]


def step_figures(recs: list[dict]) -> list[dict]:
    """Step records but for `time`, the engine-vs-trainer figures (logprob gaps, importance ratios)
    within 1e-6: the engine's fp32 logprobs move by an ulp with a batch's row count where MKL's GEMMs
    do (an AVX2-only CPU), though its tokens do not."""
    import pytest

    out = []
    for r in recs:
        r = {k: v for k, v in r.items() if k != "time"}
        if isinstance(r.get("train"), dict):
            r["train"] = {
                k: pytest.approx(v, abs=1e-6) if k.startswith(("logprob_gap", "is_ratio")) else v
                for k, v in r["train"].items()
            }
        out.append(r)
    return out


def as_bf16(tiny_model: Path, to: Path) -> Path:
    """The tiny model saved in bf16, as most Hub checkpoints are (a LoRA run's trainers convert it to
    fp32, so several of them share that copy: runtime/shared_base.py)."""
    import torch

    from tailrace.model import load_pretrained, save_pretrained

    save_pretrained(load_pretrained(tiny_model).to(torch.bfloat16), to, companions_from=tiny_model)
    return to


def as_phi3(tiny_model: Path, to: Path, original: int = 160) -> Path:
    """The tiny model saved as a Phi-3.5 (q/k/v and gate/up fused in its checkpoint; LongRoPE whose short
    range is `original` positions): a layout relabeling cannot make."""
    from tailrace.model import load_pretrained, save_pretrained

    model = load_pretrained(tiny_model)
    short = [1.0 + i / 16 for i in range(model.config.head_dim // 2)]
    rope = {"rope_type": "longrope", "original_max_position_embeddings": original, "short_factor": short,
            "long_factor": [4.0] * len(short)}  # fmt: skip
    model.config = model.config.replace(model_type="phi3", rope_scaling=rope)
    save_pretrained(model, to, companions_from=tiny_model)
    return to


def as_gemma3(tiny_model: Path, to: Path, window: int = 24) -> Path:
    """The tiny model's weights in Gemma 3's layout (sliding layers with a `window`, a full last layer, RoPE
    theta 1e4 there and 1e6 in the full one): its norms carried over as Gemma stores them (w - 1), the
    norms Gemma adds (after attention and MLP, q and k per head) at its init (0: a scale of 1). Not the
    same function (GeGLU, the added norms), but one that still answers digits now and then."""
    from tailrace.model import CausalLM, load_pretrained, save_pretrained

    src = load_pretrained(tiny_model)
    n = src.config.num_hidden_layers
    cfg = src.config.replace(
        model_type="gemma3_text", hidden_act=None, query_pre_attn_scalar=src.config.head_dim, sliding_window=window,
        layer_types=("sliding_attention",) * (n - 1) + ("full_attention",), local_rope={"rope_theta": 1e4},
        rope_theta=1e6,
    )  # fmt: skip
    model = CausalLM.from_config(cfg, seed=0)
    moved = {"post_attention_layernorm": "pre_feedforward_layernorm"}  # Llama's pre-MLP norm: Gemma's name
    state = {}
    for k, v in src.state_dict().items():
        for a, b in moved.items():
            k = k.replace(a, b)
        state[k] = v - 1 if "norm" in k else v
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all("norm" in k for k in missing), missing
    save_pretrained(model, to, companions_from=tiny_model)
    return to


def as_qwen3_moe(tiny_model: Path, to: Path, experts: int = 4) -> Path:
    """The tiny model as a Qwen3-MoE: its attention with Qwen3's q/k norms (at their init of 1), and each
    layer's MLP `experts` copies of its dense one, each nudged (so they differ), under a random router
    choosing two a token, renormalized: weights summing to 1 over near-copies keep its function close."""
    import torch

    from tailrace.model import CausalLM, load_pretrained, save_pretrained

    src = load_pretrained(tiny_model)
    cfg = src.config.replace(
        model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
        moe_intermediate_size=src.config.intermediate_size,
    )  # fmt: skip
    model = CausalLM.from_config(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    state = {}
    for k, v in src.state_dict().items():
        if ".mlp." not in k:
            state[k] = v
            continue
        at, name = k.split(".mlp.")
        for e in range(experts):
            state[f"{at}.mlp.experts.{e}.{name}"] = v + 0.01 * v.std() * torch.randn(v.shape, generator=g)
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(k.endswith(("mlp.gate.weight", "q_norm.weight", "k_norm.weight")) for k in missing), missing
    save_pretrained(model, to, companions_from=tiny_model)
    return to
