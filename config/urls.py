from django.contrib import admin
from django.urls import include, path

from recovery.console import auth_views
from sandbox import demo

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("sandbox/", include("sandbox.urls")),
    path("demo", demo.demo, name="demo"),
    path("api/", include("recovery.api.urls")),
    path("", include("recovery.observability.urls")),
    path("", include("recovery.console.urls")),
]
