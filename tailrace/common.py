"""The few things every layer may use: the two kinds of error a command ends in, and the per-machine
cache directory. No dependencies, so the engine, the simulator, the config and the CLI all import it."""

from __future__ import annotations

import os
from pathlib import Path


class InputError(ValueError):
    """Bad input (a config value, a checkpoint, a dataset, a run directory): the message names it and
    the fix, in one line. The command line ends in exit code 2."""


class ConfigError(InputError):
    """A configuration value is wrong; the message names the key and the fix, in one line."""


class Fault(RuntimeError):
    """The run stopped for a reason outside its input (a worker died, hung or failed; training went
    non-finite; the disk filled): one line with the cause. The command line ends in exit code 3."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none)."""
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def cache_root() -> Path:
    """Where tailrace keeps what it builds once per machine (the warm-started model, the C kernels,
    calibrated simulator presets): $TAILRACE_CACHE, default ~/.cache/tailrace."""
    return Path(os.environ.get("TAILRACE_CACHE", Path.home() / ".cache" / "tailrace"))


def padded_rows(m: int) -> int:
    """The row count a GEMM over `m` rows runs at where oneDNN compiles a kernel for every shape it meets
    (packed engine weights; bf16 autocast on CPU): m itself up to 8, then the next multiple of
    max(8, 2^(floor(log2 m) - 3)): at most 7 padding rows up to 64 and at most 1/8 of m above, from a
    set of about 8 shapes per doubling of m."""
    if m <= 8:
        return m
    step = max(8, 1 << (m.bit_length() - 4))
    return -(-m // step) * step
