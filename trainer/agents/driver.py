"""`AgentDriver`: a training step's groups from agents' episodes (`episode.agents`).

The driver is the one thread that uses the engine. A step (`collect`):

1. takes the calls the endpoint queued (trainer/agents/sessions.py) and submits their samples,
   steps the engine, and answers each call whose turn left it (its end of turn, the closing tag
   of a tool call: "stop"; its `max_tokens`: "length"), with the completion's text and tool calls;
2. takes the rewarded episodes into groups: episodes with the same group key (by default the
   same first prompt, i.e. the same task: GRPO's group) make a group once there are
   `rollout.n_samples_per_prompt` of them;
3. drops the open episodes idle past `episode.agent_timeout_s` (their generated tokens go to the
   ledger's `agent_timeout`);
4. returns once N = `rollout.rollout_batch_size` groups are complete and nothing is left in the
   engine (a call in flight is finished first); the groups beyond N wait for the next step.

Each episode's reward is the agent's (`meta["episode"]["score"]`, what the scorer takes from an
environment, trainer/episode/interface.py); its model tokens keep their log-probabilities and
versions, the new messages of each later call are environment tokens (never trained). Between
steps the engine is the trainer's: calls wait for the next step. A stop or pause while a step
waits for agents is taken at the boundary (`CollectInterrupted`). Open episodes are not
checkpointed: a resumed run starts with none (their agents' next calls are refused, 400).
"""
from __future__ import annotations

import time

from trainer.agents.chat import normal
from trainer.agents.sessions import KIND, Call, Session, Sessions
from trainer.engine.base import STOP
from trainer.rollout.asynchronous import CollectInterrupted
from trainer.rollout.base import Driver, Group, RolloutResult, StepCounts
from trainer.rollout.ledger import TokenLedger
from trainer.tasks.base import Problem

IDLE_WAIT_S = 0.05   # how long a step waiting for agents sleeps between looks


