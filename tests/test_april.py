"""APRIL: early termination, the partial-rollout buffer, and the invariants that hold every
step (no sample or token lost or duplicated across abort/resume)."""
import math

import pytest
import torch

from trainer import config as C
from trainer.algo import objective
from trainer.engine.embedded import EmbeddedEngine
from trainer.models.loading import load_model, load_tokenizer
from trainer.observe.metrics import MemorySink
from trainer.rewards.dispatch import score
from trainer.rollout import PromptSource, april
from trainer.rollout.base import StepRun
from trainer.rollout.synchronous import SynchronousDriver
from trainer.run.runner import Runner
from trainer.tasks.sum import SumTask


def cfg_for(*extra):
    return C.load("demo", ["rollout.rollout_batch_size=6", "rollout.n_samples_per_prompt=4",
                           "rollout.max_response_len=96", "rollout.max_slots=12",
                           "april.enabled=true", "april.over_sampling_batch_size=12",
                           "april.segment_max_tokens=24", *extra])


@pytest.fixture(scope="module")
def parts():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


def make_rollout(parts, seed=0):
    model, tok = parts
    engine = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=12,
                            max_seq_len=256, seed=seed)

    def scorer(groups):
        for g in groups:
            g.rewards = [score("sum", g.problem.answer, tok.decode(s.response_ids,
                                                                    skip_special_tokens=True))
                         for s in g.samples]
            g.raw_scores = list(g.rewards)

    prompts = PromptSource(SumTask(seed=seed))
    return SynchronousDriver(engine, tok, lambda cfg, counts: prompts.next(), scorer), engine


def test_every_step_accounts_for_every_sample_and_token(parts):
    rollout, engine = make_rollout(parts)
    cfg = cfg_for()
    trained_tokens = discarded = 0
    saw_resumed = False
    for version in range(6):
        engine.update_weights(parts[0].state_dict(), version)
        res = rollout.collect(cfg, version)
        c = res.counts
        assert c.submitted == c.completed + c.parked + c.dropped
        assert len(res.groups) == 6 and all(g.complete and g.scored for g in res.groups)
        for g in res.groups:
            for s in g.samples:
                s.check()
                assert s.versions == sorted(s.versions) and max(s.versions) <= version
                saw_resumed |= len(set(s.versions)) > 1
        trained_tokens += sum(g.tokens() for g in res.groups)
        discarded += c.discarded_tokens   # the step's rollout/discarded_tokens
        dropped = sum(rollout.ledger.dropped.values())
        assert dropped == discarded
        # every generated token is in a trained group, the buffer, or dropped under a reason
        assert engine.stats.generated_tokens == trained_tokens + rollout.held_tokens() + dropped
    assert saw_resumed, "no sample continued across steps: the test workload is too easy"
    assert len(rollout.buffer) > 0


def test_kept_caches_spare_the_resumed_samples_prefill_and_change_nothing_else(parts):
    """engine.kv_on_update: with keep the samples APRIL parks at a step's end go on from their
    cache in the next step (under new weights); with recompute each is prefilled again. The
    accounting and the per-token versions hold either way."""
    torch.manual_seed(1)
    noisy = [{k: v + 0.01 * torch.randn_like(v) for k, v in parts[0].state_dict().items()}
             for _ in range(4)]
    resumed, kept = {}, {}
    for mode in ("keep", "recompute"):
        rollout, engine = make_rollout(parts)
        cfg = cfg_for(f"engine.kv_on_update={mode}")
        for version in range(4):
            engine.update_weights(noisy[version], version)
            res = rollout.collect(cfg, version)
            c = res.counts
            assert c.submitted == c.completed + c.parked + c.dropped
            for g in res.groups:
                for s in g.samples:
                    s.check()
                    assert s.versions == sorted(s.versions) and max(s.versions) <= version
        resumed[mode] = engine.stats.resumed_prefill_tokens
        kept[mode] = engine.stats.kv_kept_tokens
    # recompute prefills every resumed history; keep only those whose cache gave its slot up
    assert resumed["recompute"] > 0 and resumed["keep"] < resumed["recompute"] / 2
    assert kept["keep"] > kept["recompute"]


