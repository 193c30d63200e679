"""The runtime tests' session pieces (the engine's C kernels, the tiny warm-started model, the tool
model made from it), built in a process of their own while the tests before tests/runtime run: those
hold one core (tests/engine and tests/model pin torch to one thread), so the other builds these
20-odd seconds for free. tests/conftest.py starts the builder once collection has picked a test that
needs a piece; the session fixtures (tests/runtime/conftest.py) wait for theirs.

`python -m tests.runtime.prebuild DIR NAME...` builds each NAME under DIR in order, then writes
DIR/NAME.done: the piece's path, or nothing (kernels this machine cannot build)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PIECES = {"_built_kernels": "kernels", "tiny_model": "tiny", "tool_model": "tool"}  # fixture -> piece
ORDER = ("kernels", "tiny", "tool")  # every runtime test needs the kernels; the tool model is made from tiny
TINY_ARCH = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
TINY_SFT = dict(examples=600, batch_tokens=2048, lr=3e-3, warmup=10, threads=1)
WAIT_S = 900.0


def build(name: str, root: Path) -> Path | None:
    """Build piece `name` under `root`: its path (None: kernels this machine cannot build)."""
    from tailrace.config import ArchConfig, SFTConfig

    if name == "kernels":  # into root's cache, whatever this process loaded before
        from tailrace.engine import ckernel

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TAILRACE_CACHE", str(root / "kernel-cache"))
            try:
                ckernel._build()
            except (RuntimeError, OSError, subprocess.SubprocessError):
                return None
        return root / "kernel-cache" / "kernels"
    if name == "tiny":  # a tiny warm-started chainsum model (seconds to build), a normal HF checkpoint
        from tailrace.runtime.warmstart import build_warm_start

        build_warm_start(ArchConfig(**TINY_ARCH), SFTConfig(**TINY_SFT), root / "tiny" / "model")
        return root / "tiny" / "model"
    # the tiny chainsum model fine-tuned briefly on chaincalc demonstrations (it learns to call)
    from tailrace.runtime.warmstart import build_tool_warm_start

    out = root / "tool" / "model"
    build_tool_warm_start(root / "tiny" / "model", SFTConfig(**TINY_SFT), out, examples=1500)
    return out


class Builder:
    """The builder process and its directory, as the session's fixtures see them."""

    def __init__(self, names: list[str]) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tailrace-prebuild-"))
        self.log = open(self.root / "builder.log", "w+")
        argv = [sys.executable, "-m", "tests.runtime.prebuild", str(self.root), *names]
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(argv, cwd=root, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, name: str) -> Path | None:
        done, deadline = self.root / f"{name}.done", time.monotonic() + WAIT_S
        while not done.exists():
            if self.proc.poll() is not None and not done.exists():
                self.log.seek(0)
                pytest.fail(f"the session's {name} was not built:\n{self.log.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the session's {name} was not built within {WAIT_S:.0f} s")
            time.sleep(0.05)
        text = done.read_text()
        return Path(text) if text else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def start(items: list) -> Builder | None:
    """A builder of the pieces `items` (the collected tests) need, or None when they need none."""
    wanted = {PIECES[f] for item in items for f in getattr(item, "fixturenames", ()) if f in PIECES}
    if "tool" in wanted:
        wanted.add("tiny")
    return Builder([n for n in ORDER if n in wanted]) if wanted else None


def piece(config: pytest.Config, fixture: str) -> Path | None:
    """The session fixture `fixture`'s piece, once the builder has it."""
    return config.stash[BUILDER].wait(PIECES[fixture])


BUILDER = pytest.StashKey[Builder]()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        path = build(name, out)
        (out / f"{name}.done.tmp").write_text("" if path is None else str(path))
        (out / f"{name}.done.tmp").rename(out / f"{name}.done")
