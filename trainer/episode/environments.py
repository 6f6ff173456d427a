"""What answers a model's turn: the tools it called, or feedback on its answer.

`Environment.respond(turn, episode)` reads the text of the turn that just ended and returns a
`Reply`: a tool's result (or the error of a malformed call, a failed or timed-out tool), feedback
after a wrong final answer (`episode.feedback`), or `None`-role: the episode is over. It keeps no
state of its own: what it needs of the episode (the problem's answer and kind, the tools offered)
is in `episode`, the sample's `meta["episode"]`, so the same episode can be answered in any
process and after a checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainer.config.values import parse_tools
from trainer.episode.tools import ToolCallError, format_error, parse_call, run_tool
from trainer.episode.turns import FEEDBACK, TOOL

FEEDBACK_WRONG = "That answer is not right. Try again."


@dataclass(frozen=True)
class Reply:
    role: str | None        # TOOL, FEEDBACK, or None: the episode is over
    text: str = ""
    error: bool = False     # a malformed call, or a tool that failed
    seconds: float = 0.0    # the tool's wall time
    tool: str = ""          # the tool called ("" for none)
    state: Any = None       # the episode's state after this turn (your own environment's)
    failure: str = ""       # your environment failed: the episode ends with this error


DONE = Reply(None)


def offered_tools(cfg) -> tuple[str, ...] | None:
    """The tools a new episode is offered (`episode.tools`), or None: single-turn
    (`episode.max_turns` = 1)."""
    return parse_tools(cfg.episode.tools) if cfg.episode.multi_turn else None


class Environment:
    """Answers turns with `tools` (called in `syntax`) and, with `feedback`, tells a wrong final
    answer so (`verify(kind, answer, text)` -> score, the task's verifier)."""

    def __init__(self, *, syntax: str, feedback: bool, timeout_s: float, output_chars: int,
                 verify: Callable[[str, Any, str], float]):
        self.syntax, self.feedback = syntax, feedback
        self.timeout_s, self.output_chars = timeout_s, output_chars
        self.verify = verify

    # --- the environment interface (trainer/episode/interface.py) -------------------------------
    def start(self, problem) -> None:
        """Keeps no state of its own: the episode's answer, kind and tools are in `episode`."""
        return None

    def score(self, turn: str, episode: dict) -> None:
        """The task's verifier scores the episode (in the reward workers, with its time limit)."""
        return None

    def respond(self, turn: str, episode: dict) -> Reply:
        """Never raises: whatever the model's text does to parsing or to a tool is a tool error
        in its own episode (the step and the other episodes go on)."""
        tools = tuple(episode.get("tools", ()))
        if tools:
            try:
                call = parse_call(turn, self.syntax, tools)
                if call is not None:
                    r = run_tool(call, timeout_s=self.timeout_s, max_output_chars=self.output_chars)
                    return Reply(TOOL, r.text, error=r.error, seconds=r.seconds, tool=call.name)
            except ToolCallError as e:
                return Reply(TOOL, format_error(e), error=True)
            except Exception as e:  # noqa: BLE001 -- the model's text must not stop the run
                return Reply(TOOL, format_error(f"the call could not be handled ({type(e).__name__})"),
                             error=True)
        if self.feedback and self.verify(episode["kind"], episode["answer"], turn) < 1.0:
            return Reply(FEEDBACK, FEEDBACK_WRONG)
        return DONE

    def calls_tool(self, turn: str, episode: dict) -> bool:
        """Does `turn` call one of the episode's tools (a malformed call counts)?"""
        tools = tuple(episode.get("tools", ()))
        if not tools:
            return False
        try:
            return parse_call(turn, self.syntax, tools) is not None
        except Exception:  # noqa: BLE001 -- a malformed call (ToolCallError, or worse) is a call
            return True