# (extra overrides, the ledger's reasons that must have dropped tokens, whether tokens waited)
MODES = {
    "plain": (["april.enabled=false"], [], False),
    "dynamic sampling": (["april.enabled=false", "rollout.dynamic_sampling=true"],
                         ["zero_variance", "surplus"], False),
    "april": ([], [], True),
    "april + dynamic sampling": (["rollout.dynamic_sampling=true"], ["zero_variance"], True),
    # a group one step from its span limit is generated to its end (its last chance) if it is
    # among the N a step trains; the others at their last chance are dropped for their span (they
    # were trained beyond it before) ...
    "april, tiny segments, short version span": (
        ["april.segment_max_tokens=4", "april.max_version_span=1", "rollout.max_sampling_rounds=3"],
        ["version_span"], True),
    # ... and a group already past a limit lowered mid-run (LATER)
    "april, version span lowered": (
        ["april.segment_max_tokens=4", "april.max_version_span=3", "rollout.max_sampling_rounds=3"],
        ["version_span"], True),
}
LATER = {"april, version span lowered": ["april.max_version_span=0"]}  # from version 2 on


@pytest.mark.parametrize("mode", MODES)
def test_the_ledger_closes_every_step_in_every_synchronous_mode(parts, mode):
    """generated = trained + waiting + dropped, and waiting is exactly what the driver holds."""
    extra, reasons, waits = MODES[mode]
    rollout, engine = make_rollout(parts)
    cfg, ledger = cfg_for(*extra), rollout.ledger
    ledger.observe_engine(engine.stats.generated_tokens)
    waited = False
    for version in range(5):
        if version == 2 and mode in LATER:
            cfg = cfg_for(*extra, *LATER[mode])
        engine.update_weights(parts[0].state_dict(), version)
        res = rollout.collect(cfg, version)
        ledger.observe_engine(engine.stats.generated_tokens)   # as the runner does
        ledger.train(sum(g.tokens() for g in res.groups))
        step = ledger.step_metrics()
        assert step["rollout/tokens/generated"] > 0
        assert ledger.generated == engine.stats.generated_tokens
        assert ledger.generated == ledger.trained + ledger.waiting + sum(ledger.dropped.values())
        assert ledger.waiting == rollout.held_tokens()
        assert len(rollout.buffer) <= april.over_sampling(cfg)
        waited |= ledger.waiting > 0
    assert waited == waits
    for reason in ledger.dropped:  # the reasons this mode must exercise did, and no others
        assert (ledger.dropped[reason] > 0) == (reason in reasons), (reason, ledger.dropped)


def test_early_termination_stops_once_n_groups_are_complete(parts):
    rollout, engine = make_rollout(parts)
    res = rollout.collect(cfg_for(), 0)
    assert len(res.groups) == 6
    assert res.counts.parked > 0 and engine.num_pending == 0
    # each parked sample generated at most one segment this step
    assert all(len(s.response_ids) <= 24 for s in rollout.buffer.samples())


def test_the_buffer_is_fed_first_and_never_holds_more_than_n_prime(parts, monkeypatch):
    """With a short segment limit most groups park: every step resumes the whole buffer before
    it draws a new prompt, new prompts enter only while fewer than N' groups are held, and the
    buffer never grows past N' (it ran away to several times N' when top-ups drew new prompts
    past the parked ones)."""
    rollout, engine = make_rollout(parts)
    cfg = cfg_for("april.segment_max_tokens=4", "april.max_version_span=100")
    started, busy_top_ups = [], []   # (buffer size, new prompts) at each draw
    start_new = StepRun.start_new

    def spy(self, n, order=None):
        started.append((len(rollout.buffer), n))
        held = (len(self.active) + len(self.parked)
                + max(len(self.ready) + len(self.waiting) - 6, 0))
        assert held + n <= 12, "new prompts beyond N' groups held"
        if engine.num_pending:   # started while other samples were still generating
            busy_top_ups.append(n)
        return start_new(self, n, order)

    monkeypatch.setattr(StepRun, "start_new", spy)
    resumed_first = 0
    for version in range(5):
        engine.update_weights(parts[0].state_dict(), version)
        buffered = len(rollout.buffer)
        res = rollout.collect(cfg, version)
        assert len(rollout.buffer) <= 12
        resumed_first += buffered > 0 and res.counts.submitted > 0
        c = res.counts
        assert c.submitted == c.completed + c.parked + c.dropped
        assert c.groups_started <= cfg.rollout.max_sampling_rounds * 12
    assert all(buffer == 0 for buffer, _ in started), "a new prompt was drawn while groups waited"
    assert resumed_first >= 3, "the buffer was rarely full at a step's start: nothing was proved"
    assert busy_top_ups and res.metrics["april/top_ups"] == res.counts.top_ups


