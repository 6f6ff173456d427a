"""async.staleness_schedule in the launch form: a text field of the [async] section, marked a
knob; a bad schedule is refused under the field with the part at fault quoted, and the field
keeps what was typed (the browser's view of the same: tests/web/test_schedule_browser.py)."""
from __future__ import annotations

import re

import pytest

from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db

KEY = "async.staleness_schedule"


def test_the_form_has_a_text_field_for_the_schedule(alice):
    html = alice.get("/").content.decode()
    field = re.search(rf'<label for="f-{re.escape(KEY)}">.*?</div>', html, re.S)
    assert field, "no schedule field in the launch form"
    assert 'class="knob-tag"' in field.group(0)
    assert re.search(rf'<input type="text" name="[^"]+" id="f-{re.escape(KEY)}"', field.group(0))


@pytest.mark.parametrize("preset, value, words", [
    ("async", "0:0, 50:2, 40:4", "'40:4': steps must increase; step 50 comes before it"),
    ("async", "0:0, 10:99", "'10:99': eta must be in [0, 64]"),
    ("async", "0:0; 10:2", "'0:0; 10:2': expected STEP:ETA"),
    ("demo", "0:0, 10:2", "only an asynchronous run has: set async.enabled = true"),
])
def test_a_bad_schedule_is_refused_under_its_field(alice, preset, value, words):
    r = alice.post("/", {"name": "scheduled", "preset": preset, "toml": "", "queue": "",
                         "cfg:" + KEY: value})
    assert r.status_code == 400 and not Run.objects.exists()
    html = r.content.decode()
    m = re.search(rf'<span class="field-error" data-error-for="{re.escape(KEY)}">([^<]*)</span>', html)
    assert m, "no error under the schedule's field"
    assert words in m.group(1).replace("&#x27;", "'"), m.group(1)
    assert f'id="f-{KEY}" value="{value}"' in html   # kept as typed
