"""Agents' episodes over the OpenAI-compatible endpoint (`episode.agents`, trainer/agents/): the
real `openai` client drives a real run of the built-in tools model with tool calls; what is trained
is token for token what the engine generated and what was fed; the agent's reward is the
episode's; another token is refused; an agent that never finishes is timed out and the run goes
on. Then the chat format's rules on their own (a chat template's delta, a diverging history)."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest
from helpers import check_rows
from test_chat_template import chat_tokenizer

from trainer import config as C
from trainer.agents.chat import AgentError, ChatFormat
from trainer.agents.endpoint import read_address
from trainer.agents.sessions import Sessions
from trainer.engine.base import ENV_VERSION, SamplingParams
from trainer.observe.metrics import MemorySink
from trainer.run.runner import Runner

AGENTS = ["episode.agents=true", "rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=2",
          "rollout.max_response_len=64", "rollout.max_slots=8", "run.eval_every=0",
          "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1"]
CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
TASKS = ["[12,30]=", "[7,5,9]="]


def start(tmp_path, steps: int, *more: str) -> tuple[Runner, MemorySink, openai.OpenAI]:
    cfg = C.load("agent", [*AGENTS, *more, f"run.max_steps={steps}"])
    sink = MemorySink()
    runner = Runner(cfg, tmp_path, sink=sink, system_telemetry=False)
    address = read_address(tmp_path)
    assert address["base_url"].startswith("http://127.0.0.1:")
    return runner, sink, openai.OpenAI(base_url=address["base_url"], api_key=address["token"],
                                       max_retries=0)


def play(client, sid: str, task: str, reward: float, log: dict) -> None:
    """An agent: ask, run the calculator it calls (at most twice), post the reward."""
    messages = [{"role": "user", "content": task}]
    seen = []
    for _ in range(3):
        r = client.chat.completions.create(model="policy", messages=messages, tools=CALCULATOR,
                                           max_tokens=24, extra_headers={"X-Session-Id": sid})
        msg = r.choices[0].message
        seen.append(msg)
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        expression = json.loads(msg.tool_calls[0].function.arguments)["expression"]
        try:
            result = str(eval(expression, {"__builtins__": {}}))  # noqa: S307 -- digits and +
        except Exception:  # noqa: BLE001 -- what the model wrote
            result = "error"
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": result})
    client.post(f"/episodes/{sid}/reward", body={"reward": reward}, cast_to=object)
    log[sid] = {"reward": reward, "replies": seen, "tools": messages}


class EngineRecord:
    """What the engine generated for each request, call by call: (token ids, log-probs)."""

    def __init__(self, engine):
        self.engine, self.starts, self.chunks = engine, {}, {}
        submit, step = engine.submit, engine.step

        def recorded_submit(samples):
            samples = list(samples)
            for s in samples:
                self.starts[s.request_id] = len(s.response_ids)
            return submit(samples)

        def recorded_step():
            out = step()
            for s in out:
                a = self.starts.pop(s.request_id)
                self.chunks.setdefault(s.request_id, []).append(
                    (s.response_ids[a:], s.logprobs[a:]))
            return out
        engine.submit, engine.step = recorded_submit, recorded_step


def test_an_openai_agent_s_calls_are_trained_token_for_token(tmp_path):
    runner, sink, client = start(tmp_path, 2)
    record = EngineRecord(runner.engine)
    trained, sequences = [], []
    collect, train = runner.rollout.collect, runner.learner.train
    runner.rollout.collect = lambda cfg, v: trained.append(r := collect(cfg, v)) or r
    runner.learner.train = lambda seqs, *a, **k: sequences.extend(seqs) or train(seqs, *a, **k)
    log: dict = {}
    agents = [threading.Thread(target=lambda k=k: [play(client, f"agent{k}-{t}", task, float(k), log)
                                                   for t, task in enumerate(TASKS)], daemon=True)
              for k in range(2)]
    for a in agents:
        a.start()
    with runner:
        runner.run()
    for a in agents:
        a.join(30)
    rows = [r for r in sink.steps if "reward/mean" in r]
    assert runner.step == 2 and len(rows) == 2
    check_rows(rows)
    tok = runner.tokenizer
    samples = [s for r in trained for g in r.groups for s in g.samples]
    assert len(samples) == 4 and {s.meta["agent_session"] for s in samples} == set(log)
    tool_turns = 0
    for s in samples:
        sid = s.meta["agent_session"]
        # the prompt was rendered once: the user message as the built-in model reads it
        assert s.prompt_ids == tok(log[sid]["tools"][0]["content"], add_special_tokens=False).input_ids
        # the model's tokens are what the engine generated, call by call, with its log-probs
        chunks = record.chunks[s.request_id]
        model = [(t, lp) for t, lp, v in zip(s.response_ids, s.logprobs, s.versions) if v != ENV_VERSION]
        assert model == [(t, lp) for ids, lps in chunks for t, lp in zip(ids, lps)]
        assert len(chunks) == len(log[sid]["replies"])
        # between them, exactly the tool messages the agent sent, in the built-in model's words
        results = [m["content"] for m in log[sid]["tools"] if m["role"] == "tool"]
        env = [t for t, v in zip(s.response_ids, s.versions) if v == ENV_VERSION]
        assert env == [t for r in results for t in tok(f"<result>{r}</result>",
                                                        add_special_tokens=False).input_ids]
        # what the agent was told is what the engine wrote
        for (ids, _), reply in zip(chunks, log[sid]["replies"]):
            text = tok.decode(ids, skip_special_tokens=True)
            if reply.tool_calls:
                tool_turns += 1
                expression = json.loads(reply.tool_calls[0].function.arguments)["expression"]
                assert text.endswith(f"<calc>{expression}</calc>")
            else:
                assert reply.content == text
        # trained as sent: the same tokens, the environment's with weight 0
        seq = next(q for q in sequences if q.prompt_ids == s.prompt_ids
                   and q.response_ids == s.response_ids)
        assert [w == 0 for w in seq.weights] == [v == ENV_VERSION for v in s.versions]
    assert tool_turns > 0   # the path with a tool call was taken
    # the agent's reward is the episode's
    for r in trained:
        for g in r.groups:
            assert g.raw_scores == [log[s.meta["agent_session"]]["reward"] for s in g.samples]
    assert sum(r["agents/rewarded"] for r in rows) == 4
    assert [g.draw for r in trained for g in r.groups] == [-1, -2]   # told apart, no prompt drawn
    assert not [e for e in sink.events if e.get("kind") in ("invariant_violated", "error")]
    started = next(e for e in sink.events if e["kind"] == "run_started")
    assert started["agents_url"] == read_address(tmp_path)["base_url"]   # on the run page's log
    # the inspector's rows: an agent's episode turn by turn, as a built-in episode's (the tool
    # messages a turn of their own, never trained), with the turns the agent took
    by_text = {tok.decode(list(s.response_ids), skip_special_tokens=True): s for s in samples}
    shown = [r for r in sink.sample_rows if r["completion"] in by_text]
    assert len(shown) == len(samples) and all(r.get("turns") and r.get("episode") for r in shown)
    for r in shown:
        s = by_text[r["completion"]]
        assert [t["role"] for t in r["turns"]][::2] == ["model"] * len(r["turns"][::2])   # model first
        assert [t["trained"] for t in r["turns"]] == [t["role"] == "model" for t in r["turns"]]
        assert r["turns"][-1]["end"] == len(s.response_ids)
        assert r["episode"]["turns"] == len(log[s.meta["agent_session"]]["replies"])
    assert any(t["role"] == "tool" for r in shown for t in r["turns"])   # (tool_turns > 0 above)


def test_another_token_is_refused_and_bad_calls_are_named(tmp_path):
    runner, _, client = start(tmp_path, 1)
    try:
        wrong = openai.OpenAI(base_url=client.base_url, api_key="another-users-token", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="its own token"):
            wrong.chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}],
                                          user="s")
        bare = urllib.request.Request(f"{client.base_url}models")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bare, timeout=10)
        assert e.value.code == 401
        assert client.models.list().data[0].owned_by == "rlpilot"   # the right token is taken
        with pytest.raises(openai.BadRequestError, match="session id"):
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}])
        with pytest.raises(openai.BadRequestError, match="streaming"):
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}],
                                           user="s", stream=True)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}],
                                           user="s", temperature=0)
        with pytest.raises(openai.NotFoundError, match="starts with a chat call"):
            client.post("/episodes/nobody/reward", body={"reward": 1}, cast_to=object)
    finally:
        runner.rollout.close()
        runner.close()


def test_a_token_given_to_the_run_is_its_only_one_and_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPILOT_AGENT_TOKEN", "from-the-environment")
    cfg = C.load("agent", [*AGENTS, "run.max_steps=1"])
    with Runner(cfg, tmp_path, sink=MemorySink(), system_telemetry=False,
                agent_token="the-owners-api-token") as runner:
        try:
            address = read_address(tmp_path)
            assert address["token_from"] == "run" and "token" not in address
            url = address["base_url"]
            ok = openai.OpenAI(base_url=url, api_key="the-owners-api-token", max_retries=0)
            assert ok.models.list().data
            for other in ("from-the-environment", ""):
                with pytest.raises(openai.AuthenticationError):
                    openai.OpenAI(base_url=url, api_key=other or "x", max_retries=0).models.list()
        finally:
            runner.rollout.close()


def test_a_never_finishing_agent_times_out_and_the_run_goes_on(tmp_path):
    runner, sink, client = start(tmp_path, 2, "episode.agent_timeout_s=5")
    now, lost, refused, log = [0.0], [], [], {}
    runner.rollout.sessions.clock = lambda: now[0]   # the endpoint's clock, moved by hand
    agents = [threading.Thread(target=lambda k=k: [play(client, f"a{k}-{t}", task, float(k), log)
                                                   for t, task in enumerate(TASKS)], daemon=True)
              for k in range(2)]

    def lazy():
        """One call, then nothing: no next call, no reward."""
        r = client.chat.completions.create(model="p", user="lazy", max_tokens=8,
                                           messages=[{"role": "user", "content": "[3,4]="}])
        lost.append(r.usage.completion_tokens)
        now[0] += 6   # past the timeout: the step waiting for groups drops it
        for a in agents:
            a.start()
        for _ in range(1200):   # until the driver dropped it (bounded)
            if "lazy" in runner.rollout.sessions.ended:
                break
            time.sleep(0.05)
        try:   # its next call comes too late
            client.chat.completions.create(model="p", user="lazy", messages=[
                {"role": "user", "content": "[3,4]="}, r.choices[0].message.model_dump(),
                {"role": "user", "content": "and?"}])
        except openai.APIStatusError as e:
            refused.append(e)

    threading.Thread(target=lazy, daemon=True).start()
    with runner:
        runner.run()
    rows = [r for r in sink.steps if "reward/mean" in r]
    assert runner.step == 2   # the run went on
    assert sum(r["agents/timeouts"] for r in rows) == 1
    assert lost[0] > 0 and sum(r["rollout/waste/agent_timeout"] for r in rows) == lost[0]
    check_rows(rows)
    assert refused and refused[0].status_code == 410 and "dropped" in refused[0].message


# --- the chat format --------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def sessions_for(tok) -> Sessions:
    return Sessions(ChatFormat(tok, chat=True), lambda: SamplingParams(max_new_tokens=64), 4096)


def test_a_later_call_appends_only_its_new_messages_in_the_template_s_words():
    tok = chat_tokenizer(TEMPLATE)
    sessions = sessions_for(tok)
    first = [{"role": "user", "content": "add 2 and 3"}]
    call = sessions.call("s", {"messages": first})
    sample = call.session.sample
    assert sample.prompt_ids == tok("<|user|>add 2 and 3\n<|assistant|>",
                                    add_special_tokens=False).input_ids
    made = tok("ok", add_special_tokens=False).input_ids   # what "the engine" wrote
    sample.response_ids += made
    sample.logprobs += [-0.5] * len(made)
    sample.versions += [0] * len(made)
    sessions.answer(call, {}, {"role": "assistant", "content": "ok", "tool_calls": []})
    later = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and 4?"}]
    sessions.call("s", {"messages": later})
    env = sample.response_ids[len(made):]
    assert env == tok("\n<|user|>and 4?\n<|assistant|>", add_special_tokens=False).input_ids
    assert sample.versions[len(made):] == [ENV_VERSION] * len(env)
    assert sample.response_ids[:len(made)] == made   # the model's turn is not re-tokenised


def test_a_call_that_rewrites_the_conversation_or_overlaps_is_refused():
    sessions = sessions_for(chat_tokenizer(TEMPLATE))
    first = [{"role": "user", "content": "hi"}]
    call = sessions.call("s", {"messages": first})
    with pytest.raises(AgentError, match="in flight") as e:
        sessions.call("s", {"messages": first + [{"role": "user", "content": "again"}]})
    assert e.value.status == 409
    sessions.answer(call, {}, {"role": "assistant", "content": "hello", "tool_calls": []})
    with pytest.raises(AgentError, match=r"messages\[1\] differs"):
        sessions.call("s", {"messages": first + [{"role": "assistant", "content": "HELLO"},
                                                 {"role": "user", "content": "x"}]})
    with pytest.raises(AgentError, match="add messages of roles tool or user"):
        sessions.call("s", {"messages": first + [{"role": "assistant", "content": "hello"}]})


def test_a_chat_model_s_json_tool_calls_become_the_reply_s_tool_calls():
    tok = chat_tokenizer(TEMPLATE)
    fmt = ChatFormat(tok, chat=True)
    text = 'let me add <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    msg = fmt.reply(tok(text, add_special_tokens=False).input_ids, ["calculator"], "call_1")
    assert msg["content"] == "let me add"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] \
        == [("calculator", {"expression": "2+3"})]
    # a function the request did not offer stays text
    other = fmt.reply(tok(text, add_special_tokens=False).input_ids, ["search"], "call_2")
    assert "tool_calls" not in other and other["content"] == text


def test_bench_agents_reports_both_ways_side_by_side():
    import argparse

    from trainer.bench import agents

    out = agents.run(argparse.Namespace(reps=1, calls=1, concurrency=2, max_tokens=8),
                     log=lambda *a: None)
    for way in ("direct", "endpoint"):
        assert out[way]["tokens_per_s"] > 0 and out[way]["call_ms"] > 0
    assert set(out["ratio"]) == {"tokens_per_s", "call_ms"}
