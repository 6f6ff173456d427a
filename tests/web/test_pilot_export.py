"""`python -m trainer advise` on a dashboard run: its JSON export, downloaded from the API, read
back by the advise command (a dashboard run's directory has no metrics.jsonl)."""
from __future__ import annotations

import json

from trainer.cli import main as cli
from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import Run


def test_advise_reads_a_dashboard_runs_json_export(alice, user, make_run, tmp_path, capsys):
    run = make_run(user, "running")
    # entropy collapses (0.5 -> 0.05) at the current temperature, a knob changed to 1.5 since launch
    Run.objects.filter(pk=run.pk).update(knobs={**run.knobs, "rollout.temperature": 1.5})
    actions.append(run.pk, [Record("points", s, "", {"actor/entropy": 0.5 if s <= 10 else 0.05,
                                                     "actor/pg_loss": 0.1, "reward/mean": 0.5})
                            for s in range(1, 21)])
    export = tmp_path / "run.json"
    export.write_bytes(alice.get(f"/api/runs/{run.pk}/export?format=json").content)
    assert cli.main(["advise", str(export), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == [1, 20]
    [advice] = out["advice"]
    assert (advice["knob"], advice["current"], advice["proposed"]) == ("rollout.temperature", 1.5, 1.7)
    ratio = next(f for f in advice["evidence"] if f["stat"] == "second-half mean over first-half mean")
    assert abs(ratio["value"] - 0.1) < 1e-9 and (ratio["first_step"], ratio["last_step"]) == (1, 20)


def test_the_advice_endpoint_gives_the_same_advice_from_the_database(alice, user, make_run):
    run = make_run(user, "running")
    Run.objects.filter(pk=run.pk).update(knobs={**run.knobs, "rollout.temperature": 1.5})
    run.refresh_from_db()
    assert alice.get(f"/api/runs/{run.pk}/advice").json() == {"window": 20, "steps": None,
                                                              "cursor": run.last_seq, "advice": []}
    # 30 steps, the entropy collapsing over the last 20 only: the default window reads steps 11-30
    actions.append(run.pk, [Record("points", s, "", {"actor/entropy": 0.5 if s <= 20 else 0.05,
                                                     "actor/pg_loss": 0.1, "reward/mean": 0.5})
                            for s in range(1, 31)])
    got = alice.get(f"/api/runs/{run.pk}/advice").json()
    assert got["window"] == 20 and got["steps"] == [11, 30]
    [advice] = got["advice"]
    assert (advice["knob"], advice["current"], advice["proposed"]) == ("rollout.temperature", 1.5, 1.7)
    ratio = next(f for f in advice["evidence"] if f["stat"] == "second-half mean over first-half mean")
    assert abs(ratio["value"] - 0.1) < 1e-9 and (ratio["first_step"], ratio["last_step"]) == (11, 30)
    # a window of the last 4 steps sees the entropy low but flat: no collapse within it, no advice
    recent = alice.get(f"/api/runs/{run.pk}/advice?window=4").json()
    assert recent["steps"] == [27, 30] and recent["advice"] == []
    for bad in ("0", "1001", "x"):
        r = alice.get(f"/api/runs/{run.pk}/advice?window={bad}")
        assert r.status_code == 400 and "window" in r.json()["errors"]
