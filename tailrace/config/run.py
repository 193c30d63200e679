"""The run's sections (task, rollout, flow, eval) and `RunConfig`, which composes every section."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

from tailrace.config.fields import need, section, setting
from tailrace.config.model import ArchConfig, ModelSpec, SFTConfig
from tailrace.config.runtime import RuntimeConfig
from tailrace.config.serve import ServeConfig
from tailrace.config.shaping import ShapingConfig
from tailrace.config.store import StoreConfig
from tailrace.config.train import TrainerConfig


@dataclass
class TaskConfig:
    name: str = setting(
        "chainsum",
        "chainsum (built in), chaincalc (chainsum with a calculator tool: multi-turn), "
        "gym:<reasoning-gym dataset>, jsonl:<path> (question/answer lines) or parquet:<path> (the same rows)",
    )
    reward: str | list[str] | None = setting(
        None,
        "your reward function instead of the task's, module:function or path/to/file.py:function: "
        "reward(question, response, answer) -> float, 1 or more = verified correct (held-out accuracy); "
        "or a list of them (TRL's reward_funcs; `task` names the task's own), summed by "
        "task.reward_weights, the first one's 1 or more deciding what is correct, each one's mean logged",
    )
    reward_weights: list[float] | None = setting(
        None, "task.reward's list: each function's weight in the sum (null = 1 each; TRL's reward_weights)"
    )
    reward_timeout_s: float = setting(5.0, "seconds a reward may take; one that hangs or raises scores 0")
    max_prompt_tokens: int | None = setting(
        None,
        "training and held-out prompts longer than this many tokens are left out, said once (verl's "
        "filter_overlong_prompts); null = those that leave no room in the context for a response",
    )
    seed: int = setting(0, "seed of the training prompt stream and the held-out set")
    config: dict[str, Any] = section(
        dict,
        "the task's own settings: a reasoning-gym dataset's config (e.g. {min_terms: 2, max_terms: 3}), "
        "chainsum's {bands, max_term, test_mod} (chaincalc's too, with {tools, tool_timeout_s, tool_latency_s}), "
        "the jsonl and code tasks' keyword options "
        "({question_field, answer_field, prompt_template, test_mod, test_path, ...})",
    )
    chat_template: Literal["auto", "none"] = setting(
        "auto",
        "auto: prompts go through the model's chat template when its tokenizer has one; "
        "none: BOS + the raw question",
    )
    system_prompt: str | None = setting(
        None, "the chat template's system message (null = the template's own default)"
    )
    thinking: bool | None = setting(
        None,
        "the chat template's enable_thinking (Qwen3's templates): false = answer without a think block, "
        "true = think first; null = the template's default",
    )
    train_size: int | None = setting(
        None,
        "training prompts: a finite set cycled in epochs, so a prompt comes back (shaping's per-prompt "
        "statistics); null = an endless stream of fresh prompts",
    )

    overlong_buffer: int = setting(
        0,
        "DAPO's soft overlong punishment: a training response in the last N tokens before "
        "rollout.max_new_tokens loses up to task.overlong_penalty of its reward, linearly (0 = off)",
    )
    overlong_penalty: float = setting(
        1.0, "the reward a response at rollout.max_new_tokens loses (task.overlong_buffer)"
    )
    max_turns: int = setting(
        32,
        "multi-turn tasks (chaincalc): turns per trajectory at most (tool calls + 1); a call past it "
        "ends the trajectory unanswered",
    )
    tool_threads: int = setting(
        4,
        "multi-turn tasks: threads of the driver's tool pool (tools run there); the run's, one pool for every policy",
    )

    def __post_init__(self) -> None:
        need(
            self.reward != [],
            "task.reward=[]: name at least one function, or leave it null for the task's own reward",
        )
        need(
            self.reward != ["task"],
            "task.reward=['task']: 'task' alone is the task's own reward; drop task.reward, or add "
            "functions of yours to the list",
        )
        need(
            self.reward_weights is None or isinstance(self.reward, list),
            f"task.reward_weights={self.reward_weights} without a list of functions in task.reward: give "
            "task.reward as a list, e.g. [task, my_rewards.py:format]",
        )
        if self.reward_weights is not None and isinstance(self.reward, list):
            w, n = len(self.reward_weights), len(self.reward)
            need(
                w == n,
                f"task.reward_weights={self.reward_weights} has {w} weight{'s' * (w != 1)} for {n} "
                f"function{'s' * (n != 1)} in task.reward; give one each",
            )
        need(self.reward_timeout_s > 0, f"task.reward_timeout_s={self.reward_timeout_s}: must be > 0 seconds")
        need(
            self.max_turns >= 1, f"task.max_turns={self.max_turns}: must be >= 1 (1 = no tool call answered)"
        )
        need(self.tool_threads >= 1, f"task.tool_threads={self.tool_threads}: must be >= 1")
        need(
            self.max_prompt_tokens is None or self.max_prompt_tokens > 0,
            f"task.max_prompt_tokens={self.max_prompt_tokens}: must be positive, or null (what the context holds)",
        )
        need(
            self.overlong_buffer >= 0,
            f"task.overlong_buffer={self.overlong_buffer}: must be >= 0 (0 = off), e.g. a fifth of "
            "rollout.max_new_tokens (DAPO: 4,096 of 20,480)",
        )
        need(
            self.overlong_penalty >= 0, f"task.overlong_penalty={self.overlong_penalty}: must be >= 0, e.g. 1"
        )
        need(
            isinstance(self.config, dict),
            f"task.config={self.config!r}: expected a mapping of the task's settings, e.g. "
            "--task.config='{min_terms: 2}'",
        )
        need(
            self.train_size is None or self.train_size > 0,
            f"task.train_size={self.train_size}: must be positive, or null for an endless stream",
        )
        need(
            self.system_prompt is None or self.chat_template == "auto",
            "task.system_prompt needs a chat template; drop it or set task.chat_template=auto",
        )
        need(
            self.thinking is None or self.chat_template == "auto",
            "task.thinking needs a chat template; drop it or set task.chat_template=auto",
        )


@dataclass
class SpecConfig:
    drafter: str = setting(
        "none",
        "speculative decoding's drafter (outputs unchanged, only time): none, history (earlier and sibling "
        "responses to the same prompt), quant8 / quant4 (the policy RTN-quantized drafts for itself), "
        "trained / trained2 (a 1- / 2-layer model on the policy's embeddings, trained on the rollouts in idle time)",
    )
    toggle: bool = setting(
        True,
        "draft only where the engine's fitted cost model predicts >= min_speedup at its active batch "
        "(false: every decode row drafts, for measurements)",
    )
    min_speedup: float = setting(1.05, "the toggle's threshold: predicted speed-up a draft must reach")
    gamma_min: int = setting(5, "the draft-length ladder's lowest rung (draft tokens)")
    gamma_max: int = setting(
        11, "the ladder's top rung; it climbs in steps of 2 with the measured acceptance"
    )
    train_s: float = setting(
        5.0,
        "drafter trained / trained2: seconds it may train per idle period of its engine, on the engine's "
        "core (0: never, a frozen drafter)",
    )
    pregen_below: float | None = setting(
        None,
        "sync + drafter history (BubbleSpec): once a round's running samples fill at most this share of "
        "the engines' slots, idle slots generate the next round's prompts as drafts (never trained); null = off",
    )

    def __post_init__(self) -> None:
        need(
            1 <= self.gamma_min <= self.gamma_max,
            f"rollout.spec.gamma_min={self.gamma_min}, gamma_max={self.gamma_max}: need 1 <= gamma_min <= gamma_max",
        )
        need(
            self.min_speedup > 0,
            f"rollout.spec.min_speedup={self.min_speedup}: must be > 0 (1.05: 5% faster)",
        )
        need(
            self.train_s >= 0,
            f"rollout.spec.train_s={self.train_s}: seconds of drafter training per idle period, >= 0 (0: frozen)",
        )
        need(
            self.pregen_below is None or (0 < self.pregen_below <= 1 and self.drafter == "history"),
            f"rollout.spec.pregen_below={self.pregen_below}: a share of the slots in (0, 1], with "
            "rollout.spec.drafter=history (the drafter that drafts from pre-generated responses); null = off",
        )


@dataclass
class RolloutConfig:
    backend: Literal["tailrace", "vllm"] = setting(
        "tailrace",
        "the rollout engine: tailrace's own, or vLLM (pip install 'tailrace[vllm]'; one weight version per "
        "engine, no speculative decoding; see engine/vllm_engine.py)",
    )
    engines: int = setting(1, "rollout engine processes")
    slots: int = setting(64, "concurrent sequences per engine")
    lookahead: int = setting(16, "samples queued per engine beyond its slots")
    threads: int = setting(1, "torch threads per engine process")
    temperature: float = setting(1.0, "sampling temperature (RL samples: > 0)")
    top_p: float = setting(1.0, "nucleus sampling: keep the most likely tokens up to this mass (1 = all)")
    top_k: int = setting(0, "sample among the k most likely tokens (0 = all)")
    max_new_tokens: int = setting(384, "response length limit in tokens; a longer response is cut off")
    prefill_tokens: int = setting(512, "prompt tokens prefilled per engine step")
    keep_kv: bool = setting(
        True,
        "multi-turn tasks: a turn that ends in a tool call keeps its k/v for its continuation, which then "
        "prefills only the observation (the pool takes kept blocks back before anyone waits; off with "
        "speculative decoding)",
    )
    max_context: int | None = setting(
        None,
        "tokens per request, prompt + response; longer prompts are refused, responses cut there "
        "(null = the model's max_position_embeddings, or its sliding window where shorter, past which "
        "it may not go; or what kv_memory_gb holds)",
    )
    kv_memory_gb: float | None = setting(
        None,
        "KV cache per engine (and tailrace eval) in GiB, filled as sequences grow; short of it the engine "
        "queues or preempts (null = a share of the memory available at start-up: engine/kv_budget.py)",
    )
    attention: Literal["auto", "kernel", "bmm", "sdpa"] = setting(
        "auto",
        "decode attention: the C kernel (CPU), bmm or sdpa; auto picks (see engine/backends/__init__.py)",
    )
    max_versions: int | None = setting(
        None,
        "weight versions each engine holds at once: null = as many as the mode needs; 1 = one copy of the "
        "weights (a large model), as vLLM holds; modes that need several versions on an engine are then refused",
    )
    spec: SpecConfig = section(
        SpecConfig, "speculative decoding in the rollout engines (exact: see engine/spec)"
    )

    def __post_init__(self) -> None:
        if self.backend == "vllm":  # (whether vLLM is installed: cli/choices.check_backend, where it runs)
            need(
                self.spec.drafter == "none",
                f"rollout.spec.drafter={self.spec.drafter}: the vLLM backend has no speculative decoding "
                "here; set rollout.spec.drafter=none or rollout.backend=tailrace",
            )
            need(
                self.attention == "auto",
                f"rollout.attention={self.attention} picks tailrace's engine kernels; leave it auto with "
                "rollout.backend=vllm",
            )
        for k in ("engines", "slots", "threads", "max_new_tokens", "prefill_tokens"):
            need(getattr(self, k) > 0, f"rollout.{k}={getattr(self, k)}: must be positive")
        need(
            self.max_versions in (None, 1),
            f"rollout.max_versions={self.max_versions}: use null (as many as the mode needs) or 1 (one copy "
            "of the weights per engine)",
        )
        need(self.lookahead >= 0, f"rollout.lookahead={self.lookahead}: must be >= 0")
        need(
            self.max_context is None or self.max_context >= 2,
            f"rollout.max_context={self.max_context}: must be >= 2 (a prompt token and a new one), or null",
        )
        need(
            self.kv_memory_gb is None or self.kv_memory_gb > 0,
            f"rollout.kv_memory_gb={self.kv_memory_gb}: must be positive GiB, or null for a share of free memory",
        )
        need(
            self.temperature > 0,
            f"rollout.temperature={self.temperature}: RL needs sampling; use a value > 0",
        )
        need(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: must be in (0, 1]")
        need(self.top_k >= 0, f"rollout.top_k={self.top_k}: must be >= 0 (0 = all tokens)")


@dataclass
class FlowConfig:
    mode: str | None = setting(
        None,
        "how rollout and training overlap: a policy of flow/policies (null = the recommended mode: "
        "multiversion, the best measured time to held-out accuracy; sync where the task, shaping or "
        "engines need sync's rounds; the run prints which)",
    )
    prompts_per_round: int = setting(16, "R: prompts issued per round")
    samples_per_prompt: int = setting(8, "G: samples per prompt, one group (advantages are taken within it)")
    train_batch: int = setting(128, "B: samples per optimizer step, U = B / G groups")
    steps: int = setting(
        120, "optimizer steps in the run (a round-based mode cuts its last round to the steps left)"
    )
    time_limit_s: float | None = setting(
        None,
        "end the run with the first step issued after this many seconds of training, checkpointed "
        "(null = no limit)",
    )
    max_staleness: int = setting(
        1, "off-policy modes: how many versions behind the trainer a trained sample may be"
    )
    frontier: int | None = setting(
        None, "pipe: admit only the F lowest unfinished groups (null = no cap: lowest groups first)"
    )
    rollout_groups: int | None = setting(
        None, "partial, multiversion: groups per version (null = max(R, 2U))"
    )
    placement: Literal["shared", "dedicated"] = setting(
        "shared",
        "multiversion: every engine serves every live version (shared), or a new version goes to the "
        "least busy engine and the others follow as they drain (dedicated, DORA's)",
    )
    ahead: int | None = setting(
        None,
        "streaming modes (partial, multiversion): open no group while this many train steps of groups "
        "(or what fills the engines' slots) are queued for the trainer; null = up to the staleness bound",
    )
    zero_signal: Literal["replace", "train"] = setting(
        "replace",
        "groups whose rewards are all equal (no advantage): replace them with fresh prompts (DAPO's "
        "dynamic sampling) or train them as they are",
    )
    extra_groups: int | None = setting(
        None,
        "zero_signal=replace or store.filter: at most this many replacement groups per optimizer step "
        "(null = U); past it, such groups are trained",
    )
    checkpoint_every: int | None = setting(
        None,
        "publishing steps between checkpoints (null with checkpoint_minutes null = by the checkpoint's "
        "size: every step under 1 GiB, else every 30 minutes; the last step always writes one)",
    )
    checkpoint_minutes: float | None = setting(
        None, "minutes between checkpoints (at the first publishing step after them; null = by steps)"
    )
    keep_checkpoints: int = setting(2, "checkpoints kept; older ones are deleted")
    share: Literal["turns", "fifo"] = setting(
        "turns",
        "several policies (policies) take turns: turns = an engine admits first the requests of the policy "
        "whose oldest unfinished group began first, and trainers sharing cores train one step at a time, "
        "in the order the steps were issued, so one policy generates while another trains; fifo = the "
        "engines take requests in arrival order and the trainers train at once (the OS shares the cores)",
    )

    def __post_init__(self) -> None:
        for k in ("prompts_per_round", "samples_per_prompt", "train_batch", "steps"):
            need(getattr(self, k) > 0, f"flow.{k}={getattr(self, k)}: must be positive")
        need(
            self.train_batch % self.samples_per_prompt == 0,
            f"flow.train_batch={self.train_batch} is not a multiple of flow.samples_per_prompt="
            f"{self.samples_per_prompt}; a step trains whole groups",
        )
        U = self.train_batch // self.samples_per_prompt
        need(
            self.prompts_per_round % U == 0,
            f"flow.prompts_per_round={self.prompts_per_round} is not a multiple of train_batch/samples_per_prompt"
            f"={U}; a round must split into whole steps",
        )
        need(self.max_staleness >= 0, f"flow.max_staleness={self.max_staleness}: must be >= 0")
        need(
            self.frontier is None or self.frontier > 0,
            f"flow.frontier={self.frontier}: must be positive or null",
        )
        need(
            self.rollout_groups is None or self.rollout_groups >= self.groups_per_step,
            f"flow.rollout_groups={self.rollout_groups}: must be >= train_batch/samples_per_prompt "
            f"({self.groups_per_step}) so a version can fill a train step",
        )
        need(
            self.time_limit_s is None or self.time_limit_s > 0,
            f"flow.time_limit_s={self.time_limit_s}: must be positive seconds, or null for no limit",
        )
        need(
            self.checkpoint_every is None or self.checkpoint_every > 0,
            f"flow.checkpoint_every={self.checkpoint_every}: must be positive, or null",
        )
        need(
            self.checkpoint_minutes is None or self.checkpoint_minutes > 0,
            f"flow.checkpoint_minutes={self.checkpoint_minutes}: must be positive, or null",
        )
        need(self.ahead is None or self.ahead >= 0, f"flow.ahead={self.ahead}: must be >= 0, or null")
        need(
            self.extra_groups is None or self.extra_groups >= 0,
            f"flow.extra_groups={self.extra_groups}: must be >= 0, or null for U",
        )
        need(self.keep_checkpoints > 0, f"flow.keep_checkpoints={self.keep_checkpoints}: must be positive")

    @property
    def groups_per_step(self) -> int:
        return self.train_batch // self.samples_per_prompt

    @property
    def steps_per_round(self) -> int:
        return self.prompts_per_round // self.groups_per_step


@dataclass
class EvalConfig:
    n: int = setting(512, "held-out prompts (at 256 the standard error is ~3 points)")
    temperature: float = setting(
        1.0, "sampling temperature: the accuracy of the sampling policy (pass@1), as trained; 0 = greedy"
    )
    samples: int = setting(
        1,
        "samples per held-out prompt: accuracy is their mean (pass@1 with less sampling noise), and "
        "pass@k is reported beside it (k times the evaluation's time)",
    )
    max_new_tokens: int = setting(384, "response length limit in tokens")
    batch: int = setting(64, "prompts decoded at once")
    every: int = setting(
        0, "also evaluate every N-th step's weights, after training (snapshots; 0 = base and final only)"
    )

    def __post_init__(self) -> None:
        need(self.n > 0, f"eval.n={self.n}: must be positive")
        need(self.max_new_tokens > 0, f"eval.max_new_tokens={self.max_new_tokens}: must be positive")
        need(self.every >= 0, f"eval.every={self.every}: must be >= 0 (0 = base and final only)")
        need(self.temperature >= 0, f"eval.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        need(self.batch > 0, f"eval.batch={self.batch}: must be positive")
        need(self.samples > 0, f"eval.samples={self.samples}: must be positive (1 = one sample a prompt)")
        need(
            self.samples == 1 or self.temperature > 0,
            f"eval.samples={self.samples} with eval.temperature=0: greedy samples of a prompt are all the same; "
            "set eval.samples=1 or a temperature above 0",
        )


@dataclass
class RunConfig:
    model: ModelSpec = section(ModelSpec, "the policy to train")
    arch: ArchConfig = section(ArchConfig, "the built-in model's shape (when model.path is null)")
    task: TaskConfig = section(TaskConfig, "prompts and their rewards")
    sft: SFTConfig = section(SFTConfig, "how the built-in model is warm-started (cached by recipe)")
    rollout: RolloutConfig = section(RolloutConfig, "the rollout engines")
    flow: FlowConfig = section(FlowConfig, "the scheduler: batch shape, overlap mode, run length")
    shaping: ShapingConfig = section(ShapingConfig, "the length distribution generated and trained on")
    store: StoreConfig = section(StoreConfig, "the trajectory store: its replay buffer")
    train: TrainerConfig = section(TrainerConfig, "the GRPO trainer")
    eval: EvalConfig = section(EvalConfig, "held-out accuracy before and after training")
    runtime: RuntimeConfig = section(RuntimeConfig, "where the trainer and engine processes run")
    serve: ServeConfig = section(ServeConfig, "tailrace serve: an OpenAI-compatible endpoint on an engine")
    seed: int = setting(0, "seed of the engines' sampling and the trainer")
    device: str = setting(
        "auto", "where the engines and the trainer run: auto (cuda when torch sees a GPU), cpu, cuda, cuda:N"
    )
    out: str = setting("runs", "where new run directories go: OUT/<date>-<time>-<mode>")
    tensorboard: bool = setting(
        False, "also write scalars to RUN_DIR/tensorboard (pip install tailrace[tensorboard])"
    )
    worker_timeout_s: float = setting(
        120.0, "seconds a worker process may miss its heartbeat (sent every second) before it counts as stuck"
    )
    max_restarts: int = setting(
        3,
        "restarts of each worker process (dead, or stuck and killed) within an hour; past it the run "
        "stops (0 = stop at the first lost worker)",
    )
    policies: list[dict[str, Any]] = section(
        list,
        "several policies in one run, sharing the rollout engines: one entry each, {name, and any of the "
        "sections task, flow, shaping, store, train, eval and the key seed}, each on top of the run's own "
        "(e.g. [{name: sums}, {name: calc, task: {seed: 1}, flow: {mode: sync}}]); each policy has its "
        "own scheduler, versions, staleness bound and trainer (empty = one policy)",
    )

    max_policies: int | None = setting(
        None,
        "room for policies that join the running run (tailrace policy join RUN_DIR NAME), these included; "
        "needs a policies list, even of one (null = the policies it starts with). Each place holds "
        "flow.max_staleness + 3 published versions in shared memory: a LoRA adapter's MBs each, or the "
        "whole model's without train.lora",
    )

    def __post_init__(self) -> None:
        need(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            f"device={self.device!r}: use auto, cpu, cuda or cuda:N",
        )
        need(
            self.worker_timeout_s >= 3,
            f"worker_timeout_s={self.worker_timeout_s}: must be at least 3 seconds (heartbeats come every second)",
        )
        need(self.max_restarts >= 0, f"max_restarts={self.max_restarts}: must be >= 0 (0 = no restarts)")
        need(
            self.max_policies is None or self.max_policies >= max(1, len(self.policies)),
            f"max_policies={self.max_policies}: must hold the {len(self.policies)} policies the run starts "
            "with (null = just those)",
        )
        need(
            not (self.max_policies and self.max_policies > 1 and not self.policies),
            f"max_policies={self.max_policies} without a policies list: policies that join sit beside named "
            "ones; name the run's first policy, e.g. --policies='[{name: main}]'",
        )
        need(
            not (self.store.replay and self.train.loss.correction == "none"),
            f"store.replay={self.store.replay} with train.loss.correction=none: replayed groups are "
            "off-policy and need a correction anchored at the logprobs that sampled them: set "
            "train.loss.correction to behaviour, tis or decoupled (or null: the mode's own, behaviour "
            "with replay)",
        )

        need(
            self.task.overlong_buffer <= self.rollout.max_new_tokens,
            f"task.overlong_buffer={self.task.overlong_buffer} is more than rollout.max_new_tokens="
            f"{self.rollout.max_new_tokens}: the penalty would start before the response does; lower it (DAPO: "
            "a fifth of the cap) or raise rollout.max_new_tokens",
        )
        need(
            self.train.lr_warmup_steps <= self.flow.steps,
            f"train.lr_warmup_steps={self.train.lr_warmup_steps} is more than flow.steps={self.flow.steps}: "
            "the learning rate would never reach train.lr; lower the warmup (a tenth of the steps or less "
            "is usual) or raise flow.steps",
        )
        need(
            self.train.critic.warmup_steps < self.flow.steps,
            f"train.critic.warmup_steps={self.train.critic.warmup_steps} is not under flow.steps="
            f"{self.flow.steps}: the policy would never train; lower the critic's warmup or raise flow.steps",
        )
        need(
            self.train.mini_batches <= self.flow.groups_per_step,
            f"train.mini_batches={self.train.mini_batches} is more than a step's "
            f"{self.flow.groups_per_step} groups (flow.train_batch / flow.samples_per_prompt): a mini-batch "
            f"holds whole groups; lower it to {self.flow.groups_per_step} or less, or raise flow.train_batch",
        )
        need(
            not (
                self.train.advantage == "gae"
                and self.flow.samples_per_prompt == 1
                and self.flow.zero_signal == "replace"
            ),
            "train.advantage=gae with flow.samples_per_prompt=1 and flow.zero_signal=replace: a group of one "
            "sample has one reward, so every group would be replaced as zero-signal; set "
            "flow.zero_signal=train (the critic learns from every group)",
        )
        need(
            not (self.train.external and self.train.world_size > 1),
            f"train.external with train.world_size={self.train.world_size}: your own trainer is one process "
            "to the run (--train.world_size=1; your trainer's parallelism is its own)",
        )
        need(
            not (self.train.routing_replay and self.rollout.backend == "vllm"),
            "train.routing_replay with rollout.backend=vllm: the vLLM engine here does not return the experts "
            "it chose; set rollout.backend=tailrace (or train.routing_replay=false)",
        )
        for name in self.train.moe_only():
            need(
                self.model.path is not None,
                f"train.{name}: the built-in model has no mixture of experts; set model.path to one (Qwen3-MoE, "
                f"Qwen2-MoE, OLMoE, Mixtral, Granite MoE) or drop train.{name}",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
