"""The one schema of rlpilot's configuration, and configs loaded, checked and written with it.

Every parameter is declared exactly once, as a dataclass field of a section (`sections`; the
schema and the `Config` of all sections are derived from them in `schema`): its type, default,
allowed range or choices, one line of help, and whether it may change while a run is going
("tunable", i.e. a knob). The CLI, the launch form, the live-tuning panel and the JSON
API all read this schema through `schema()`; nothing else lists parameters.

Configs are loaded from TOML (a preset shipped in `trainer/presets/` or a file) and then
overridden with dotted `section.key=value` pairs (`loading`). Anything wrong -- an unknown key, a
wrong type, a value out of range (`params`), a value's own syntax (`values`), a rule between keys
(`checks`) -- raises `ConfigError` whose `errors` maps each dotted key to a message that names the allowed values.
`text` holds the rules for text any config string (and the webapp's own text) must follow.

Everything is re-exported here: callers write `from trainer import config as config_mod` and
`config_mod.load(...)`.
"""
from trainer.config.checks import check, pilot_bounds
from trainer.config.loading import (
    PRESETS_PACKAGE,
    apply_knob_change,
    apply_overrides,
    from_dict,
    load,
    loads_toml,
    parse_override,
    preset_config,
    preset_dict,
    preset_names,
    preset_requires,
    to_toml,
)
from trainer.config.params import TYPE_NAMES, ConfigError, ParamSpec, param
from trainer.config.schema import SECTIONS, Config, knobs, param_spec, schema
from trainer.config.sections import (
    AUTOPILOT_RULES,
    TRACKERS,
    AlgoConfig,
    AprilConfig,
    AsyncConfig,
    ClusterConfig,
    DataConfig,
    GresoConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PilotConfig,
    RolloutConfig,
    RunConfig,
)
from trainer.config.text import MAX_TEXT_LEN, UNSTORABLE, short_repr, text_problem
from trainer.config.values import MAX_STOP_LEN, MAX_STOP_STRINGS, stop_strings

__all__ = [
    "AUTOPILOT_RULES", "MAX_STOP_LEN", "MAX_STOP_STRINGS", "MAX_TEXT_LEN", "PRESETS_PACKAGE",
    "SECTIONS", "TRACKERS", "UNSTORABLE", "TYPE_NAMES",
    "AlgoConfig", "AprilConfig", "AsyncConfig", "ClusterConfig", "Config", "ConfigError",
    "DataConfig", "GresoConfig", "LoraConfig", "ModelConfig", "OptimConfig", "ParamSpec", "PilotConfig",
    "RolloutConfig", "RunConfig",
    "apply_knob_change", "apply_overrides", "check", "from_dict", "knobs", "load", "loads_toml",
    "param", "param_spec", "parse_override", "pilot_bounds", "preset_config", "preset_dict",
    "preset_names", "preset_requires", "schema", "short_repr", "stop_strings", "text_problem",
    "to_toml",
]
