"""LoRA: low-rank adapters on a frozen `CausalLM`, and their files in PEFT's format.

`attach(model, cfg)` swaps each target projection (`LoraConfig.targets`, PEFT's names: q_proj ...
down_proj) for a `LoRALinear` that keeps the base `weight` and `bias` (the same Parameters, under the same
state_dict keys) and adds `lora_A` (r, in) and `lora_B` (out, r):

    y = x W^T + b + (alpha / r) (x A^T) B^T

as PEFT's `lora.Linear` computes it (no dropout: the policy is trained in eval mode). A starts as PEFT's
(kaiming-uniform, a = sqrt(5)), B at zero, so the adapted model starts as the base. Every base parameter
is frozen (requires_grad False): an optimizer over the trainable parameters holds the adapter's alone.

`Adapter` is one adapter's weights apart from any model — what an engine loads (`engine.adapters`) and
what `save_peft` / `load_peft` write and read: `adapter_config.json` + `adapter_model.safetensors` keyed
as PEFT keys them (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so
`peft.PeftModel.from_pretrained(hf_model, path)` loads it onto transformers' model of the same base; on
Phi-3, whose q/k/v and gate/up are fused, its files adapt the fused modules (`fused.fuse_adapter`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tailrace.common import ConfigError, InputError, one_line
from tailrace.config.train import LORA_TARGETS, LoraConfig
from tailrace.model import fused
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM

ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint keeps its adapter here, beside model/ (merged)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel (base_model) wrapping the LoraModel (model) around the HF model
_PARENT = {t: "self_attn" for t in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    t: "mlp" for t in ("gate_proj", "up_proj", "down_proj")
}
_FILE_PARENT = _PARENT | {name: parent for name, (parent, _) in fused.GROUPS.items()}  # names in PEFT files

Site = tuple[int, str]  # (layer index, target projection name)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update, PEFT's layout (`lora_A`, `lora_B`)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias  # None registers no parameter, as nn.Linear
        self.in_features, self.out_features = base.in_features, base.out_features
        # trained master weights: fp32 even over a base kept in bf16 (`store_frozen_projections`)
        dtype = torch.float32 if base.weight.dtype in (torch.bfloat16, torch.float16) else base.weight.dtype
        kw = dict(bias=False, device=base.weight.device, dtype=dtype)
        self.lora_A = nn.Linear(self.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, **kw)
        self.scaling = alpha / rank
        self.off = False  # `as_reference`: the base projection, plus the reference adapter if any
        # the KL reference's own adapter (`set_reference`: the one a run started from), frozen; not saved
        self.register_buffer("ref_A", None, persistent=False)
        self.register_buffer("ref_B", None, persistent=False)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init_lora_weights=True
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # in bf16 when `store_frozen_projections` kept it so: autocast casts x to it
        if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            w = w.to(x.dtype)
        y = F.linear(x, w, self.bias)
        if not self.off:
            return y + self.lora_B(self.lora_A(x)) * self.scaling
        if self.ref_A is None:
            return y
        return y + F.linear(F.linear(x, self.ref_A), self.ref_B) * self.scaling


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter's weights: per (layer, target), A (r, in) and B (out, r); the update is
    scale * (x A^T) B^T with scale = alpha / rank."""

    rank: int
    alpha: float
    weights: dict[Site, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> tuple[str, ...]:
        names = {t for _, t in self.weights}
        return tuple(t for t in LORA_TARGETS if t in names)


def adapted_weight(name: str, targets: tuple[str, ...]) -> bool:
    """Whether the state-dict key `name` is the base weight of a projection in `targets`."""
    return any(name.endswith(f".{_PARENT[t]}.{t}.weight") for t in targets)


def expert_weight(name: str) -> bool:
    """Whether the state-dict key `name` is a projection weight of a mixture of experts' expert (Qwen2-MoE's
    shared one too): frozen under LoRA, which adapts only the attention there."""
    expert = ".mlp.experts." in name or ".mlp.shared_expert." in name
    return expert and name.endswith("_proj.weight")


def stored_low(name: str, targets: tuple[str, ...]) -> bool:
    """Whether `store_frozen_projections` keeps the state-dict key `name` in the autocast dtype: an
    adapted projection's base weight, or an expert's."""
    return adapted_weight(name, targets) or expert_weight(name)


def adaptable(cfg: ModelConfig, layer: int, target: str) -> bool:
    """Whether LoRA may adapt projection `target` of layer `layer` (any, on every layer): not an MLP's of a
    mixture-of-experts model (see `attach`)."""
    return _FILE_PARENT[target] != "mlp" or not cfg.moe


def _module(model: CausalLM, layer: int, target: str) -> nn.Module:
    return getattr(getattr(model.model.layers[layer], _PARENT[target]), target)


def attach(model: CausalLM, cfg: LoraConfig) -> CausalLM:
    """Give `model` (in place) a fresh adapter on `cfg.targets` of every layer and freeze the rest;
    its A draws from torch's global generator. Returns the model. On a mixture-of-experts model (`cfg.moe`)
    only the attention projections are adapted, its MLPs (experts, and any dense ones) frozen: the default
    targets (all seven) mean those there, and naming an MLP target is refused (PEFT reads gate_proj, up_proj
    and down_proj there as the experts' 3-D weights, which tailrace's adapters do not reach)."""
    if cfg.rank < 1:
        raise ValueError(f"lora rank {cfg.rank}: attach needs a rank >= 1")
    mlp = [t for t in cfg.targets if _PARENT[t] == "mlp"]
    if model.config.moe and mlp and set(cfg.targets) != set(LORA_TARGETS):
        raise ConfigError(
            f"train.lora.targets={list(cfg.targets)}: {', '.join(mlp)} of a mixture-of-experts model are its "
            "experts, which tailrace's adapters leave frozen; adapt q_proj, k_proj, v_proj and o_proj only"
        )
    layers = range(model.config.num_hidden_layers)
    sites = [(i, t) for i in layers for t in cfg.targets if adaptable(model.config, i, t)]
    model.requires_grad_(False)
    for i, t in sites:
        parent = getattr(model.model.layers[i], _PARENT[t])
        base = getattr(parent, t)
        if isinstance(base, LoRALinear):
            raise ValueError(f"layer {i} {t} already has an adapter")
        setattr(parent, t, LoRALinear(base, cfg.rank, cfg.alpha))
    return model


def store_frozen_projections(model: CausalLM, dtype: torch.dtype) -> int:
    """Keep the frozen base weight of every adapted projection, and every expert's of a mixture of experts
    (Qwen2-MoE's shared one too; frozen under LoRA: most of such a model's weights), in `dtype`; returns the
    bytes saved. For a LoRA trainer that autocasts to `dtype`: its GEMMs cast every frozen weight to `dtype`
    on each forward anyway, so this changes no value it computes, halves those weights' memory and skips the
    casts (outside autocast `LoRALinear` and `SparseMoE` cast to the weight's dtype). Embeddings, norms, routers
    and projections without an adapter stay as they are. Only a weight `dtype` holds exactly is kept so (a
    bf16 checkpoint's, read into fp32): the base the checkpoints merge the adapter into (`merged_state`)
    stays the checkpoint's to the bit; an fp32 checkpoint's base stays fp32."""
    saved = 0
    for name, m in model.named_modules():
        expert = isinstance(m, nn.Linear) and expert_weight(f"{name}.weight")
        w = m.weight if isinstance(m, LoRALinear) or expert else None
        if w is None or w.requires_grad:
            continue
        low = exactly_in(w, dtype) if w.dtype != dtype else None
        if low is not None:
            saved += w.numel() * (w.element_size() - torch.finfo(dtype).bits // 8)
            m.weight = nn.Parameter(low, requires_grad=False)
    return saved


def exactly_in(w: torch.Tensor, dtype: torch.dtype, head: int = 4096) -> torch.Tensor | None:
    """`w` in `dtype` where every value of it is one of `dtype`'s (rounding it there loses nothing), else
    None: one conversion, kept. Its first `head` values are tried alone first: a trained fp32 weight fails
    there at once, without a whole copy in `dtype` (and a mapped checkpoint's, without reading it all)."""
    with torch.no_grad():
        first = w.detach().reshape(-1)[:head]
        if not torch.equal(first.to(dtype).to(w.dtype), first):
            return None
        low = w.detach().to(dtype)
        return low if torch.equal(low.to(w.dtype), w) else None


@contextmanager
def as_reference(model: nn.Module) -> Iterator[nn.Module]:
    """`model` computing as a LoRA run's KL reference while inside, without a second copy of the base:
    its base (PEFT's `disable_adapter`: a fresh adapter's start), plus the adapter the run started from
    where `set_reference` gave it one."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in mods:
        m.off = True
    try:
        yield model
    finally:
        for m in mods:
            m.off = False


def set_reference(model: CausalLM, adapter: Adapter) -> None:
    """`adapter` (the one a run started from: train.lora.init) as `model`'s reference adapter, frozen
    beside the trained one: `as_reference` computes base + it."""
    for (i, t), (a, b) in adapter.weights.items():
        m = _module(model, i, t)
        if not isinstance(m, LoRALinear) or m.lora_A.weight.shape != a.shape or m.scaling != adapter.scale:
            raise ValueError(
                f"layer {i} {t}: the model's adapter does not fit this one (rank, alpha or target)"
            )
        kw = dict(device=m.lora_A.weight.device, dtype=m.lora_A.weight.dtype)
        m.ref_A, m.ref_B = a.detach().to(**kw).clone(), b.detach().to(**kw).clone()


def has_adapter(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_of(model: CausalLM) -> Adapter:
    """The adapter `attach` gave `model`, as detached copies (its current weights)."""
    weights, rank, alpha = {}, None, None
    for i in range(len(model.model.layers)):
        for t in LORA_TARGETS:
            m = _module(model, i, t) if adaptable(model.config, i, t) else None
            if isinstance(m, LoRALinear):
                a, b = m.lora_A.weight, m.lora_B.weight
                weights[i, t] = (a.detach().clone(), b.detach().clone())
                rank, alpha = a.shape[0], m.scaling * a.shape[0]
    if not weights:
        raise ValueError("the model has no adapter; lora.attach gives it one")
    return Adapter(int(rank), float(alpha), weights)


def load_adapter_into(model: CausalLM, adapter: Adapter) -> None:
    """Copy `adapter`'s weights into the adapter `attach` gave `model` (same rank and targets)."""
    for (i, t), (a, b) in adapter.weights.items():
        m = _module(model, i, t)
        if (
            not isinstance(m, LoRALinear)
            or m.lora_A.weight.shape != a.shape
            or m.lora_B.weight.shape != b.shape
        ):
            raise ValueError(f"layer {i} {t}: the model's adapter does not fit this one (rank or target)")
        with torch.no_grad():
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)
        m.scaling = adapter.scale


def merged(model: CausalLM, adapter: Adapter) -> CausalLM:
    """W + scale B A folded into each target's weight of `model` (in place; a reference, not a server)."""
    with torch.no_grad():
        for (i, t), (a, b) in adapter.weights.items():
            w = _module(model, i, t).weight
            w.add_((b.float() @ a.float()).mul_(adapter.scale).to(w.dtype))
    return model


def merged_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The state dict of the model `attach` adapted, in fp32, with each adapter folded into its base
    weight (W + scale B A, new tensors; the model is unchanged): a plain checkpoint of the policy."""
    out = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if ".lora_A." in name or ".lora_B." in name:
                continue
            m = model.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(m, LoRALinear) and name.endswith(".weight"):
                t = t.float() + (m.lora_B.weight.float() @ m.lora_A.weight.float()).mul_(m.scaling)
            out[name] = t.float()  # one dtype (a base kept in bf16 by `store_frozen_projections` too)
    return out


# -- PEFT files ----------------------------------------------------------------------------------------


def peft_key(site: Site, which: str) -> str:
    i, t = site
    return f"{PEFT_PREFIX}model.layers.{i}.{_FILE_PARENT[t]}.{t}.lora_{which}.weight"


def save_peft(
    adapter: Adapter, path: str | os.PathLike, base_model: str | None = None, cfg: ModelConfig | None = None
) -> None:
    """Write `adapter` as PEFT writes a LoRA adapter of a causal LM (each file replaced atomically).
    `cfg`: the base model's, needed for a family with fused projections (Phi-3), whose modules the files
    then adapt (their rank and alpha in `rank_pattern` and `alpha_pattern`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights, ranks, alphas = adapter.weights, {}, {}
    if cfg is not None and fused.fused(cfg):
        weights, wide = fused.fuse_adapter(weights, cfg, adapter.rank)
        for name, n in wide.items():
            if n > 1:
                ranks[name], alphas[name] = n * adapter.rank, n * adapter.alpha
    state = {}
    for site, (a, b) in weights.items():
        state[peft_key(site, "A")] = a.detach().to("cpu").contiguous()
        state[peft_key(site, "B")] = b.detach().to("cpu").contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({t for _, t in weights}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
    }
    tmp = path / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / ADAPTER_WEIGHTS)
    tmp = path / f".{ADAPTER_CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path / ADAPTER_CONFIG)


def load_peft(path: str | os.PathLike, base: ModelConfig | None = None) -> Adapter:
    """A PEFT LoRA adapter directory (ours or PEFT's own) of a Llama-family causal LM (Mistral, Qwen2/3,
    OLMo2/3, SmolLM3: the same layer names; Phi-3's fused modules, split by `base`, its base model's
    config); one rank and alpha for all targets (a `rank_pattern` / `alpha_pattern` other than the
    fused modules' that `save_peft` writes, DoRA or rsLoRA are refused, in one line)."""
    path = Path(path)
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path / ADAPTER_CONFIG}: not a readable adapter config ({one_line(e)})")
    if cfg.get("peft_type") != "LORA" or not _fused_patterns(cfg):
        raise InputError(f"{path}: only plain LoRA adapters load (one rank and alpha; no rank_pattern)")
    if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("bias", "none") != "none":
        raise InputError(f"{path}: DoRA, rsLoRA and trained biases are not supported; use plain LoRA")
    try:
        with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as fh:
            state = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise InputError(f"{path / ADAPTER_WEIGHTS}: not a readable safetensors file ({one_line(e)})")
    state = {k.removeprefix(PEFT_PREFIX): t for k, t in state.items()}
    return from_state(state, int(cfg["r"]), float(cfg["lora_alpha"]), str(path), base)


