"""Named test users for the tests that call the actions layer directly (as healthchecks' tests
name theirs): alice owns the runs, bob watches them, carol is staff. No passwords: hashing one
costs seconds on a busy CPU, and these tests never log in. Import the fixtures a module needs."""
from __future__ import annotations

import pytest


@pytest.fixture
def alice(django_user_model):
    """Owns the runs."""
    return django_user_model.objects.create_user("alice")


@pytest.fixture
def bob(django_user_model):
    """Another user: may watch alice's runs, not control them."""
    return django_user_model.objects.create_user("bob")


@pytest.fixture
def carol(django_user_model):
    """Staff: may control anyone's run."""
    return django_user_model.objects.create_user("carol", is_staff=True)


@pytest.fixture
def running(alice, make_run):
    """A running run of alice's, with a Celery task id (no worker: the tests drive its rows)."""
    return make_run(alice, "running", celery_task_id="task-1")
