"""GRESO's forgetting (greso.forget_half_life) against hand-computed keep probabilities, and
the built-in drift task it is for."""
import json

import pytest

from trainer import config as C
from trainer.config import GresoConfig
from trainer.rollout.greso import GresoFilter, keep_probability
from trainer.tasks import build_task

CORRECT = [1.0, 1.0, 1.0, 1.0]
WRONG = [0.0, 0.0, 0.0, 0.0]
MIXED = [1.0, 0.0, 1.0, 0.0]


def aged(filter_, now):
    """Move the filter's clock to step `now` (another prompt's group recorded then)."""
    filter_.record("clock", now, MIXED)
    return filter_


def test_keep_probability_by_hand():
    # p 0.5, z 2: fresh 0.25; h 4: 1 - 0.75 * 2**(-age/4)
    assert keep_probability(0.5, 2, 0.01, age=0, half_life=4) == 0.25
    assert keep_probability(0.5, 2, 0.01, age=4, half_life=4) == pytest.approx(0.625)
    assert keep_probability(0.5, 2, 0.01, age=8, half_life=4) == pytest.approx(0.8125)
    assert keep_probability(0.5, 2, 0.01, age=2, half_life=4) == pytest.approx(1 - 0.75 * 0.5 ** 0.5)
    # the floor first, then the ageing: 0.5**10 < 0.01 -> 1 - 0.99 / 2
    assert keep_probability(0.5, 10, 0.01, age=10, half_life=10) == pytest.approx(0.505)
    # h = 0 never forgets, whatever the age
    assert keep_probability(0.5, 2, 0.01, age=1000, half_life=0) == 0.25


def test_decide_ages_by_the_filters_clock():
    f = GresoFilter(p_easy=0.5)
    f.record("q", 3, CORRECT)
    f.record("q", 5, CORRECT)                      # z 2, last group at step 5
    cfg = GresoConfig(forget_half_life=4)
    d = f.decide("q", cfg)
    assert (d.kind, d.streak, d.age, d.keep_prob) == ("easy", 2, 0, 0.25)   # fresh: the paper's rule
    d = aged(f, 13).decide("q", cfg)
    assert d.age == 8 and d.keep_prob == pytest.approx(0.8125)
    assert f.decide("q", GresoConfig()).keep_prob == 0.25  # the knob is read at each decision


def test_a_prompt_skipped_for_all_correct_is_explored_again_once_its_record_ages():
    cfg = GresoConfig(forget_half_life=5)
    f = GresoFilter(p_easy=0.05, seed=11)
    for step in (1, 2, 3):
        f.record("q", step, CORRECT)               # keep max(0.05**3, 0.01) = 0.01
    early = sum(f.decide("q", cfg).skip for _ in range(400))
    assert early >= 380                             # skipped nearly always while fresh
    aged(f, 43)                                     # 40 steps on: keep 1 - 0.99 * 2**-8 = 0.9961
    late = sum(f.decide("q", cfg).skip for _ in range(400))
    assert late <= 8
    never = sum(f.decide("q", GresoConfig()).skip for _ in range(400))
    assert never >= 380                             # without forgetting the old record still rules


def test_no_forgetting_is_the_old_rule_draw_for_draw():
    def decisions(cfg):
        f = GresoFilter(seed=5)
        for step in range(6):
            f.record(f"p{step % 3}", step, CORRECT if step % 2 else WRONG)
        aged(f, 50)
        return [f.decide(f"p{i % 3}", cfg) for i in range(60)]

    default, explicit = decisions(GresoConfig()), decisions(GresoConfig(forget_half_life=0))
    assert [(d.skip, d.keep_prob) for d in default] == [(d.skip, d.keep_prob) for d in explicit]
    assert [d.keep_prob for d in default] == [keep_probability(0.5, d.streak, 0.01) for d in default]
    assert any(d.skip for d in default) and any(d.age == 45 for d in default)   # not trivial


