import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from webapp import vardir  # noqa: E402
from webapp.dashboard.limits import static_handler_class  # noqa: E402
from webapp.dashboard.origins import SameOriginValidator  # noqa: E402
from webapp.dashboard.routing import websocket_urlpatterns  # noqa: E402

vardir.ensure_secret_key()   # the web server starts: keep (or adopt) the local SECRET_KEY

http_app = django_asgi
if settings.SERVE_STATIC:   # Django's static handler; /static/%2e%2e/... is a 404, not a 500
    http_app = static_handler_class()(django_asgi)

application = ProtocolTypeRouter({
    "http": http_app,
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
