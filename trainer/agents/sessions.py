"""Agents' episodes, one per session id: what the endpoint's threads and the driver share.

A session is one episode: one `Sample` whose prompt is its first call's conversation and whose
response grows by each call (the environment's new messages, then the model's completion:
trainer/agents/chat.py). Its life:

    open      calls come and go, one at a time (a second call while one is in flight: 409)
    rewarded  the agent posted its reward: the episode is over, waiting for its group
    dropped   timed out: no call and no reward within `episode.agent_timeout_s` of its last reply
              (its tokens: the ledger's `agent_timeout`), or the run closed

The endpoint's threads (trainer/agents/server.py) turn a request into a `Call` here, under the
lock, and wait for it; the driver (trainer/agents/driver.py), the only thread that touches the
engine, takes the calls, generates, and answers them (`answer`). A sample is changed only while
no call of its session is in the engine.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from trainer.agents.chat import NEW_ROLES, AgentError, ChatFormat, normal, tool_names
from trainer.engine.base import ENV_VERSION, LENGTH, SEGMENT, Sample, SamplingParams

OPEN, REWARDED, DROPPED = "open", "rewarded", "dropped"
KIND = "agent"   # an agent episode's kind (meta["episode"]["kind"])


@dataclass
class Session:
    id: str
    sample: Sample
    messages: list[dict]          # the conversation so far, normalised, the replies included
    group: str                    # episodes of one group are one GRPO group
    last: float                   # clock time of its last reply (or its start)
    call: "Call | None" = None    # the call in flight
    calls: int = 0
    status: str = OPEN


@dataclass
class Call:
    session: Session
    offered: list[str]            # the request's function names
    fed: int                      # tokens fed before generating: the prompt, or the new messages
    arrived: float
    start: int = 0                # where its completion starts in the response
    done: threading.Event = field(default_factory=threading.Event)
    response: dict | None = None
    error: AgentError | None = None

    def fail(self, error: AgentError) -> None:
        self.error = error
        self.done.set()


def session_id(body: dict, header: str | None) -> str:
    """The session an agent's call belongs to: the `X-Session-Id` header, else the body's
    `session_id` (the openai client's extra_body), else its `user` field."""
    sid = header or body.get("session_id") or body.get("user")
    if not isinstance(sid, str) or not sid.strip() or len(sid) > 200:
        raise AgentError(400, "a session id is required (1-200 characters): the X-Session-Id "
                              "header, extra_body={'session_id': ...} or the 'user' field; an "
                              "agent's calls with one session id are one episode")
    return sid.strip()


class Sessions:
    """The open sessions, the calls waiting for the engine, the rewarded episodes."""

    def __init__(self, fmt: ChatFormat, params: Callable[[], SamplingParams],
                 max_seq_len: int, clock: Callable[[], float] = time.monotonic):
        self.fmt, self.params, self.max_seq_len, self.clock = fmt, params, max_seq_len, clock
        self.lock = threading.Condition()
        self.open: dict[str, Session] = {}
        self.inbox: list[Call] = []
        self.rewarded: list[Session] = []
        self.closed = False
        self.sessions_started = 0
        self.ended: dict[str, str] = {}   # session id -> how its episode ended (REWARDED, DROPPED)

    # --- the endpoint's side ----------------------------------------------------------------------
    def call(self, sid: str, body: dict) -> Call:
        """A chat request, checked and written into its episode: queued for the driver."""
        _check_options(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise AgentError(400, "'messages' must be a non-empty list")
        offered = tool_names(body.get("tools"))
        with self.lock:
            if self.closed:
                raise AgentError(503, "the run is over: its endpoint takes no more calls")
            s = self.open.get(sid)
            if s is None and sid in self.ended:
                raise AgentError(410, _ended(sid, self.ended[sid]))
            if s is None:
                s = self._start(sid, body, messages)
                fed = len(s.sample.prompt_ids)
            else:
                fed = self._extend(s, messages, body)
            call = Call(s, offered, fed, self.clock())
            s.call, s.calls = call, s.calls + 1
            self.inbox.append(call)
            self.lock.notify_all()
            return call

    def reward(self, sid: str, body: dict) -> dict:
        """The agent's reward for its episode (which is then over)."""
        value = body.get("reward") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise AgentError(400, "'reward' must be a finite number")
        with self.lock:
            s = self.open.get(sid)
            if s is None and sid in self.ended:
                raise AgentError(410, _ended(sid, self.ended[sid]))
            if s is None:
                raise AgentError(404, f"no episode {sid!r}: an episode starts with a chat call")
            if s.call is not None:
                raise AgentError(409, f"episode {sid!r} has a call in flight: reward it after "
                                      "its reply")
            group = body.get("group")
            if group is not None:
                if not isinstance(group, str) or not group.strip():
                    raise AgentError(400, "'group' must be a non-empty string")
                s.group = group.strip()
            ep = s.sample.meta["episode"]
            ep["score"], ep["end"] = float(value), "answer"
            if s.sample.finish_reason == SEGMENT:   # cut at the call's max_tokens
                s.sample.finish_reason = LENGTH
            s.status = self.ended[sid] = REWARDED
            del self.open[sid]
            self.rewarded.append(s)
            self.lock.notify_all()
            return {"session": sid, "reward": float(value), "group": s.group,
                    "tokens": s.sample.model_tokens}

    # --- the driver's side ------------------------------------------------------------------------
    def take(self) -> tuple[list[Call], list[Session]]:
        """The calls waiting for the engine and the newly rewarded episodes."""
        with self.lock:
            calls, self.inbox = self.inbox, []
            done, self.rewarded = self.rewarded, []
            return calls, done

    def wait(self, timeout_s: float) -> None:
        with self.lock:
            if not self.inbox and not self.rewarded:
                self.lock.wait(timeout_s)

    def answer(self, call: Call, response: dict, normalised_reply: dict) -> None:
        with self.lock:
            s = call.session
            s.messages.append(normalised_reply)
            s.call, s.last = None, self.clock()
            call.response = response
            call.done.set()

    def expire(self, timeout_s: float) -> list[Session]:
        """The open episodes idle (no call in flight, no reward) for over `timeout_s` since their
        last reply: dropped."""
        now = self.clock()
        with self.lock:
            out = [s for s in self.open.values() if s.call is None and now - s.last > timeout_s]
            for s in out:
                s.status = self.ended[s.id] = DROPPED
                del self.open[s.id]
            return out

    def held(self) -> list[Session]:
        with self.lock:
            return list(self.open.values())

    def close(self) -> list[Session]:
        """No more calls; the calls waiting are refused; the open episodes are returned, dropped."""
        with self.lock:
            self.closed = True
            for c in self.inbox:
                c.fail(AgentError(503, "the run is over"))
            for s in self.open.values():
                if s.call is not None and not s.call.done.is_set():
                    s.call.fail(AgentError(503, "the run is over"))
                s.status = DROPPED
            out, self.inbox = list(self.open.values()), []
            self.open.clear()
            self.lock.notify_all()
            return out

    # --- episodes -----------------------------------------------------------------------------------
    def _start(self, sid: str, body: dict, messages: list) -> Session:
        base = self.params()
        temperature = _temperature(body, base.temperature)
        ids = self.fmt.prompt_ids(messages, body.get("tools"))
        if len(ids) + base.max_new_tokens > self.max_seq_len:
            raise AgentError(400, f"the prompt ({len(ids)} tokens) and the episode's token budget "
                                  f"(rollout.max_response_len = {base.max_new_tokens}) exceed the "
                                  f"engine's {self.max_seq_len} positions")
        params = SamplingParams(temperature=temperature, top_p=base.top_p,
                                max_new_tokens=base.max_new_tokens,
                                segment_max_tokens=_max_tokens(body, base.max_new_tokens))
        sample = Sample(ids, params, meta={"agent_session": sid, "episode": {
            "id": sid, "kind": KIND, "answer": "", "tools": [], "turns": 1, "tool_calls": 0,
            "tool_errors": 0, "tool_s": 0.0, "feedback": 0, "end": "", "state": None}})
        s = Session(sid, sample, [normal(m, i) for i, m in enumerate(messages)],
                    group=str(body.get("group") or _prompt_key(ids)), last=self.clock())
        self.open[sid] = s
        self.sessions_started += 1
        return s

    def _extend(self, s: Session, messages: list, body: dict) -> int:
        if s.call is not None:
            raise AgentError(409, f"episode {s.id!r} has a call in flight: one call at a time")
        sample = s.sample
        if sample.finish_reason == LENGTH:
            raise AgentError(400, f"episode {s.id!r} spent its token budget (rollout."
                                  f"max_response_len = {sample.params.max_new_tokens}): post its "
                                  "reward")
        if _temperature(body, sample.params.temperature) != sample.params.temperature:
            raise AgentError(400, f"episode {s.id!r} samples at temperature "
                                  f"{sample.params.temperature:g} (its first call's): its "
                                  "log-probabilities are taken at it")
        n = len(s.messages)
        given = [normal(m, i) for i, m in enumerate(messages)]
        for i, (old, new) in enumerate(zip(s.messages, given)):
            if old != new:
                raise AgentError(400, f"messages[{i}] differs from episode {s.id!r}'s conversation "
                                      "so far: a call must repeat it (the replies as given) and add "
                                      "new tool or user messages; start another session for "
                                      "another conversation")
        new = given[n:]
        if len(given) < n or not new or any(m["role"] not in NEW_ROLES for m in new):
            raise AgentError(400, f"episode {s.id!r}: a call must add messages of roles tool or "
                                  "user after the conversation so far")
        last = sample.response_ids[-1] if sample.response_ids else None
        ids, users = self.fmt.delta_ids(new, last)
        if len(ids) >= sample.remaining:
            raise AgentError(400, f"episode {s.id!r}: the new messages ({len(ids)} tokens) do not "
                                  f"fit in what is left of its token budget ({sample.remaining} "
                                  "of rollout.max_response_len): post its reward")
        sample.response_ids.extend(ids)
        sample.logprobs.extend([0.0] * len(ids))
        sample.versions.extend([ENV_VERSION] * len(ids))
        ep = sample.meta["episode"]
        ep["turns"] += 1
        ep["feedback"] += users
        s.messages = given
        limit = _max_tokens(body, sample.params.max_new_tokens)
        sample.params = SamplingParams(temperature=sample.params.temperature,
                                       top_p=sample.params.top_p,
                                       max_new_tokens=sample.params.max_new_tokens,
                                       segment_max_tokens=limit)
        return len(ids)


def _ended(sid: str, how: str) -> str:
    if how == REWARDED:
        return f"episode {sid!r} is over (rewarded): use a new session id for each episode"
    return (f"episode {sid!r} was dropped: no call nor reward within episode.agent_timeout_s "
            "of its last reply")


def _check_options(body: dict) -> None:
    if body.get("stream"):
        raise AgentError(400, "streaming is not supported: call without stream=True")
    if body.get("n", 1) != 1:
        raise AgentError(400, "'n' must be 1: each call is one turn of one episode")
    if body.get("top_p") not in (None, 1, 1.0):
        raise AgentError(400, "'top_p' is the run's (rollout.top_p): leave it out")


def _temperature(body: dict, default: float) -> float:
    t = body.get("temperature")
    if t is None:
        return default
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 2:
        raise AgentError(400, "'temperature' must be in (0, 2]: a training run samples (0, greedy, "
                              "has no log-probabilities to train with)")
    return float(t)


def _max_tokens(body: dict, budget: int) -> int | None:
    m = body.get("max_completion_tokens", body.get("max_tokens"))
    if m is None:
        return None
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise AgentError(400, "'max_tokens' must be a positive integer")
    return min(m, budget)


def _prompt_key(ids: list[int]) -> str:
    """Episodes that start from the same prompt tokens are one group by default."""
    return "prompt-" + hashlib.sha1(repr(ids).encode()).hexdigest()[:12]
