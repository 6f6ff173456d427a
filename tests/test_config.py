"""The one schema: loading, overrides, validation messages, presets."""
import pytest

from trainer import config as C


def test_every_param_declares_type_default_and_help():
    names = set()
    for p in C.schema():
        assert p.help and p.type in (bool, int, float, str, list)
        default = list(p.default) if p.type is list else p.default   # a list's spec holds a tuple
        assert p.coerce(p.default) == default, p.name  # defaults are valid
        names.add(p.name)
    assert {"optim.lr", "optim.grad_clip", "algo.kl_coef", "rollout.temperature",
            "algo.overlong_penalty"} <= {p.name for p in C.knobs()}
    assert "model.path" in names and "model.path" not in {p.name for p in C.knobs()}


def test_override_types_are_coerced_from_cli_strings():
    cfg = C.apply_overrides(C.Config(), ["optim.lr=3e-5", "run.max_steps=7",
                                         "algo.overlong_penalty=true", "model.path=/tmp/m"])
    assert cfg.optim.lr == 3e-5 and cfg.run.max_steps == 7
    assert cfg.algo.overlong_penalty is True and cfg.model.path == "/tmp/m"


@pytest.mark.parametrize("override, key, fragment", [
    ("optim.lr=5", "optim.lr", "[0.0, 1.0]"),
    ("optim.lrr=1", "optim.lrr", "known keys: lr,"),
    ("nope.x=1", "nope.x", "sections are model, data"),
    ("run.max_steps=2.5", "run.max_steps", "an integer"),
    ("model.device=tpu", "model.device", "one of 'auto', 'cpu', 'cuda'"),
    ("algo.overlong_penalty=maybe", "algo.overlong_penalty", "true or false"),
    ("rollout.temperature=nan", "rollout.temperature", "a number"),
    ("run.report_to=comet", "run.report_to", "unknown name 'comet'; expected a list of distinct names"),
])
def test_bad_values_name_the_key_and_the_allowed_values(override, key, fragment):
    with pytest.raises(C.ConfigError) as e:
        C.apply_overrides(C.Config(), [override])
    assert key in e.value.errors
    assert fragment in e.value.errors[key]


def test_all_errors_are_reported_together():
    with pytest.raises(C.ConfigError) as e:
        C.apply_overrides(C.Config(), {"optim.lr": -1, "run.seed": "x"})
    assert set(e.value.errors) == {"optim.lr", "run.seed"}


def test_cross_field_rules():
    with pytest.raises(C.ConfigError) as e:
        C.apply_overrides(C.Config(), ["data.task=math"])
    assert "data.path" in e.value.errors


def test_presets_load_and_toml_round_trips():
    assert "demo" in C.preset_names()
    cfg = C.load("demo", ["optim.lr=2e-5"])
    again = C.loads_toml(C.to_toml(cfg))
    assert again == cfg and again.optim.lr == 2e-5


def test_every_shipped_preset_loads():
    names = C.preset_names()
    assert {"demo", "april", "greso", "async", "all"} <= set(names)
    for name in names:
        C.load(name)  # raises ConfigError on a bad or duplicated key


def test_unknown_preset_and_bad_toml():
    with pytest.raises(C.ConfigError) as e:
        C.load("nosuch")
    assert "demo" in e.value.errors["config"]
    with pytest.raises(C.ConfigError) as e:
        C.loads_toml("[optim\nlr = ")
    assert "not valid TOML" in e.value.errors["toml"]
    with pytest.raises(C.ConfigError) as e:
        C.loads_toml("[optim]\nlr = 'fast'")
    assert "optim.lr" in e.value.errors


def test_schema_json_shape_for_the_web_and_api():
    row = next(p.as_json() for p in C.schema() if p.name == "optim.lr")
    assert row == {"name": "optim.lr", "type": "float", "default": 1e-4, "min": 0.0, "max": 1.0,
                   "choices": None, "help": row["help"], "tunable": True}


