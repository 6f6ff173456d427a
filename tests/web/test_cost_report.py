"""A run's cost on its report (webapp/dashboard/reports/cost.py over trainer/accounting/cost.py): the
recorded run of tests/test_cost.py, appended through the actions layer, shows its device-hours,
idle share, per-unit figures, processes and priced waste, in hours without a rate and priced with
one, on the report page and in the exported HTML; a real run a worker trained has its account;
a run recorded before the devices were reported says why it has none."""
from __future__ import annotations

import re

import pytest
from test_cost import DEVICES, ROWS, SLICES

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import Run
from webapp.dashboard.reports import exports

pytestmark = pytest.mark.django_db


def recorded(make_run, owner) -> Run:
    run = make_run(owner, "finished", max_steps=2)
    actions.append(run.pk, [Record("event", 0, "run_started", {"max_steps": 2, "devices": DEVICES})])
    for row in ROWS:   # one scalar batch per row, as the trainer's sink writes them
        actions.append(run.pk, [Record("points", row["step"], values={k: v for k, v in row.items() if k != "step"})])
    for step, spans in SLICES:
        actions.append(run.pk, [Record("timeline", step, values={"spans": spans})])
    return run


def section(html: str) -> str:
    return html.split('<section class="card" id="cost">')[1].split("</section>")[0]


def cells(html: str, table: str) -> dict[str, list[str]]:
    """{row key: the text of each cell} of a report table."""
    body = html.split(f'id="{table}"')[1].split("</table>")[0]
    return {k: [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
            for k, row in re.findall(r'<tr data-\w+="([^"]+)">(.*?)</tr>', body, re.S)}


def test_the_report_shows_the_runs_cost_in_device_hours_without_a_rate(alice, user, make_run, settings):
    settings.RLPILOT_RATE_GPU_HOUR = settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.0
    run = recorded(make_run, user)
    html = section(alice.get(f"/runs/{run.pk}/report/").content.decode())
    assert "0.008333 cpu device-hours" in html and "no rate set" in html and "price" not in html.split("no rate")[0]
    assert 'id="cost-idle">30%<' in html and 'id="cost-waste-share">34.0%<' in html
    figures = cells(html, "cost-figures")
    assert figures["per_step"] == ["per step", "15 device-s"]
    assert figures["per_accuracy_point"] == ["per held-out accuracy point gained", "5 device-s"]
    lanes = cells(html, "cost-lanes")
    assert lanes == {"rank 0": ["rank 0", "2 cpu", "20", "generating 8, training 8", "4"],
                     "engine": ["engine", "1 cpu", "10", "generating 5", "5"]}
    waste = cells(html, "cost-waste")
    assert waste == {"zero_variance": ["zero_variance", "6 device-s"], "version_span": ["version_span", "3 device-s"],
                     "stale": ["stale", "1.2 device-s"]}


def test_a_rate_prices_the_whole_run_on_the_page_and_in_the_export(alice, user, make_run, settings):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    run = recorded(make_run, user)
    for html in (alice.get(f"/runs/{run.pk}/report/").content.decode(), exports.export_html(run)):
        part = section(html)
        assert "<strong>price 0.003</strong>" in part and "× 0.36 = 0.003" in part
        assert cells(part, "cost-figures")["per_step"][1] == "0.0015"   # 15 device-s at 0.36/h
        assert cells(part, "cost-waste")["stale"][1] == "0.00012"


def test_a_run_without_devices_says_why_it_has_no_account(alice, user, make_run):
    run = make_run(user, "finished")
    actions.append(run.pk, [Record("event", 0, "run_started", {"max_steps": 2}),
                            Record("timeline", 1, values={"spans": SLICES[0][1]})])
    assert 'id="no-cost"' in section(alice.get(f"/runs/{run.pk}/report/").content.decode())


@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)   # the worker's telemetry threads write committed rows
def test_a_run_a_worker_trained_has_its_account(alice, user, tiny):
    """The real path: the trainer's run_started devices, timeline and ledger rows through the
    database sink, read back as the report's account."""
    import json

    from webapp.dashboard.worker import tasks

    r = alice.post("/api/runs", json.dumps({"name": "cost", "preset": "demo",
                                            "overrides": {**tiny, "run.max_steps": 3}}),
                   content_type="application/json")
    assert r.status_code == 201, r.content
    run = Run.objects.get(pk=r.json()["id"])
    assert tasks.execute(run) == "finished"
    html = section(alice.get(f"/runs/{run.pk}/report/").content.decode())
    lanes = cells(html, "cost-lanes")
    assert list(lanes) == ["rank 0"] and lanes["rank 0"][1] == "1 cpu"   # model.threads = 1
    assert "training" in lanes["rank 0"][3] and "generating" in lanes["rank 0"][3]
    assert "cpu device-hours" in html
    assert cells(html, "cost-figures")["per_trained_token"][1].endswith(" device-s")


