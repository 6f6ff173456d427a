"""The token ledger through real runs: the metrics each step writes say where every generated
token went (trained, still waiting, dropped by reason), the parts add up step by step and in
total, and they keep adding up across a checkpoint resume. The per-mode driver checks (every
synchronous mode, every step) are in tests/test_april.py."""
import pytest
from helpers import TINY_RUN, check_rows

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.rollout.ledger import TokenLedger
from trainer.run.runner import Runner

# APRIL with dynamic sampling, tiny segments, few rounds and a short version span: every reason
# a synchronous run drops tokens for (version_span once the resume lowers the span to 0: a group
# reaching its span limit otherwise runs to its end), and an evaluation whose tokens must not count
SHORT_APRIL = [*TINY_RUN, "april.enabled=true", "april.segment_max_tokens=4",
               "april.max_version_span=1", "rollout.max_sampling_rounds=2",
               "rollout.dynamic_sampling=true", "run.eval_every=2", "run.eval_size=8"]


def run(tmp_path, steps, resume=False, *extra):
    cfg = C.load("demo", [*SHORT_APRIL, f"run.max_steps={steps}", *extra])
    sink = MemorySink()
    knobs = [e.split("=")[0] for e in extra]   # the resumed knob values, except these
    with Runner(cfg, tmp_path, sink=sink, resume=resume, keep_knobs=knobs,
                system_telemetry=False) as runner:
        runner.run()
        held = runner.rollout.held_tokens()
        ledger = runner.rollout.ledger
        rollout_tokens = runner.engine.stats.generated_tokens - runner.eval_tokens
    rows = [r for r in sink.steps if "rollout/tokens/generated" in r]
    return rows, sink.events, held, ledger, rollout_tokens


def test_a_run_says_where_every_token_went_and_keeps_saying_it_after_a_resume(tmp_path):
    rows, events, held, ledger, rollout_tokens = run(tmp_path, 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    totals = check_rows(rows)
    waiting, generated = totals[0], totals[1]
    assert generated == rollout_tokens       # the engine's own count, evaluations left out
    assert waiting == held > 0               # what the buffer holds, exactly
    short = [r for r in rows if r["rollout/effective_groups"] < 4]
    assert len([e for e in events if e["kind"] == "warning"]) == (1 if short else 0)

    rows2, _, held2, ledger2, _ = run(tmp_path, 5, True, "april.max_version_span=0")
    assert [r["step"] for r in rows2] == [4, 5]
    check_rows(rows2, *totals)                # the totals carry on from the checkpoint
    assert rows2[-1]["rollout/tokens/waiting"] == held2
    assert ledger2.generated > ledger.generated
    # the reasons this workload must exercise, so the sums above proved something
    assert ledger2.dropped["version_span"] > 0 and ledger2.dropped["zero_variance"] > 0


def test_the_ledger_refuses_an_unknown_reason_and_rebases_after_a_restart():
    ledger = TokenLedger()
    ledger.observe_engine(100)          # the first observation is the baseline
    ledger.observe_engine(130)
    ledger.train(20)
    ledger.drop("surplus", 4)
    assert (ledger.generated, ledger.waiting) == (30, 6)
    with pytest.raises(ValueError, match="'lost'.*surplus"):
        ledger.drop("lost", 1)
    again = TokenLedger()
    again.load_state_dict(ledger.state_dict())
    again.observe_engine(5)             # a restarted engine counts from 0 again: a new baseline
    again.observe_engine(12)
    assert (again.generated, again.waiting) == (37, 13)


@pytest.mark.parametrize("mode, level", [("mask", "token"), ("band", "sequence")])
def test_tokens_the_mismatch_correction_masks_are_dropped_not_trained(tmp_path, mode, level):
    """A bfloat16 engine and a narrow band: the correction masks tokens (token level) or whole
    sequences out of the loss; they count as `mismatch` waste, never as trained, and the sums
    still hold."""
    cfg = C.load("demo", [*TINY_RUN, "run.max_steps=3", "rollout.dtype=bfloat16",
                          f"mismatch.correction={mode}", f"mismatch.level={level}",
                          "mismatch.lower=0.99", "mismatch.upper=1.01"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as runner:
        runner.run()
    rows = [r for r in sink.steps if "rollout/tokens/generated" in r]
    check_rows(rows)
    masked = sum(r["rollout/waste/mismatch"] for r in rows)
    assert masked == sum(r.get("mismatch/correction_zeroed_tokens", 0) for r in rows) > 0
    for r in rows:   # trained = the tokens the loss counted
        assert r["rollout/tokens/trained"] == r.get("actor/loss_tokens", 0)
