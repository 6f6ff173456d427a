"""The rlpilot dashboard: a Django project (ASGI + Channels) with Celery training workers."""
from webapp.celery import app as celery_app

__all__ = ["celery_app"]
