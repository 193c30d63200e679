"""A trainer of one's own for the external-trainer tests: tailrace's model (no transformers import),
the example's loss. `--nan-at S`: answer step S with weights that are not finite (the run refuses them);
`--die-at S`: exit abruptly holding step S's batch; `--dump D`: its weights after each step into D. Exit code 3
when the run refused it. On a LoRA run it trains tailrace's own adapter (lora.attach) on the base."""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file

from tailrace.client import TrainerClient, TrainerClientError, load_optimizer_state, optimizer_state
from tailrace.model import lora
from tailrace.model.checkpoint import load_pretrained


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--nan-at", type=int, default=None)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument(
        "--dump", default=None, help="a directory: its weights after each step, step_<S>.safetensors"
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    client = TrainerClient(a.run_dir, wait_s=120)
    model = load_pretrained(client.start, dtype=torch.float32)
    if client.config.lora.rank:  # the run's adapter on the base: its names are the run's
        lora.attach(model, client.config.lora)
        if client.adapter:
            lora.load_adapter_into(model, lora.load_peft(client.adapter))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if client.state:
        load_optimizer_state(opt, client.state)
    print(f"start {client.steps_done} state {len(client.state)}", flush=True)
    try:
        for batch in client.batches():
            print(f"batch {batch.step} replay={batch.replay} publish={batch.publish}", flush=True)
            if batch.step == a.die_at and not batch.replay:
                os._exit(9)
            tb = batch.tensors()
            logp = torch.log_softmax(model(tb.input_ids).float(), -1)
            logp = logp.gather(-1, tb.targets.unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logp - tb.behav_logp)
            loss = -(torch.min(ratio * tb.adv, ratio.clamp(0.8, 1.2) * tb.adv) * tb.scale).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            weights = model.state_dict()
            if batch.step == a.nan_at:
                weights = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
            batch.done(weights, {"loss": loss.item()}, state=lambda: optimizer_state(opt))
            if a.dump:  # (a tied embedding is one tensor under two names: each saved on its own)
                save_file(
                    {k: v.clone() for k, v in weights.items()}, f"{a.dump}/step_{batch.step}.safetensors"
                )
        print(f"end steps_done={client.steps_done} finished={client.finished}", flush=True)
    except TrainerClientError as e:
        print(e, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