def test_the_api_forecasts_a_live_runs_time_and_price_to_its_end(alice, user, make_run, settings):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    run = recorded(make_run, user)
    Run.objects.filter(pk=run.pk).update(status="running", step=2, max_steps=10)
    f = alice.get(f"/api/runs/{run.pk}").json()["forecast"]
    # steps of 6 s and 4 s (their timelines' cover): 8 to go at 5 s; 3 cores at 0.36 an hour
    assert f["steps_left"] == 8 and f["seconds"] == pytest.approx(40.0)
    assert f["low_s"] == pytest.approx(40 - 2 * 80 ** 0.5) and f["price"] == pytest.approx(120 / 3600 * 0.36)
    # a knob change at step 1: one step since it is too few to read a pace from, so both are used
    actions.append(run.pk, [Record("event", 1, "knob_applied", {"changes": {"optim.lr": {"old": 2e-4, "new": 1e-4}}})])
    assert alice.get(f"/api/runs/{run.pk}").json()["forecast"]["window"] == 2
    Run.objects.filter(pk=run.pk).update(status="finished")
    assert alice.get(f"/api/runs/{run.pk}").json()["forecast"] is None   # nothing left to forecast


def test_the_api_says_what_a_run_cost_so_far_and_how_far_its_target_accuracy_is(alice, user, make_run, settings):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    run = recorded(make_run, user)
    so_far = alice.get(f"/api/runs/{run.pk}").json()["cost_so_far"]   # a finished run too
    assert so_far["device_hours"] == {"cpu": pytest.approx(30 / 3600)} and so_far["idle_share"] == pytest.approx(0.3)
    assert so_far["price"] == pytest.approx(30 / 3600 * 0.36) and so_far["steps"] == 2
    assert so_far["waste_price"] == pytest.approx(10.2 / 3600 * 0.36)   # 6 + 3 + 1.2 device-s dropped
    Run.objects.filter(pk=run.pk).update(status="running", step=2, max_steps=10,
                                         knobs={**run.knobs, "run.target_accuracy": 0.6})
    # the recorded evaluations, 0.40 at step 0 and 0.46 at step 2: 0.03 a step, 0.14 to go
    target = alice.get(f"/api/runs/{run.pk}").json()["forecast"]["target"]
    assert (target["steps"], target["steps_low"], target["low_s"]) == (5, None, None)   # two points: no range
    for step, acc in ((3, 0.49), (4, 0.52)):   # two more on the same line
        actions.append(run.pk, [Record("points", step, values={"eval/accuracy": acc})])
    target = alice.get(f"/api/runs/{run.pk}").json()["forecast"]["target"]
    assert target["reached"] is False and target["evals"] == 4
    assert target["points_per_100_steps"] == pytest.approx(300.0)
    assert (target["steps"], target["steps_low"], target["steps_high"]) == (3, 3, 3)   # 0.08 / 0.03
    assert target["seconds"] == pytest.approx(15.0)   # 3 steps at 5 s
    assert target["price"] == pytest.approx(15 * 3 / 3600 * 0.36)   # 3 cores
    # a person lowers the target below the latest accuracy mid-run: reached
    Run.objects.filter(pk=run.pk).update(knobs={**run.knobs, "run.target_accuracy": 0.5})
    assert alice.get(f"/api/runs/{run.pk}").json()["forecast"]["target"]["reached"] is True