def _fused_patterns(cfg: dict) -> bool:
    """Whether the adapter config's rank and alpha patterns (if any) are the fused modules' n r and n alpha."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if set(ranks) != set(alphas) or not set(ranks) <= set(fused.GROUPS):
        return False
    return all(
        ranks[k] == len(fused.GROUPS[k][1]) * r and alphas[k] == len(fused.GROUPS[k][1]) * alpha
        for k in ranks
    )


def from_state(
    state: dict[str, torch.Tensor], rank: int, alpha: float, source: str, base: ModelConfig | None = None
) -> Adapter:
    """The adapter whose tensors `state` holds, keyed as the adapted model names them
    (`model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}[.<adapter name>].weight`): a PEFT file's
    (its prefix removed) or a LoRA trainer's published parameters. `source` names it in errors; `base`,
    the base model's config, splits the adapters of fused modules (Phi-3's `qkv_proj`, `gate_up_proj`)."""
    weights: dict[Site, list] = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if (
            len(parts) < 7
            or parts[:2] != ["model", "layers"]
            or _FILE_PARENT.get(parts[4]) != parts[3]
            or parts[5] not in ("lora_A", "lora_B")
        ):
            raise InputError(
                f"{source}: unexpected tensor {key!r}; a Llama-family LoRA adapter names its layers"
            )
        site = (int(parts[2]), parts[4])
        if base is not None and site[0] < base.num_hidden_layers and not adaptable(base, *site):
            raise InputError(
                f"{source}: adapts layer {site[0]}'s {site[1]}, an MLP of a mixture-of-experts model, which "
                "tailrace's adapters leave frozen; use an adapter of the attention projections"
            )
        weights.setdefault(site, [None, None])["AB".index(parts[5][-1])] = tensor
    if any(t in fused.GROUPS for _, t in weights):
        if base is None or not fused.fused(base):
            raise InputError(
                f"{source}: adapts fused modules (Phi-3's qkv_proj, gate_up_proj); load it onto a Phi-3 base"
            )
        if any(a is None or b is None for a, b in weights.values()):
            raise InputError(f"{source}: a layer lacks lora_A or lora_B")
        try:
            weights = fused.split_adapter(weights, base, rank, source)
        except ValueError as e:
            raise InputError(one_line(e))
    out = {}
    for site, (a, b) in weights.items():
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise InputError(f"{source}: layer {site[0]} {site[1]} lacks lora_A or lora_B of rank {rank}")
        out[site] = (a, b)
    if not out:
        raise InputError(f"{source}: no LoRA tensors")
    return Adapter(rank, alpha, out)