def test_a_lower_n_prime_drops_the_newest_buffered_groups_and_counts_them(parts):
    rollout, engine = make_rollout(parts)
    # one round of short segments, more groups asked than complete in it: each of the 24
    # groups gets a turn in the engine's 12 slots, so the newest hold tokens too
    rollout.collect(cfg_for("rollout.rollout_batch_size=12", "april.over_sampling_batch_size=24",
                            "april.segment_max_tokens=4", "rollout.max_sampling_rounds=1"), 0)
    before = list(rollout.buffer.groups)
    assert len(before) > 6, "the buffer never exceeded the lower bound: nothing to shrink"
    held = rollout.held_tokens()
    engine.update_weights(parts[0].state_dict(), 1)
    res = rollout.collect(cfg_for("april.over_sampling_batch_size=6"), 1)
    newest = before[6:]
    assert rollout.ledger.dropped["surplus"] == sum(g.tokens() for g in newest) > 0
    dropped_ids = {id(g) for g in newest}
    carried = res.groups + list(rollout.buffer.groups)
    assert not any(id(g) in dropped_ids for g in carried)
    # the oldest six were resumed: trained, or kept for the next step
    assert all(any(g is k for k in carried) for g in before[:6])
    assert len(rollout.buffer) <= 6
    assert rollout.ledger.dropped["surplus"] < held


def test_a_short_step_trains_what_it_has_and_warns_once_until_the_knobs_change(parts):
    """One token a segment and one round a step: the round limit ends a step with fewer than N
    complete groups, never one with none (the first step has none after its round: it goes on
    until a group completes)."""
    rollout, engine = make_rollout(parts)
    cfg = cfg_for("april.segment_max_tokens=1", "rollout.max_sampling_rounds=1",
                  "april.max_version_span=100")
    warned, short, messages = [], [], []
    for version in range(5):
        if version == 3:
            rollout.set_config(cfg)   # a knob change: the next short step is news again
        engine.update_weights(parts[0].state_dict(), version)
        res = rollout.collect(cfg, version)
        assert res.groups, f"step {version} ended with nothing to train"
        if version == 0:
            assert res.counts.rounds > 1, "the first step's groups completed in one round"
        short.append(len(res.groups) < 6)
        # it trains every complete group it has (none is held back for a fuller step)
        assert len(res.groups) == min(res.metrics["rollout/effective_groups"], 6)
        warned += [(version, kind) for kind, _ in res.events]
        messages += [data["message"] for _, data in res.events]
    assert any(short[:3]) and any(short[3:]), "steps completed N groups: nothing proved"
    first, first_after_change = short.index(True), 3 + short[3:].index(True)
    assert warned == [(first, "warning"), (first_after_change, "warning")]
    assert "segment limit of 1 tokens" in messages[0]


def test_without_april_every_group_finishes_and_nothing_is_buffered(parts):
    rollout, _ = make_rollout(parts)
    res = rollout.collect(cfg_for("april.enabled=false"), 0)
    assert len(res.groups) == 6 and res.counts.parked == 0 and len(rollout.buffer) == 0


def test_version_span_drop_requeues_the_prompt(parts):
    rollout, _ = make_rollout(parts)
    cfg = cfg_for("april.max_version_span=2")
    rollout.collect(cfg, 0)
    assert len(rollout.buffer)
    rollout.engine.update_weights(parts[0].state_dict(), 3)
    # every buffered token is now 3 versions old; groups that never got a token are not old
    old = [g for g in rollout.buffer.groups if any(s.versions for s in g.samples)]
    assert len(old) == len(rollout.buffer.groups) - sum(
        1 for g in rollout.buffer.groups if not any(s.versions for s in g.samples))
    res = rollout.collect(cfg, 3)
    assert res.counts.span_dropped_groups == len(old) and res.counts.dropped > 0
    # nothing older than the span was trained; the dropped prompts started afresh
    assert all(3 - min(s.versions) <= 2 for g in res.groups for s in g.samples if s.versions)
    restarted = [g for g in res.groups + list(rollout.buffer.groups)
                 if g.problem.id in {t.problem.id for t in old}]
    assert len(restarted) == len(old)


