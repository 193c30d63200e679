"""Worker health: dead, stuck (no heartbeat), or fine — and busy is never stuck."""

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tailrace.runtime.health import STARTUP_S, Health, Pulse


@dataclass
class FakeProc:
    exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


def health(timeout=10.0):
    return Health("engine0", FakeProc(), SimpleNamespace(value=0), timeout, since=0.0)


def test_a_beating_worker_is_healthy_and_a_silent_one_stuck_after_the_timeout():
    h = health()
    for t in range(1, 30):
        h.counter.value += 1
        assert h.check(float(t)) is None
    assert h.check(29 + 10.0) is None  # silent for exactly the timeout: not yet
    verdict = h.check(29 + 10.5)
    assert verdict.startswith("engine0 process is stuck: no heartbeat for 10 s")


def test_before_its_first_beat_a_worker_has_the_startup_allowance():
    h = health(timeout=10.0)
    assert h.check(STARTUP_S - 1) is None  # importing torch on a loaded machine
    assert "stuck" in h.check(STARTUP_S + 1)


def test_a_dead_worker_says_how_it_died():
    h = health()
    h.proc.exitcode = -9
    assert h.check(1.0) == "engine0 process died (killed by SIGKILL: out of memory?)"
    h.proc.exitcode = 1
    assert h.check(1.0) == "engine0 process died (exit code 1)"


def test_the_pulse_beats_through_long_torch_work_and_a_checkpoint_write(tmp_path):
    """What a long trainer step, a long prefill or a big save does to the beat: nothing (the GIL is
    released), so a slow-but-working worker is never taken for a stuck one."""
    from safetensors.torch import save_file

    counter = SimpleNamespace(value=0)
    Pulse(counter, beat_s=0.05).start()
    a = torch.randn(256, 256)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        a = torch.tanh(a @ a)
        save_file({"w": torch.randn(1 << 18)}, str(tmp_path / "w.safetensors"))
    assert counter.value >= 10  # 1.5 s of 0.05 s beats, allowing for a loaded machine