def test_strings_round_trip_through_toml_exactly():
    # generated strings: every control character, quotes, backslashes, TOML syntax, non-ASCII
    import random

    rng = random.Random(11)
    alphabet = ([chr(i) for i in range(1, 32)] + ["\x7f", '"', "\\", "'", "=", "[", "]", "#",
                "{", "}", "\u00e9", "\u4e2d", "\U0001F600", "\u2028", " ", "a", "Z", "0"])
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cfg = C.load("demo", {"data.prompt_template": text + "{prompt}", "data.eval_path": text})
        again = C.loads_toml(C.to_toml(cfg))
        assert again.data.prompt_template == text + "{prompt}"
        assert again.data.eval_path == text
        assert again.to_dict() == cfg.to_dict()


def test_a_newline_in_a_prompt_template_survives_the_run_config():
    cfg = C.load("demo", {"data.prompt_template": "Question: {prompt}\nAnswer:"})
    assert C.loads_toml(C.to_toml(cfg)).data.prompt_template == "Question: {prompt}\nAnswer:"


@pytest.mark.parametrize("bad, what", [("a\ud800b", "lone UTF-16 surrogate (U+D800) at character 1"),
                                       ("x\x00", "NUL character at character 1")])
def test_strings_the_database_cannot_hold_are_refused_by_name(bad, what):
    with pytest.raises(C.ConfigError) as e:
        C.load("demo", {"model.path": bad})
    assert what in e.value.errors["model.path"]


def test_a_huge_integer_for_a_float_key_is_a_config_error():
    with pytest.raises(C.ConfigError) as e:
        C.load("demo", {"optim.lr": 10 ** 400})
    msg = e.value.errors["optim.lr"]
    assert "expected a number" in msg and len(msg) < 200  # the value is shortened, not echoed


def test_deeply_nested_toml_is_a_config_error():
    with pytest.raises(C.ConfigError) as e:
        C.loads_toml("a = " + "[" * 5000 + "]" * 5000)
    assert "nested too deeply" in e.value.errors["toml"]


def test_max_turns_is_read_in_one_place():
    """`episode.multi_turn` is the one reading of max_turns: 1 is single-turn, more has an
    environment; the checks and the knob rule ask it."""
    assert not C.Config().episode.multi_turn
    multi = C.apply_overrides(C.Config(), ["episode.max_turns=2"])
    assert multi.episode.multi_turn
    with pytest.raises(C.ConfigError) as e:
        C.apply_overrides(C.Config(), ["episode.feedback=true"])
    assert "episode.max_turns > 1" in e.value.errors["episode.feedback"]
    with pytest.raises(C.ConfigError) as e:
        C.apply_knob_change(C.Config(), {"episode.max_turns": 3})
    assert "launched single-turn" in e.value.errors["episode.max_turns"]
    new, _ = C.apply_knob_change(multi, {"episode.max_turns": 3})
    assert new.episode.max_turns == 3


def test_value_parsers_are_parameter_types_of_the_schema():
    """config/ checks a value's own syntax with its parameter type (config/values.py), the same
    parser the package acting on it reads it with."""
    from trainer.config import values
    from trainer.engine.sglang import urls
    from trainer.episode import environments, tools
    from trainer.rollout import staleness_schedule

    assert urls.parse_urls is values.parse_urls and environments.parse_tools is values.parse_tools
    assert staleness_schedule.parse is values.parse_schedule and tools.TOOLS is values.TOOLS
    for key, bad, says in (("rollout.sglang_urls", "ftp://x", "not an http(s) server URL"),
                           ("episode.tools", "calculator,shell", "unknown tool 'shell'"),
                           ("async.staleness_schedule", "5:1, 3:2", "steps must increase")):
        with pytest.raises(C.ConfigError) as e:
            C.apply_overrides(C.Config(), [f"{key}={bad}", "async.enabled=true"])
        assert says in e.value.errors[key], e.value.errors
