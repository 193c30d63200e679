"""Process placement: which cores each role gets, and starting role processes.

On a machine with n cores the trainer takes the first half and the engines share the rest (one core
each when there are enough), so rollout and training really overlap (DESIGN.md §6). Workers start
by 'forkserver': a server process that has only imported torch and the worker bodies
(runtime/preload.py), no thread pool running, forks each one, so a worker skips those imports;
forking the driver itself, which runs torch's thread pools, would be unsafe. A forked worker takes
the driver's environment as it is at its start (hosts.LocalHosts.start), not the server's.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def placement(engines: int) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """(trainer cores, [cores of engine i]). With one core everything shares it."""
    cores = available_cores()
    if len(cores) == 1:
        return tuple(cores), [tuple(cores)] * engines
    n_train = max(1, len(cores) // 2) if engines > 1 else max(1, len(cores) - engines)
    train, rest = cores[:n_train], cores[n_train:]
    per = max(1, len(rest) // engines)
    return tuple(train), [
        tuple(rest[(i * per) % len(rest) : (i * per) % len(rest) + per]) for i in range(engines)
    ]


def pin(cores: tuple[int, ...]) -> None:
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


def name_process(name: str) -> None:
    """Show this process as `name` in ps, top and /proc/PID/comm (Linux keeps 15 bytes): which pid
    is the trainer and which an engine, for a person or a chaos test. Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: the state first, the start time at [19]. Raises
    FileNotFoundError where there is no such process, another OSError where there is no /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def started_at(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd field): with its pid,
    a process's identity, for a kill decided a moment before it runs (a pid may be reused meanwhile).
    None where there is no such process, or no /proc."""
    try:
        return int(stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_process(pid: int, started: int | None) -> None:
    """SIGKILL `pid` if it is still the process that started at `started` (`started_at`; None: not known,
    so any process of that pid): a kill decided a moment before, for a process that is not this one's
    child (a Ray actor's, a joined engine's)."""
    if started is not None and started_at(pid) != started:
        return  # it ended meanwhile, and its pid may be another's now
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass


def release_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere a no-op), after an
    engine frees a policy version (not after a trainer step: its activations are needed again).
    Without it an engine serving SmolLM2-135M in bf16 settles ~600 MB above its start (freed ranges
    stay in the heap, fragmented); trimmed, it returns to its start after each weight load. Costs
    milliseconds."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tailrace.runtime.preload"])  # read when the server starts (once)
    return ctx


def start_fork_server() -> None:
    """Start the fork server local workers fork from (`context`) now, without waiting for it: its
    import of torch and the worker bodies (`preload`) then runs while the caller imports its own, not
    after (a tiny `tailrace train` on 2 cores: 10.3 -> 8.9 s)."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


def resolve_dtype(dtype: str, device: str) -> str:
    """`model.dtype` for engines on `device` (as `resolve_device` names it): "auto" is bfloat16 on CUDA
    with native bf16 (compute capability 8.0 on; a Ray driver that sees no GPU assumes its workers'
    have it), float32 on a CPU or an older GPU."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    import torch

    native = not torch.cuda.is_available() or torch.cuda.get_device_capability(device) >= (8, 0)
    return "bfloat16" if native else "float32"


def resolve_device(name: str) -> str:
    """`device` as torch names it: "auto" is cuda when torch sees a GPU, else cpu. A cuda device
    torch cannot see is a clear error, not a crash inside a worker."""
    import torch

    from tailrace.common import ConfigError

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={name}: torch sees {torch.cuda.device_count()} CUDA device(s); use device=cpu "
                "(or auto), or a torch build with CUDA on a machine with a GPU"
            )
    return name
