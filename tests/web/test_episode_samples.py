"""Multi-turn episodes in the rollout inspector's web side: an episode row's turns and counters
cleaned for the database (webapp/dashboard/rows/samples.py), served whole by the samples API (the
list carries the counters only), and in the exports (the samples CSV as JSON columns; the offline
report with the completion turn by turn and the environment's runs named "env")."""
import csv
import io
import json

import pytest
from helpers import sample_row

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import RolloutSample
from webapp.dashboard.reports import exports

pytestmark = pytest.mark.django_db

# a calculator episode: the model's call, the tool's result (version -1), the model's answer
PIECES = [("<calc>23+58</calc>", 2), ("<result>81</result>", -1), (">81", 2)]


def episode_row(step, **extra):
    tokens, segments, turns, i = [], [], [], 0
    for text, v in PIECES:
        tokens += list(text)
        segments.append([v, len(text)])
        turns.append({"role": "tool" if v == -1 else "model", "start": i, "end": i + len(text),
                      "trained": v != -1})
        i += len(text)
    row = sample_row(step, group=3, index=0, completion="".join(tokens), versions=tuple(map(tuple, segments)))
    row.update(turns=turns, episode={"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.0003,
                                     "end": "answer"}, **extra)
    return row


def test_an_episode_row_is_stored_cleaned_and_served(alice, user, make_run):
    run = make_run(user, "running")
    bad = episode_row(2, index=1)
    bad["turns"] = [{"role": "tool", "start": -5, "end": 10 ** 9, "trained": True},   # clamped, never trained
                    {"role": "<b>x</b>", "start": 0, "end": 1}, "junk",
                    {"role": "model", "start": 3, "end": 1, "trained": "yes"}]
    bad["episode"] = {"turns": "3", "tool_calls": -2, "tool_s": float("nan"), "end": "<script>", "extra": 1}
    plain = sample_row(2, group=4)
    actions.append(run.pk, [Record("samples", 2, "", {"rows": [episode_row(2), bad, plain]})], {"step": 2})
    ep, cleaned, single = RolloutSample.objects.filter(run=run).order_by("id")
    assert ep.turns == [{"role": "model", "start": 0, "end": 18, "trained": True},
                        {"role": "tool", "start": 18, "end": 37, "trained": False},
                        {"role": "model", "start": 37, "end": 40, "trained": True}]
    assert ep.episode == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.0003, "end": "answer"}
    assert ep.segments == [[2, 18], [-1, 19], [2, 3]]
    assert cleaned.turns == [{"role": "tool", "start": 0, "end": 40, "trained": False},
                             {"role": "model", "start": 3, "end": 3, "trained": False}]
    assert cleaned.episode == {"turns": 3, "tool_calls": 0, "tool_errors": 0, "tool_s": 0.0, "end": ""}
    assert single.turns == [] and single.episode == {}

    listed = alice.get(f"/api/runs/{run.pk}/samples", {"fields": "summary", "order": "step"}).json()["samples"]
    assert [s["episode"] for s in listed][0]["tool_calls"] == 1 and "turns" not in listed[0]
    # why each episode ended, in the server's words (the inspector shows them as they come)
    assert [s["episode"].get("end_text") for s in listed] == ["answered", None, None], listed
    whole = alice.get(f"/api/runs/{run.pk}/samples/{ep.pk}").json()["sample"]
    assert whole["turns"] == ep.turns and whole["segments"] == ep.segments
    assert whole["episode"] == {**ep.episode, "end_text": "answered"}


def test_the_exports_carry_an_episode_turn_by_turn(alice, user, make_run):
    run = make_run(user, "finished")
    actions.append(run.pk, [Record("samples", 1, "", {"rows": [episode_row(1), sample_row(1, group=9)]})],
                   {"step": 1})
    r = alice.get(f"/api/runs/{run.pk}/export?format=samples_csv")
    got = list(csv.DictReader(io.StringIO(b"".join(r.streaming_content).decode())))
    assert [json.loads(g["episode"]) for g in got] == [
        {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.0003, "end": "answer"}, {}]
    assert [len(json.loads(g["turns"])) for g in got] == [3, 0]
    html = exports.export_html(run)
    assert "v2×18, env×19, v2×3" in html and "2 turns, 1 tool call, ended: answer" in html
    assert html.count('class="turn turn-tool"') == 1 and html.count('class="turn turn-model"') == 2
    assert "tool (environment, not trained)" in html
    assert "&lt;result&gt;81&lt;/result&gt;" in html   # the tool's text, escaped, in its own block


def test_a_shipped_tools_model_is_no_path_outside_the_model_roots():
    """model.path "builtin-tools" names trainer/assets/builtin-tools (like "builtin"): the launch
    checks that it loads, never that it lies in RLPILOT_MODEL_ROOTS; a look-alike is a path."""
    from trainer import config as config_mod
    from trainer.models.loading import BUILTIN_TOOLS, builtin_dir
    from webapp.dashboard.access import validation

    cfg = config_mod.from_dict({"model": {"path": "builtin-tools"}})
    problem = validation.config_problems(cfg).get("model.path")
    if (builtin_dir(BUILTIN_TOOLS) / "model.safetensors").is_file():
        assert problem is None, problem
    else:
        assert "warmup --tools" in problem and "RLPILOT_MODEL_ROOTS" not in problem, problem
    cfg = config_mod.from_dict({"model": {"path": "builtin-tools-x"}})
    assert "RLPILOT_MODEL_ROOTS" in validation.config_problems(cfg)["model.path"]
