"""The schema, derived from the sections (trainer/config/sections.py): `SECTIONS` by their TOML
names, `Config` holding one of each, `schema()` every parameter as a `ParamSpec`, `param_spec(key)`
one of them, `knobs()` the tunable ones."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trainer.config.params import ConfigError, ParamSpec
from trainer.config.sections import (
    AlgoConfig,
    AprilConfig,
    AsyncConfig,
    ClusterConfig,
    CostConfig,
    DataConfig,
    EngineConfig,
    EpisodeConfig,
    GresoConfig,
    LoraConfig,
    MismatchConfig,
    ModelConfig,
    OptimConfig,
    PilotConfig,
    RolloutConfig,
    RunConfig,
    SandboxConfig,
)

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "episode": EpisodeConfig,
    "sandbox": SandboxConfig,
    "algo": AlgoConfig,
    "mismatch": MismatchConfig,
    "optim": OptimConfig,
    "lora": LoraConfig,
    "april": AprilConfig,
    "greso": GresoConfig,
    "async": AsyncConfig,
    "run": RunConfig,
    "cluster": ClusterConfig,
    "pilot": PilotConfig,
    "cost": CostConfig,
}

# `async` is a Python keyword: the section is [async] in TOML and dotted keys ("async.
# max_staleness"), and the attribute `Config.async_`.
_ATTR = {"async": "async_"}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    april: AprilConfig = field(default_factory=AprilConfig)
    greso: GresoConfig = field(default_factory=GresoConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    pilot: PilotConfig = field(default_factory=PilotConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(self.section(name)) for name in SECTIONS}

    def section(self, name: str):
        return getattr(self, _ATTR.get(name, name))

    def get(self, key: str):
        section, name = _split_key(key)
        return getattr(self.section(section), name)

    def set(self, key: str, value) -> None:
        """Set one validated value (raises ConfigError)."""
        spec = param_spec(key)
        section, name = _split_key(key)
        setattr(self.section(section), name, spec.coerce(value))

    def knob_values(self) -> dict[str, Any]:
        return {p.name: self.get(p.name) for p in schema() if p.tunable}

    def copy(self) -> "Config":
        return copy.deepcopy(self)


def _split_key(key: str) -> tuple[str, str]:
    if not isinstance(key, str) or key.count(".") != 1:
        raise ConfigError({str(key): "expected a key of the form section.name, e.g. optim.lr"})
    return tuple(key.split("."))  # type: ignore[return-value]


_SCHEMA: list[ParamSpec] | None = None


def schema() -> list[ParamSpec]:
    """Every parameter, in declaration order."""
    global _SCHEMA
    if _SCHEMA is None:
        specs = []
        for section, cls in SECTIONS.items():
            for f in dataclasses.fields(cls):
                m = f.metadata
                default = (tuple(f.default_factory()) if f.default is dataclasses.MISSING
                           else f.default)   # a list's default as a tuple: the spec is frozen
                specs.append(ParamSpec(name=f"{section}.{f.name}", type=_field_type(f),
                                       default=default, help=m["help"], min=m["min"], max=m["max"],
                                       choices=m["choices"], tunable=m["tunable"],
                                       prefixes=m.get("prefixes")))
        _SCHEMA = specs
    return _SCHEMA


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float,
                                                   "bool": bool, "list[str]": list}[f.type]
    return t


def param_spec(key: str) -> ParamSpec:
    section, name = _split_key(key)
    for p in schema():
        if p.name == key:
            return p
    if section not in SECTIONS:
        raise ConfigError({key: f"unknown section {section!r}; sections are "
                                + ", ".join(SECTIONS)})
    names = [p.name.split(".")[1] for p in schema() if p.name.startswith(section + ".")]
    raise ConfigError({key: f"unknown key {name!r} in [{section}]; known keys: " + ", ".join(names)})


def knobs() -> list[ParamSpec]:
    return [p for p in schema() if p.tunable]
