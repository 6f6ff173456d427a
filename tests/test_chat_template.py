"""Real models, the fast part: prompts rendered with chat templates and system prompts (string and
message prompts, tokenizers with and without a template), stop tokens from generation configs,
`rollout.stop` strings, a tokenizer without a pad token, and check_model_dir's messages."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from trainer import config as C
from trainer.algo.learner import Learner, TrainSequence
from trainer.cli import main as cli
from trainer.engine.base import LENGTH, STOP, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.engine.stops import StopStrings
from trainer.models.loading import (
    BUILTIN,
    build_char_tokenizer,
    builtin_dir,
    check_model_dir,
    load_model,
    load_tokenizer,
    require_model_dir,
    stop_token_ids,
)
from trainer.tasks import build_task
from trainer.tasks.jsonl import JsonlTask
from trainer.tasks.prompts import PromptRenderer, messages_problem

# a ChatML-like template, enough to see where each part goes
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer(template: str | None = CHATML):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- rendering ------------------------------------------------------------------------------------

def test_a_string_prompt_without_a_chat_template_is_the_plain_template():
    r = PromptRenderer(chat_tokenizer(None), template="Q: {prompt}\nA:")
    assert not r.uses_chat
    assert r.render("1+1?") == "Q: 1+1?\nA:"
    sys = PromptRenderer(chat_tokenizer(None), template="Q: {prompt}", system_prompt="Be brief.")
    assert sys.render("1+1?") == "Be brief.\n\nQ: 1+1?"
    assert PromptRenderer().render("{x} {prompt}") == "{x} {prompt}"  # braces in problems are safe


def test_a_string_prompt_goes_into_the_user_turn_of_the_chat_template():
    r = PromptRenderer(chat_tokenizer(), template="{prompt} Box it.", system_prompt="You add.")
    assert r.uses_chat
    assert r.render("1+1?") == "<|system|>You add.\n<|user|>1+1? Box it.\n<|assistant|>"
    assert PromptRenderer(chat_tokenizer()).render("hi") == "<|user|>hi\n<|assistant|>"


def test_chat_template_none_renders_plain_text_even_when_the_tokenizer_has_one():
    r = PromptRenderer(chat_tokenizer(), template="Q: {prompt}", chat_template="none")
    assert not r.uses_chat and r.render("1+1?") == "Q: 1+1?"
    with pytest.raises(ValueError, match="data.chat_template"):
        PromptRenderer(chat_tokenizer(), chat_template="sometimes")


def test_messages_prompt_with_and_without_a_chat_template():
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?", "name": "ignored"}]
    chat = PromptRenderer(chat_tokenizer(), template="{prompt}!", system_prompt="Sys.")
    assert chat.render(msgs) == ("<|system|>Sys.\n<|user|>2+2?\n<|assistant|>4\n<|user|>3+3?!\n"
                                 "<|assistant|>")
    own_system = [{"role": "system", "content": "Mine."}] + msgs
    assert chat.render(own_system).startswith("<|system|>Mine.\n<|user|>")  # the row's wins
    plain = PromptRenderer(None, template="{prompt}!", system_prompt="Sys.")
    assert plain.render(msgs) == ("System: Sys.\n\nUser: 2+2?\n\nAssistant: 4\n\nUser: 3+3?!"
                                  "\n\nAssistant:")


def test_a_bos_the_template_writes_is_not_doubled_by_the_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "hi": 2, "[INST]": 3, "[/INST]": 4, "<unk>": 5}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    text = PromptRenderer(tok).render("hi")
    assert text == "[INST] hi [/INST]"
    assert tok(text).input_ids == [0, 3, 2, 4]  # exactly one BOS


@pytest.mark.parametrize("bad, says", [
    ([], "empty"),
    ("hi", "expected a list"),
    ([{"role": "bot", "content": "x"}], "'role' must be one of"),
    ([{"role": "user", "content": 5}], "'content' must be a string, got int"),
    ([{"role": "user", "content": "  "}], "'content' is empty"),
    ([{"role": "user"}], "'content' must be a string, got NoneType"),
    (["hi"], "expected an object"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "may only come first"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message"),
])
def test_bad_messages_are_refused_with_what_is_wrong(bad, says):
    assert says in messages_problem(bad)


# --- JSONL rows, tasks and the config keys ---------------------------------------------------------------

def test_jsonl_rows_may_hold_messages_and_problems_hold_the_rendered_prompt(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"prompt": "1+1?", "answer": "2"},
        {"prompt": [{"role": "system", "content": "S."}, {"role": "user", "content": "2+2?"}],
         "answer": "4"}])
    task = JsonlTask(path, kind="math", renderer=PromptRenderer(chat_tokenizer(), template="{prompt} Box."))
    assert task.problem(0).prompt == "<|user|>1+1? Box.\n<|assistant|>"
    assert task.problem(1).prompt == "<|system|>S.\n<|user|>2+2? Box.\n<|assistant|>"
    assert JsonlTask(path, kind="math").problem(1).prompt == "System: S.\n\nUser: 2+2?\n\nAssistant:"


def test_bad_message_rows_name_the_line_and_the_field(tmp_path):
    rows = [{"prompt": "ok", "answer": "1"},
            {"prompt": [{"role": "robot", "content": "x"}], "answer": "1"},
            {"prompt": [{"role": "user", "content": ["x"]}], "answer": "1"},
            {"prompt": 7, "answer": "1"}]
    with pytest.raises(C.ConfigError) as e:
        JsonlTask(write_jsonl(tmp_path / "bad.jsonl", rows), kind="math")
    msg = e.value.errors["data.path"]
    assert "line 2: 'prompt': message 0: 'role' must be one of 'system', 'user', 'assistant', got 'robot'" in msg
    assert "line 3: 'prompt': message 0: 'content' must be a string, got list" in msg
    assert "line 4: 'prompt' must be a string or a list of messages, got a number" in msg


def test_a_chat_template_that_fails_on_the_data_is_a_launch_error(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"prompt": [{"role": "system", "content": "S."}, {"role": "user", "content": "q"}], "answer": "1"}])
    tok = chat_tokenizer("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
                         "{% endif %}{{ messages[0]['content'] }}")
    with pytest.raises(C.ConfigError) as e:
        JsonlTask(path, kind="math", renderer=PromptRenderer(tok))
    assert "no system role" in e.value.errors["data.chat_template"]


def test_the_config_keys_are_declared_and_validated():
    cfg = C.Config()
    assert (cfg.data.chat_template, cfg.data.system_prompt, cfg.rollout.stop) == ("auto", "", "")
    for key in ("data.chat_template", "data.system_prompt", "rollout.stop"):
        assert C.param_spec(key).help
    with pytest.raises(C.ConfigError) as e:
        C.load("demo", ["data.chat_template=always"])
    assert "one of 'auto', 'none'" in e.value.errors["data.chat_template"]
    for bad, says in (("'</a>'", "not valid JSON"), ("'[1]'", "JSON list of strings"),
                      ("'[\"\"]'", "empty"), ("'[\"" + "x" * 300 + "\"]'", "too long"),
                      ("'[\"</a>\", \"\\u0000\"]'", "stop string 2: contains a NUL character"),
                      ("'[\"a\\ud800\"]'", "lone UTF-16 surrogate (U+D800)")):
        with pytest.raises(C.ConfigError) as e:
            C.load("demo", [f"rollout.stop={bad}"])
        assert says in e.value.errors["rollout.stop"], bad
    cfg = C.apply_overrides(C.load("demo"), {"rollout.stop": json.dumps(["</a>", "\n\nUser:"]),
                                             "data.system_prompt": "Be brief."})
    assert C.stop_strings(cfg.rollout.stop) == ["</a>", "\n\nUser:"]
    assert C.loads_toml(C.to_toml(cfg)) == cfg


def test_build_task_renders_for_the_tokenizer_and_the_arith_task():
    cfg = C.load("demo", ["data.task=arith", "data.prompt_template={prompt} Box it.",
                          "data.system_prompt=Sys."])
    task = build_task(cfg, chat_tokenizer())
    p = task.problem(0)
    assert p.kind == "math" and p.prompt.startswith("<|system|>Sys.\n<|user|>") and p.prompt.endswith(
        " Box it.\n<|assistant|>")
    assert int(p.answer) >= 0 and task.problem(0) == p and task.eval_problems(2)[0].id.startswith("arith:")
    with pytest.raises(C.ConfigError):
        C.load("demo", ["data.task=arith", "data.path=/x.jsonl"])
    # the list task with the built-in tokenizer (no template) is unchanged
    sum_task = build_task(C.load("demo"), load_tokenizer(BUILTIN))
    assert sum_task.problem(0).prompt.startswith("[") and sum_task.problem(0).prompt.endswith("]=")


# --- stop tokens and stop strings ------------------------------------------------------------------------

class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_stop_ids_are_every_eos_of_the_generation_config_and_the_tokenizer():
    model = _Cfg(generation_config=_Cfg(eos_token_id=[7, 9]), config=_Cfg(eos_token_id=9, vocab_size=100))
    assert stop_token_ids(model, _Cfg(eos_token_id=3)) == [3, 7, 9]
    model = _Cfg(generation_config=_Cfg(eos_token_id=None), config=_Cfg(eos_token_id=[5, 500], vocab_size=100))
    assert stop_token_ids(model, _Cfg(eos_token_id=None)) == [5]  # out of the vocabulary: dropped
    with pytest.raises(ValueError, match="eos"):
        stop_token_ids(_Cfg(generation_config=None, config=_Cfg(vocab_size=10)), _Cfg(eos_token_id=None))


def test_the_engine_stops_at_every_id_of_a_generation_config_list():
    tok = load_tokenizer(BUILTIN)
    model = load_model(BUILTIN, torch.device("cpu"), torch.float32).eval()
    prompt = tok("[3,5,1]=").input_ids
    full = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_seq_len=64).generate(
        [Sample(list(prompt), SamplingParams(temperature=0, max_new_tokens=40))])[0]
    first = full.response_ids[2]
    model.generation_config.eos_token_id = [tok.eos_token_id, first]
    ids = stop_token_ids(model, tok)
    assert ids == sorted({tok.eos_token_id, first})
    s = EmbeddedEngine(model, eos_token_ids=ids, max_seq_len=64).generate(
        [Sample(list(prompt), SamplingParams(temperature=0, max_new_tokens=40))])[0]
    stop_at = full.response_ids.index(first) + 1
    assert s.finish_reason == STOP and s.response_ids == full.response_ids[:stop_at]


def _greedy(engine, tok, text, n=40):
    return engine.generate([Sample(tok(text).input_ids, SamplingParams(temperature=0, max_new_tokens=n))])[0]


def test_stop_strings_end_a_response_at_the_token_that_completes_them():
    tok = load_tokenizer(BUILTIN)
    model = load_model(BUILTIN, torch.device("cpu"), torch.float32).eval()
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_seq_len=96)
    full = _greedy(eng, tok, "[3,5,1,2]=")
    text = tok.decode(full.response_ids)
    assert text.count(";") >= 2, text
    stopped = _greedy(StopStrings(eng, tok, [";"]), tok, "[3,5,1,2]=")
    k = text.index(";") + 1  # one character per token: the cut is after the first ';'
    assert stopped.finish_reason == STOP and tok.decode(stopped.response_ids) == text[:k]
    assert stopped.logprobs == full.logprobs[:k] and len(stopped.versions) == k
    # a two-token stop string spanning tokens, and one that never appears
    stop = text[2:5]
    two = _greedy(StopStrings(eng, tok, [stop, "zz"]), tok, "[3,5,1,2]=")
    assert tok.decode(two.response_ids) == text[:text.find(stop) + 3]
    never = _greedy(StopStrings(eng, tok, ["zz"]), tok, "[3,5,1,2]=")
    assert never.response_ids == full.response_ids and never.finish_reason == full.finish_reason


class _LateEngine:
    """An engine that hands tokens over only when a sample leaves it (like the process and
    SGLang engines): every sample gets `tokens` at once."""

    def __init__(self, tokens):
        self.tokens, self.queue, self.version = tokens, [], 0

    def submit(self, samples):
        self.queue.extend(samples)

    @property
    def num_pending(self):
        return len(self.queue)

    def step(self):
        out, self.queue = self.queue, []
        for s in out:
            s.response_ids += self.tokens
            s.logprobs += [-0.5] * len(self.tokens)
            s.versions += [self.version] * len(self.tokens)
            s.finish_reason = LENGTH
        return out

    def abort(self, ids=None, keep_cache=False):
        return []


def test_stop_strings_cut_a_late_engines_sample_and_drop_what_came_after():
    tok = build_char_tokenizer()
    late = StopStrings(_LateEngine(tok("abc</a>tail").input_ids), tok, ["</a>"])
    s = late.generate([Sample(tok("q").input_ids, SamplingParams(max_new_tokens=32))])[0]
    assert tok.decode(s.response_ids) == "abc</a>" and s.finish_reason == STOP
    assert len(s.logprobs) == len(s.versions) == len(s.response_ids)
    late.version = 3
    assert late.inner.version == 3 and late.num_pending == 0


def test_build_engine_uses_the_stop_ids_and_wraps_for_stop_strings():
    from trainer.run.engines import build_engine

    tok = load_tokenizer(BUILTIN)
    model = load_model(BUILTIN, torch.device("cpu"), torch.float32).eval()
    model.generation_config.eos_token_id = [tok.eos_token_id, 5]
    plain = build_engine(C.load("demo"), model, tok, torch.device("cpu"), torch.float32, 64)
    assert isinstance(plain, EmbeddedEngine) and plain.eos.tolist() == sorted({tok.eos_token_id, 5})
    wrapped = build_engine(C.load("demo", ["rollout.stop='[\";\"]'"]), model, tok, torch.device("cpu"),
                           torch.float32, 64)
    assert isinstance(wrapped, StopStrings) and isinstance(wrapped.inner, EmbeddedEngine)
    assert wrapped.stats is wrapped.inner.stats


# --- a tokenizer without a pad token ----------------------------------------------------------------------

def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_trains_the_final_eos(tmp_path):
    d = tmp_path / "nopad"
    shutil.copytree(builtin_dir(), d)
    cfg_file = d / "tokenizer_config.json"
    conf = json.loads(cfg_file.read_text())
    conf.pop("pad_token", None)
    cfg_file.write_text(json.dumps(conf))
    tok = load_tokenizer(str(d))
    assert tok.pad_token_id == tok.eos_token_id
    model = load_model(str(d), torch.device("cpu"), torch.float32).eval()
    eos = tok.eos_token_id
    long_seq = TrainSequence(tok("[1,2]=").input_ids, tok("1+2=3;>3").input_ids + [eos], [0.0] * 9, 1.0, 1.0)
    short = TrainSequence(tok("[4]=").input_ids, tok(">4").input_ids + [eos], [0.0] * 3, 1.0, 1.0)
    learner = Learner(model, lr=0.0, weight_decay=0.0, track_reference=False)
    batched = learner.logprobs([long_seq, short], tok.pad_token_id, max_tokens=4096)
    alone = learner.logprobs([short], tok.pad_token_id, max_tokens=4096)
    # padding with the eos id masks nothing: the short sequence's own final eos keeps its logprob
    assert batched[1] == pytest.approx(alone[0], abs=1e-5) and batched[1][-1] < 0


# --- check_model_dir -------------------------------------------------------------------------------------

def test_check_model_dir_accepts_the_builtin_and_a_saved_model(tmp_path):
    assert check_model_dir(BUILTIN) == []
    shutil.copytree(builtin_dir(), tmp_path / "m")
    assert check_model_dir(str(tmp_path / "m")) == []


def test_check_model_dir_says_what_is_wrong(tmp_path):
    missing = check_model_dir(str(tmp_path / "nope"))
    assert len(missing) == 1 and "no model directory at" in missing[0] and "never from a hub" in missing[0]
    known = check_model_dir(str(tmp_path / "smollm2-135m-instruct"))[0]
    assert f"python -m trainer import-gguf smollm2 {tmp_path / 'smollm2-135m-instruct'}" in known
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in check_model_dir(str(tmp_path / "empty"))[0]

    gpt = tmp_path / "gpt2"
    shutil.copytree(builtin_dir(), gpt)
    conf = json.loads((gpt / "config.json").read_text())
    conf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (gpt / "config.json").write_text(json.dumps(conf))
    [arch] = check_model_dir(str(gpt))
    assert "GPT2LMHeadModel (model_type 'gpt2') is not supported by the embedded engine" in arch
    assert "LlamaForCausalLM (llama), MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2)" in arch
    assert check_model_dir(str(gpt), engine="sglang") == []  # SGLang serves other architectures

    broken = tmp_path / "broken"
    shutil.copytree(builtin_dir(), broken)
    (broken / "tokenizer.json").write_text("{not json")
    for f in broken.glob("*.safetensors"):
        f.unlink()
    problems = check_model_dir(str(broken))
    assert any("has no weights" in p for p in problems)
    assert any(p.startswith("its tokenizer does not load") for p in problems), problems

    with pytest.raises(C.ConfigError) as e:
        require_model_dir(str(gpt))
    assert "not supported" in e.value.errors["model.path"]


def test_the_cli_refuses_a_bad_model_path_before_making_a_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["run", "demo", "--set", f"model.path={tmp_path / 'smollm2-135m-instruct'}",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "error: model.path: no model directory at" in err and "import-gguf smollm2" in err
    assert not out.exists()


def test_opt_in_presets_say_what_they_need():
    assert C.preset_requires("demo") is None
    assert "var/models/smollm2-135m-instruct" in C.preset_requires("smollm2-math")
    cfg = C.load("smollm2-math")
    assert (cfg.data.task, cfg.data.chat_template) == ("arith", "auto")
    assert "\\boxed{}" in cfg.data.prompt_template


def test_a_presets_relative_model_path_is_read_inside_the_var_dir_of_whoever_runs_it(tmp_path, monkeypatch):
    """One rule for the CLI and the web (config.preset_config): var/ is RLPILOT_VAR_DIR, default
    <project>/var; the CLI's project is the folder it runs in."""
    monkeypatch.delenv("RLPILOT_VAR_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert C.load("smollm2-math").model.path == str(tmp_path / "var/models/smollm2-135m-instruct")
    monkeypatch.setenv("RLPILOT_VAR_DIR", str(tmp_path / "elsewhere"))
    assert C.load("smollm2-math").model.path == str(tmp_path / "elsewhere/models/smollm2-135m-instruct")
    web = C.preset_config("smollm2-math", project_dir="/srv/rlpilot", var_dir="/data/rlp")
    assert web.model.path == "/data/rlp/models/smollm2-135m-instruct"
    assert C.load("smollm2-math", ["model.path=rel/dir"]).model.path == "rel/dir"  # an override is as given
    assert C.load("demo").model.path == "builtin"
