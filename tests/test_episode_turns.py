"""How environment turns are written (trainer/episode/turns.py) and how tools are offered in the
prompt (trainer/tasks/prompts.py): a real model's chat template (SmolLM2's, in var/models) reads
our conversation exactly as it would render the same messages itself."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainer.episode.tools import JSON_SYNTAX, TAG_SYNTAX
from trainer.episode.turns import FEEDBACK, TOOL, TurnFormat
from trainer.models import gguf_import
from trainer.models.loading import build_char_tokenizer
from trainer.tasks.prompts import PromptRenderer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "23+58"}}</tool_call>'


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    out = Path(__file__).resolve().parents[1] / "var" / "models" / gguf_import.SMOLLM2_DIR_NAME
    if not (out / "config.json").is_file():  # `make sglang-model` writes it (make test does)
        gguf_import.import_gguf(gguf_import.smollm2_gguf(download=True), out)
    return AutoTokenizer.from_pretrained(out, local_files_only=True)


def test_smollm2_reads_a_tool_turn_as_its_template_writes_it(smollm2):
    tok = smollm2
    renderer = PromptRenderer(tok, tools=("calculator",))
    fmt = TurnFormat.for_renderer(renderer)
    assert fmt.chat and fmt.syntax == JSON_SYNTAX
    prompt = renderer.render("What is 23+58?")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # the model's turn as the engine keeps it: its text, then its end-of-turn token
    ours = (prompt + CALL + "<|im_end|>" + fmt.env_text(TOOL, "81", end)
            + "81" + "<|im_end|>" + fmt.env_text(FEEDBACK, "Try again.", end))
    system = renderer.messages("What is 23+58?")
    head = tok.apply_chat_template([{"role": "system", "content": _system(prompt)}, *system],
                                   tokenize=False, add_generation_prompt=True)
    assert head == prompt   # the offered tools are in the system message (the template has no tools=)
    theirs = tok.apply_chat_template(
        [{"role": "system", "content": _system(prompt)}, *system,
         {"role": "assistant", "content": CALL}, {"role": "tool", "content": "81"},
         {"role": "assistant", "content": "81"}, {"role": "user", "content": "Try again."}],
        tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "<|im_start|>tool\n81<|im_end|>\n<|im_start|>assistant\n" in theirs
    # a turn cut at the call's closing tag (no end-of-turn token) gets the template's own
    assert fmt.env_text(TOOL, "81", None).startswith("<|im_end|>\n<|im_start|>tool\n")
    # as token ids: the template's special tokens, one each
    ids = fmt.env_ids(TOOL, "81", end)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def _system(prompt: str) -> str:
    return prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]


def test_the_system_message_tells_a_model_its_tools_when_the_template_cannot(smollm2):
    text = PromptRenderer(smollm2, tools=("calculator", "python")).render("Hi")
    assert '<tool_call>{"name": "TOOL"' in text and "- calculator:" in text and "- python:" in text
    assert "tool_call" not in PromptRenderer(smollm2).render("Hi")   # single-turn: nothing


def test_a_template_that_renders_tools_gets_their_schemas():
    tok = build_char_tokenizer()
    tok.chat_template = ("{% if tools %}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}"
                         "\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text = PromptRenderer(tok, tools=("calculator",)).render("Hi")
    assert text.startswith("<|tools|>calculator\n") and "You may call a tool" not in text


def test_the_plain_format_for_the_built_in_model():
    fmt = TurnFormat(build_char_tokenizer(), chat=False)
    assert fmt.syntax == TAG_SYNTAX
    assert fmt.env_text(TOOL, "172") == "<result>172</result>"
    assert fmt.env_text(FEEDBACK, "Try again.") == "<feedback>Try again.</feedback>"


def test_a_template_without_a_tool_message_is_refused_by_name():
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}<|{{ m['role'] }}|>"
                         "{{ m['content'] }}\n{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="does not render a 'tool' message.*chat_template = 'none'"):
        TurnFormat(tok, chat=True)
