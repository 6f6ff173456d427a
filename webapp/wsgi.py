import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
application = get_wsgi_application()

from webapp import vardir  # noqa: E402

vardir.ensure_secret_key()   # the web server starts: keep (or adopt) the local SECRET_KEY