class AgentDriver(Driver):
    def __init__(self, engine, tokenizer, scorer, sessions: Sessions, server=None):
        self.engine, self.tokenizer, self.scorer = engine, tokenizer, scorer
        self.sessions, self.server = sessions, server
        self.ledger = TokenLedger()
        self.timeout_s = 300.0
        self.in_engine: dict[int, Call] = {}         # request id -> its call
        self.forming: dict[str, list[Session]] = {}  # group key -> rewarded episodes
        self.complete: list[Group] = []              # full groups no step took yet
        self.step_calls = self.step_rewarded = self.step_timeouts = 0
        self.groups_made = 0   # a group's id is -(its number): the invariants tell groups apart

    # --- the run's life ----------------------------------------------------------------------------
    def start(self, cfg, version: int) -> None:
        self.timeout_s = cfg.episode.agent_timeout_s
        if self.server is not None and not self.server.thread.is_alive():
            self.server.start()

    def set_config(self, cfg) -> None:
        self.timeout_s = cfg.episode.agent_timeout_s

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for s in self.sessions.close():
            self.ledger.drop("agent_timeout", s.sample.model_tokens)

    def state_dict(self) -> dict:
        return {"groups_made": self.groups_made}

    def load_state_dict(self, state: dict, version: int) -> None:
        self.groups_made = int(state.get("groups_made", 0))

    def held_tokens(self) -> int:
        open_ = sum(s.sample.model_tokens for s in self.sessions.held())
        forming = sum(s.sample.model_tokens for ss in self.forming.values() for s in ss)
        return open_ + forming + sum(g.tokens() for g in self.complete)

    # --- a step ------------------------------------------------------------------------------------
    def collect(self, cfg, version: int) -> RolloutResult:
        t0 = time.monotonic()
        self.timeout_s = cfg.episode.agent_timeout_s
        N, G = cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt
        counts = StepCounts()
        self.step_calls = self.step_rewarded = self.step_timeouts = 0
        while len(self.complete) < N or self.engine.num_pending:
            busy = self.serve(G, counts)
            if not busy and len(self.complete) < N:
                if self.interrupted():
                    raise CollectInterrupted("a stop or pause is waiting at the step boundary")
                self.sessions.wait(IDLE_WAIT_S)
            self._expire()
        train, self.complete = self.complete[:N], self.complete[N:]
        self.scorer(train)
        counts.completed = sum(len(g.samples) for g in train)
        metrics = {"rollout/groups_started": counts.groups_started, "rollout/rounds": 1,
                   "rollout/effective_groups": len(train), "rollout/discarded_tokens": 0,
                   "agents/calls": self.step_calls, "agents/rewarded": self.step_rewarded,
                   "agents/timeouts": self.step_timeouts,
                   "agents/open": len(self.sessions.held()),
                   "agents/waiting": sum(len(v) for v in self.forming.values())
                   + sum(len(g.samples) for g in self.complete)}
        return RolloutResult(groups=train, scored=train, gen_seconds=time.monotonic() - t0,
                             counts=counts, metrics=metrics)

    def serve(self, G: int, counts: StepCounts) -> bool:
        """One round: the calls queued submitted, the rewarded episodes filed into groups of `G`,
        one engine step with the answers it brings. False when the engine had nothing to do."""
        self._take(G, counts)
        if not self.engine.num_pending:
            return False
        for s in self.engine.step():
            self._answer(s)
        return True

    def _take(self, G: int, counts: StepCounts) -> None:
        """Submit the calls queued; file the rewarded episodes into their groups."""
        calls, rewarded = self.sessions.take()
        for c in calls:
            c.start = len(c.session.sample.response_ids)
            self.in_engine[c.session.sample.request_id] = c
            counts.submitted += 1
        if calls:
            self.engine.submit([c.session.sample for c in calls])
        drop = getattr(self.engine, "drop_cache", None)
        if rewarded and drop is not None:   # their caches were kept for a next call
            drop([s.sample.request_id for s in rewarded])
        for s in rewarded:
            self.step_rewarded += 1
            members = self.forming.setdefault(s.group, [])
            members.append(s)
            if len(members) == G:
                del self.forming[s.group]
                self.complete.append(self._group(members))
                counts.groups_started += 1

    def _group(self, members: list[Session]) -> Group:
        first = members[0].sample
        problem = Problem(id=members[0].group, prompt=self.tokenizer.decode(first.prompt_ids),
                          answer="", kind=KIND)
        self.groups_made += 1
        draw = -self.groups_made   # below the data cursor's positions: no prompt was drawn
        for k, s in enumerate(members):
            s.sample.meta.update(draw=draw, index=k)
        return Group(problem=problem, samples=[s.sample for s in members], draw=draw)

    def _answer(self, s) -> None:
        """A sample out of the engine: its call's reply (its turn ended, or hit max_tokens)."""
        call = self.in_engine.pop(s.request_id, None)
        if call is None:
            return
        ep = s.meta["episode"]
        ids = s.response_ids[call.start:]
        msg = self.sessions.fmt.reply(ids, call.offered, f"call_{s.request_id}_{call.session.calls}")
        calls = msg.get("tool_calls") or []
        ep["tool_calls"] += len(calls)
        finish = "tool_calls" if calls else ("stop" if s.finish_reason == STOP else "length")
        versions = s.versions[call.start:]
        response = {
            "id": f"chatcmpl-{s.request_id}-{call.session.calls}", "object": "chat.completion",
            "created": int(time.time()),
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": call.fed, "completion_tokens": len(ids),
                      "total_tokens": call.fed + len(ids)},
            "rlpilot": {"session": call.session.id, "policy_versions": sorted(set(versions)),
                        "episode_tokens": len(s.response_ids)}}
        self.step_calls += 1
        self.sessions.answer(call, response, normal(msg, 0))

    def _expire(self) -> None:
        for s in self.sessions.expire(self.timeout_s):
            self.step_timeouts += 1
            self.ledger.drop("agent_timeout", s.sample.model_tokens)
            drop = getattr(self.engine, "drop_cache", None)
            if drop is not None:
                drop([s.sample.request_id])
