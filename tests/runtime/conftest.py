from pathlib import Path

import pytest

TINY_ARCH = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
TINY_SFT = dict(
    examples=600,
    batch_tokens=2048,
    lr=3e-3,
    warmup=10,
    threads=1,
)

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
def tiny_model(tmp_path_factory) -> Path:
    """A tiny warm-started chainsum model (seconds to build), as a normal HF checkpoint directory."""
    from tailrace.config import ArchConfig, SFTConfig
    from tailrace.runtime.warmstart import build_warm_start

    out = tmp_path_factory.mktemp("tiny") / "model"
    build_warm_start(ArchConfig(**TINY_ARCH), SFTConfig(**TINY_SFT), out)
    return out


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path / "cache"))
    yield
