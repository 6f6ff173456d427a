"""Data accounting (trainer/invariants/draws.py) on hand-made steps."""
from trainer.invariants.draws import DrawAccount


def test_every_position_scored_or_held_loses_nothing():
    a = DrawAccount()
    s1 = a.step(cursor=4, scored=[0, 1], greso=[2], dropped=[], held=[3])
    assert (s1.skipped, s1.repeated, s1.greso) == ([], [], 1)
    s2 = a.step(cursor=6, scored=[3, 4, 5], greso=[], dropped=[], held=[])
    assert s2.skipped == [] and a.open == set()


def test_a_position_neither_settled_nor_held_a_step_later_is_skipped():
    a = DrawAccount()
    a.step(cursor=4, scored=[0, 1], greso=[], dropped=[], held=[2, 3])
    # group 3 vanished (a resume that forgot it, a killed worker): lost at the next step end
    s = a.step(cursor=6, scored=[2, 4, 5], greso=[], dropped=[], held=[])
    assert s.skipped == [3] and s.figures()["invariants/prompts_skipped"] == 1


def test_a_position_handed_out_this_step_is_judged_only_next_step():
    a = DrawAccount()
    s = a.step(cursor=3, scored=[0], greso=[], dropped=[], held=[])   # 1, 2 not in running yet
    assert s.skipped == []
    assert a.step(cursor=3, scored=[1], greso=[], dropped=[], held=[2]).skipped == []


def test_deliberate_drops_and_greso_skips_are_counted_apart():
    a = DrawAccount()
    s = a.step(cursor=5, scored=[0, 1], greso=[2, 3], dropped=[4], held=[])
    assert (s.skipped, s.greso, s.dropped) == ([], 2, 1)


def test_a_cursor_moving_back_repeats_positions():
    a = DrawAccount()
    a.step(cursor=8, scored=range(8), greso=[], dropped=[], held=[])
    s = a.step(cursor=5, scored=[], greso=[], dropped=[], held=[])
    assert s.repeated == [5, 6, 7] and s.figures()["invariants/prompts_repeated"] == 3


def test_a_position_settled_beyond_the_cursor_read_is_no_loss():
    a = DrawAccount()
    # the worker drew 3 and GRESO skipped it after the cursor was read as 3
    s = a.step(cursor=3, scored=[0, 1, 2], greso=[3], dropped=[], held=[])
    assert s.skipped == [] and 3 not in a.open
    assert a.step(cursor=4, scored=[], greso=[], dropped=[], held=[]).skipped == []


def test_the_account_survives_a_checkpoint():
    a = DrawAccount()
    a.step(cursor=4, scored=[0, 1], greso=[], dropped=[], held=[2, 3])
    b = DrawAccount()
    b.load_state_dict(a.state_dict(), cursor=4)
    # the resumed driver holds 2 but lost 3
    assert b.step(cursor=4, scored=[2], greso=[], dropped=[], held=[]).skipped == [3]
    fresh = DrawAccount()
    fresh.load_state_dict({}, cursor=10)   # a checkpoint from before the accounting
    assert fresh.step(cursor=12, scored=[10, 11], greso=[], dropped=[], held=[]).skipped == []
