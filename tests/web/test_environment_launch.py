"""Your own environment (`episode.environment`) at a web launch: a path that does not import, a
class that does not implement the interface or that raises when built is refused by name, before
any run is made; the toy guessing game launches."""
from __future__ import annotations

import json

import pytest

from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db


def launch(client, tiny, environment):
    body = {"name": "env", "preset": "demo",
            "overrides": {**tiny, "episode.max_turns": 3, "episode.tools": "",
                          "episode.environment": environment}}
    return client.post("/api/runs", json.dumps(body), content_type="application/json")


@pytest.mark.parametrize("environment, says", [
    ("fakes.no_such_module:GuessEnv", "cannot import 'fakes.no_such_module'"),
    ("fakes.guess_env:NoScore", "NoScore does not implement the environment interface: no method 'score'"),
    ("fakes.guess_env:BrokenInit", "BrokenInit.__init__ raised RuntimeError"),
])
def test_a_bad_environment_is_refused_by_name(alice, tiny, environment, says):
    r = launch(alice, tiny, environment)
    assert r.status_code == 400, r.content[:300]
    assert says in r.json()["errors"]["episode.environment"]
    assert not Run.objects.exists()


def test_the_guessing_game_launches(alice, tiny):
    r = launch(alice, tiny, "fakes.guess_env:GuessEnv")
    assert r.status_code in (200, 201), r.content[:300]
    assert Run.objects.get().config["episode"]["environment"] == "fakes.guess_env:GuessEnv"
