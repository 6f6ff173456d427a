"""DAPO dynamic sampling's rule and round sizing against hand-computed cases."""
import pytest

from trainer.engine.base import Sample
from trainer.rollout import dynamic
from trainer.rollout.base import Group
from trainer.rollout.dynamic import next_sampling_batch_size
from trainer.tasks.base import Problem


def test_next_sampling_batch_size_by_hand():
    assert next_sampling_batch_size(32, 0.5, 1, 1024) == 80       # 32 / 0.5 * 1.25
    assert next_sampling_batch_size(32, 0.0, 1, 1024) == 40       # 32 * 1.25
    assert next_sampling_batch_size(10, 0.2, 1, 1024) == 16       # 15.625 rounded up
    assert next_sampling_batch_size(2, 0.9, 1, 1024) == 25        # 25.000000000000004 in floats


def test_next_sampling_batch_size_all_zero_variance_returns_hi():
    assert next_sampling_batch_size(32, 1.0, 8, 256) == 256
    assert next_sampling_batch_size(32, 1.0 - 1e-12, 8, 256) == 256


def test_next_sampling_batch_size_clamps():
    assert next_sampling_batch_size(1, 0.0, 8, 256) == 8          # 2 -> lo
    assert next_sampling_batch_size(32, 0.9, 8, 256) == 256       # 400 -> hi
    assert next_sampling_batch_size(32, -0.5, 8, 256) == 40       # negative ratio counts as 0
    assert next_sampling_batch_size(32, float("nan"), 8, 256) == 40
    with pytest.raises(ValueError):
        next_sampling_batch_size(32, 0.5, 10, 5)


def test_next_sampling_batch_size_nothing_needed():
    assert next_sampling_batch_size(0, 0.5, 8, 256) == 0
    assert next_sampling_batch_size(-3, 0.5, 8, 256) == 0
    assert next_sampling_batch_size(0, 1.0, 8, 256) == 0


def test_round_sizes_by_hand():
    # 3 of 8 scored groups filtered (ratio 0.375), 4 of N = 6 ready: ceil(2 / 0.625 * 1.25) = 4
    assert dynamic.round_size(6, 4, 3, 8) == 4
    # nothing scored yet: the ratio is 0, ceil(6 * 1.25) = 8
    assert dynamic.round_size(6, 0, 0, 0) == 8
    # the next step's first round: ceil(6 / 0.625 * 1.25) = 12, never below N, at most 8 N
    assert dynamic.first_round_size(6, 3, 8) == 12
    assert dynamic.first_round_size(6, 0, 8) == 8
    assert dynamic.first_round_size(6, 8, 8) == 48


def test_filtered_groups_are_those_with_equal_rewards():
    def group(rewards):
        return Group(problem=Problem(id="p", prompt="[1]=", answer=1, kind="sum"),
                     samples=[Sample([1]) for _ in rewards], rewards=rewards)

    assert dynamic.filtered(group([1.0, 1.0, 1.0]))
    assert dynamic.filtered(group([0.0, 0.0]))
    assert not dynamic.filtered(group([1.0, 0.0, 1.0]))
