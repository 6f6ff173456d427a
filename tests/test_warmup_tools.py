"""The built-in tool model: its warm-up (by-hand sums and calculator episodes, the environment's
text never a target) and the shipped `builtin-tools` model."""
import json
import random

import pytest
import torch

from trainer.cli import main as cli
from trainer.models.loading import (
    BUILTIN_ASSETS,
    BUILTIN_TOOLS,
    build_char_tokenizer,
    builtin_dir,
    check_model_dir,
    load_model,
    load_tokenizer,
    model_dir,
)
from trainer.run.warmup import _loss, _tools_example, choice_keep, tools_parts
from trainer.tasks.calc import CalcTask
from trainer.tasks.sum import reference_solution


def _split(tok, example):
    """(the target characters, the masked ones) of an example, in order."""
    ids, flags = example
    chars = tok.convert_ids_to_tokens(ids)
    return ("".join(c for c, f in zip(chars, flags) if f),
            "".join(c for c, f in zip(chars, flags) if not f))


def test_a_calculator_episode_trains_the_call_and_the_answer_never_the_result():
    tok = build_char_tokenizer()
    parts = tools_parts([23, 58, 91], use_tool=True)
    assert "".join(t for t, _ in parts) == "[23,58,91]=<calc>23+58+91</calc><result>172</result>>172"
    assert [t for t, mine in parts if not mine] == ["[23,58,91]=", "<result>172</result>"]
    rng, task = random.Random(0), CalcTask(max_len=6, max_operand=99)
    seen = set()
    for _ in range(200):
        example = _tools_example(tok, rng, task, tool_examples=0.5, keep=1.0)
        targets, masked = _split(tok, example)
        values = [int(v) for v in masked[1:masked.index("]")].split(",")]
        total = sum(values)
        if "<calc>" in targets:
            assert targets == "<calc>" + "+".join(map(str, values)) + f"</calc>>{total}<eos>"
            assert masked.endswith(f"]=<result>{total}</result>") and "<result>" not in targets
        else:
            assert targets == reference_solution(values) + "<eos>" and masked.endswith("]=")
        seen.add("<calc>" in targets)
    assert seen == {True, False}  # both kinds at tool_examples 0.5


def test_the_choice_of_the_tool_is_trained_at_tool_share_though_most_examples_use_it():
    tok = build_char_tokenizer()
    keep = choice_keep(0.3, 0.75)
    rng, task = random.Random(1), CalcTask()
    first = []   # the first target character of each example: '<' = the tool chosen
    episodes = 0
    for _ in range(4000):
        ids, flags = _tools_example(tok, rng, task, 0.75, keep)
        chars = tok.convert_ids_to_tokens(ids)
        episodes += "/" in chars
        choice = chars.index("=") + 1   # the first response character
        if flags[choice]:
            first.append(chars[choice])
    assert abs(episodes / 4000 - 0.75) < 0.03
    assert abs(first.count("<") / len(first) - 0.3) < 0.03
    assert choice_keep(0.3, 0.3) == 1.0 and choice_keep(0.0, 0.5) == 0.0
    for bad in ((0.5, 0.3), (0.3, 1.0), (-0.1, 0.5)):
        with pytest.raises(ValueError):
            choice_keep(*bad)


class _Logits(torch.nn.Module):
    """A stand-in model whose logits are one parameter, to see which positions the loss reads."""
    def __init__(self, T, V):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(1, T, V))

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": self.table})()


def test_the_loss_reads_only_the_models_tokens():
    tok = build_char_tokenizer()
    ids, flags = _tools_example(tok, random.Random(3), CalcTask(), tool_examples=1.0, keep=1.0)
    fake = _Logits(len(ids), len(tok))
    _loss(fake, [(ids, flags)], tok.pad_token_id).backward()
    read = fake.table.grad[0].abs().sum(-1) > 0   # position t predicts token t + 1
    assert read[:-1].tolist() == flags[1:] and not read[-1]


def test_warmup_tools_saves_a_loadable_model_and_records_its_settings(tmp_path):
    out = tmp_path / "m"
    assert cli.main(["warmup", "--tools", "--out", str(out), "--steps", "2"]) == 0
    info = json.loads((out / "warmup.json").read_text())
    assert info["steps"] == 2 and info["tool_share"] == 1.0 and info["init"] is None
    assert info["task"] == {"name": "calc", "max_len": 6, "max_operand": 99}
    assert check_model_dir(str(out)) == []
    assert load_model(str(out), torch.device("cpu"), torch.float32).config.model_type == "qwen2"


def test_builtin_tools_loads_like_builtin():
    assert BUILTIN_ASSETS == {"builtin": "builtin-sum", "builtin-tools": "builtin-tools"}
    assert model_dir(BUILTIN_TOOLS) == builtin_dir(BUILTIN_TOOLS) != builtin_dir()
    assert check_model_dir(BUILTIN_TOOLS) == []
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "warmup.json"):
        assert (builtin_dir(BUILTIN_TOOLS) / name).is_file()
    model = load_model(BUILTIN_TOOLS, torch.device("cpu"), torch.float32)
    tok = load_tokenizer(BUILTIN_TOOLS)
    assert 5e5 < sum(p.numel() for p in model.parameters()) < 2e6
    text = "[23,58,91]=<calc>23+58+91</calc><result>172</result>>172"
    assert tok.decode(tok(text).input_ids) == text
    # spaces and newlines too (a tool's error message): both shipped models read text as built
    spaced = "<result>error: unknown tool 'foo'\nTry again.</result>"
    for name in BUILTIN_ASSETS:
        loaded = load_tokenizer(name)
        assert loaded(spaced).input_ids == build_char_tokenizer()(spaced).input_ids
        assert loaded.decode(loaded(spaced).input_ids) == spaced
    info = json.loads((builtin_dir(BUILTIN_TOOLS) / "warmup.json").read_text())
    assert info["task"]["name"] == "calc" and 0 < info["tool_share"] <= 1