def test_the_runs_own_rate_prices_it_and_a_change_reprices_the_whole_run(alice, user, make_run, settings):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    run = recorded(make_run, user)
    Run.objects.filter(pk=run.pk).update(knobs={**run.knobs, "cost.cpu_core_hour": 0.72})   # a knob change
    part = section(alice.get(f"/runs/{run.pk}/report/").content.decode())
    assert "<strong>price 0.006</strong>" in part and "× 0.72 = 0.006" in part   # 30 core-s at 0.72/h


def test_the_summary_and_the_comparison_carry_the_cost(alice, user, make_run, settings):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    a, b = recorded(make_run, user), recorded(make_run, user)
    Run.objects.filter(pk=b.pk).update(knobs={**b.knobs, "cost.cpu_core_hour": 0.72})
    summary = cells(alice.get(f"/runs/{a.pk}/report/").content.decode(), "summary")
    assert summary["device_hours"][1] == "0.008333" and summary["cost_price"][1] == "0.003"
    assert summary["cost_idle_share"][1] == "0.3"
    page = alice.get(f"/compare/?ids={a.pk},{b.pk}").content.decode()
    row = page.split('data-key="cost_price"')[1].split("</tr>")[0]
    assert "0.003" in row and "0.006" in row and "2.00x" in row   # the second run's rate, twice the price


def test_the_runs_list_has_each_runs_device_hours_and_price(alice, user, make_run, settings):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    run = make_run(user, "running", name="costly")
    for step, hours in ((1, 0.25), (2, 0.5)):   # the trainer's cost/* figures, as its sink writes them
        actions.append(run.pk, [Record("points", step, values={"cost/gpu_hours": 0.0, "cost/cpu_core_hours": hours})])
    unpriced = make_run(user, "finished", name="before the account")   # no cost/* figures
    html = alice.get("/").content.decode()
    head = re.findall(r"<th[^>]*>(.*?)</th>", html.split('id="runs-table"')[1].split("</thead>")[0])
    row = html.split(f'data-run="{run.pk}"')[1].split("</tr>")[0]
    cells_ = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
    assert cells_[head.index("Device-h")] == "0.5" and cells_[head.index("Price")] == "0.18"
    listed = {r["id"]: r for r in alice.get("/api/runs").json()["runs"]}
    assert listed[run.pk]["cost"] == {"device_hours": 0.5, "price": pytest.approx(0.18)}
    assert listed[unpriced.pk]["cost"] is None
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.0   # no rate: hours, and no price
    listed = {r["id"]: r for r in alice.get("/api/runs").json()["runs"]}
    assert listed[run.pk]["cost"] == {"device_hours": 0.5, "price": None}


def test_an_advices_drops_are_priced_per_100_steps(user, make_run, settings):
    from webapp.dashboard.reports import advice

    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    run = recorded(make_run, user)
    costs = advice._drop_costs(run, advice.latest_rows(run.pk, 20), {"april", "greso", "staleness", "mismatch"})
    # 0.03 device-s a generated token (tests/test_cost.py): 100 version_span tokens, 200 zero_variance,
    # 40 stale over 2 steps; no mismatch drop: nothing at stake
    assert costs["april"] == {"reasons": ["version_span", "surplus", "aborted"], "device_s": pytest.approx(150.0),
                              "price": pytest.approx(150 / 3600 * 0.36)}
    assert costs["greso"]["device_s"] == pytest.approx(300.0) and costs["staleness"]["device_s"] == pytest.approx(60.0)
    assert "mismatch" not in costs
