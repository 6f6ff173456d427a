from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from webapp.dashboard.access.throttle import ThrottledLoginView
from webapp.dashboard.monitoring import views as monitoring

urlpatterns = [
    # failed logins are throttled per username + address (RLPILOT_LOGIN_MAX_FAILURES)
    path("accounts/login/", ThrottledLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    # Prometheus and health checks: 404 unless RLPILOT_METRICS_ENABLED (webapp/dashboard/monitoring/)
    path("metrics", monitoring.metrics, name="metrics"),
    path("health", monitoring.health_check, name="health"),
    path("", include("webapp.dashboard.urls")),
]
