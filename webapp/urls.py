from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from webapp.dashboard.throttle import ThrottledLoginView

urlpatterns = [
    # failed logins are throttled per username + address (RLPILOT_LOGIN_MAX_FAILURES)
    path("accounts/login/", ThrottledLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("webapp.dashboard.urls")),
]