def test_keep_policy_trains_old_samples(parts):
    rollout, _ = make_rollout(parts)
    cfg = cfg_for("april.max_version_span=0", "april.span_policy=keep")
    rollout.collect(cfg, 0)
    res = rollout.collect(cfg, 3)
    assert res.counts.span_dropped_groups == 0
    assert any(min(s.versions) == 0 for g in res.groups for s in g.samples if s.versions)


def test_short_first_admission_orders_new_prompts_by_history(parts):
    rollout, engine = make_rollout(parts)
    cfg = cfg_for("april.admission=short_first")
    task = SumTask(seed=0)  # the task make_rollout draws from
    history = {task.train_problem(i).id: float(1000 - i) for i in range(40)}
    rollout.length_history = dict(history)
    first_batch = []
    real_submit = engine.submit
    engine.submit = lambda samples: (first_batch.append(samples[0].meta["draw"]),
                                     real_submit(samples))
    rollout.collect(cfg, 0)
    lengths = [history[task.train_problem(d).id] for d in first_batch[:12]]  # first 12 groups
    assert lengths == sorted(lengths) and lengths != [history[task.train_problem(d).id]
                                                      for d in range(12)]


def test_token_weights_by_hand():
    """(loss mask, the surrogate's weights, pi_old): the mask decides the token count and the KL
    penalty, the weights (TIS, decay) scale the clipped surrogate alone."""
    versions, behave, current = [3, 3, 5], [-1.0, -2.0, -0.5], [-0.5, -2.5, -0.5]
    m, w, old = objective.token_weights(versions, 5, behave, None, mode="as_is", cap=2.0,
                                        decay=1.0)
    assert m == w == [1.0, 1.0, 1.0] and old == behave
    m, w, old = objective.token_weights(versions, 5, behave, None, mode="mask", cap=2.0, decay=1.0)
    assert m == [0.0, 0.0, 1.0] and w == [1.0, 1.0, 1.0]
    m, w, old = objective.token_weights(versions, 5, behave, current, mode="tis", cap=1.5,
                                        decay=1.0)
    # exp(-0.5 - -1) = 1.6487 -> capped 1.5; exp(-2.5 - -2) = 0.6065; on-policy token: 1
    assert m == [1.0, 1.0, 1.0]
    assert w[0] == 1.5 and abs(w[1] - math.exp(-0.5)) < 1e-12 and w[2] == 1.0
    assert old == current
    m, w, _ = objective.token_weights(versions, 5, behave, None, mode="as_is", cap=2.0, decay=0.9)
    assert m == [1.0, 1.0, 1.0] and [round(x, 6) for x in w] == [0.81, 0.81, 1.0]


def test_segment_auto_adjusts_within_bounds():
    assert april.adjust_segment(100, 0.5, 256) == 80
    assert april.adjust_segment(100, 0.05, 256) == 125
    assert april.adjust_segment(250, 0.0, 256) == 256
    assert april.adjust_segment(9, 0.9, 256) == 8
    assert april.adjust_segment(100, 0.2, 256) == 100


def test_buffer_survives_checkpoint_and_resume(tmp_path):
    overrides = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                 "rollout.max_response_len=96", "rollout.max_slots=12", "april.enabled=true",
                 "april.segment_max_tokens=16", "run.reward_workers=0", "model.threads=1",
                 "run.eval_every=0", "run.checkpoint_every=0", "run.max_steps=2"]
    cfg = C.load("demo", overrides)
    with Runner(cfg, tmp_path, sink=MemorySink()) as first:
        first.run()
        saved = [(s.request_id, list(s.response_ids), list(s.versions), list(s.logprobs))
                 for s in first.rollout.buffer.samples()]
    assert saved
    cfg = C.load("demo", overrides[:-1] + ["run.max_steps=3"])
    with Runner(cfg, tmp_path, sink=MemorySink(), resume=True) as again:
        restored = [(s.request_id, list(s.response_ids), list(s.versions), list(s.logprobs))
                    for s in again.rollout.buffer.samples()]
        assert restored == saved
        again.run()
    assert again.step == 3


def test_as_is_and_mask_use_the_recomputed_policy_when_asked():
    # algo.recompute_old_logprobs: pi_old is the current policy even with stale tokens present
    versions, behave, current = [3, 3, 5], [-1.0, -2.0, -0.5], [-0.5, -2.5, -0.7]
    m, _, old = objective.token_weights(versions, 5, behave, current, mode="as_is", cap=2.0,
                                        decay=1.0)
    assert m == [1.0, 1.0, 1.0] and old == current
    m, _, old = objective.token_weights(versions, 5, behave, current, mode="mask", cap=2.0,
                                        decay=1.0)
    assert m == [0.0, 0.0, 1.0] and old == current


