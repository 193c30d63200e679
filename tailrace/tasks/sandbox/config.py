"""SandboxConfig: the limits of a sandboxed process and the mechanisms to try (see the package doc)."""

from __future__ import annotations

from dataclasses import dataclass

# Optional mechanisms, each tried where the OS allows it; the limits, the private directory and the
# process group apply everywhere.
MECHANISMS = ("netns", "uid", "landlock", "seccomp")


@dataclass(frozen=True)
class SandboxConfig:
    cpu_s: int = 10  # CPU seconds per reward call (per code run), soft limit: SIGXCPU past it
    memory_mb: int = 2048  # address space a process may add to its size when the sandbox starts
    file_mb: int = 64  # largest file it may write (EFBIG past it)
    procs: int = 64  # processes it may run at once (throwaway uid or user namespace: counted alone)
    read_paths: tuple[str, ...] = ()  # readable beyond the system and Python paths (Landlock)
    mechanisms: tuple[str, ...] = MECHANISMS  # which optional mechanisms to try

    def __post_init__(self) -> None:
        for field in ("cpu_s", "memory_mb", "file_mb", "procs"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox {field}={value!r}: must be a whole number >= 1")
        unknown = set(self.mechanisms) - set(MECHANISMS)
        if unknown:
            raise ValueError(
                f"sandbox mechanisms {sorted(unknown)} unknown; choose from {', '.join(MECHANISMS)}"
            )
