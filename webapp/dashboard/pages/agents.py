"""The run page's "Your agents" panel (an `episode.agents` run): where its OpenAI-compatible
endpoint listens and how to authenticate. Only the run's owner and staff see it; the token itself
only its owner: staff are told whose it is, never shown it."""
from __future__ import annotations

from webapp.dashboard.models import ApiToken, Run, RunEvent


def endpoint_url(run: Run) -> str:
    """The endpoint's base URL from the run's latest `run_started`/`run_resumed` event (a resume
    serves on a new port when episode.agent_port = 0); "" before the trainer has started."""
    for data in (RunEvent.objects.filter(run_id=run.pk, kind__in=("run_started", "run_resumed"))
                 .order_by("-seq").values_list("data", flat=True)):
        url = str((data or {}).get("agents_url") or "")
        if url:
            return url
    return ""


def owner_token(run: Run) -> str:
    """The key the endpoint takes: the owner's first API token (the one the worker gives the run,
    worker/tasks.agent_token, which makes it when they have none); "" while none exists yet."""
    token = ApiToken.objects.filter(user_id=run.owner_id).order_by("id").first()
    return token.key if token else ""


def panel(run: Run, user) -> dict | None:
    """What the panel shows `user`, or None: not an agents run, or not its owner or staff."""
    if not (run.config or {}).get("episode", {}).get("agents") or not run.can_control(user):
        return None
    mine = user.pk == run.owner_id
    return {"url": endpoint_url(run), "mine": mine, "token": owner_token(run) if mine else "",
            "owner": run.owner.get_username(), "worker": run.worker_host, "active": run.is_active}