def test_the_clock_survives_a_checkpoint_and_old_checkpoints_derive_it():
    f = GresoFilter()
    f.record("q", 4, CORRECT)
    aged(f, 9)
    state = json.loads(json.dumps(f.state_dict()))
    g = GresoFilter()
    g.load_state_dict(state)
    assert g.clock == 9 and g.age("q") == 5
    del state["clock"]                             # a checkpoint written before forgetting
    h = GresoFilter()
    h.load_state_dict(state)
    assert h.clock == 9 and h.age("q") == 5


def test_forget_half_life_is_a_knob_with_a_default_of_never():
    spec = C.param_spec("greso.forget_half_life")
    assert spec.tunable and spec.default == 0.0
    with pytest.raises(C.ConfigError, match="greso.forget_half_life"):
        C.load("greso", ["greso.forget_half_life=-1"])


# -- the drift task -----------------------------------------------------------------------------

def test_the_drift_task_shifts_even_rows_at_its_step_under_the_same_ids():
    task = build_task(C.load("demo", ["data.task=drift", "data.drift_step=5", "data.train_size=8"]))
    task.begin_step(4)
    before = [task.problem(r) for r in range(4)]
    task.begin_step(5)
    after = [task.problem(r) for r in range(4)]
    assert [p.id for p in before] == [p.id for p in after] == [f"drift:0:{r}" for r in range(4)]
    lengths = [(p.prompt.count(",") + 1, q.prompt.count(",") + 1) for p, q in zip(before, after)]
    assert all(10 <= b <= 14 for b, _ in lengths)            # every row long before the shift
    assert [a for _, a in lengths][0::2] == [2, 2]           # even rows short from the shift on
    assert after[1] == before[1]                             # odd rows unchanged
    never = build_task(C.load("demo", ["data.task=drift", "data.train_size=8"]))
    never.begin_step(10_000)
    assert never.problem(0) == before[0]                     # drift_step 0: never shifts


def test_drift_step_without_the_drift_task_is_refused():
    with pytest.raises(C.ConfigError, match="data.drift_step.*only the drift task shifts"):
        C.load("demo", ["data.drift_step=5"])


class _Group:
    def __init__(self, problem, rewards):
        self.problem, self.rewards = problem, rewards


def drift_run(half_life: float, seed: int, steps: int = 40, drift_step: int = 10):
    """GRESO's real selector on the drift task for `steps` steps of 4 prompts, with a scripted
    policy in place of the model (a long list: every answer wrong; a short one: half right), so
    that the outcome of a prompt is its list's alone. Returns (wrong, right) skips judged from
    the shift on."""
    import threading

    from trainer.rollout.base import PromptSource, StepCounts
    from trainer.rollout.selection import PromptSelector

    cfg = C.load("greso", ["data.task=drift", f"data.drift_step={drift_step}", "data.train_size=32",
                           "rollout.rollout_batch_size=4", f"greso.forget_half_life={half_life}",
                           f"run.seed={seed}"])
    task = build_task(cfg)
    selector = PromptSelector(PromptSource(task), task.train_size, cfg, threading.RLock())
    wrong = right = 0
    for step in range(1, steps + 1):
        task.begin_step(step)
        counts, groups = StepCounts(), []
        for _ in range(4):
            _, problem = selector(cfg, counts)
            short = problem.prompt.count(",") + 1 <= 2
            groups.append(_Group(problem, MIXED if short else WRONG))
        selector.observe(cfg, step, groups)
        w, r = selector.filter.take_skip_judgements()
        if step >= drift_step:
            wrong, right = wrong + w, right + r
    return wrong, right


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forgetting_lowers_the_wrong_skip_ratio_on_the_drift_task(seed):
    wrong, right = drift_run(0, seed)
    assert wrong >= 10 and right >= 10               # the stale "hard" records do mislead
    wrong_f, right_f = drift_run(4, seed)
    assert right_f > 0                                # forgetting still skips the still-hard rows
    assert wrong_f / (wrong_f + right_f) < wrong / (wrong + right) - 0.1
