"""Multi-turn runs that are single-turn in fact: no silent fallback.

A run configured for episodes of several turns (`episode.max_turns` > 1) whose scored episodes
all had one model turn (`episode/turns/max` = 1) for `single_turn_steps` steps in a row trains
single-turn without saying so: the environment never answered a turn. The advice names why, where
the metrics and the config tell it:

  - every episode spent its token budget in its first turn (`rollout/truncated_ratio` = 1);
  - your own environment (`episode.environment`) failed every episode, or returned done() after
    every first turn;
  - no tools are offered and feedback is off: nothing can answer a turn;
  - the model never called a tool (`episode/tool_use_rate` = 0) and feedback is off, so the
    environment ends every episode at its first answer;
  - with feedback on, every first answer was right (`reward/accuracy` = 1).

The runner also writes it as a `single_turn_episodes` event, and the dashboard raises the
`single_turn` alert on that event (cleared by a step with a longer episode).
"""
from __future__ import annotations

from trainer.pilot.advice import Advice, derived, figure, note_advice
from trainer.pilot.thresholds import Thresholds
from trainer.pilot.window import Window

REASON = "single_turn_fallback"
EVENT = "single_turn_episodes"


def single_turn_streak(w: Window) -> int:
    """Steps in a row, up to the last one with episodes, whose episodes all had one model turn."""
    n = 0
    for _, turns in reversed(w.series("episode/turns/max")):
        if turns > 1:
            break
        n += 1
    return n


def why_single_turn(w: Window, cfg, steps: int) -> str:
    """The reason the metrics and the config give for the last `steps` single-turn steps."""
    recent = Window(w.rows[-steps:])
    e = cfg.episode

    def every(name: str, test) -> bool:
        share = recent.share(name, test)
        return share is not None and share == 1.0

    tools = [t.strip() for t in (e.tools or "").split(",") if t.strip()]
    if every("rollout/truncated_ratio", lambda v: v >= 1.0):
        return ("every episode spent its token budget in its first turn: raise "
                "rollout.max_response_len (it bounds the whole episode)")
    if e.environment.strip():
        if every("episode/env_errors", lambda v: v > 0):
            return (f"your environment ({e.environment}) failed episodes in every step: see the "
                    "episodes' errors in the inspector")
        return (f"your environment ({e.environment}) returned done() after every first turn")
    if not tools and not e.feedback:
        return ("no tools are offered (episode.tools is empty) and feedback is off: nothing "
                "answers a turn")
    if every("episode/tool_use_rate", lambda v: v == 0):
        why = f"the model never called a tool ({', '.join(tools)})"
        if not e.feedback:
            return why + " and feedback is off, so every episode ended at its first answer"
        if every("reward/accuracy", lambda v: v >= 1.0):
            return why + ", and every first answer was right (no feedback was due)"
        return why
    return "the environment ended every episode after its first turn"


def single_turn_fallback(w: Window, cfg, th: Thresholds) -> Advice | None:
    """`single_turn_steps` steps in a row of one-turn episodes in a multi-turn run (the module
    docstring): a note naming the reason."""
    if cfg.episode.max_turns < 2:
        return None
    steps = single_turn_streak(w)
    if steps < th.single_turn_steps:
        return None
    reason = why_single_turn(w, cfg, steps)
    evidence = [figure(w, "episode/turns/max", "last"),
                derived("episode/turns/max", "steps in a row at 1", steps, w, "episode/turns/max"),
                figure(w, "episode/tool_use_rate", "mean")]
    return note_advice("episodes", REASON,
                       message=f"episode.max_turns is {cfg.episode.max_turns}, but every episode "
                       f"of the last {steps} steps had a single model turn: {reason}",
                       expected="episodes of more than one turn (episode/turns/max above 1)",
                       confidence="high", evidence=evidence)


RULES = (single_turn_fallback,)
