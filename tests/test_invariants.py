"""The invariant rules on hand-built steps (trainer/invariants/rules.py): each rule broken and held."""
import pytest

from trainer.invariants import rules
from trainer.invariants.rules import Bounds, TrainedIds, TrainedSample

ENV = rules.ENV_VERSION


def sample(draw, index, versions, weights=None):
    return TrainedSample(draw, index, tuple(versions), tuple(weights or [1.0] * len(versions)))


def names(found):
    return {v.rule: v.count for v in found}


def test_a_healthy_step_breaks_nothing():
    step = [sample(0, 0, [5, 5, 5]), sample(0, 1, [4, 5]), sample(1, 0, [5, ENV, ENV, 5], [1, 0, 0, 1])]
    found = rules.check(3, step, Bounds(5, "beyond_eta", 1), TrainedIds())
    assert found == []
    assert rules.figures(found, Bounds(5, "beyond_eta", 1)) == {
        "invariants/beyond_eta": 0.0, "invariants/beyond_span": 0.0, "invariants/trained_twice": 0.0,
        "invariants/env_loss": 0.0, "invariants/bound": 1.0}


def test_a_token_beyond_eta_is_caught_at_the_bound_in_force():
    step = [sample(0, 0, [3, 5]), sample(0, 1, [4, 5]), sample(1, 0, [5])]
    # eta 1 at policy 5: the token of version 3 is 2 old
    found = rules.check(7, step, Bounds(5, "beyond_eta", 1), TrainedIds())
    assert names(found) == {"beyond_eta": 1}
    assert found[0].samples == ["0/0"] and found[0].step == 7
    assert "2 versions old" in found[0].detail
    # eta raised to 2 by a knob change: the same step holds
    assert rules.check(7, step, Bounds(5, "beyond_eta", 2), TrainedIds()) == []


def test_a_group_older_than_the_span_is_caught_and_span_0_trains_only_fresh_tokens():
    old_group = [sample(2, 0, [3, 3, 5]), sample(2, 1, [3, 4])]
    found = rules.check(5, old_group, Bounds(5, "beyond_span", 1), TrainedIds())
    assert names(found) == {"beyond_span": 2}
    fresh = [sample(3, 0, [5, 5])]
    assert rules.check(5, fresh, Bounds(5, "beyond_span", 0), TrainedIds()) == []
    assert names(rules.check(5, [sample(4, 0, [4, 5])], Bounds(5, "beyond_span", 0),
                             TrainedIds())) == {"beyond_span": 1}


def test_a_masked_old_token_is_not_trained_and_no_bound_checks_nothing():
    masked = [sample(0, 0, [1, 5], [0.0, 1.0])]   # APRIL's mask: the old token has weight 0
    assert rules.check(1, masked, Bounds(5, "beyond_span", 0), TrainedIds()) == []
    assert rules.check(1, [sample(0, 0, [1, 5])], Bounds(5, "beyond_span", None), TrainedIds()) == []


def test_an_environment_token_is_never_old():
    assert rules.check(1, [sample(0, 0, [5, ENV, 5], [1, 0, 1])], Bounds(5, "beyond_span", 0),
                       TrainedIds()) == []


def test_environment_tokens_carrying_loss_are_caught():
    step = [sample(0, 0, [5, ENV, ENV, 5], [1, 1, 0, 1]), sample(0, 1, [5, ENV], [1, 0])]
    found = rules.check(2, step, Bounds(5, "beyond_span", 0), TrainedIds())
    assert names(found) == {"env_loss": 1} and found[0].samples == ["0/0"]


def test_a_sample_trained_twice_is_caught_within_a_step_and_across_steps():
    seen = TrainedIds()
    assert rules.check(1, [sample(0, 0, [0]), sample(0, 1, [0])], Bounds(0, "beyond_span", 0), seen) == []
    again = rules.check(2, [sample(1, 0, [1]), sample(0, 1, [1])], Bounds(1, "beyond_span", 0), seen)
    assert names(again) == {"trained_twice": 1} and again[0].samples == ["0/1"]
    twice_here = rules.check(3, [sample(5, 0, [2]), sample(5, 0, [2])], Bounds(2, "beyond_span", 0), seen)
    assert names(twice_here) == {"trained_twice": 1}


def test_a_sample_with_no_trained_token_is_not_counted_as_trained():
    seen = TrainedIds()
    rules.check(1, [sample(0, 0, [0], [0.0])], Bounds(0, "beyond_span", 0), seen)
    assert (0, 0) not in seen
    assert rules.check(2, [sample(0, 0, [1])], Bounds(1, "beyond_span", 0), seen) == []


def test_the_trained_ids_survive_a_checkpoint_and_stay_bounded():
    seen = TrainedIds(keep_groups=2)
    for draw in range(3):
        seen.add(draw, 0)
    assert (0, 0) not in seen and (1, 0) in seen and (2, 0) in seen
    resumed = TrainedIds(keep_groups=2)
    resumed.load_state_dict(seen.state_dict())
    found = rules.check(9, [sample(2, 0, [4])], Bounds(4, "beyond_span", 0), resumed)
    assert names(found) == {"trained_twice": 1}


def test_figures_count_samples_per_rule():
    found = rules.check(1, [sample(0, 0, [1, ENV], [1, 1]), sample(0, 1, [5, ENV], [1, 1])],
                        Bounds(5, "beyond_eta", 2), TrainedIds())
    m = rules.figures(found)
    assert m["invariants/beyond_eta"] == 1 and m["invariants/env_loss"] == 2
    assert "invariants/bound" not in m


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="versions for"):
        rules.check(1, [TrainedSample(0, 0, (1, 2), (1.0,))], Bounds(2, "beyond_span", 0), TrainedIds())
