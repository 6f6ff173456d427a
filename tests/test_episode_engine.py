"""The episode wrapper (trainer/episode/engine.py) over a scripted engine: turns, environment
tokens (version ENV_VERSION, logprob 0), tool calls and their errors, max_turns, the token budget,
and episodes parked mid-turn (segment limit) or between turns (aborted while a tool runs) that
resume exactly as an episode that never stopped."""
from __future__ import annotations

import threading

import pytest

from trainer.engine.base import ABORT, ENV_VERSION, LENGTH, SEGMENT, STOP, EngineStats, Sample, SamplingParams
from trainer.engine.stops import StopStrings
from trainer.episode.engine import Episodes, final_turn, new_episode
from trainer.episode.environments import Environment
from trainer.episode.tools import TAG_SYNTAX, stop_strings
from trainer.episode.turns import TurnFormat
from trainer.models.loading import build_char_tokenizer
from trainer.tasks.base import Problem

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


class ScriptedEngine:
    """Writes, for each sample, the next characters of its script (the model's turns, written
    one after another): what it writes depends only on the sample's model tokens so far, so a
    sample parked and resumed writes what it would have written anyway. One token per step;
    each token's logprob is -0.5 and its version the engine's."""

    def __init__(self, script: str):
        self.script = TOK(script, add_special_tokens=False).input_ids + [EOS]
        self.version = 0
        self.stats = EngineStats()
        self.running: list[Sample] = []

    @property
    def num_pending(self) -> int:
        return len(self.running)

    def submit(self, samples):
        for s in samples:
            s.finish_reason, s.segment_tokens = None, 0
            self.running.append(s)

    def step(self):
        out = []
        for s in list(self.running):
            tok = self.script[s.model_tokens]
            s.response_ids.append(tok)
            s.logprobs.append(-0.5)
            s.versions.append(self.version)
            s.segment_tokens += 1
            self.stats.generated_tokens += 1
            if tok == EOS:
                s.finish_reason = STOP
            elif len(s.response_ids) >= s.params.max_new_tokens:
                s.finish_reason = LENGTH
            elif s.params.segment_max_tokens and s.segment_tokens >= s.params.segment_max_tokens:
                s.finish_reason = SEGMENT
            if s.finish_reason:
                self.running.remove(s)
                out.append(s)
        return out

    def abort(self, request_ids=None, keep_cache=False):
        out = [s for s in self.running if request_ids is None or s.request_id in request_ids]
        for s in out:
            s.finish_reason = ABORT
            self.running.remove(s)
        return out

    def update_weights(self, named_tensors, version, recompute_kv=False):
        self.version = version

    def close(self):
        pass


def episodes(script: str, *, max_turns: int = 4, gate: threading.Event | None = None,
             tools=("calculator",)) -> Episodes:
    verify = lambda kind, answer, text: float(text.strip().endswith(f">{answer}"))  # noqa: E731
    env = Environment(syntax=TAG_SYNTAX, feedback=False, timeout_s=2.0, output_chars=100,
                      verify=verify)
    if gate is not None:   # a tool that waits for the test to let it finish
        respond = env.respond
        env.respond = lambda turn, ep: (gate.wait(10), respond(turn, ep))[1]
    inner = StopStrings(ScriptedEngine(script), TOK, stop_strings(TAG_SYNTAX, tools))
    return Episodes(inner, TOK, env, TurnFormat(TOK, chat=False), max_turns=max_turns)


def sample(max_new_tokens: int = 64, segment: int | None = None) -> Sample:
    problem = Problem(id="p", prompt="[2,3]=", answer=5, kind="sum")
    s = Sample(TOK("[2,3]=").input_ids, SamplingParams(max_new_tokens=max_new_tokens,
                                                     segment_max_tokens=segment))
    s.meta["episode"] = new_episode(problem, ("calculator",))
    return s


def text(ids) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def run(engine: Episodes, s: Sample) -> Sample:
    (out,) = engine.generate([s])
    assert out is s
    return s


