"""The run's engine with episodes: the environment, the turn format and the tool-call stops that
a config asks for, around the engine `trainer.engine.build_engine` makes (it calls `with_episodes`
when `episode.max_turns` > 1)."""
from __future__ import annotations

from trainer.episode.engine import Episodes
from trainer.episode.environments import Environment, parse_tools
from trainer.episode.interface import UserEnvironment, load_environment
from trainer.episode.tools import stop_strings
from trainer.episode.turns import TurnFormat
from trainer.tasks import task_spec
from trainer.tasks.prompts import PromptRenderer


def with_episodes(cfg, tokenizer, make_engine) -> Episodes:
    """The run's engine with episodes: `make_engine(tool_stops)` builds the inner engine, ending
    responses also at the closing tags of the offered tools' calls. `episode.environment` names
    your own environment class; else the built-in one (tools, feedback) answers."""
    e = cfg.episode
    fmt = TurnFormat.for_renderer(PromptRenderer.from_config(cfg, tokenizer))
    tools = parse_tools(e.tools)
    if e.environment.strip():   # your own (trainer/episode/interface.py); checked at launch
        env = UserEnvironment(load_environment(e.environment), e.environment.strip())
    else:
        env = Environment(syntax=fmt.syntax, feedback=e.feedback, timeout_s=e.tool_timeout_s,
                          output_chars=e.tool_output_chars,
                          verify=lambda kind, answer, text: task_spec(kind).score(answer, text))
    inner = make_engine(stop_strings(fmt.syntax, tools) if tools else [])
    return Episodes(inner, tokenizer, env, fmt, max_turns=e.max_turns, workers=e.tool_workers)
