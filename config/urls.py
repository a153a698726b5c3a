from django.contrib import admin
from django.shortcuts import redirect
from django.urls import include, path

urlpatterns = [
    path("", lambda request: redirect("admin:index")),
    path("admin/", admin.site.urls),
    path("sandbox/", include("sandbox.urls")),
    path("api/", include("recovery.urls")),
]
