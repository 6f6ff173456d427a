"""An agents run launched from the dashboard (`episode.agents`): its endpoint takes its owner's
API token (made for them when they have none), and no other user's."""
import pytest

from trainer import config as config_mod
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
