"""An agents run launched from the dashboard (`episode.agents`): its endpoint takes its owner's
API token (made for them when they have none), and no other user's; the run page shows the
endpoint and that token to its owner, the endpoint and whose token to staff, nothing to others."""
import pytest
from django.test import Client

from trainer import config as config_mod
from webapp.dashboard import actions
from webapp.dashboard.models import ApiToken, Run, Status
from webapp.dashboard.worker.tasks import agent_token

pytestmark = pytest.mark.django_db


def _run(owner, *sets):
    cfg = config_mod.load("agent", list(sets))
    return cfg, Run.objects.create(owner=owner, name="agents", config=cfg.to_dict(),
                                   knobs=cfg.knob_values(), max_steps=cfg.run.max_steps,
                                   status=Status.QUEUED)


def test_an_agents_run_takes_its_owner_s_api_token(user, other_user):
    theirs = ApiToken.objects.create(user=other_user).key
    cfg, run = _run(user, "episode.agents=true")
    made = agent_token(run.pk, cfg)
    assert made == ApiToken.objects.get(user=user).key != theirs   # one made for the owner
    assert agent_token(run.pk, cfg) == made                       # and the same next time
    plain, other = _run(user)
    assert agent_token(other.pk, plain) is None                   # no endpoint, no token


def _page(user, run) -> str:
    client = Client()
    client.force_login(user)
    r = client.get(f"/runs/{run.pk}/")
    assert r.status_code == 200
    return r.content.decode()


def test_the_run_page_shows_the_endpoint_and_the_token_to_its_owner_only(user, other_user, staff_user):
    cfg, run = _run(user, "episode.agents=true")
    token = agent_token(run.pk, cfg)   # as the worker does when it starts the run
    theirs = ApiToken.objects.create(user=other_user).key
    actions.set_status(run, "running")
    actions.event(run.pk, 0, "run_started", {"agents_url": "http://127.0.0.1:40123/v1"})
    owner = _page(user, run)
    assert 'id="agents-panel"' in owner and "http://127.0.0.1:40123/v1" in owner
    assert f'<code id="agents-token">{token}</code>' in owner and theirs not in owner
    staff = _page(staff_user, run)
    assert 'id="agents-panel"' in staff and "API token of its owner, <b>alice</b>" in staff
    assert token not in staff
    other = _page(other_user, run)
    assert 'id="agents-panel"' not in other and token not in other and "run-status" in other
    actions.set_status(run, "finished")   # the endpoint ended with the run: the panel is hidden
    assert 'id="agents-panel" class="agents-panel" hidden' in _page(user, run)
    plain, other_run = _run(user)
    assert 'id="agents-panel"' not in _page(user, other_run)   # no endpoint, no panel