TOOL_SCRIPT = "<calc>2+3</calc>>5"


def test_a_tool_call_becomes_an_environment_turn_and_the_episode_goes_on():
    s = run(episodes(TOOL_SCRIPT), sample())
    assert text(s.response_ids) == "<calc>2+3</calc><result>5</result>>5"
    assert s.finish_reason == STOP
    env = [i for i, v in enumerate(s.versions) if v == ENV_VERSION]
    assert text([s.response_ids[i] for i in env]) == "<result>5</result>"
    assert all(s.logprobs[i] == 0.0 for i in env)
    assert s.model_tokens == len("<calc>2+3</calc>>5") + 1   # with its EOS
    assert text(final_turn(s)) == ">5"
    ep = s.meta["episode"]
    assert (ep["turns"], ep["tool_calls"], ep["tool_errors"], ep["end"]) == (2, 1, 0, "answer")
    s.check()


def test_a_malformed_call_is_a_tool_error_in_the_conversation():
    s = run(episodes("<calc>2+</calc>>5"), sample(max_new_tokens=300))
    result = text(s.response_ids).split("</calc>", 1)[1]
    assert result.startswith("<result>error: ") and result.endswith("</result>>5")
    assert s.meta["episode"]["tool_errors"] == 1


def test_max_turns_ends_the_episode_without_running_the_last_call():
    s = run(episodes("<calc>1+1</calc><calc>2+2</calc>>4", max_turns=2), sample())
    assert text(s.response_ids) == "<calc>1+1</calc><result>2</result><calc>2+2</calc>"
    ep = s.meta["episode"]
    assert (ep["turns"], ep["tool_calls"], ep["end"]) == (2, 1, "max_turns")
    assert s.finish_reason == STOP


def test_the_environment_cannot_overrun_the_token_budget():
    """Room for 5 tokens: not even the result's wrapper fits, so nothing of it is written (never
    "<resu", a message cut inside its wrapper); the episode ends on the budget."""
    budget = len("<calc>2+3</calc>") + 5
    s = run(episodes(TOOL_SCRIPT), sample(max_new_tokens=budget))
    assert len(s.response_ids) <= budget and s.finish_reason == LENGTH
    assert s.meta["episode"]["end"] == "budget"
    assert text(s.response_ids) == "<calc>2+3</calc>"


def test_a_message_longer_than_the_budget_left_is_cut_at_a_word_and_marked():
    """The agent preset's case: a 96-token budget, a tool error of 94 characters (tokens, for
    the character-level model). With 44 tokens left, the error is cut after a whole word, marked
    "...", and its wrapper closed: "<result>error: the calculator...</result>" (41 tokens: the
    next word would not fit); the episode ends on the budget."""
    call = "<calc>2+x</calc>"
    s = run(episodes(call + ">5"), sample(max_new_tokens=len(call) + 44))
    got = text(s.response_ids)
    assert got == call + "<result>error: the calculator...</result>", got
    assert s.finish_reason == LENGTH and s.meta["episode"]["end"] == "budget"
    assert s.versions[len(call):] == [ENV_VERSION] * (len(got) - len(call))
    assert s.meta["episode"]["tool_errors"] == 1


def test_parked_mid_turn_and_resumed_equals_the_whole_episode():
    whole = run(episodes(TOOL_SCRIPT), sample())
    eng = episodes(TOOL_SCRIPT)
    s = sample(segment=4)
    rounds = 0
    while s.finish_reason not in (STOP, LENGTH):
        (out,) = eng.generate([s])
        rounds += 1
        if out.finish_reason == SEGMENT:   # at most 4 model tokens per submission, over turns
            assert out.model_tokens - (rounds - 1) * 4 <= 4
    assert rounds > 3   # it was parked, several times, in both model turns
    assert (s.response_ids, s.logprobs, s.versions) == (whole.response_ids, whole.logprobs,
                                                         whole.versions)
    assert s.meta["episode"] == whole.meta["episode"] | {"tool_s": s.meta["episode"]["tool_s"]}


