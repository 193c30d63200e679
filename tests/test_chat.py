"""Chat templates: prompts rendered as transformers renders them (same ids as its own
apply_chat_template), one BOS, the end-of-turn token found, and the session's stop ids and text."""

import json

import pytest

from tailrace.chat import ChatFormat
from tailrace.tokenizer import TokenizerError, load_tokenizer
from tests.chat_helpers import (
    BOS_FIRST,
    CHATML,
    GEMMA2,
    GEMMA3,
    GEMMA_SPECIALS,
    THINKING,
    write_chat_model,
    write_tokenizer,
)

Q = "Q:a7 b3 c9\n"


def hf_ids(d, messages, **options):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(d)
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **options)
    return list(out["input_ids"])


@pytest.mark.parametrize("template", [CHATML, BOS_FIRST], ids=["chatml", "bos-first"])
@pytest.mark.parametrize("system", [None, "Answer briefly."])
def test_prompt_ids_are_transformers_own_with_one_bos(tmp_path, template, system):
    d = write_tokenizer(tmp_path, template, bos="<|im_start|>" if template == CHATML else "<|endoftext|>")
    tok = load_tokenizer(d)
    chat = ChatFormat(tok, system)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": Q}]
    ids = chat.ids(Q)
    assert ids == hf_ids(d, messages)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's BOS, never a second one
    assert chat.end_of_turn == 2  # <|im_end|>


def test_the_rendered_prompt_is_the_chat(tmp_path):
    chat = ChatFormat(load_tokenizer(write_tokenizer(tmp_path)), "Be terse.")
    assert chat.render(Q) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nQ:a7 b3 c9\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("thinking", [None, False, True])
def test_the_thinking_switch_renders_as_transformers_does(tmp_path, thinking):
    """task.thinking is Qwen3's enable_thinking: false closes an empty think block after the
    generation prompt; the ids are apply_chat_template's with the same switch."""
    d = write_tokenizer(tmp_path, THINKING)
    chat = ChatFormat(load_tokenizer(d), None, thinking)
    options = {} if thinking is None else {"enable_thinking": thinking}
    assert chat.ids(Q) == hf_ids(d, [{"role": "user", "content": Q}], **options)
    closed = chat.render(Q).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed == (thinking is False) and chat.end_of_turn == 2


def test_a_thinking_switch_the_template_lacks_is_refused(tmp_path):
    with pytest.raises(TokenizerError) as e:
        ChatFormat(load_tokenizer(write_tokenizer(tmp_path)), None, False)
    assert str(e.value) == (
        "task.thinking=false but the model's chat template has no enable_thinking switch; drop task.thinking"
    )


def test_templates_are_read_where_transformers_reads_them(tmp_path):
    assert load_tokenizer(write_tokenizer(tmp_path / "file", in_file=True)).chat_template == CHATML
    assert load_tokenizer(write_tokenizer(tmp_path / "none", None)).chat_template is None
    d = write_tokenizer(tmp_path / "named", None)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(d).chat_template == CHATML


def test_a_template_that_rejects_the_messages_is_one_line(tmp_path):
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    tok = load_tokenizer(write_tokenizer(tmp_path, strict + CHATML))
    with pytest.raises(TokenizerError) as e:
        ChatFormat(tok, "Be terse.")
    assert str(e.value) == (
        "the model's chat template failed (TemplateError: System role not supported); drop "
        "task.system_prompt or set task.chat_template=none to send the question as raw text"
    )


def session(d, *overrides):
    from tailrace.config import load_config
    from tailrace.runtime.session import Session

    return Session(load_config(None, [f"--model.path={d}", *overrides]))


def test_the_session_renders_through_the_template_and_stops_at_the_end_of_turn(tmp_path):
    from tailrace.types import Finish, GenResult

    d = write_chat_model(tmp_path)
    ses = session(d, "--task.system_prompt=Be terse.")
    try:
        ex = ses.task.examples("train", 1)[0]
        p = ses.prompt(ex)
        assert (
            p.token_ids == tuple(ChatFormat(ses.tok, "Be terse.").ids(ex.question)) and p.text == ex.question
        )
        assert ses.stop_ids == (0, 2)  # EOS <|endoftext|>, then ChatML's <|im_end|>
        ids = tuple(ses.tok.encode("A:12")) + (2,)
        r = GenResult("x", ids, (0.0,) * len(ids), (0,) * len(ids), Finish.STOP)
        assert ses.response_text(r) == "A:12"  # the reward sees the response only
    finally:
        ses.close()
    raw = session(d, "--task.chat_template=none")
    try:
        assert raw.prompt(ex).token_ids == (1, *raw.tok.encode(ex.question)) and raw.stop_ids == (0,)
    finally:
        raw.close()


