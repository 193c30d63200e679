"""A dataset with prompts longer than the model's context: they are left out of training and
evaluation, said once, instead of failing the run at the first one an engine meets."""

import json
import re
from itertools import islice

import pytest

from tailrace.common import ConfigError
from tests.chat_helpers import write_chat_model


def _session(tmp_path, rows, *over):
    from tailrace.config import load_config
    from tailrace.runtime.session import Session

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in rows))
    d = write_chat_model(tmp_path / "model", template=None)  # 256 positions; BOS + the raw question
    return Session(load_config(None, [f"--model.path={d}", f"--task.name=jsonl:{data}", *over]))


def test_too_long_prompts_are_left_out_of_training_and_evaluation_and_said_once(tmp_path, capsys):
    rows = [f"q{i}" if i % 3 else "x" * 300 + f"q{i}" for i in range(60)]
    ses = _session(tmp_path, rows, "--task.config={test_mod: 4}", "--eval.n=8")
    try:
        assert ses.max_prompt == 255  # a 256-token context less a token to answer with
        got = list(islice(ses.prompt_stream(), 50))
        assert all(len(p.token_ids) <= 255 for p in got) and len({p.id for p in got}) > 10
        held = ses.heldout(8)
        assert held and all(len(p.token_ids) <= 255 for p in held)
        out = capsys.readouterr().out
        assert out.count("such prompts are left out of training") == 1
        assert re.search(
            r"prompt \d+ is 30\d tokens, more than the 255 a prompt may take \(a 256-token context", out
        )
        assert "held-out prompts that long are left out of evaluation" in out
    finally:
        ses.close()


def test_a_limit_of_ones_own_and_a_dataset_of_nothing_but_long_prompts(tmp_path, capsys):
    ses = _session(tmp_path, [f"q{i}" + "y" * (i % 7) for i in range(40)], "--task.max_prompt_tokens=5")
    try:
        assert ses.max_prompt == 5
        assert all(len(p.token_ids) <= 5 for p in islice(ses.prompt_stream(), 20))
        assert "(task.max_prompt_tokens)" in capsys.readouterr().out
    finally:
        ses.close()
    ses = _session(tmp_path, ["z" * 400 + str(i) for i in range(40)], "--task.train_size=8")
    try:
        with pytest.raises(
            ConfigError, match=r"training prompts in a row are longer than 255 tokens.*shorten"
        ):
            list(islice(ses.prompt_stream(), 1))
        with pytest.raises(ConfigError, match=r"all \d+ held-out prompts are longer than 255 tokens"):
            ses.heldout(8)
    finally:
        ses.close()
