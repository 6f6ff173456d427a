"""The dashboard's single_turn alert: raised by the trainer's single_turn_episodes event (a
multi-turn run whose episodes are all single-turn), cleared once episodes have several turns."""
from __future__ import annotations

from django.test import override_settings

from trainer.pilot.episodes import EVENT
from webapp.dashboard.actions import Record
from webapp.dashboard.worker.alerts import RULES, Monitor


@override_settings(ALERT_CLEAR_STEPS=2)
def test_the_event_raises_the_alert_and_longer_episodes_clear_it():
    assert "single_turn" in RULES
    m = Monitor()
    message = "episode.max_turns is 3, but every episode of the last 5 steps had a single model turn"
    out = m.check([Record("points", 5, values={"episode/turns/max": 1}),
                   Record("event", 5, EVENT, {"message": message})])
    assert [(r.name, r.values["rule"], r.values["message"]) for r in out] == [
        ("alert", "single_turn", message)]
    assert m.check([Record("event", 6, EVENT, {"message": message})]) == []   # raised once
    assert m.check([Record("points", 7, values={"episode/turns/max": 2})]) == []
    out = m.check([Record("points", 8, values={"episode/turns/max": 3})])
    assert [(r.name, r.values["rule"]) for r in out] == [("alert_cleared", "single_turn")]
