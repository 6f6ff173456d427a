import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import SuspiciousOperation  # noqa: E402
from django.http import Http404  # noqa: E402

from webapp import vardir  # noqa: E402
from webapp.dashboard.live.origins import SameOriginValidator  # noqa: E402
from webapp.dashboard.live.routing import websocket_urlpatterns  # noqa: E402


class SafeASGIStaticFilesHandler(ASGIStaticFilesHandler):
    """Django's static handler, answering 404 (not 500) for paths that leave the static folders
    (/static/%2e%2e/...: SuspiciousFileOperation) or cannot name a file (NUL)."""

    def serve(self, request):
        try:
            return super().serve(request)
        except (SuspiciousOperation, ValueError):
            raise Http404("no such file") from None


vardir.ensure_secret_key()   # the web server starts: keep (or adopt) the local SECRET_KEY

http_app = SafeASGIStaticFilesHandler(django_asgi) if settings.SERVE_STATIC else django_asgi

application = ProtocolTypeRouter({
    "http": http_app,
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