@pytest.mark.parametrize("mode", ["as_is", "mask"])
def test_runner_recomputes_old_logprobs_with_stale_tokens(tmp_path, mode, monkeypatch):
    cfg = C.load("demo", ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                          "rollout.max_response_len=96", "rollout.max_slots=12",
                          "april.enabled=true", "april.segment_max_tokens=8",
                          f"april.offpolicy={mode}", "algo.recompute_old_logprobs=true",
                          "run.reward_workers=0", "model.threads=1", "run.eval_every=0",
                          "run.checkpoint_every=0", "run.max_steps=4"])
    weighted = []  # (sample had stale tokens, current-policy logprobs were passed)
    real_weights = objective.token_weights

    def token_weights(versions, version, behave, current, **kw):
        weighted.append((any(v < version for v in versions), current is not None))
        return real_weights(versions, version, behave, current, **kw)

    monkeypatch.setattr(objective, "token_weights", token_weights)
    compared = []
    with Runner(cfg, tmp_path, sink=MemorySink(), system_telemetry=False) as r:
        real_update = r.learner.update

        def update(seqs, **kw):
            for seq, cur in zip(seqs, r._logprobs(seqs)):
                assert seq.old_logprobs == pytest.approx(cur, abs=1e-5)
            compared.append(len(seqs))
            return real_update(seqs, **kw)

        r.learner.update = update
        r.run()
    assert (True, True) in weighted, "no step trained stale tokens: the test proves nothing"
    assert (True, False) not in weighted
    assert sum(compared) > 0


def test_restored_samples_never_share_a_request_id_with_new_ones():
    from trainer.engine.base import Sample

    buf = april.PartialBuffer()
    probe = Sample([1, 2])
    far = probe.request_id + 1000
    buf.load_state_dict({"groups": [{
        "problem": {"id": "p1", "prompt": "[1]=", "answer": 1, "kind": "sum"}, "rewards": [], "draw": 0,
        "samples": [{"prompt_ids": [1, 2], "params": {}, "response_ids": [], "logprobs": [],
                     "versions": [], "finish_reason": None, "request_id": far, "meta": {}}]}]})
    assert Sample([3]).request_id > far


def test_tis_runs_the_trainers_forward_over_the_stale_samples_alone():
    """pi_old of a sample made wholly by the current policy is its behaviour logprob; the extra
    forward pass TIS needs covers only the samples with tokens of older versions."""
    from trainer.engine.base import Sample, SamplingParams
    from trainer.rollout.base import Group
    from trainer.tasks.base import Problem

    # (measuring the mismatch runs the forward over every sample: off here, as it may be)
    cfg = C.load("demo", ["april.enabled=true", "april.offpolicy=tis", "april.tis_cap=2.0",
                          "mismatch.measure=false"])

    def sample(versions, logprobs):
        s = Sample([5, 6], SamplingParams())
        s.response_ids, s.logprobs, s.versions = [7] * len(versions), list(logprobs), list(versions)
        return s

    fresh, stale = sample([4, 4], [-1.0, -2.0]), sample([3, 4], [-1.0, -2.0])
    group = Group(problem=Problem(id="p", prompt="[1]=", answer=1, kind="sum"), samples=[fresh, stale],
                  rewards=[1.0, 0.0])
    asked = []

    def forward(seqs):   # the trainer's current-policy logprobs, made up
        asked.append([list(q.old_logprobs) for q in seqs])
        return [[-0.5, -2.5] for _ in seqs]

    seqs = objective.train_sequences([group], cfg, 4, forward).seqs
    assert asked == [[[-1.0, -2.0]]] and len(asked[0]) == 1          # the stale sample only
    by_sample = dict(zip(("fresh", "stale"), seqs))
    assert by_sample["fresh"].old_logprobs == [-1.0, -2.0] and by_sample["fresh"].weights == [1.0, 1.0]
    assert by_sample["stale"].old_logprobs == [-0.5, -2.5]
    # its age-1 token: min(exp(-0.5 - -1.0), 2) = 1.6487 on its surrogate; its current token: 1
    assert by_sample["stale"].is_weights == [pytest.approx(math.exp(0.5)), 1.0]
    assert by_sample["stale"].weights == [1.0, 1.0]
