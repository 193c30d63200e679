"""The terminal view of a run: a rich progress bar (step, reward, accuracy, tokens/s, ETA) and one
summary line per step."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tailrace.records import EvalRecord, StepRecord


class ConsoleUI:
    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(highlight=False, markup=False)
        self.quiet = quiet
        self.progress: Progress | None = None

    def begin(self, done: int, total: int, base: EvalRecord | None) -> None:
        if base is not None:
            b = base.summary
            self.console.print(
                f"base policy: held-out accuracy {b['accuracy']:.1%} on {b['n']} prompts, "
                f"length p50 {b['p50']:.0f} p99 {b['p99']:.0f} max {b['max']}"
            )
        if self.quiet:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info="")
        self.progress.start()

    def step(self, r: StepRecord) -> None:
        t, L = r.time, r.length
        line = (
            f"step {r.step + 1:4d} v{r.version:<3d} reward {r.reward:.3f} acc {r.accuracy:.3f} "
            f"len p50 {L.get('p50', 0):.0f} max {L.get('max', 0):.0f}  gen {t['gen_tok_s']:.0f} tok/s  "
            f"step {t['step_s']:.2f}s  wait {t['trainer_wait_ratio']:.2f} bubble {t['bubble_ratio']:.2f}"
        )
        if self.progress is not None:
            self.progress.console.print(line)
            self.progress.update(
                self.task,
                completed=r.step + 1,
                info=f"reward {r.reward:.3f} acc {r.accuracy:.3f} {t['gen_tok_s']:.0f} tok/s",
            )
        else:
            self.console.print(line)

    def end(self) -> None:
        if self.progress is not None:
            self.progress.stop()