def test_a_system_prompt_or_thinking_switch_without_a_template_is_refused(tmp_path):
    from tailrace.common import ConfigError

    d = write_chat_model(tmp_path)
    write_tokenizer(d, None)
    with pytest.raises(ConfigError, match="has no chat template .*; drop task.system_prompt"):
        session(d, "--task.system_prompt=Be terse.")
    with pytest.raises(
        ConfigError, match="task.thinking is set but .* has no chat template .*; drop task.thinking"
    ):
        session(d, "--task.thinking=false")


@pytest.mark.parametrize("system", [None, "Answer briefly."])
def test_gemma3s_template_folds_the_system_message_into_the_first_turn(tmp_path, system):
    """Gemma 3's chat: BOS, the system message (if any) before the question in the user's turn, the
    generation prompt "<start_of_turn>model"; ids as transformers', the end of a turn <end_of_turn>."""
    d = write_tokenizer(tmp_path, GEMMA3, bos="<bos>", specials=GEMMA_SPECIALS)
    tok = load_tokenizer(d)
    chat = ChatFormat(tok, system)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": Q}]
    assert chat.ids(Q) == hf_ids(d, messages)
    assert chat.render(Q) == (
        "<bos><start_of_turn>user\n" + (f"{system}\n\n" if system else "") + "Q:a7 b3 c9<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert chat.end_of_turn == GEMMA_SPECIALS.index("<end_of_turn>")


def test_gemma2s_template_refuses_a_system_message_in_one_line_naming_the_fix(tmp_path):
    d = write_tokenizer(tmp_path, GEMMA2, bos="<bos>", specials=GEMMA_SPECIALS)
    assert ChatFormat(load_tokenizer(d)).end_of_turn == GEMMA_SPECIALS.index("<end_of_turn>")
    with pytest.raises(TokenizerError) as e:
        ChatFormat(load_tokenizer(d), "Answer briefly.")
    assert "System role not supported" in str(e.value) and "drop task.system_prompt" in str(e.value)


def test_a_datasets_chat_messages_render_as_transformers_renders_them(tmp_path):
    """A JSONL row's messages (TRL's conversational format) through the model's template, token for
    token as apply_chat_template; task.system_prompt goes first only where a row has no system message."""
    rows = [
        [{"role": "user", "content": "a1 b2"}],
        [{"role": "system", "content": "Sum it."}, {"role": "user", "content": "a4 b5"}],
        [
            {"role": "user", "content": "a1"},
            {"role": "assistant", "content": "A:1"},
            {"role": "user", "content": "b2"},
        ],
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": m, "answer": "3"}) + "\n" for m in rows))
    d = write_chat_model(tmp_path / "model")
    task = [
        f"--task.name=jsonl:{data}",
        "--task.config={question_field: prompt, test_path: " + str(data) + "}",
    ]
    for system in (None, "Be terse."):
        ses = session(d, *task, *([f"--task.system_prompt={system}"] if system else []))
        try:
            for ex in ses.task.examples("test", 3):
                messages = [{"role": r, "content": c} for r, c in ex.messages]
                if system and messages[0]["role"] != "system":
                    messages = [{"role": "system", "content": system}] + messages
                assert list(ses.prompt(ex).token_ids) == hf_ids(d, messages)
                assert ses.prompt(ex).text == ex.messages[-1][1]  # what the reward reads: the last question
        finally:
            ses.close()
    raw = session(d, *task, "--task.chat_template=none")
    try:
        from tailrace.common import ConfigError

        with pytest.raises(ConfigError, match="its prompts are chat messages, which need a chat template"):
            raw.prompt(raw.task.examples("test", 1)[0])
    finally:
        raw.close()


def test_chat_messages_a_template_refuses_are_named_with_the_templates_own_reason(tmp_path):
    """Gemma 2's template has no system role: a dataset row that brings one is refused naming the prompt,
    its roles and the template's reason, not with advice about task.system_prompt it never set."""
    from tailrace.common import ConfigError

    data = tmp_path / "chat.jsonl"
    rows = [[{"role": "system", "content": "Sum it."}, {"role": "user", "content": "a4 b5"}]]
    data.write_text("".join(json.dumps({"prompt": m, "answer": "9"}) + "\n" for m in rows))
    d = write_chat_model(tmp_path / "model", template=GEMMA2)
    ses = session(
        d, f"--task.name=jsonl:{data}", "--task.config={question_field: prompt, test_path: " + str(data) + "}"
    )
    try:
        with pytest.raises(ConfigError) as e:
            ses.prompt(ses.task.examples("test", 1)[0])
        assert (
            "prompt 0's chat messages (system/user) fail the model's chat template (TemplateError: System "
            in str(e.value)
        )
        assert "role not supported); make the rows' messages what the template takes" in str(e.value)
    finally:
        ses.close()
