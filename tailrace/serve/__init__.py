"""`tailrace serve`: an OpenAI-compatible endpoint (completions and chat completions, streaming) on
a rollout engine (tailrace's, or vLLM's with rollout.backend=vllm), so an external agent framework
can drive it; every response carries the policy version and the token logprobs a trainer needs
(api.py: the wire format; server.py: the server)."""

from __future__ import annotations

import secrets
import signal
import threading
from collections.abc import Callable

import torch

from tailrace.config import RunConfig
from tailrace.engine import build_engine
from tailrace.model.checkpoint import load_pretrained
from tailrace.runtime.procs import available_cores, resolve_device, resolve_dtype
from tailrace.runtime.session import ModelText
from tailrace.runtime.warmstart import ensure_warm_start
from tailrace.serve.server import LOOPBACK, Endpoint, EngineLoop, make_server


def serve(cfg: RunConfig, say: Callable[[str], None] = print, progress=None, ready=None) -> None:
    """Serve `cfg`'s model until SIGINT or SIGTERM. `ready(server)`: called once it listens (tests)."""
    s = cfg.serve
    path = cfg.model.path or ensure_warm_start(cfg.arch, cfg.sft, progress)
    text = ModelText(path, cfg.task.chat_template, cfg.task.system_prompt, cfg.task.thinking)
    text.model_cfg.context(s.context, "serve.context")  # past the model's sliding window: ConfigError
    torch.set_num_threads(len(available_cores()))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    if cfg.rollout.backend == "vllm":  # vLLM loads the checkpoint itself
        engine = build_engine(
            str(path), backend="vllm", num_slots=s.slots, seed=cfg.seed, max_context=s.context,
            kv_memory_gb=cfg.rollout.kv_memory_gb, dtype=dtype,
        )  # fmt: skip
    else:
        model = load_pretrained(path, dtype=getattr(torch, dtype), device=device)
        engine = build_engine(
            model, num_slots=s.slots, device=device, seed=cfg.seed, max_context=s.context,
            expected_context=s.context, kv_memory_gb=cfg.rollout.kv_memory_gb,
        )  # fmt: skip
        del model
    token = s.token or secrets.token_urlsafe(24)
    loop = EngineLoop(engine)
    ep = Endpoint(loop, text, str(path), token, s.max_tokens, text.model_cfg.vocab_size, s.context)
    server = make_server(ep, s.host, s.port)
    host, port = server.server_address[:2]
    say(engine.describe())
    say(f"serving {path} on http://{host}:{port}/v1 (completions, chat completions"
        f"{'' if text.chat else ': no chat template, completions only'})")  # fmt: skip
    if host not in LOOPBACK:
        say(
            f"warning: listening on {host}: reachable from other machines; anyone with the token can generate"
        )
    if s.token is None:
        say(f"token (this run only): {token}")
    say(f"try: curl -s http://{host}:{port}/v1/completions -H 'Authorization: Bearer {token}' "
        "-H 'Content-Type: application/json' -d '{\"prompt\": \"1+2=\", \"max_tokens\": 8}'")  # fmt: skip
    loop.start()
    if threading.current_thread() is threading.main_thread():  # SIGTERM ends it as Ctrl-C does
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        loop.stop()
