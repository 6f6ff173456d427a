"""`Episodes`: any rollout engine, extended turn by turn into multi-turn episodes.

A sample whose `meta["episode"]` is set is an episode. When its model turn ends (the engine
finishes it with "stop": an end-of-turn token, or the closing tag of a tool call, a stop string),
the wrapper asks the environment for the next message, on a worker thread so that the next decode
step runs meanwhile (the answers are taken at the end of that step, in the order the tools were
called: a run does not depend on the tools' timing, and resumes exactly), appends it as
environment tokens (version ENV_VERSION, log-probability 0) and submits the sample again: the
next model turn is generated after it. The sample leaves the wrapper, as any response leaves an
engine, when its episode is over:

- the environment has nothing to add (a final answer, right or, with feedback, out of turns);
- `episode.max_turns` model turns were generated (the last turn's tool call is not run);
- the token budget (`SamplingParams.max_new_tokens`, model and environment tokens together) is
  spent, mid-turn (the engine's "length") or by the environment's message ("length": the message
  cut after a whole word and marked "...", or left out when not even its wrapper fits; never cut
  inside its wrapper).

An episode also leaves part-way, as any partial response does, and is resumed later from where it
stopped: at its segment limit (APRIL: the tokens generated since its submission, over turns, are
bounded as for one response) or aborted (APRIL's early termination, an asynchronous weight
update). Aborted while its tool runs, it waits for the tool and leaves between turns with the
result appended, so the next submission starts the next model turn.

The engine keeps an episode's KV cache while its environment answers (the embedded engine parks
it, trainer/engine/parking.py): the next turn prefills only the environment's tokens, and the cache
is given up when the episode is over (`drop_cache`).

Per episode, `meta["episode"]` counts turns, tool calls, tool errors, tool seconds and feedback
messages (plain data: it is checkpointed with the sample). `on_tool(start, end)` hears each tool
call's wall-clock span (the timeline's "tool" phase).
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from trainer.engine.base import ABORT, ENV_VERSION, LENGTH, SEGMENT, STOP, EngineWrapper, Sample
from trainer.episode.environments import Environment, Reply
from trainer.episode.interface import EnvironmentProblem, Problem
from trainer.episode.tools import format_error
from trainer.observe import clock

# why an episode ended (meta["episode"]["end"]); "error": its environment failed (["error"] says how)
END_ANSWER, END_MAX_TURNS, END_BUDGET, END_ERROR = "answer", "max_turns", "budget", "error"


def new_episode(problem, tools: tuple[str, ...]) -> dict:
    """The plain-data state of a new episode for `problem` (a Problem; its own tools, a JSONL
    row's, replace `tools`): what its environment needs and what it has done so far."""
    own = getattr(problem, "tools", None)
    tools = tools if own is None else own
    return {"id": problem.id, "kind": problem.kind, "answer": problem.answer, "tools": list(tools),
            "turns": 1,
            "tool_calls": 0, "tool_errors": 0, "tool_s": 0.0, "feedback": 0, "end": ""}


def final_turn(sample: Sample) -> list[int]:
    """The token ids of the sample's last model turn (the whole response for a single turn):
    what the verifier scores, so a tool's output in the conversation is never read as the
    model's answer."""
    return sample.response_ids[sample.turn_start:]


class Episodes(EngineWrapper):
    """`engine` with episodes (see the module docstring). `environment` answers turns; `fmt`
    (trainer/episode/turns.py) writes its messages; `max_turns` is per episode."""

    def __init__(self, engine, tokenizer, environment: Environment, fmt, *, max_turns: int,
                 workers: int = 2, on_tool: Callable[[float, float], None] | None = None):
        self.inner, self.tokenizer = engine, tokenizer
        self.environment, self.fmt = environment, fmt
        self.max_turns = int(max_turns)
        self.on_tool = on_tool
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(workers)),
                                       thread_name_prefix="rlpilot-tool")
        self.in_tool: dict[int, tuple[Sample, Future]] = {}   # request id -> (sample, reply)
        # request id -> (model tokens at its submission, its segment limit then): a segment runs
        # over turns, as one response's would
        self.segment: dict[int, tuple[int, int | None]] = {}
        self.failed: list[Sample] = []   # episodes whose environment's start failed: over

    @property
    def num_pending(self) -> int:
        return self.inner.num_pending + len(self.in_tool) + len(self.failed)

    def set_limits(self, *, max_turns: int, timeout_s: float, output_chars: int,
                   feedback: bool) -> None:
        """New knob values (`episode.*`), for the turns that end from now on."""
        self.max_turns = int(max_turns)
        env = self.environment
        env.timeout_s, env.output_chars, env.feedback = timeout_s, output_chars, feedback

    # --- the engine interface ----------------------------------------------------------------------
    def submit(self, samples: Iterable[Sample]) -> None:
        samples = [s for s in samples if self._started(s)]
        for s in samples:
            self.segment[s.request_id] = (s.model_tokens, s.params.segment_max_tokens)
        self.inner.submit(samples)

    def step(self) -> list[Sample]:
        due = list(self.in_tool)   # tools called before this step: they run while it decodes
        out, self.failed = self.failed, []
        out += [s for s in self.inner.step() if not self._turn_ended(s)]
        if not due and not self.inner.num_pending and not out:
            due = list(self.in_tool)   # nothing else to do: wait for the tools called just now
        out.extend(self._replies(due))
        for s in out:
            self._leave(s)
        over = [s.request_id for s in out if s.episode is not None and s.done]
        drop = getattr(self.inner, "drop_cache", None)
        if over and drop is not None:   # the engine kept their caches for a turn that won't come
            drop(over)
        return out

    def abort(self, request_ids: Iterable[int] | None = None, keep_cache: bool = False) -> list[Sample]:
        ids = None if request_ids is None else set(request_ids)
        out = self.inner.abort(None if ids is None else list(ids), keep_cache=keep_cache)
        out = [s for s in out if not self._turn_ended(s)]   # a turn that ended as it was aborted
        out += [s for s in self.failed if ids is None or s.request_id in ids]
        self.failed = [s for s in self.failed if s not in out]
        for rid in [r for r in self.in_tool if ids is None or r in ids]:
            s, fut = self.in_tool.pop(rid)
            if self._append(s, fut.result()):   # the tool is bounded by its time limit
                s.finish_reason = ABORT
            out.append(s)
        for s in out:
            self._leave(s)
        return out

    def close(self) -> None:
        for _, fut in self.in_tool.values():
            fut.cancel()
        self.in_tool.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.inner.close()

    # --- the environment's start and score ----------------------------------------------------------
    def _started(self, s: Sample) -> bool:
        """Start `s`'s episode with the environment the first time it is submitted (its state in
        `meta["episode"]["state"]`); False when the start failed (the episode is over, with the
        error: returned by the next step)."""
        ep = s.episode
        if ep is None or "state" in ep or ep.get("end"):
            return True
        problem = Problem(id=ep.get("id", ""), prompt=self.tokenizer.decode(s.prompt_ids),
                          answer=ep["answer"], kind=ep["kind"], tools=tuple(ep.get("tools", ())))
        try:
            state = self.environment.start(problem)
        except EnvironmentProblem as e:
            ep["end"], ep["error"] = END_ERROR, str(e)
            s.finish_reason = STOP
            self.failed.append(s)
            return False
        ep["state"] = state   # (None for the built-in environment: started once all the same)
        return True

    def _score(self, s: Sample) -> None:
        """A finished episode's reward from its environment (`meta["episode"]["score"]`), when it
        gives one (the built-in environment leaves it to the task's verifier)."""
        ep = s.episode
        if ep is None or not s.done or ep.get("error") or "score" in ep:
            return
        turn = self.tokenizer.decode(final_turn(s), skip_special_tokens=True)
        try:
            value = self.environment.score(turn, ep)
        except EnvironmentProblem as e:
            ep["error"] = str(e)
            return
        if value is not None:
            ep["score"] = value

    # --- turns -------------------------------------------------------------------------------------
    def _turn_ended(self, s: Sample) -> bool:
        """Whether `s`, just out of the engine, goes on to its environment (True: held here)."""
        ep = s.episode
        if ep is None or ep.get("end"):
            return False
        if s.finish_reason == LENGTH:   # the token budget ran out mid-turn
            ep["end"] = END_BUDGET
        if s.finish_reason != STOP:
            return False
        turn = self.tokenizer.decode(final_turn(s), skip_special_tokens=True)
        if ep["turns"] >= self.max_turns:   # out of turns: a call in this one is not run
            ep["end"] = END_MAX_TURNS if self.environment.calls_tool(turn, ep) else END_ANSWER
            return False
        self.in_tool[s.request_id] = (s, self.pool.submit(self._respond, turn, dict(ep)))
        return True

    def _respond(self, turn: str, episode: dict) -> Reply:
        start = clock.now()   # the timeline's clock
        reply = self.environment.respond(turn, episode)
        if self.on_tool is not None and (reply.tool or reply.error):   # a tool was called
            self.on_tool(start, clock.now())
        return reply

    def _replies(self, due: list[int]) -> list[Sample]:
        """The samples whose tools were `due`, in the order they were called (so a run is the
        same whatever the tools' timing): resubmitted for their next turn, or returned (the
        episode is over, or at its segment limit)."""
        out, again = [], []
        for rid in due:
            s, fut = self.in_tool.pop(rid)
            if not self._append(s, fut.result()):   # bounded by the tool's time limit
                out.append(s)                      # over: the answer, or the budget
            elif self._segment_spent(s):
                s.finish_reason = SEGMENT          # parked between turns
                out.append(s)
            else:
                again.append(s)
        if again:
            self.inner.submit(again)
        return out

    def _append(self, s: Sample, reply: Reply) -> bool:
        """Write the environment's reply into the episode; False when the episode is over."""
        ep = s.meta["episode"]
        if reply.state is not None:
            ep["state"] = reply.state
        if reply.tool or reply.error:
            ep["tool_calls"] += 1
            ep["tool_errors"] += int(reply.error)
            ep["tool_s"] = round(ep["tool_s"] + reply.seconds, 6)
        if reply.role is None:
            ep["end"] = END_ERROR if reply.failure else END_ANSWER
            if reply.failure:
                ep["error"] = reply.failure
            return False
        if reply.role != "tool":
            ep["feedback"] += 1
        last = s.response_ids[-1] if s.response_ids else None
        room = s.params.max_new_tokens - len(s.response_ids)
        try:   # cut to the budget at a word, marked, or left out whole (turns.env_ids_within)
            ids, whole = self.fmt.env_ids_within(reply.role, reply.text, last, room)
        except Exception as e:  # noqa: BLE001 -- a result the tokenizer refuses is the tool's error
            ep["tool_errors"] += int(not reply.error)
            ids, whole = self.fmt.env_ids_within(reply.role, format_error(
                f"the tool's result could not be tokenized ({type(e).__name__})"), last, room)
        cut = not whole
        s.response_ids.extend(ids)
        s.logprobs.extend([0.0] * len(ids))
        s.versions.extend([ENV_VERSION] * len(ids))
        if cut or len(s.response_ids) >= s.params.max_new_tokens:
            ep["end"] = END_BUDGET
            s.finish_reason = LENGTH
            return False
        ep["turns"] += 1
        s.finish_reason = None
        self._limit_segment(s)
        return True

    def _segment_spent(self, s: Sample) -> bool:
        base, seg = self.segment.get(s.request_id, (0, None))
        return seg is not None and s.model_tokens - base >= seg

    def _leave(self, s: Sample) -> None:
        """`s` leaves the wrapper: with the segment limit it was submitted with (what its
        later turns were left of it was this submission's share: resubmitted, parked at its
        limit or not, it gets a whole segment again), and scored if its episode is over."""
        entry = self.segment.pop(s.request_id, None)
        if entry is not None and s.params.segment_max_tokens != entry[1]:
            s.params = dataclasses.replace(s.params, segment_max_tokens=entry[1])
        self._score(s)

    def _limit_segment(self, s: Sample) -> None:
        """The next turn may use only what is left of the sample's segment (its own params: the
        step's are shared)."""
        base, seg = self.segment.get(s.request_id, (0, None))
        if seg is not None:
            left = max(1, seg - (s.model_tokens - base))
            s.params = dataclasses.replace(s.params, segment_max_tokens=left)


def apply_limits(engine, cfg) -> None:
    """The `episode.*` knobs' current values, for an engine with episodes (else nothing)."""
    if isinstance(engine, Episodes):
        e = cfg.episode
        engine.set_limits(max_turns=e.max_turns, timeout_s=e.tool_timeout_s,
                          output_chars=e.tool_output_chars, feedback=e.feedback)
