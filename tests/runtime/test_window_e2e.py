"""A Mistral v0.1-style checkpoint (a sliding window shorter than its positions) trains with every
sequence held to its window, where the window's attention is tailrace's full attention; a context
past the window is refused in one line before anything starts."""

import json
import shutil

from tests.runtime.conftest import TINY_RUN, checkpoints, one_line, run


def test_a_windowed_mistral_trains_held_to_its_window(capfd, tiny_model, tmp_path):
    src = tmp_path / "mistral"
    shutil.copytree(tiny_model, src)
    d = json.loads((src / "config.json").read_text())
    del d["attention_bias"], d["mlp_bias"]  # MistralConfig has neither
    d.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=96)
    (src / "config.json").write_text(json.dumps(d))
    argv = ["train", f"--model.path={src}", *TINY_RUN, "--flow.steps=2", "--flow.mode=sync"]

    rc, out = run(capfd, *argv, f"--run-dir={tmp_path / 'past'}", "--rollout.max_context=97")
    assert rc == 2, out
    assert "rollout.max_context=97 is past the model's sliding_window=96" in one_line(out)
    assert "set max_context <= 96" in one_line(out)

    rc, out = run(capfd, *argv, f"--run-dir={tmp_path / 'run'}")
    assert rc == 0, out
    assert "slots of up to 96" in out  # the window is the engines' context
    saved = json.loads((checkpoints(tmp_path / "run")[-1] / "model" / "config.json").read_text())
    assert (saved["model_type"], saved["sliding_window"]) == ("mistral", 96)  # transformers windows it too