def test_a_parked_episode_gets_a_whole_segment_when_resubmitted():
    """Within a submission the turns share one segment; the sample leaves with the limit it
    came with, so its next submission (APRIL's next round) gets a whole segment again, also
    after it was parked between turns with its segment spent by the call."""
    eng = episodes(TOOL_SCRIPT)
    s = sample(segment=4)
    per_round, between = [], []
    while s.finish_reason not in (STOP, LENGTH):
        before = s.model_tokens
        (out,) = eng.generate([s])
        per_round.append(out.model_tokens - before)
        between.append(out.versions[-1] == ENV_VERSION)
        assert out.params.segment_max_tokens == 4
    # "<calc>2+3</calc>" is 16 tokens: its last segment ends the turn, and the sample is parked
    # with the tool's result appended; ">5" and the eos follow in one more segment
    assert between == [False, False, False, True, False]
    assert per_round == [4, 4, 4, 4, 3]


def test_aborted_while_its_tool_runs_it_parks_between_turns_and_resumes():
    gate = threading.Event()
    eng = episodes(TOOL_SCRIPT, gate=gate)
    s, other = sample(), sample()
    eng.submit([s])
    for _ in range(5):
        assert not eng.step()
    eng.submit([other])             # still decoding when s's call ends its turn
    while not eng.in_tool:
        assert not eng.step()
    assert eng.inner.num_pending == 1 and eng.num_pending == 2
    threading.Timer(0.2, gate.set).start()
    parked = {x.request_id: x for x in eng.abort()}   # waits for the tool, then leaves
    assert set(parked) == {s.request_id, other.request_id} and eng.num_pending == 0
    assert s.finish_reason == ABORT and other.finish_reason == ABORT
    assert text(s.response_ids) == "<calc>2+3</calc><result>5</result>"
    assert s.versions[-1] == ENV_VERSION
    eng.inner.inner.update_weights({}, 1)   # a new policy for the next turn
    run(eng, s)
    assert text(s.response_ids) == "<calc>2+3</calc><result>5</result>>5"
    assert set(s.policy_versions) == {0, 1}  # the second turn is the new policy's
    assert s.meta["episode"]["turns"] == 2


def test_answers_are_taken_in_the_order_the_tools_were_called():
    """Tools finish in any order; the samples go on in the order of their calls, after the
    decode step that ran beside them, so a run does not depend on the tools' timing."""
    eng = episodes(TOOL_SCRIPT)
    slow = threading.Event()
    respond = eng.environment.respond
    calls = []

    def timed(turn, ep):
        calls.append(ep)
        if len(calls) == 1:
            slow.wait(0.5)   # the first call finishes last
        return respond(turn, ep)

    eng.environment.respond = timed
    a, b, c = sample(), sample(), sample()
    eng.submit([a, b])
    for _ in range(3):
        eng.step()
    eng.submit([c])                 # still decoding when a's and b's calls end their turns
    while not eng.in_tool:
        assert eng.step() == []
    order = list(eng.in_tool)
    assert order == [a.request_id, b.request_id]
    submitted = []
    real_submit = eng.inner.submit
    eng.inner.submit = lambda xs: (submitted.extend(x.request_id for x in xs), real_submit(xs))
    eng.step()
    assert submitted == order and list(eng.in_tool) == []
    assert calls[0]["turns"] == 1 and len(calls) == 2


def test_single_turn_samples_pass_through_untouched():
    eng = episodes(TOOL_SCRIPT)
    s = Sample(TOK("[2,3]=").input_ids, SamplingParams(max_new_tokens=64))
    run(eng, s)
    assert text(s.response_ids) == "<calc>2+3</calc>" and ENV_VERSION not in s.versions


@pytest.mark.parametrize("value", ["calculator,python", "python", ""])
def test_offered_tools_parse(value):
    from trainer.episode.environments import parse_tools

    assert parse_tools(value) == tuple(n for n in value.split(",") if n)
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        parse_tools("calculator,shell")
