"""The launch form in headless Chromium: the config fields' placeholders follow the selected preset
(its values as the server read them), and "Load the selected preset's full config" fills the TOML
editor with that preset's whole config, which parses back to the same values."""
import shutil
import tomllib

import pytest
from conftest import CHROMIUM

from trainer import config as config_mod

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

# text fields (a list among them); some differ between the two presets compared (a guard checks it)
KEYS = ("data.train_size", "april.segment_max_tokens", "async.max_inflight", "optim.lr", "run.report_to")


def shown(cfg: config_mod.Config, key: str) -> str:
    value = cfg.get(key)
    if isinstance(value, bool):
        return "true" if value else "false"
    return ", ".join(map(str, value)) or "(none)" if isinstance(value, list) else str(value)


def test_the_placeholders_and_the_editor_follow_the_selected_preset(live_asgi, django_user_model, monkeypatch):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    from conftest import logged_in_page

    demo, every = config_mod.preset_config("demo"), config_mod.preset_config("all")
    assert [k for k in KEYS if demo.get(k) != every.get(k)], "the presets no longer differ: the test proves nothing"
    django_user_model.objects.create_user("gina", password="gina-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread

    def placeholders(page) -> dict[str, str]:
        return {k: page.get_attribute(f'input[data-key="{k}"]', "placeholder") for k in KEYS}

    with logged_in_page(live_asgi, "gina", "gina-pw-123") as (page, errors):
        page.click("summary:has-text('Raw TOML')")   # the editor's section opens as a person opens it
        for name, cfg in (("all", every), ("demo", demo)):
            page.select_option("#id_preset", name)
            assert placeholders(page) == {k: shown(cfg, k) for k in KEYS}, name
            page.click("#load-preset-toml")
            loaded = config_mod.from_dict(tomllib.loads(page.input_value("#id_toml")))
            assert {k: loaded.get(k) for k in KEYS} == {k: cfg.get(k) for k in KEYS}, name
        assert not errors, errors
