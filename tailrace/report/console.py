"""The terminal view of a run: a rich progress bar (step, reward, accuracy, tokens/s, ETA) and one
summary line per step (with the checkpoint's size when the step wrote one); a warning when
the run has no reward signal to learn from; one line per recovered worker."""

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

from tailrace.records import CheckpointRecord, EvalRecord, StepRecord, on_prompts


def _no_signal_at_base(n: int) -> str:
    """The warning for a base policy that got none of `n` held-out prompts right. 0 of n rules out, at
    95% confidence, only accuracies above 1 - 0.05^(1/n) (about 3/n): on a few prompts a base that
    samples the right answer now and then, which is all GRPO needs, often scores 0 too."""
    fix = "make the task easier (task.config) or use a stronger model"
    bound = 1 - 0.05 ** (1 / n)
    if bound <= 0.05:
        return f"warning: 0% at base on {n} prompts: RL has no signal; {fix}"
    return (
        f"warning: 0% at base on {n} prompts: RL may have no signal ({n} prompts rule out only an "
        f"accuracy above {bound:.0%}; raise eval.n to tell); if the steps find none either, {fix}"
    )


class ConsoleUI:
    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(highlight=False, markup=False)
        self.quiet = quiet
        self.progress: Progress | None = None
        self._eval: tuple[Progress, int] | None = None  # an evaluation's own bar, outside training

    def begin(self, done: int, total: int, base: EvalRecord | None) -> None:
        # each policy's group counts at its last step seen (None: resumed, not yet seen)
        self._groups: dict[str, dict] | None = {} if done == 0 else None
        self._steps: dict[str, int] = {}  # each policy's steps done (its name: "" for a run's only one)
        if base is not None:
            b = base.summary
            self.console.print(
                f"base policy: held-out accuracy {b['accuracy']:.1%} {on_prompts(b)}, "
                f"length p50 {b['p50']:.0f} p99 {b['p99']:.0f} max {b['max']}"
            )
            if b["accuracy"] == 0:
                self.console.print(_no_signal_at_base(b["n"]), style="yellow")
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

    def evaluating(self, tag: str, done: int, total: int) -> None:
        """A held-out evaluation's progress with an ETA (a line of its own, gone when it ends)."""
        if self.quiet:
            return
        if self.progress is not None:  # the training bar is live: its info line says it
            self.progress.update(self.task, info=f"eval ({tag}) {done}/{total}")
            return
        if self._eval is None:
            bar = Progress(
                TextColumn(f"eval ({tag})"), BarColumn(), MofNCompleteColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=self.console, transient=True,
            )  # fmt: skip
            self._eval = (bar, bar.add_task(tag, total=total))
            bar.start()
        bar, task = self._eval
        bar.update(task, completed=done)
        if done >= total:
            bar.stop()
            self._eval = None

    def step(
        self, r: StepRecord, saved: CheckpointRecord | None = None, policy: str = "", replacing: bool = False
    ) -> None:
        """A step line; `policy`: whose step, in a run of several policies (its name leads the line and its
        warning); `replacing`: the policy replaces zero-signal groups (flow.zero_signal=replace)."""
        t, L = r.time, r.length
        # a list of reward functions (task.reward): each one's mean beside the reward
        parts = " (" + " ".join(f"{k} {v:.3f}" for k, v in r.rewards.items()) + ")" if r.rewards else ""
        line = (f"{policy}: " if policy else "") + (
            f"step {r.step + 1:4d} v{r.version:<3d} reward {r.reward:.3f}{parts} acc {r.accuracy:.3f} "
            f"len p50 {L.get('p50', 0):.0f} max {L.get('max', 0):.0f}  gen {t['gen_tok_s']:.0f} tok/s  "
            f"step {t['step_s']:.2f}s  wait {t['trainer_wait_ratio']:.2f} bubble {t['bubble_ratio']:.2f}"
        )
        if r.tools:  # a multi-turn task: its tool use, and the time its samples waited on tools
            line += (
                f"  tools {r.tools['calls']} calls {r.tools['turns_mean']:.1f} turns/traj  "
                f"tool wait {t.get('tool_wait_s', 0):.2f}s (max {t.get('tool_wait_max_s', 0):.2f}s)"
            )
        generated = r.ledger.get("generated")
        if r.discards.get("shaping") and generated:  # shaping is on: what it generated vs trained
            line += f"  generated p50 {generated['p50']:.0f} max {generated['max']}"
        if "spec_forwards_per_token" in t:
            line += (
                f"  spec acc {t['spec_accepted_share']:.2f} len {t['spec_mean_accepted']:.1f} "
                f"on {t['spec_on_fraction']:.2f} fwd/tok {t['spec_forwards_per_token']:.2f}"
            )
            if t.get("spec_train_steps"):  # a trained drafter learnt in the engines' idle time
                line += (
                    f" drafter train {t['spec_train_steps']} steps {t['spec_train_step_s'] * 1e3:.0f} ms/step"
                )
        if saved is not None:
            line += f"  ckpt {_size(saved.bytes['total'])} in {saved.seconds:.1f}s"
        warning = self._zero_signal(r, policy, replacing)
        self._steps[policy] = r.step + 1
        if self.progress is not None:
            self.progress.console.print(line)
            if warning:
                self.progress.console.print(warning, style="yellow")
            self.progress.update(
                self.task,
                completed=sum(self._steps.values()),
                info=f"reward {r.reward:.3f} acc {r.accuracy:.3f} {t['gen_tok_s']:.0f} tok/s",
            )
        else:
            self.console.print(line)
            if warning:
                self.console.print(warning, style="yellow")

    def note(self, line: str) -> None:
        """A line between the step lines (a worker recovered, ...)."""
        (self.progress.console if self.progress is not None else self.console).print(line)

    def _zero_signal(self, r: StepRecord, policy: str = "", replacing: bool = False) -> str | None:
        """A warning when at least 3/4 of the groups completed since the last step had equal rewards
        (the ledger's group counts are cumulative; after a resume the first step sets the baseline)."""
        now = r.ledger["groups"]
        if self._groups is None:  # (resumed: the first step sets the baseline)
            self._groups = {policy: now}
            return None
        prev = self._groups.get(policy, {})  # (a fresh run: its first step counts from zero)
        self._groups[policy] = now
        done = now["complete"] - prev.get("complete", 0)
        zero = now["zero_signal"] - prev.get("zero_signal", 0)
        if not done or 4 * zero < 3 * done:
            return None
        replaced = now["dropped"].get("zero-signal", 0) - prev.get("dropped", {}).get("zero-signal", 0)
        what = f"; {replaced} replaced by fresh prompts" if replaced else ""
        what += "; the step trained nothing" if r.train.get("skipped") else ""
        fix = "tune it with task.config" + ("" if replacing else " or set flow.zero_signal=replace")
        share = f"{r.accuracy:.0%} of the step's samples correct"
        if r.accuracy <= 0.05:
            why = f"the task is too hard for this model ({share}): make it easier"
        elif r.accuracy >= 0.95:
            why = f"the task is too easy for this model ({share}): make it harder"
        else:
            why = f"each prompt is all right or all wrong ({share}): raise rollout.temperature"
        who = f"{policy}: " if policy else ""
        return (
            f"warning: {who}step {r.step + 1}: {zero} of {done} groups had equal rewards (no signal){what}: "
            f"{why}; {fix}"
        )

    def end(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _size(n: float) -> str:
    """Bytes in decimal units: 3.1 MB."""
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.1f} {units[i]}"
