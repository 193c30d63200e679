"""A small random Llama / Qwen3 whose tokenizer has a chat template, through `tailrace eval` and
`tailrace train`: prompts rendered by the template, generation stopped by its end-of-turn token, and
a run without reward signal that replaces its groups (boundedly), skips its backward passes and
says so."""

import json

from tailrace.chat import ChatFormat
from tailrace.cli import main
from tailrace.config import load_config
from tailrace.records import Finished, Opened, read_journal
from tailrace.types import Finish
from tests.chat_helpers import THINKING, write_chat_model
from tests.runtime.conftest import TINY_RUN

EOS, IM_END = 0, 2


def test_eval_renders_the_template_and_stops_at_the_end_of_turn(tmp_path, capsys):
    import torch

    from tailrace.engine import build_engine
    from tailrace.model.checkpoint import load_pretrained
    from tailrace.runtime.evaluate import Evaluator
    from tailrace.runtime.session import Session

    d = write_chat_model(tmp_path / "llama", "llama", max_position_embeddings=32768)
    flags = [f"--model.path={d}", "--eval.n=32", "--eval.max_new_tokens=64"]
    assert main(["eval", *flags]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy 0.0% on 32 prompts of chainsum" in out
    assert "evaluating: 32/32 responses, ETA 0 s" in out  # progress as plain lines in a log
    # KV sized by the work (eval.batch = 64 slots of a ~120-token prompt + 64 new tokens, in blocks of
    # 16), not by 64 x 32,768 positions
    blocks = int(out.split(" blocks of 16 tokens")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert 64 * 5 <= blocks <= 64 * 16, out
    # the requests `tailrace eval` sends, and what the engine makes of them
    ses = Session(load_config(None, flags))
    try:
        ev = Evaluator(ses, ses.cfg.eval)
        reqs = ev.requests(version=0)
        chat = ChatFormat(ses.tok)
        assert [r.prompt_ids for r in reqs] == [tuple(chat.ids(p.text)) for p in ev.prompts]
        assert reqs[0].prompt_ids[:2] == (1, *ses.tok.encode("s"))  # <|im_start|>system: one BOS
        assert all(r.params.stop_token_ids == (EOS, IM_END) for r in reqs)
        results = build_engine(load_pretrained(d, dtype=torch.float32), num_slots=32, seed=0).generate(reqs)
    finally:
        ses.close()
    stopped = [r for r in results if r.finish == Finish.STOP]
    assert any(r.token_ids[-1] == IM_END for r in stopped), "no response ended its turn"
    for r in results:
        ended = r.token_ids[-1:] if r.finish == Finish.STOP else ()
        assert ended in ((EOS,), (IM_END,), ()) and not {EOS, IM_END} & set(
            r.token_ids[: len(r.token_ids) - len(ended)]
        )


def test_train_with_a_chat_model_and_no_reward_signal(tmp_path, capsys):
    """A Qwen3 checkpoint (q/k norms, head_dim wider than hidden / heads) with its thinking switch off."""
    d = write_chat_model(tmp_path / "qwen3", "qwen3", THINKING, head_dim=16)
    run = tmp_path / "run"
    flags = [f"--model.path={d}", "--task.thinking=false"]
    rc = main(["train", f"--run-dir={run}", *flags, *TINY_RUN, "--flow.zero_signal=replace"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "0% at base on 16 prompts: RL may have no signal" in out
    assert "groups had equal rewards (no signal)" in out and "the step trained nothing" in out
    steps = [
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"
    ]
    assert len(steps) == 4 and all(s["train"]["skipped"] == 1 for s in steps)
    groups = steps[-1]["ledger"]["groups"]
    U = 4  # train_batch 16 / 4 samples per prompt
    assert groups["complete"] == groups["zero_signal"] and 0 < groups["dropped"]["zero-signal"] <= 4 * U
    journal = read_journal(run / "journal.jsonl")
    from tailrace.tokenizer import load_tokenizer

    chat = ChatFormat(load_tokenizer(d), None, False)
    opened = [e for e in journal if isinstance(e, Opened)]
    assert all(e.prompt.token_ids == tuple(chat.ids(e.prompt.text)) for e in opened)
    closed = tuple(chat.tok.encode("assistant\n<think>\n\n</think>\n\n"))  # thinking off
    assert opened and all(e.prompt.token_ids[-len(closed) :] == closed for e in opened)
    done = [e.trajectory.result for e in journal if isinstance(e, Finished)]
    assert all(r.token_ids[-1] in (EOS, IM_END) for r in done if r.finish == Finish.STOP)
